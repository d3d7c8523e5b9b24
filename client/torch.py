"""PyTorch adapter: :class:`RemoteOptimizer`, a ``torch.optim.Optimizer`` whose state lives on a server.

Swap ``torch.optim.AdamW(model.parameters(), ...)`` for::

    opt = RemoteOptimizer(model.named_parameters(), "127.0.0.1:50051",
                          optimizer={"name": "adamw", "args": {"learning_rate": 1e-3}},
                          session="my-run")

and keep the loop (``loss.backward(); opt.step(); opt.zero_grad()``). ``step()`` pushes the
``.grad`` of every named parameter and writes the parameters the server returns into the
model in place, so their dtype, device and ``requires_grad`` never change. On a server on the
same host (shared memory), float32 CPU parameters and their gradients move, once, into the
session's shared regions, so that a step copies nothing on the client (``zero_copy``); with
``zero_copy=False`` their storage never changes either.

Precision: the server holds a float32 master copy of every parameter and runs float32
optimizer math; bfloat16 / float16 parameters receive the rounded float32 values. The wire
format (``wire_dtype``) is independent of both: ``"bfloat16"`` halves the bytes on the wire.

Sharing: several processes (or optimizers) naming the same ``session`` train one model: the
first creates the session from its parameters, the others attach and start from the
session's current parameters. An attach is refused (``FailedPreconditionError`` naming the
difference) when the session's optimizer or mode differs from this optimizer's, so rerunning a
script with another learning rate never silently trains with the old one.

Security: with an address, ``token``, ``tls``, ``client_cert`` and ``tls_server_name`` are passed
to the :class:`~optserve.client.Client` it opens (see there)::

    RemoteOptimizer(model.named_parameters(), "optserve.example:50051", spec, session="run",
                    token=os.environ["OPTSERVE_TOKEN"], tls="ca.pem")

Imports torch and the NumPy client only (never jax or ray).
"""

from __future__ import annotations

import dataclasses
import uuid
import warnings
from typing import Any, Iterable, Mapping, Optional, Union

import numpy as np
import torch

from optserve.client import Client
from optserve.client._diloco_torch import DiLoCo  # noqa: F401  (public here: optserve.client.torch.DiLoCo)
from optserve.client._torch_arrays import (checked_named_parameters, gradient_to_numpy, tensor_to_numpy,  # noqa: F401
                                           write_numpy_)
from optserve.client._torch_model import ModelTensors
from optserve.client._torch_sessions import SessionSwitching
from optserve.client._torch_groups import (GroupSync, group_labels, server_options, session_groups, split_groups,
                                           torch_defaults)
from optserve.client._transport import ClientCert, TLSArg
from optserve.client.errors import (AlreadyExistsError, FutureBaseError, InvalidArgumentError, SessionReplacedError,
                                    StaleError)
from optserve.client.options import SessionOptions
from optserve.client.overlap import DelayedStepper



