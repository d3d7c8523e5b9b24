"""A session's parameters and optimizer state on one shard, and the jitted step over them.

The shard's tensors form one pytree (a dict name -> array) on the shard's JAX device; each step
runs the shard's :class:`~optserve.server.compute.chunked_update.ChunkedUpdate`: jitted, donated
programs over its chunks (for most shards one chunk of every tensor: one program over the whole
tree), plus one partial-statistic program per chunk when the optimizer needs a cross-shard sum.
Shampoo sessions whose roots are offloaded call their
:class:`~optserve.server.compute.root_offload.ShardPreconditioners` right before and after it.
The updater knows nothing of versions, tickets or clients: the domain's shard session decides
*what* to apply; this module applies it.

Sessions share compiled programs (:data:`~optserve.server.compute.compile_cache.EXECUTABLES`,
process-wide) keyed by the optimizer (name and canonical options, after
:func:`~optserve.server.compute.root_offload.build_shard_optimizer` decided where roots are
computed) and the chunk's tensor structure (names, shapes, dtypes). A kernel built twice from the
same name and options is the same pure function, so the second session with the same key reuses
the first one's executables: its first step costs a dispatch, not a compile. The first session of
a key compiles its step when it is initialized (ahead of time, for the shapes the step will see),
so even its first step is a dispatch. Options that are not plain JSON (a callable passed in
process) make the key None: that session shares only programs whose text is identical.

A shard with more than :data:`~optserve.server.compute.chunked_update.CHUNK_TENSORS` tensors (and
no offloaded roots) is updated in chunks of that many: its optimizer state is then the tuple of
its chunks' states.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, Mapping, Optional, Sequence

import numpy as np

from optserve.server.compute.chunked_update import CHUNK_TENSORS, ChunkedUpdate, plan_chunks
from optserve.server.compute.compile_cache import count_compiles, update_key
from optserve.server.compute.heap import release_free_memory
from optserve.server.compute.host_transfer import to_host
from optserve.server.compute.kernel_words import error_line, failing_alone


class Updater:
    """Parameters + optimizer state of one session's tensors on one shard (not thread-safe:
    the shard session serialises calls).

    Args:
      optimizer: the ``BuiltOptimizer`` to run (built once for this shard).
      preconditioners: Shampoo's per-shard root handling, or None.
      param_specs: name -> (shape, dtype) of the shard's tensors (needed to restore a checkpoint).
    """

    def __init__(self, optimizer, preconditioners=None, param_specs: Optional[Mapping[str, tuple]] = None):
        import jax

        count_compiles()
        self.optimizer = optimizer
        self.preconditioners = preconditioners
        self._param_specs = dict(param_specs or {})
        self.device = jax.devices()[0]
        self.params: Optional[dict[str, Any]] = None
        self.opt_state: Any = None
        self._host_copy: Optional[tuple] = None  # (params, their pinned host copies): accelerators only
        self.hyper = optimizer.hyperparams  # {group: {option: float32}}: what the next step runs with
        many = len(self._param_specs) > CHUNK_TENSORS and preconditioners is None
        self.chunk_tensors = CHUNK_TENSORS if many else 0  # 0: one step over the whole tree
        self._update: Optional[ChunkedUpdate] = None
        self._compiled_ahead = False

    def use_chunks(self, chunk_tensors: int) -> None:
        """Lays the state out as a checkpoint recorded it (``chunk_tensors``: 0 for one tree);
        call before :meth:`abstract_state` and :meth:`restore`."""
        self.chunk_tensors = int(chunk_tensors)
        self._update = None
        self._compiled_ahead = False

    def _chunks(self, params: Optional[Mapping[str, Any]] = None) -> ChunkedUpdate:
        """The step of this shard's tensors (``param_specs``, else those of ``params`` or of the
        current parameters), chunk by chunk (one chunk: the whole tree)."""
        if self._update is None:
            specs = self._param_specs or {name: (np.shape(value), value.dtype)
                                          for name, value in (self.params if params is None else params).items()}
            key = update_key(self.optimizer, getattr(self.preconditioners, "offloaded", False), {})
            self._update = ChunkedUpdate(self.optimizer, step_function(self.optimizer),
                                         _masked_step_function(self.optimizer),
                                         plan_chunks(specs, self.chunk_tensors), key, whole=not self.chunk_tensors)
        return self._update

    @property
    def initialized(self) -> bool:
        return self.params is not None

    def initialize(self, values: Mapping[str, np.ndarray], borrowed: Collection[str] = ()) -> None:
        """Installs initial parameters (name -> array in the tensor's dtype) and the optimizer's
        state, and compiles the step for them (sessions of one structure at once wait for one
        compilation, not each do their own).

        The arrays are the updater's from now on (on a CPU device the parameters are them:
        ``device_put`` of aligned host memory aliases it), except those named in ``borrowed``,
        which someone else writes later (a client's shared-memory region): on a CPU device each
        of those is copied first (elsewhere ``device_put`` copies anyway)."""
        import jax

        copy = set(borrowed) if self.device.platform == "cpu" else set()
        params = {name: jax.device_put(np.array(value) if name in copy else value, self.device)
                  for name, value in values.items()}
        self.opt_state, self.params = self._chunks(params).init(params), params
        self._compile_ahead()
        release_free_memory()  # what the compiler freed (several times the code) goes back now

    def _compile_ahead(self) -> Optional[Exception]:
        """Compiles every chunk's step for these shapes (once); what failed, or None."""
        if not self._compiled_ahead:
            try:
                self._chunks().compile_ahead(self.params, self.opt_state, self.hyper)
            except Exception as exc:  # noqa: BLE001 - the kernel's refusal (step_problem words it)
                return exc
            self._compiled_ahead = True
        return None

    def init_problem(self) -> Optional[str]:
        """Why the optimizer cannot build its state for this shard's tensors (``param_specs``), or
        None when it can.

        Some kernels accept their options yet raise while building their state for a tensor they
        cannot handle (T5X Adafactor on a tensor of rank > 2 with no factor rule: ``ValueError``).
        Such a failure is a property of the optimizer and the tensors: this traces ``init``
        abstractly (nothing allocated, compiled or run), so a shard can refuse a session before it
        holds anything.

        Returns:
          None, or a phrase naming the optimizer, the tensors that fail alone (shape, dtype) and
          the kernel's error, e.g. ``optimizer 'adafactor' cannot build its state for tensor 'w'
          (shape [2, 3, 4], float32): ValueError: parameter 'w' of shape (2, 3, 4) has rank > 2 ...``.
        """
        import jax

        if not self._param_specs:  # nothing to check against (an updater built without its tensors' specs)
            return None
        params = _abstract_params(self._param_specs)
        try:
            jax.eval_shape(self.optimizer.transformation.init, params)
        except Exception as exc:  # noqa: BLE001 - any failure to trace init is the kernel's refusal
            return (f"optimizer {self.optimizer.name!r} cannot build its state for "
                    f"{_failing_init_tensors(self.optimizer, params)}: {error_line(exc)}")
        return None

    def step_working_bytes(self) -> Optional[int]:
        """The step's working memory on the host (:meth:`~.chunked_update.ChunkedUpdate.working_bytes`:
        compiling it now, so the steps compile nothing more); None for several chunks or an
        accelerator (its own memory)."""
        if not self._param_specs or self.device.platform != "cpu":
            return None
        return self._chunks().working_bytes(_abstract_params(self._param_specs), self.hyper)

    def step_problem(self) -> Optional[str]:
        """Why the optimizer's step cannot run on this shard's tensors, or None when it can.

        Some kernels accept their options and build their state, yet raise while their update is
        traced for a tensor they cannot handle (Muon's shape factor of a matrix with a zero-length
        axis: ``ZeroDivisionError``). Such a failure is a property of the optimizer and the tensors,
        not of a gradient: this compiles the step (free once it compiled ahead), so a caller can
        refuse a push before its step is decided. Call it between steps.

        Returns:
          None, or a phrase naming the optimizer, the tensors that fail alone (shape, dtype) and
          the kernel's error, e.g. ``optimizer 'muon' cannot update tensor 'e' (shape [0, 4],
          float32): ZeroDivisionError: division by zero``.
        """
        failed = self._compile_ahead()
        if failed is None:
            return None
        return (f"optimizer {self.optimizer.name!r} cannot update "
                f"{_failing_step_tensors(self.optimizer, self.params, self.hyper)}: {error_line(failed)}")

    def abstract_state(self) -> dict:
        """``{"params", "opt_state"}`` as ``jax.ShapeDtypeStruct`` trees (what a checkpoint restores into)."""
        params = _abstract_params(self._param_specs)
        return {"params": params, "opt_state": self._chunks(params).abstract_state(params)}

    def state_from_leaves(self, params: Mapping[str, np.ndarray], leaves: Sequence[np.ndarray]) -> Any:
        """The optimizer state whose leaves, in its tree's order, are ``leaves`` (the tree this
        updater's optimizer and state chunking give: call :meth:`use_chunks` first), once
        ``params`` and ``leaves`` are checked against what :meth:`abstract_state` expects.

        Raises:
          ValueError: a tensor or leaf differs in name, number, shape or element type (the first
            one named).
        """
        import jax

        abstract = self.abstract_state()
        want = {name: (tuple(s.shape), np.dtype(s.dtype)) for name, s in abstract["params"].items()}
        got = {name: (tuple(np.shape(a)), np.asarray(a).dtype) for name, a in params.items()}
        if want != got:
            differ = sorted(n for n in set(want) | set(got) if want.get(n) != got.get(n))[0]
            raise ValueError(f"tensor {differ!r}: expected {want.get(differ)}, got {got.get(differ)}")
        expected = jax.tree.leaves(abstract["opt_state"])
        if len(expected) != len(leaves):
            raise ValueError(f"the optimizer state has {len(expected)} arrays, got {len(leaves)}")
        for index, (spec, leaf) in enumerate(zip(expected, leaves)):
            if (tuple(spec.shape), np.dtype(spec.dtype)) != (tuple(np.shape(leaf)), np.asarray(leaf).dtype):
                raise ValueError(f"optimizer state array {index}: expected {np.dtype(spec.dtype).name} "
                                 f"{list(spec.shape)}, got {np.asarray(leaf).dtype.name} {list(np.shape(leaf))}")
        return jax.tree.unflatten(jax.tree.structure(abstract["opt_state"]), list(leaves))

    def restore(self, params: Mapping[str, np.ndarray], opt_state: Any) -> None:
        """Installs parameters and optimizer state read back from a checkpoint (host arrays)."""
        import jax

        self.params = {name: jax.device_put(np.asarray(value), self.device) for name, value in params.items()}
        self.opt_state = jax.tree.map(lambda x: jax.device_put(np.asarray(x), self.device), opt_state)
        self._chunks().adopt(self.opt_state)

    def apply(self, grads: Mapping[str, np.ndarray], scale: float, reduce: Callable[[float], float],
              before: Optional[Callable[[float], None]] = None, absent: Iterable[str] = ()) -> float:
        """One update with float32 ``grads`` (name -> array, the shard's tensors), scaled by ``scale``.

        ``reduce(partial) -> total``: sums this shard's partial statistic over the session's
        shards (called only when the optimizer has one; a replay passes the logged total back).
        ``before(total)``: called once the total is known and before anything changes (write-ahead
        logging); what it raises propagates with the parameters and the state untouched.
        ``absent``: tensors without a gradient this step: each keeps its parameter and the
        optimizer state kept under its name (state shared by several tensors, such as a step
        count, moves on); compiled separately, on the first step that has such tensors.
        Returns the total used (0.0 without one) once the new parameters exist; ``grads`` may be
        reused by the caller afterwards.
        """
        import jax

        self._host_copy = None  # the pinned copy of the parameters before this step (replies hold their own views)
        # may_alias: on CPU the jitted step reads the pooled host buffers directly (no copy); they
        # return to the pool only after the step completed (block_until_ready below).
        on_device = getattr(grads, "on_device", {})  # uploaded as the push arrived (an accelerator's)
        grads = {name: on_device[name] if name in on_device else jax.device_put(g, self.device, may_alias=True)
                 for name, g in grads.items()}
        chunks = self._chunks()
        global_stat = np.float32(0.0)
        if self.optimizer.partial_statistic is not None:
            global_stat = np.float32(reduce(chunks.partial(grads, self.opt_state, self.params)))
        if before is not None:
            before(float(global_stat))
        if self.preconditioners is not None:  # installs roots that arrived; waits past the age bound
            self.opt_state = self.preconditioners.before_update(self.opt_state, grads, self.params)
        self.params, self.opt_state = chunks.step(self.params, self.opt_state, grads, np.float32(scale), global_stat,
                                                  self.hyper, frozenset(absent) & frozenset(self.params))
        jax.block_until_ready(self.params)
        if self.preconditioners is not None:  # sends the statistics for new roots, without waiting
            self.opt_state = self.preconditioners.after_update(self.opt_state)
        return float(global_stat)

    def param_bytes(self) -> int:
        return _tree_bytes(self.params)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state's arrays (0 before initialization)."""
        return _tree_bytes(self.opt_state)

    def set_hyper(self, hyper: Mapping[str, Mapping[str, float]]) -> None:
        """The hyperparameters of the next steps: ``{group: {option: value}}`` for groups and
        options this optimizer has (others are ignored: a group with no tensor on this shard);
        the compiled step is reused (the values are its arguments)."""
        merged = {group: dict(values) for group, values in self.hyper.items()}
        for group, values in hyper.items():
            for option, value in values.items():
                if group in merged and option in merged[group]:
                    merged[group][option] = float(value)
        self.hyper = merged

    def hyperparams_now(self, count: int) -> list[tuple]:
        """``[(group, option, value, scheduled)]`` of the next step, the optimizer's ``count``-th
        (see :func:`optserve.optim_kernels.hyperparams.values_at`)."""
        from optserve.optim_kernels.hyperparams import values_at

        return values_at(self.optimizer.groups, self.hyper, count)

    def evaluation_params(self) -> Optional[dict[str, np.ndarray]]:
        """The parameters to evaluate the model with (schedule-free optimizers), as host arrays;
        None when they are the trained ones."""
        if self.optimizer.evaluation is None:
            return None
        return to_host(self._chunks().evaluation(self.opt_state, self.params))

    def host_params(self) -> dict[str, np.ndarray]:
        """The parameters as host arrays. On CPU, views of the device buffers (no copy): drop them
        before the next :meth:`apply`, since a view still alive stops the update from donating its
        buffer. On an accelerator, read-only views of one pinned host copy per version (see
        :func:`~optserve.server.compute.host_transfer.to_host`), shared by every reply of it."""
        held = self._host_copy
        if held is not None and held[0] is self.params:
            return held[1]
        host = to_host(self.params)
        if self.device.platform != "cpu":
            self._host_copy = (self.params, host)
        return host

    def host_state(self) -> tuple[dict[str, np.ndarray], Any]:
        """``(parameters, optimizer state)`` as host arrays (see :meth:`host_params`), for a checkpoint."""
        return to_host((self.params, self.opt_state))

    @property
    def host_state_is_copy(self) -> bool:
        """Whether :meth:`host_state` is a copy (on an accelerator), not views of the live state."""
        return self.device.platform != "cpu"


def step_function(optimizer) -> Callable:
    """``step(params, state, grads, scale, global_stat, hyper) -> (params, state)`` of ``optimizer``,
    not jitted: float32 ``grads`` cast to the parameters' dtypes, the update scaled by ``scale``."""
    import jax
    import optax

    tx = optimizer.transformation
    partial = optimizer.partial_statistic

    def step(params, state, grads, scale, global_stat, hyper):
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        extra = {"hyperparams": hyper} if optimizer.groups else {}  # a transformation built elsewhere takes none
        if partial is None:
            updates, state = tx.update(grads, state, params, **extra)
        else:
            updates, state = tx.update(grads, state, params, global_grad_sq_norm=global_stat, **extra)
        updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
        return optax.apply_updates(params, updates), state

    return step


def _masked_step_function(optimizer) -> Callable:
    """``step(params, state, grads, scale, global_stat, hyper, keep) -> (params, state)``: the step
    of ``optimizer``, then each tensor whose ``keep[name]`` is true back to its parameter and the
    state leaves kept under its name (the last dict key of a leaf's path naming a tensor)."""
    import jax
    import jax.numpy as jnp

    step = step_function(optimizer)
    below = 1 if len(optimizer.groups) > 1 else 0  # grouped state is {group label: state}: labels name no tensor

    def masked(params, state, grads, scale, global_stat, hyper, keep):
        new_params, new_state = step(params, state, grads, scale, global_stat, hyper)
        names = frozenset(params)

        def pick(path, old, new):
            owner = next((k.key for k in reversed(path[below:])
                          if isinstance(k, jax.tree_util.DictKey) and k.key in names), None)
            return new if owner is None else jnp.where(keep[owner], old, new)

        new_params = {name: jnp.where(keep[name], params[name], new_params[name]) for name in params}
        return new_params, jax.tree_util.tree_map_with_path(pick, state, new_state)

    return masked


def _failing_init_tensors(optimizer, params: Mapping[str, Any]) -> str:
    """The tensors of ``params`` (abstract) whose state ``optimizer`` fails to build alone, in words."""
    import jax

    init = optimizer.transformation.init
    return failing_alone(params, lambda alone: jax.eval_shape(init, alone))


def _failing_step_tensors(optimizer, params: Mapping[str, Any], hyper) -> str:
    """The tensors of ``params`` whose step of ``optimizer`` fails when traced alone, in words."""
    import jax

    tx, step = optimizer.transformation, step_function(optimizer)
    scalar = jax.ShapeDtypeStruct((), np.float32)
    params = {name: jax.ShapeDtypeStruct(value.shape, value.dtype) for name, value in params.items()}
    return failing_alone(params, lambda alone: jax.eval_shape(
        step, alone, jax.eval_shape(tx.init, alone), _abstract_grads(alone), scalar, scalar, hyper))


def _abstract_params(specs: Mapping[str, tuple]) -> dict:
    """``jax.ShapeDtypeStruct`` parameters for ``specs`` (name -> (shape, dtype))."""
    import jax

    return {name: jax.ShapeDtypeStruct(tuple(shape), dtype) for name, (shape, dtype) in specs.items()}


def _abstract_grads(params: Mapping[str, Any]) -> dict:
    """Float32 ``jax.ShapeDtypeStruct`` gradients for ``params`` (what a step receives)."""
    import jax

    return {name: jax.ShapeDtypeStruct(tuple(np.shape(p)), np.float32) for name, p in params.items()}


def _tree_bytes(tree) -> int:
    import jax

    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree.leaves(tree)) if tree is not None else 0
