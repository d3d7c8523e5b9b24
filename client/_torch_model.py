"""The model side of :class:`optserve.client.torch.RemoteOptimizer`: its named parameters, the
gradients a step pushes, the values a step writes back, and ``zero_grad``.

With ``zero_copy`` the float32 CPU parameters and their gradients live in the session's shared
regions (:class:`~optserve.client._torch_shared.SharedModelMemory`); the others are copied.
Imports torch and NumPy only.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from optserve.client._torch_arrays import gradient_to_numpy, viewed_without_copy, write_numpy_
from optserve.client._torch_shared import SharedModelMemory
from optserve.client.errors import UnavailableError


class ModelTensors:
    """A model's trained ``(name, parameter)`` pairs, as one session sees them.

    Args:
      named: the pairs (:func:`~optserve.client._torch_arrays.checked_named_parameters`).
      session: the :class:`~optserve.client.Session` they train in.
      zero_copy: keep float32 CPU parameters and gradients in the session's shared regions.
    """

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], session, zero_copy: bool):
        self.named = list(named)
        self.names = [name for name, _ in self.named]
        self._zero_copy = zero_copy
        self._shared: Optional[SharedModelMemory] = None
        self.follow(session)

    def follow(self, session) -> None:
        """Trains in ``session`` from now on (regions of a former session are let go)."""
        if self._shared is not None:
            self._shared = self._shared.following(session)
            self.bind_gradients()
        elif self._zero_copy:
            self._shared = SharedModelMemory(session, self.named)

    @property
    def zero_copy(self) -> bool:
        return self._shared is not None

    @property
    def shared(self) -> list[str]:
        """Names of the parameters whose storage is a shared region now."""
        return [] if self._shared is None else self._shared.bound

    def take_regions(self) -> None:
        """After a create: the parameters move into the regions' reply parts (their values copied
        there: a shard whose initial values went as chunks left its part unwritten)."""
        if self._shared is not None:
            try:
                buffers = self._shared.session.parameter_buffers()
            except UnavailableError:  # a shard restarting: the parameters move after a later call
                return
            self._shared.adopt(buffers, written=False)

    def detach(self) -> None:
        """A step ended without its answer: the model leaves the regions (see
        :meth:`SharedModelMemory.detach`)."""
        if self._shared is not None:
            self._shared.detach()

    def bind_gradients(self) -> None:
        """Preallocates ``.grad`` in the push regions, so that backward accumulates there."""
        if self._shared is not None:
            self._shared.gradients()

    def write(self, params: Mapping[str, np.ndarray]) -> None:
        """Puts ``params`` (name -> values, as ``push_pull(views=True)`` returns them) into the
        model: a region's reply array becomes the parameter's storage, other values are copied.

        Raises:
          ValueError: naming the tensor whose shape differs from the parameter's.
        """
        adopted = self._shared.adopt(params) if self._shared is not None else set()
        for name, parameter in self.named:
            if name in adopted:  # the values already are the parameter's storage
                continue
            try:
                write_numpy_(parameter, params[name])
            except ValueError as exc:
                raise ValueError(f"tensor {name!r}: {exc}") from None

    def gradients(self, *, copy: bool) -> tuple[Optional[dict[str, np.ndarray]], list[str]]:
        """The push's gradients by name (zeros for a parameter without one) and the names
        without one, in order; ``(None, [])`` when no parameter has one (nothing to push).
        ``copy``: gradients that would be views of ``.grad`` are copied (the step is still in
        flight when the next backward runs).

        A parameter is without a gradient where torch would hold ``None``: its ``.grad`` is
        ``None``, or it is bound to a region and none (cleared by ``zero_grad`` or at the binding,
        and given no value since: :mod:`optserve.client._torch_shared`). Any other ``.grad``
        counts, zeros included (after ``zero_grad(set_to_none=False)``, or assigned).

        Raises:
          TypeError: a sparse gradient.
        """
        grads, without = self._shared.gradients() if self._shared is not None else ({}, set())
        without |= {name for name, p in self.named if name not in grads and p.grad is None}
        if len(without) == len(self.named):
            return None, []
        for name, p in self.named:
            if name in grads:
                continue
            if name in without:  # None, or bound and none (zeros) on a shard this step copies to
                grads[name] = np.zeros(tuple(p.shape), np.float32)
            elif p.grad.is_sparse:
                raise TypeError(f"tensor {name!r}: sparse gradients are not supported")
            else:
                g = gradient_to_numpy(p.grad)
                if copy and viewed_without_copy(p.grad):
                    g = g.copy()  # a view of .grad, which the next backward may overwrite in place
                grads[name] = g
        return grads, [name for name in self.names if name in without]

    def zero_grad(self, set_to_none: bool) -> None:
        """As torch's ``Optimizer.zero_grad``: a ``None`` gradient stays ``None``, and the others
        are set to ``None`` (``set_to_none``) or zeroed (a gradient of zeros, which counts),
        except that gradients bound to a region are zeroed in place and, with ``set_to_none``,
        remembered as none (:meth:`SharedModelMemory.zero_grad`)."""
        bound = self._shared.zero_grad(set_to_none) if self._shared is not None else set()
        for name, p in self.named:
            if name in bound or p.grad is None:
                continue
            if set_to_none:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None