@dataclasses.dataclass(frozen=True, init=False)
class RemoteOptimizerConfig:
    """What a :class:`RemoteOptimizer` asks the server for; validated on construction.

    Args:
      optimizer: ``{"name": registry name, "args": {constructor keyword: value}}``, and for
        Shampoo optionally ``"preconditioners": {"in_process": bool, "max_age": int}``; the
        server checks the name and arguments against the kernel constructor.
      session: the session's name; optimizers naming the same session share one model.
      overlap: one-step-delayed updates (see ``optserve.client.overlap``): ``step()`` returns
        while its push is in flight and writes the previous step's parameters.
      options: the session's other options by keyword, the fields of
        :class:`~optserve.client.SessionOptions` (``mode``, ``num_workers``, ``max_staleness``,
        ``staleness_policy``, ``wire_dtype``, ``allow_nonfinite``, ``min_workers``,
        ``max_workers``, ``lease_s``, ``straggler_s``, ``late``), with its defaults.

    Attributes:
      optimizer, session, overlap: as given.
      options: the :class:`~optserve.client.SessionOptions` a created session gets. float32 on
        the wire is what a session does by default for float32 parameters, so only a narrower
        ``wire_dtype`` becomes the session's default for other clients.
      wire_dtype: the wire dtype this optimizer asks for on every call (its canonical name;
        ``None``: the session's), so that a worker attaching to an existing session still gets
        its own choice.

    Raises:
      InvalidArgumentError (a ``ValueError``): naming the option that is wrong.
      TypeError: a keyword that is no session option.
    """

    optimizer: Mapping[str, Any]
    session: str
    overlap: bool
    options: SessionOptions
    wire_dtype: Optional[str]

    def __init__(self, optimizer: Mapping[str, Any], session: str, *, overlap: bool = False, **options: Any):
        if not session or not isinstance(session, str):
            raise InvalidArgumentError(f"session must be a non-empty string, got {session!r}")
        requested = SessionOptions.from_spec(optimizer, **options)
        created = dataclasses.replace(requested, wire_dtype=None) if requested.wire_dtype == "float32" else requested
        for name, value in (("optimizer", optimizer), ("session", session), ("overlap", overlap),
                            ("options", created), ("wire_dtype", requested.wire_dtype)):
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        """The session options read as attributes too (``config.mode``, ``config.num_workers``, ...)."""
        if name != "options" and name in SessionOptions.__dataclass_fields__:
            return getattr(self.options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


# --- the optimizer -----------------------------------------------------------------------------


class RemoteOptimizer(SessionSwitching, torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose parameters and state live in an optserve session.

    Args:
      named_parameters: ``(name, parameter)`` pairs, e.g. ``model.named_parameters()``;
        parameters with ``requires_grad=False`` are left out. Names must be unique; they are
        the session's tensor names. Or parameter groups as torch takes them, each with its
        pairs: ``[{"params": [(name, p), ...], "weight_decay": 0.0}, {"params": ...}]``; a
        group's ``lr``, ``weight_decay``, ``betas``, ``eps`` and ``momentum`` override the
        optimizer's ``learning_rate`` (``lr`` where the server optimizer calls it so),
        ``weight_decay``, ``b1``/``b2``, ``eps`` and ``momentum`` for its tensors (the session's
        ``param_groups``). ``param_groups[i]["lr"]`` and the others may change between steps
        (any ``torch.optim.lr_scheduler``): ``step()`` sends what changed
        (``Session.set_hyperparams``), so each step runs with the values its groups hold.
      address: the server's ``host:port``, or an ``optserve.client.Client`` to reuse.
      optimizer: ``{"name": ..., "args": {...}}`` (see ``optserve.optim_kernels.OPTIMIZERS``);
        Shampoo also takes ``"preconditioners": {"in_process": bool, "max_age": int}``.
      session: the session's name (default: a fresh unique name). Naming an existing session
        attaches to it (its tensor names must match) and loads its current parameters into the
        model; the attach is refused with ``FailedPreconditionError`` (naming the difference) if
        the session's optimizer (name, args, preconditioners) or mode differs from this one's.
      overlap: see :class:`RemoteOptimizerConfig`.
      worker_id: the worker this optimizer pushes as (elastic sessions' member id; default generated).
      token, tls, client_cert, tls_server_name: with an address, the security settings of the
        ``Client`` this optimizer opens (see ``optserve.client.Client``); ignored when
        ``address`` is a ``Client`` (its own settings apply).
      shared_memory: with an address, ``Client(shared_memory=...)``: "auto" (default) moves the
        tensor bytes through shared memory where a shard proves it is on this host.
      zero_copy: on shards reached through shared memory (and without ``overlap``), keep the
        model's float32 CPU parameters and their ``.grad`` in the session's shared regions
        (:mod:`optserve.client._torch_shared`): ``backward`` accumulates into the region and a step
        copies no tensor on the client. Bound gradients are zeroed in place by :meth:`zero_grad`
        (never ``None``; a parameter no backward reached afterwards is still pushed as having no
        gradient). False: parameters and gradients keep their own storage and are copied.
      options: the session's other options by keyword (``mode``, ``num_workers``, ``wire_dtype``,
        ...: the fields of :class:`~optserve.client.SessionOptions`; see :class:`RemoteOptimizerConfig`).

    Attributes:
      created: whether this optimizer created the session (``False``: it attached).
      version: the session version of the parameters now in the model.
      stale_pushes: pushes the server refused as stale (async, ``staleness_policy="reject"``);
        such a step is dropped and the model refreshed to the session's current parameters.
      shared_tensors: names of the parameters whose storage is a shared region now (``zero_copy``).
    """

    def __init__(
        self,
        named_parameters: Iterable[Union[tuple[str, torch.nn.Parameter], Mapping[str, Any]]],
        address: Union[str, Client],
        optimizer: Mapping[str, Any],
        *,
        session: Optional[str] = None,
        overlap: bool = False,
        worker_id: Optional[str] = None,
        token: Optional[str] = None,
        tls: TLSArg = False,
        client_cert: Optional[ClientCert] = None,
        tls_server_name: Optional[str] = None,
        shared_memory: Union[bool, str] = "auto",
        zero_copy: bool = True,
        **options: Any,
    ):
        named, groups = split_groups(named_parameters)
        self._named = checked_named_parameters(named)
        kept = {id(p) for _, p in self._named}
        name = optimizer.get("name") if isinstance(optimizer, Mapping) else None
        if groups is not None and isinstance(optimizer, Mapping):
            args = dict(optimizer.get("args") or {})
            args["param_groups"] = session_groups(name, groups, lambda tensor: id(tensor) in kept)
            optimizer = {**optimizer, "args": args}
        self.config = RemoteOptimizerConfig(optimizer, session or f"torch-{uuid.uuid4().hex[:12]}", overlap=overlap,
                                            **options)
        self._worker_id = worker_id
        self._tensors_fixed = False
        torch_groups = ([{"params": [p for _, p in self._named]}] if groups is None else
                        [{**g, "params": [p for _, p in g["params"] if id(p) in kept]} for g in groups])
        super().__init__(torch_groups, defaults=torch_defaults(name, self.config.options.optimizer_args))
        self._tensors_fixed = True
        self._group_labels = ["default"] if groups is None else group_labels(self.param_groups)
        self._created_options = [server_options(self.config.options.optimizer, g) for g in self.param_groups]
        self._groups_sync = GroupSync(self.config.options.optimizer, self._group_labels, self._created_options)
        self._client = address if isinstance(address, Client) else Client(
            address, token=token, tls=tls, client_cert=client_cert, tls_server_name=tls_server_name,
            shared_memory=shared_memory)
        self._owns_client = not isinstance(address, Client)
        try:
            self._session, self.created = self._create_or_attach()
        except BaseException:
            if self._owns_client:  # e.g. an attach refused for other options: no channels left open
                self._client.close()
            raise
        self._stepper = DelayedStepper(self._session) if overlap else None
        # overlap keeps a step in flight while the model changes: it copies
        self._model = ModelTensors(self._named, self._session, zero_copy and not overlap)
        # Per call, so that a worker attaching to an existing session still gets its own choice.
        self._wire = {"wire_dtype": self.config.wire_dtype} if self.config.wire_dtype is not None else {}
        self.stale_pushes = 0
        if self.created:
            self.version = self._session.version
            # the initial values went through the regions' reply parts: the model's storage moves there
            self._model.take_regions()
        else:
            self._pull_into_model()
            if self.version > 0:  # a rerun of a script attaches to the session its last run trained
                warnings.warn(
                    f"optserve: session {self.config.session!r} already existed at version {self.version}: this "
                    f"optimizer attached to it and loaded its parameters into the model (the freshly initialised "
                    f"values were replaced). To start fresh, close it first (optserve.client.Client(address)"
                    f".close_session({self.config.session!r})) or pick another session name.",
                    stacklevel=2)
        self._model.bind_gradients()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: a session's tensors are fixed when it is created."""
        if self._tensors_fixed:
            raise NotImplementedError("RemoteOptimizer cannot add parameters: the session's tensors are fixed")
        super().add_param_group(param_group)

    # -- what the session is -------------------------------------------------------------------

    @property
    def session(self):
        """The underlying ``optserve.client.Session`` (push / pull / status)."""
        return self._session

    @property
    def session_name(self) -> str:
        return self.config.session

    @property
    def tensor_names(self) -> list[str]:
        return self._model.names

    @property
    def shared_tensors(self) -> list[str]:
        return self._model.shared

    # -- the training loop ---------------------------------------------------------------------

    def step(self, closure=None, loss=None):
        """Pushes every parameter's ``.grad`` and writes the returned parameters in place.

        A parameter whose ``.grad`` is ``None`` is left alone, as torch optimizers do: its value
        and the optimizer state kept for it stay as they are (with several workers in a sync
        step: when none of them had a gradient for it; state shared by all tensors, such as a
        step count, moves on). If every ``.grad`` is ``None`` nothing is pushed.
        With ``overlap=True`` the parameters written are those of the previous step (none on
        the first step) and this step's push is still in flight when ``step()`` returns.

        ``loss`` (a number or a scalar tensor), or the value ``closure()`` returns, travels with
        the push as telemetry: the server keeps it with the push's version and staleness
        (``optserve report``); it never changes the update.

        Returns:
          ``closure()``'s loss if a closure is given, else ``None``.
        """
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        telemetry = loss if loss is not None else result
        grads, without = self._model.gradients(copy=self.config.overlap)
        if grads is None:
            return result
        push = dict(self._wire)
        if without:
            push["without_gradient"] = without
        if telemetry is not None:
            push["loss"] = float(telemetry.detach().item() if isinstance(telemetry, torch.Tensor) else telemetry)
        if self._stepper is not None:
            self._write_in_flight()  # before new values are sent: the push in flight keeps its own
        self._groups_sync.send_changes(self.param_groups, self._session.set_hyperparams)
        if self._stepper is not None:
            self._stepper.step(grads, **push)  # nothing in flight now: starts the push and returns
        else:
            try:
                # views: on shared memory the parameters are copied from the region straight into
                # the tensors (no intermediate array); they are read before the next step
                self._write(self._session.push_pull(grads, views=True, **push))
            except StaleError:
                self._skip_stale()
            except SessionReplacedError as replaced:
                self._reattach(replaced)
            except BaseException:  # unanswered, it may still be applied from the regions later
                self._model.detach()
                raise
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; gradients in a shared region are zeroed in place (see ``zero_copy``)."""
        self._model.zero_grad(set_to_none)

    def synchronize(self) -> None:
        """With ``overlap=True``: waits for the push in flight and writes its parameters."""
        if self._stepper is not None:
            self._write_in_flight()

    def pull(self) -> None:
        """Overwrites the model's parameters with the session's current ones."""
        self.synchronize()
        self._pull_into_model()

    def close(self) -> None:
        """Waits for a push in flight and closes the connection; the session stays on the server.

        End the session itself (for every worker) with ``optimizer.session.close()``.
        """
        if self._stepper is not None:
            self._stepper.wait()
        self._model.close()
        self._session.detach()
        if self._owns_client:
            self._client.close()

    # -- internals ------------------------------------------------------------------------------

    def _create_or_attach(self):
        initial = {name: tensor_to_numpy(p) for name, p in self._named}
        try:
            session = self._client.create_session_with(self.config.session, initial, self.config.options,
                                                       worker_id=self._worker_id)
            return session, True
        except AlreadyExistsError:  # another worker created it first: attach, if it is what we asked for
            return self._client.session(self.config.session, expect=self.config.options, worker_id=self._worker_id), False

    def _write_in_flight(self) -> None:
        try:
            params = self._stepper.wait()
        except (StaleError, FutureBaseError):  # refused (stale, or its base rolled back): the model pulls
            self._skip_stale()
            return
        except SessionReplacedError as replaced:
            self._reattach(replaced)
            return
        if params is not None:
            self._write(params)

    def _skip_stale(self) -> None:
        self.stale_pushes += 1
        self._pull_into_model()

    def _pull_into_model(self) -> None:
        params = self._session.pull(views=True, **self._wire)
        missing = sorted(set(self.tensor_names) - set(params))
        extra = sorted(set(params) - set(self.tensor_names))
        if missing or extra:
            raise ValueError(
                f"session {self.config.session!r} holds different tensors: missing {missing}, unexpected {extra}"
            )
        self._write(params)

    def _write(self, params: Mapping[str, np.ndarray]) -> None:
        self._model.write(params)
        self.version = self._session.version
