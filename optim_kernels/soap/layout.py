"""Which axes of a parameter SOAP rotates: the working shape and its preconditioned axes.

A parameter of shape ``S`` is viewed in a *working shape*; each working axis of length ``d`` is
either preconditioned (it owns a ``[d, d]`` statistic and an eigenbasis) or left alone (the
identity basis). The rules, those of the paper's reference implementation:

* a scalar: nothing preconditioned (plain Adam);
* a vector: its one axis, only with ``precondition_1d`` and ``d <= max_precondition_dim``;
* rank >= 2: each axis with ``d <= max_precondition_dim`` (an axis above it is left alone: the
  one-sided variant). With ``merge_dims`` the working shape is ``merge_small_dims(S,
  max_precondition_dim)`` (adjacent axes multiplied together while the product stays <= the
  bound, axes of length 1 dropped), after moving the channels of a rank-4 ``channels_last``
  tensor (NHWC) in front of the spatial axes (NCHW). When every axis merges into one, that one
  axis is preconditioned as for rank >= 2 (``pytorch_optimizer`` 4.1.0 fails there: its merge
  returns ``[1]``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from optserve.optim_kernels.shampoo.blocking import merge_small_dims
from optserve.optim_kernels.soap.config import SoapConfig

__all__ = ["SoapLayout"]

_NHWC_TO_NCHW = (0, 3, 1, 2)


@dataclasses.dataclass(frozen=True)
class SoapLayout:
    """How one parameter is viewed by SOAP.

    Attributes:
      shape: the parameter's shape.
      permutation: axes permutation applied before reshaping (channels_last rank-4 tensors under
        ``merge_dims``), or ``None``.
      working_shape: the shape the moments, statistics and bases refer to.
      preconditioned: per working axis, whether it has a statistic and an eigenbasis.
    """

    shape: tuple[int, ...]
    permutation: tuple[int, ...] | None
    working_shape: tuple[int, ...]
    preconditioned: tuple[bool, ...]

    @classmethod
    def create(cls, shape: Sequence[int], config: SoapConfig) -> SoapLayout:
        shape = tuple(int(d) for d in shape)
        bound = config.max_precondition_dim
        if len(shape) == 1:
            return cls(shape, None, shape, (config.precondition_1d and shape[0] <= bound,))
        permutation, working = None, shape
        if config.merge_dims and len(shape) >= 2:
            if config.data_format == "channels_last" and len(shape) == 4:
                permutation = _NHWC_TO_NCHW
                working = tuple(shape[a] for a in permutation)
            working = merge_small_dims(working, bound)
        return cls(shape, permutation, working, tuple(d <= bound for d in working))

    @property
    def axes(self) -> tuple[int, ...]:
        """The preconditioned working axes, in order."""
        return tuple(a for a, p in enumerate(self.preconditioned) if p)

    @property
    def statistic_sizes(self) -> tuple[int, ...]:
        """The side of each statistic (one per preconditioned axis)."""
        return tuple(self.working_shape[a] for a in self.axes)

    def to_working(self, x: jax.Array) -> jax.Array:
        """``x`` (``shape``) viewed in the working shape."""
        if self.permutation is not None:
            x = jnp.transpose(x, self.permutation)
        return jnp.reshape(x, self.working_shape)

    def from_working(self, y: jax.Array) -> jax.Array:
        """Inverse of :meth:`to_working`."""
        if self.permutation is None:
            return jnp.reshape(y, self.shape)
        permuted = tuple(self.shape[a] for a in self.permutation)
        inverse = tuple(sorted(range(len(self.permutation)), key=self.permutation.__getitem__))
        return jnp.transpose(jnp.reshape(y, permuted), inverse)
