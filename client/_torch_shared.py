"""A torch model whose parameters and gradients live in its session's shared-memory regions.

On shards this process reaches through shared memory (same host), each step's gradients are
read by the shard straight from the region's push part and the new parameters are written into
its reply part (:meth:`Session.gradient_buffers`, :meth:`Session.parameter_buffers`).
:class:`SharedModelMemory` makes a float32 CPU parameter's storage the reply array and its
``.grad`` the push array, so ``backward`` accumulates into the region and a step copies no
tensor on the client.

What stays as torch has it: the ``Parameter`` objects (only their storage moves, through
``.data``), their dtype, shape and ``requires_grad``, and what a step does with each gradient.
What differs: once bound, ``.grad`` is never ``None`` (``backward`` must find the region there to
accumulate into it). Where torch would hold ``None`` (right after the binding, after
``zero_grad(set_to_none=True)``, after ``p.grad = None``) the bound gradient holds zeros and is
remembered as *none* ("cleared"), and a step leaves its parameter and the optimizer state kept
for it alone (``without_gradient``), as a torch optimizer skips a ``None`` gradient.

A cleared gradient counts again (is pushed, zeros included) once anything gave it a value, as
torch would then hold a tensor:

- a ``backward`` reached it (its post-accumulate hook; zeros from backward count too);
- ``.grad`` was assigned another tensor (``p.grad = g``, ``backward(create_graph=True)``): it is
  copied into the region once and the region's array is bound again;
- its values are no longer all zeros: an in-place write (``fill_``, ``copy_``, ``add_``, also
  through ``.data`` or a NumPy view), such as the ``else`` branch of
  ``if p.grad is None: p.grad = g else: p.grad.add_(g)``.

An in-place operation that leaves a cleared gradient all zeros keeps it none. Code that guards
with ``if p.grad is not None`` skips a ``None`` gradient in torch, and on the bound zeros it
leaves them zeros: ``clip_grad_norm_`` (its ``mul_``), a grad scaler's unscale,
``zero_grad(set_to_none=False)`` of the optimizer or of the model. The tensor's version counter
(``_version``) cannot tell those from a write: they move it too (and a write through ``.data``
does not). What the values cannot tell is an in-place write of exact zeros into a cleared
gradient; it stays none: assign ``p.grad = torch.zeros_like(p)`` to push a zero gradient there.

Parameters that are not float32, not on the CPU or not contiguous, and tensors on shards reached
by gRPC, keep their own storage and torch's own ``None``, and are copied as before. Imports torch
and NumPy only.
"""

from __future__ import annotations

import warnings
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from optserve.client.errors import UnavailableError


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def eligible(tensor: Optional[torch.Tensor]) -> bool:
    """Whether ``tensor`` (a parameter or its gradient) can live in a region: float32, on the CPU,
    dense and contiguous (checked at every call: a model moved or cast later is copied instead)."""
    return (tensor is not None and tensor.dtype == torch.float32 and tensor.device.type == "cpu"
            and tensor.layout == torch.strided and tensor.is_contiguous())


