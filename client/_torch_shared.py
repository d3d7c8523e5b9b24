"""A torch model whose parameters and gradients live in its session's shared-memory regions.

On shards this process reaches through shared memory (same host), each step's gradients are
read by the shard straight from the region's push part and the new parameters are written into
its reply part (:meth:`Session.gradient_buffers`, :meth:`Session.parameter_buffers`).
:class:`SharedModelMemory` makes a float32 CPU parameter's storage the reply array and its
``.grad`` the push array, so ``backward`` accumulates into the region and a step copies no
tensor on the client.

What stays as torch has it: the ``Parameter`` objects (only their storage moves, through
``.data``), their dtype, shape and ``requires_grad``. What differs: once bound, ``.grad`` is
never ``None``; ``zero_grad(set_to_none=True)`` zeroes it in place and remembers that torch
would have made it ``None``, so a parameter that no ``backward`` reaches afterwards is still
pushed as having no gradient (``without_gradient``), as a torch optimizer leaves it alone.
``model.zero_grad()`` (setting ``.grad`` to ``None``) and any ``.grad`` assigned by hand are
fine: such a gradient is copied into the region once, and the region's array is bound again.

Parameters that are not float32, not on the CPU or not contiguous, and tensors on shards reached
by gRPC, keep their own storage and are copied as before. Imports torch and NumPy only.
"""

from __future__ import annotations

import warnings
from typing import Mapping, Sequence

import numpy as np
import torch


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def eligible(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` can live in a region: float32, on the CPU, dense and contiguous."""
    return (parameter.dtype == torch.float32 and parameter.device.type == "cpu" and parameter.layout == torch.strided
            and parameter.is_contiguous())


class SharedModelMemory:
    """Binds a model's parameters and gradients to the regions of ``session`` and keeps them bound.

    Args:
      session: the :class:`~optserve.client.Session` the model trains in.
      named: ``(name, parameter)`` pairs (the session's tensor names); those that are not
        :func:`eligible` are never bound.
    """

    def __init__(self, session, named: Sequence[tuple[str, torch.nn.Parameter]]):
        self.session = session
        self._named = [(name, p) for name, p in named if eligible(p)]
        self._cleared: set[str] = set()  # bound gradients that torch would hold as None
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _p, name=name: self._cleared.discard(name))
                       for name, p in self._named]

    @property
    def bound(self) -> list[str]:
        """Names of the parameters whose storage is a region's reply array now."""
        buffers = self.session.parameter_buffers()
        return [name for name, p in self._named if name in buffers and p.data_ptr() == _address(buffers[name])]

    def adopt(self, params: Mapping[str, np.ndarray]) -> set[str]:
        """After a pull or step was answered with ``params`` (``views=True``): every parameter whose
        values arrived as a view of a reply array takes that array as its storage. Returns the
        names that now need no copy."""
        buffers = self.session.parameter_buffers()
        adopted = set()
        for name, p in self._named:
            buffer, values = buffers.get(name), params.get(name)
            if buffer is None or values is None or _address(values) != _address(buffer) or values.shape != buffer.shape:
                continue
            if p.data_ptr() != _address(buffer):
                p.data = _as_tensor(buffer)
            adopted.add(name)
        return adopted

    def gradients(self) -> tuple[dict[str, np.ndarray], set[str]]:
        """The bound parameters' gradients as the push arrays themselves, and the names among
        them that have no gradient (``.grad`` cleared or ``None``: their array holds zeros).

        A ``.grad`` that is not the push array (``None``, set by hand, or from before the region
        changed) is copied into it once and the push array bound in its place."""
        buffers, shared = self.session.gradient_buffers(), self.session.parameter_buffers()
        grads, without = {}, set()
        for name, p in self._named:
            buffer = buffers.get(name)
            if buffer is None or name not in shared:  # a shard reached by gRPC bytes
                continue
            if p.grad is None:
                buffer.fill(0.0)
                self._cleared.add(name)
            elif p.grad.data_ptr() != _address(buffer):
                np.copyto(buffer, p.grad.detach().numpy())
                self._cleared.discard(name)
            if p.grad is None or p.grad.data_ptr() != _address(buffer):
                p.grad = _as_tensor(buffer)
            grads[name] = buffer
            if name in self._cleared:
                without.add(name)
        return grads, without

    def zero_grad(self, set_to_none: bool) -> set[str]:
        """Zeroes the bound gradients in place (``set_to_none``: and remembers them as none);
        returns their names (the caller handles the others as torch does)."""
        buffers = self.session.gradient_buffers()
        zeroed = set()
        for name, p in self._named:
            buffer = buffers.get(name)
            if p.grad is not None and buffer is not None and p.grad.data_ptr() == _address(buffer):
                p.grad.zero_()
                if set_to_none:
                    self._cleared.add(name)
                zeroed.add(name)
        return zeroed

    def close(self) -> None:
        """Removes the gradient hooks (the tensors keep their storage, which outlives the regions)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

