"""JAX adapter: pytrees in, pytrees of jax arrays out.

A session's tensors are named after the key paths of the parameter pytree, joined by ``/``:
``{"dense": {"w": ..., "b": ...}, "layers": [{"w": ...}]}`` gives ``dense/b``, ``dense/w`` and
``layers/0/w`` (dict keys, sequence indices and attribute names, in ``jax.tree_util`` order).
The names depend only on the tree's structure, so every worker holding the same structure
agrees on them.

    import optserve.client.jax as ojax
    session = ojax.create_session(client, "run", params, optimizer={"name": "adam", "args": {...}})
    for batch in data:
        params = session.push_pull(jax.grad(loss)(params, batch))

Given an address instead of a ``Client``, :func:`create_session` and :func:`attach_session` open
one with the keyword arguments ``token``, ``tls``, ``client_cert`` and ``tls_server_name`` (see
``optserve.client.Client``); with a ``Client`` those are ignored (its own settings apply)::

    session = ojax.create_session("optserve.example:50051", "run", params, optimizer=spec,
                                  token=os.environ["OPTSERVE_TOKEN"], tls="ca.pem")

This module imports jax (only JAX users import it); the NumPy client core does not.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optserve.client import Client, InvalidArgumentError
from optserve.client._diloco import DiLoCoCore, DiLoCoViews
from optserve.client._transport import ClientCert, TLSArg
from optserve.client.options import SessionOptions
from optserve.client.overlap import DelayedStepper

PyTree = Any


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def tensor_names(tree: PyTree) -> list[str]:
    """The session tensor name of each leaf of ``tree``, in ``jax.tree_util`` leaf order.

    Raises:
      ValueError: ``tree`` has no leaves, or two leaves get the same name (e.g. a dict key
        containing ``/`` that collides with a nested path).
    """
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    if not paths:
        raise ValueError("the parameter pytree has no leaves")
    names = ["/".join(_key_name(k) for k in path) or "value" for path in paths]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"pytree key paths give duplicate tensor names {duplicates}")
    return names


class TreeCodec:
    """Converts between one pytree structure and the named NumPy arrays a session speaks.

    Args:
      like: a pytree with the structure (and leaf dtypes) of the parameters.

    Leaves go to the wire as float32 (the server's optimizer math is float32; the session's
    ``wire_dtype`` compresses the transfer) and come back as jax arrays of each leaf's
    original dtype.
    """

    def __init__(self, like: PyTree):
        leaves, self.treedef = jax.tree_util.tree_flatten(like)
        self.names = tensor_names(like)
        self.dtypes = [jnp.result_type(leaf) for leaf in leaves]
        self.shapes = [tuple(np.shape(leaf)) for leaf in leaves]
        for name, dtype in zip(self.names, self.dtypes):
            if not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(f"leaf {name!r} has dtype {dtype}; only floating-point leaves train")

    def to_named(self, tree: PyTree) -> dict[str, np.ndarray]:
        """``tree``'s leaves as ``{name: float32 ndarray}`` (no copy for float32 CPU arrays)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"pytree structure {treedef} differs from the session's {self.treedef}")
        named = {}
        for name, shape, leaf in zip(self.names, self.shapes, leaves):
            array = np.asarray(leaf)
            if array.shape != shape:
                raise ValueError(f"tensor {name!r}: shape {array.shape}, expected {shape}")
            named[name] = array if array.dtype == np.float32 else array.astype(np.float32)
        return named

    def from_named(self, named: Mapping[str, np.ndarray],
                   aliased: Optional[Mapping[str, np.ndarray]] = None) -> PyTree:
        """The pytree of jax arrays (original leaf dtypes) holding ``named``'s values.

        ``aliased``: writable float32 host arrays holding the same values (a session's reply
        region): each float32 leaf found there becomes a jax array over that memory where the
        platform allows it (a CPU device: no copy), the others are copied."""
        missing = [n for n in self.names if n not in named]
        if missing:
            raise ValueError(f"tensors {missing} missing from the server's answer")
        aliased = aliased or {}
        leaves = [jax.device_put(aliased[n], may_alias=True) if n in aliased and dtype == jnp.float32
                  else jnp.asarray(named[n], dtype=dtype) for n, dtype in zip(self.names, self.dtypes)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


class PytreeSession:
    """An ``optserve.client.Session`` that speaks pytrees.

    Args:
      session: the NumPy-level session.
      codec: the tree structure the session's tensors come from.
    """

    def __init__(self, session, codec: TreeCodec):
        self.raw = session
        self.codec = codec

    @property
    def version(self) -> int:
        return self.raw.version

    @property
    def options(self) -> SessionOptions:
        """The session's options, as the server reports its configuration."""
        return self.raw.options

    def pull(self, **kwargs: Any) -> PyTree:
        return self.codec.from_named(self.raw.pull(**kwargs))

    def state(self) -> dict:
        """The session's whole state at one version (``optserve.client.Session.state``; tensors by
        their session names): save it with ``optserve.client.state_files.save_state``, start a
        session from it with :func:`create_session` ``(..., state=...)``."""
        return self.raw.state()

    def push(self, grads: PyTree, **kwargs: Any) -> None:
        self.raw.push(self.codec.to_named(grads), **kwargs)

    def push_pull(self, grads: PyTree, views: bool = False, **kwargs: Any) -> PyTree:
        """Pushes ``grads`` and returns the parameters of the step they joined.

        ``views``: on shards reached through shared memory, each float32 leaf returned is a jax
        array over the session's reply region on a CPU device (no copy; elsewhere a copy), valid
        until this session's next step, which overwrites it in place: read it (compute the next
        gradient) before then, copy what you keep longer. The gradients go into the push region
        in one copy (jax computed them in memory of its own)."""
        if not views:
            return self.codec.from_named(self.raw.push_pull(self.codec.to_named(grads), **kwargs))
        buffers = self.raw.gradient_buffers()
        for name, value in self.codec.to_named(grads).items():
            np.copyto(buffers[name], value)
        answered = self.raw.push_pull(buffers, views=True, **kwargs)
        region = self.raw.parameter_buffers()  # the step's reply, where it came through this region
        return self.codec.from_named(answered, {name: array for name, array in region.items()
                                                if name in answered and np.shares_memory(array, answered[name])})

    def push_pull_async(self, grads: PyTree, **kwargs: Any) -> concurrent.futures.Future:
        """Starts a push_pull; the future resolves to the updated parameter pytree."""
        inner = self.raw.push_pull_async(self.codec.to_named(grads), **kwargs)
        outer: concurrent.futures.Future = concurrent.futures.Future()

        def _done(f: concurrent.futures.Future) -> None:
            try:
                outer.set_result(self.codec.from_named(f.result()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                outer.set_exception(exc)

        inner.add_done_callback(_done)
        return outer

    def status(self):
        return self.raw.status()

    @property
    def last_step(self):
        """What became of the latest push (see ``Session.last_step``)."""
        return self.raw.last_step

    def history(self, since: int = 0):
        """Each version's record (its pushes, their base versions and scales) and hyperparameter
        changes after ``since`` (see ``Session.history``)."""
        return self.raw.history(since)

    def set_hyperparams(self, group=None, **values: float) -> int:
        """Changes hyperparameters from the next step on (see ``Session.set_hyperparams``)."""
        return self.raw.set_hyperparams(group, **values)

    def join(self):
        return self.raw.join()

    def leave(self) -> None:
        self.raw.leave()

    def close(self) -> None:
        self.raw.close()


class DelayedPytreeStepper:
    """Overlap for JAX loops: one-step-delayed updates (see ``optserve.client.overlap``).

    ``step(grads)`` starts pushing ``grads`` and returns the parameters of the previous step,
    or ``None`` on the first step (keep the initial parameters)::

        stepper = DelayedPytreeStepper(session)
        for batch in data:
            grads = jax.grad(loss)(params, batch)   # runs while the previous push is in flight
            previous = stepper.step(grads)
            params = params if previous is None else previous
        params = stepper.wait()
    """

    def __init__(self, session: PytreeSession):
        self._codec = session.codec
        self._stepper = DelayedStepper(session.raw)

    def step(self, grads: PyTree, **kwargs: Any) -> Optional[PyTree]:
        # jax arrays are immutable, so the views in to_named stay valid while the push reads them.
        previous = self._stepper.step(self._codec.to_named(grads), **kwargs)
        return None if previous is None else self._codec.from_named(previous)

    def wait(self) -> Optional[PyTree]:
        previous = self._stepper.wait()
        return None if previous is None else self._codec.from_named(previous)


def _client(client_or_address: Any, **security: Any) -> Any:
    """``client_or_address`` if it is a ``Client``; else a new ``Client`` with the security settings."""
    return Client(client_or_address, **security) if isinstance(client_or_address, str) else client_or_address


def create_session(client: Any, name: str, params: PyTree, optimizer: Mapping[str, Any] | SessionOptions,
                   *, token: Optional[str] = None, tls: TLSArg = False, client_cert: Optional[ClientCert] = None,
                   tls_server_name: Optional[str] = None, shared_memory: Any = "auto", worker_id: Optional[str] = None,
                   state: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> PytreeSession:
    """Creates session ``name`` holding ``params``.

    Args:
      client: an ``optserve.client.Client`` or a ``host:port`` address.
      optimizer: ``{"name": ..., "args": {...}, "preconditioners": {...}}`` as for
        ``Client.create_session``, or a :class:`~optserve.client.SessionOptions`.
      token, tls, client_cert, tls_server_name: with an address, the security settings of the
        ``Client`` opened for it (see ``optserve.client.Client``); ignored with a ``Client``.
      shared_memory: with an address, ``Client(shared_memory=...)`` ("auto", True, False).
      kwargs: the other options of ``Client.create_session`` (``mode``, ``num_workers``,
        ``max_staleness``, ``staleness_policy``, ``wire_dtype``, ``allow_nonfinite``, and the
        elastic ``min_workers``, ``max_workers``, ``lease_s``, ``straggler_s``, ``late``); with a
        ``SessionOptions`` they replace its fields.
      worker_id: the session object's worker id (see ``optserve.client.Session``).
      state: a saved state (:meth:`PytreeSession.state`) the session starts from: its parameters
        (``params`` then gives the tree's structure only), optimizer state, version and hyperparameters.

    Raises:
      InvalidArgumentError: naming the option (or the saved state's leaf), before anything is trained.
    """
    options = SessionOptions.from_spec(optimizer, **kwargs)
    codec = TreeCodec(params)
    connection = _client(client, token=token, tls=tls, client_cert=client_cert, tls_server_name=tls_server_name,
                         shared_memory=shared_memory)
    session = connection.create_session_with(name, codec.to_named(params), options, worker_id=worker_id, state=state)
    return PytreeSession(session, codec)


def attach_session(client: Any, name: str, like: PyTree, expect: Optional[SessionOptions] = None, *,
                   token: Optional[str] = None, tls: TLSArg = False, client_cert: Optional[ClientCert] = None,
                   tls_server_name: Optional[str] = None, shared_memory: Any = "auto",
                   worker_id: Optional[str] = None) -> PytreeSession:
    """Attaches to an existing session whose tensors come from a pytree structured like ``like``.

    Args:
      client: an ``optserve.client.Client`` or a ``host:port`` address.
      expect: the options this worker means to train with (as ``Client.session``): the attach is
        refused with ``FailedPreconditionError`` naming the difference if the session's optimizer
        or mode differs. ``None``: attach to whatever the session is.
      token, tls, client_cert, tls_server_name, shared_memory, worker_id: as for :func:`create_session`.
    """
    connection = _client(client, token=token, tls=tls, client_cert=client_cert, tls_server_name=tls_server_name,
                         shared_memory=shared_memory)
    return PytreeSession(connection.session(name, expect=expect, worker_id=worker_id), TreeCodec(like))


class DiLoCo(DiLoCoViews):
    """DiLoCo for JAX loops over a params pytree with an optax inner optimizer (the outer loop:
    :mod:`optserve.client._diloco`; the same options as ``optserve.client.torch.DiLoCo``).

    ``params = diloco.step(grads)`` runs one inner step (``inner.update`` then the update added to
    the params) and, every ``sync_every``-th call per fragment, the exchange with the session:
    the pseudo-gradient (round-start shared params minus params now) goes out, the new shared
    params come back and replace (or, with ``overlap_steps``, merge into) the params. ``params``
    and ``inner_state`` are the current values; the inner state stays local across rounds.
    ``options``: ``sync_seconds`` and the session's options by keyword (``num_workers``,
    ``mode``, the elastic ones: the fields of ``optserve.client.SessionOptions``, with its defaults).
    """

    def __init__(self, params: PyTree, inner, address: Any, *, session: str, sync_every: int = 500,
                 outer: Optional[Mapping[str, Any]] = None, worker_id: Optional[str] = None,
                 wire_dtype: Optional[str] = None, fragments: int = 1, overlap_steps: int = 0, merge_alpha: float = 0.5,
                 token: Optional[str] = None, tls: TLSArg = False, client_cert: Optional[ClientCert] = None,
                 tls_server_name: Optional[str] = None, shared_memory: Any = "auto", **options: Any):
        self._codec = TreeCodec(params)
        self._owns_client = not isinstance(address, Client)
        self._client = _client(address, token=token, tls=tls, client_cert=client_cert,
                               tls_server_name=tls_server_name, shared_memory=shared_memory)
        named = {n: np.array(v, dtype=np.float32) for n, v in self._codec.to_named(params).items()}
        self._core = DiLoCoCore(self._client, session, named, sync_every=sync_every, outer=outer,
                                fragments=fragments, overlap_steps=overlap_steps, merge_alpha=merge_alpha,
                                wire_dtype=wire_dtype, worker_id=worker_id, **options)
        self.created = self._core.created
        self.params = params if self.created else self._codec.from_named(self._core.shared())
        self.inner = inner
        self.inner_state = inner.init(self.params)
        self.inner_steps = 0

    def step(self, grads: PyTree) -> PyTree:
        updates, self.inner_state = self.inner.update(grads, self.inner_state, self.params)
        self.params = jax.tree_util.tree_map(lambda p, u: p + u.astype(p.dtype), self.params, updates)
        self.inner_steps += 1
        named: dict[str, np.ndarray] = {}

        def current_of(names) -> dict[str, np.ndarray]:
            if not named:  # the host copy, made only at a step with an exchange
                named.update({n: np.array(v, dtype=np.float32) for n, v in self._codec.to_named(self.params).items()})
            return {n: named[n] for n in names}

        loaded = self._core.after_inner_step(self.inner_steps, current_of)
        if loaded:
            current_of(())
            named.update(loaded)
            self.params = self._codec.from_named(named)
        return self.params

    def state_dict(self) -> dict:
        """What a worker's checkpoint keeps beside its params: ``inner_state`` (the optax state,
        its leaves as NumPy arrays), ``inner_steps`` (the rounds' schedule) and ``error_buffers``
        (SparseLoCo's, tensor name -> float32 array; empty without compression). The shared params
        are the session's: a restarted worker attaches, takes them, then loads this state."""
        return {"inner_state": jax.tree_util.tree_map(np.asarray, self.inner_state), "inner_steps": self.inner_steps,
                "error_buffers": self._core.error_buffers()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s state (the inner state's structure and shapes, and each
        error buffer's shape, checked: ``InvalidArgumentError`` names a mismatch)."""
        self._core.load_error_buffers(state.get("error_buffers", {}))
        leaves, treedef = jax.tree_util.tree_flatten(state["inner_state"])
        mine, my_treedef = jax.tree_util.tree_flatten(self.inner_state)
        if treedef != my_treedef or [np.shape(a) for a in leaves] != [np.shape(b) for b in mine]:
            raise InvalidArgumentError("the state's inner_state does not match this inner optimizer's state "
                                       f"(structure {treedef} vs {my_treedef})")
        self.inner_state = jax.tree_util.tree_unflatten(
            my_treedef, [jnp.asarray(a, dtype=jnp.asarray(b).dtype) for a, b in zip(leaves, mine)])
        self.inner_steps = int(state["inner_steps"])

    def close(self) -> None:
        """Merges exchanges in flight into ``params``, then leaves the sessions (they stay)."""
        named = {n: np.array(v, dtype=np.float32) for n, v in self._codec.to_named(self.params).items()}
        named.update(self._core.flush(lambda names: {n: named[n] for n in names}))
        self.params = self._codec.from_named(named)
        self._core.close()
        if self._owns_client:
            self._client.close()