class SharedModelMemory:
    """Binds a model's parameters and gradients to the regions of ``session`` and keeps them bound.

    Only calls that the optimizer makes anyway (its step, its pulls) look the regions up; what is
    bound is remembered (by address), so ``zero_grad`` and :attr:`bound` ask nothing of a shard.

    Args:
      session: the :class:`~optserve.client.Session` the model trains in.
      named: ``(name, parameter)`` pairs (the session's tensor names).
      cleared: names whose gradient torch would hold as None (carried over from a former binding).
    """

    def __init__(self, session, named: Sequence[tuple[str, torch.nn.Parameter]], cleared: Optional[set] = None):
        self.session = session
        self._named = list(named)
        self.cleared: set[str] = set() if cleared is None else cleared  # bound gradients torch would hold as None
        self._params: dict[str, int] = {}  # name -> address of the reply array the parameter's storage is
        self._grads: dict[str, int] = {}  # name -> address of the push array its .grad is
        touched = self.cleared  # the hooks hold the set only (not this object, its session or client)
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _p, name=name, touched=touched: touched.discard(name))
                       for name, p in self._named]

    @property
    def bound(self) -> list[str]:
        """Names of the parameters whose storage is a region's reply array now."""
        return [name for name, p in self._named if self._params.get(name) == p.data_ptr()]

    def adopt(self, params: Mapping[str, np.ndarray], written: bool = True) -> set[str]:
        """After a pull or step was answered with ``params`` (``views=True``): every parameter whose
        values arrived as a view of a reply array takes that array as its storage. Returns the
        names that now need no copy. ``written=False`` (``params`` are the buffers themselves,
        after a create): the parameter's values are copied into the array first."""
        try:
            buffers = self.session.parameter_buffers()
        except UnavailableError:  # a shard restarting: copied this time, bound after a later call
            return set()
        adopted = set()
        for name, p in self._named:
            buffer, values = buffers.get(name), params.get(name)
            if (buffer is None or values is None or not eligible(p) or _address(values) != _address(buffer)
                    or values.shape != buffer.shape):
                continue
            if p.data_ptr() != _address(buffer):
                if not written:
                    np.copyto(buffer, p.detach().numpy())
                p.data = _as_tensor(buffer)
            self._params[name] = _address(buffer)
            adopted.add(name)
        return adopted

    def gradients(self) -> tuple[dict[str, np.ndarray], set[str]]:
        """The bound parameters' gradients as the push arrays themselves, and the names whose
        gradient torch would hold as ``None`` (their array holds zeros; see the module's docstring).

        A ``.grad`` that is not the push array (``None``, set by hand, or from before the region
        changed) is copied into it once and the push array bound in its place: a ``None`` one as
        none, one set by hand as a gradient. A shard restarting (no regions this time) returns no
        arrays, only the names that are none (the caller copies the others)."""
        self._settle()
        try:
            buffers, shared = self.session.gradient_buffers(), self.session.parameter_buffers()
        except UnavailableError:  # a shard restarting: this step copies; bound gradients torch holds as None stay so
            return {}, self._none()
        grads = {}
        for name, p in self._named:
            buffer = buffers.get(name)
            if buffer is None or name not in shared or not eligible(p) or (p.grad is not None and not eligible(p.grad)):
                continue  # a shard reached by gRPC bytes, or a tensor moved or cast since
            if p.grad is None:
                buffer.fill(0.0)
                self.cleared.add(name)
            elif p.grad.data_ptr() != _address(buffer):  # set by hand (it counts: settled), or a former region's
                np.copyto(buffer, p.grad.detach().numpy())
            if p.grad is None or p.grad.data_ptr() != _address(buffer):
                p.grad = _as_tensor(buffer)
            self._grads[name] = _address(buffer)
            grads[name] = buffer
        return grads, self._none()

    def _none(self) -> set[str]:
        """Names of the bound gradients that torch would hold as ``None`` (after :meth:`_settle`):
        cleared, and given no value since (see the module's docstring)."""
        return {name for name, p in self._named if name in self.cleared and self._is_bound_grad(name, p)}

    def zero_grad(self, set_to_none: bool) -> set[str]:
        """Zeroes the bound gradients in place and returns their names (the caller handles the
        others as torch does). ``set_to_none``: they are none from now on, as torch would hold
        them. Otherwise each keeps its meaning, as torch zeroes only a gradient it holds: one
        that has a gradient (backward, a write or an assignment since it was cleared) is a
        gradient of zeros from now on, which a step pushes; one that is none stays none."""
        if not set_to_none:
            self._settle()  # before the values that tell a write are zeroed
        zeroed = set()
        for name, p in self._named:
            if self._is_bound_grad(name, p):
                p.grad.zero_()
                if set_to_none:
                    self.cleared.add(name)
                zeroed.add(name)
        return zeroed

    def detach(self) -> None:
        """A step ended without its answer: the shard may still read the gradients where they lie
        and write the parameters where the model reads them, later. The bound tensors move to
        storage of their own (one copy) and are bound to fresh regions by the next step."""
        with torch.no_grad():
            for name, p in self._named:
                if self._params.pop(name, None) == p.data_ptr():
                    p.data = p.data.clone()
                if self._is_bound_grad(name, p):
                    p.grad = p.grad.clone()
                    self._grads[name] = p.grad.data_ptr()  # ours still: copied into a region, it keeps what it was

    def following(self, session) -> "SharedModelMemory":
        """The same model bound to ``session`` from now on (which gradients torch would hold as
        None is kept; this object's hooks are removed)."""
        moved = SharedModelMemory(session, self._named, self.cleared)
        moved._grads = dict(self._grads)  # copied into the new regions, they keep their meaning
        self.close()
        return moved

    def _is_bound_grad(self, name: str, p: torch.nn.Parameter) -> bool:
        return p.grad is not None and self._grads.get(name) == p.grad.data_ptr()

    def _settle(self) -> None:
        """Un-clears each cleared gradient given a value since it was cleared: its ``.grad`` is
        another tensor than the one bound (assigned), or its values are no longer all zeros
        (written in place, by any means). A ``backward`` un-clears it at once (the hooks); a
        ``.grad`` set to ``None`` stays cleared. Reads only the cleared gradients (those no
        backward reached since they were cleared)."""
        for name, p in self._named:
            if name in self.cleared and p.grad is not None and (
                    not self._is_bound_grad(name, p) or bool(p.grad.detach().any())):
                self.cleared.discard(name)

    def close(self) -> None:
        """Removes the gradient hooks (the tensors keep their storage, which outlives the regions)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
