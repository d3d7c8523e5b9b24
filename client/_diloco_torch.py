"""DiLoCo for PyTorch loops: ``optserve.client.torch.DiLoCo`` (the outer loop: :mod:`optserve.client._diloco`)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import numpy as np
import torch

from optserve.client import Client
from optserve.client._diloco import DEFAULT_OUTER, DiLoCoCore, DiLoCoViews
from optserve.client._torch_arrays import checked_named_parameters, tensor_to_numpy, write_numpy_
from optserve.client._transport import ClientCert, TLSArg


class DiLoCo(DiLoCoViews):
    """Low-communication data parallelism: ``diloco.step()`` replaces ``inner_optimizer.step()``.

    Every ``sync_every``-th call (per fragment, see :mod:`optserve.client._diloco`) pushes the
    pseudo-gradient (the shared parameters at the round's start minus the model's parameters now)
    to the session, loads the new shared parameters into the model in place and takes them as the
    next round's start. ``inner_optimizer`` keeps its state across rounds. The first worker
    creates the session (sync mode by default, ``outer`` as its optimizer, the model's parameters
    as the initial values); the others attach and load the shared parameters.

    Args:
      model: a ``torch.nn.Module`` (its ``named_parameters()``) or ``(name, parameter)`` pairs.
      inner_optimizer: the worker's own torch optimizer over the same parameters.
      address: ``host:port`` of the server, or a ``Client``.
      session: the session's name (fragments: ``"{session}.f{i}"``).
      sync_every: H, inner steps per round; or ``"auto"`` with ``sync_seconds=T``: Dynamic Local
        Updates (each round's H from this worker's measured inner-step time, so workers of
        different speeds arrive every T seconds; see :mod:`optserve.client._diloco`).
      outer: the outer optimizer spec (default: SGD, lr 0.7, momentum 0.9, Nesterov).
      worker_id: this worker's id (elastic sessions' member id).
      wire_dtype: the pseudo-gradients' wire dtype ("bf16", "f16", "int8" with error feedback).
      fragments, overlap_steps, merge_alpha: Streaming DiLoCo.
      token, tls, client_cert, tls_server_name, shared_memory: with an address, the ``Client``'s settings.
      options: ``sync_seconds`` (with ``sync_every="auto"``) and the session's options by keyword
        (``num_workers``, ``mode``, the elastic ``min_workers``, ``max_workers``, ``lease_s``,
        ``straggler_s``, ``late``, ...: see ``optserve.client.SessionOptions``, whose defaults
        apply); ``mode="async"`` applies each pseudo-gradient on arrival (asynchronous DiLoCo;
        pair it with ``delayed_nesterov``).

    Attributes:
      inner_steps: ``step()`` calls so far. ``created``: this worker created the session(s).
      sessions: the ``Session`` objects (one per fragment).
      exchanges: one ``Exchange`` per completed exchange (fragment, inner step, H, versions).
    """

    def __init__(self, model: Union[torch.nn.Module, Any], inner_optimizer: torch.optim.Optimizer,
                 address: Union[str, Client], *, session: str, sync_every: int = 500,
                 outer: Optional[Mapping[str, Any]] = None, worker_id: Optional[str] = None,
                 wire_dtype: Optional[str] = None, fragments: int = 1, overlap_steps: int = 0, merge_alpha: float = 0.5,
                 token: Optional[str] = None, tls: TLSArg = False, client_cert: Optional[ClientCert] = None,
                 tls_server_name: Optional[str] = None, shared_memory: Union[bool, str] = "auto", **options: Any):
        named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
        self._named = dict(checked_named_parameters(named))
        self.inner_optimizer = inner_optimizer
        self._client = address if isinstance(address, Client) else Client(
            address, token=token, tls=tls, client_cert=client_cert, tls_server_name=tls_server_name,
            shared_memory=shared_memory)
        self._owns_client = not isinstance(address, Client)
        try:
            self._core = DiLoCoCore(self._client, session, self._current(list(self._named)), sync_every=sync_every,
                                    outer=outer or DEFAULT_OUTER, fragments=fragments, overlap_steps=overlap_steps,
                                    merge_alpha=merge_alpha, wire_dtype=wire_dtype, worker_id=worker_id, **options)
        except BaseException:
            if self._owns_client:
                self._client.close()
            raise
        self.created = self._core.created
        if not self.created:  # start from the shared parameters, as every worker does
            self._load(self._core.shared())
        self.inner_steps = 0

    def step(self, closure=None):
        """One inner step, then the exchanges due at it (see the class docstring); returns the
        inner optimizer's result (the closure's loss, if given)."""
        result = self.inner_optimizer.step(closure)
        self.inner_steps += 1
        self._load(self._core.after_inner_step(self.inner_steps, self._current))
        return result

    def state_dict(self) -> dict:
        """What a worker's checkpoint keeps beside its model: the inner optimizer's state, the
        inner steps taken (the rounds' schedule) and SparseLoCo's error buffers (tensor name ->
        float32 tensor; none without compression). The shared parameters are the session's: a
        restarted worker attaches, loads them, then this state."""
        return {"inner_optimizer": self.inner_optimizer.state_dict(), "inner_steps": self.inner_steps,
                "error_buffers": {n: torch.from_numpy(e) for n, e in self._core.error_buffers().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`'s state (shapes checked; ``InvalidArgumentError`` names a mismatch)."""
        self._core.load_error_buffers({n: np.array(tensor_to_numpy(t), np.float32)
                                       for n, t in state.get("error_buffers", {}).items()})
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.inner_steps = int(state["inner_steps"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        """Merges exchanges still in flight, then leaves the sessions (they stay on the server)."""
        self._load(self._core.flush(self._current))
        self._core.close()
        if self._owns_client:
            self._client.close()

    def _current(self, names) -> dict[str, np.ndarray]:
        return {n: np.array(tensor_to_numpy(self._named[n]), dtype=np.float32) for n in names}

    def _load(self, values: Mapping[str, np.ndarray]) -> None:
        with torch.no_grad():
            for name, value in values.items():
                write_numpy_(self._named[name], value)
