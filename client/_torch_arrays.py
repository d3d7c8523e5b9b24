"""PyTorch tensors <-> the NumPy arrays the client core speaks, and the named parameters a session trains.

Used by the torch adapters (:class:`optserve.client.torch.RemoteOptimizer` and
:class:`optserve.client.torch.DiLoCo`). Imports torch and NumPy only; ``ml_dtypes`` (optional)
on first use.
"""

from __future__ import annotations

import functools
import warnings
from typing import Iterable, Optional

import numpy as np
import torch

from optserve.protos import contract


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The float32 NumPy values of ``tensor`` (same shape), without a copy where possible.

    A float32 CPU tensor is returned as a view of its storage (modify neither while the other
    is in use). bfloat16 goes through its raw 16 bits (an int16 view widened by a shift,
    exact); float16 / float64 are converted; CUDA tensors are copied to the host first.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu", non_blocking=False)
    if tensor.dtype == torch.float32:
        return tensor.numpy()
    if tensor.dtype == torch.bfloat16:
        bits = tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
        return contract.bf16_bits_to_f32(bits)
    if tensor.dtype in (torch.float16, torch.float64):
        return tensor.numpy().astype(np.float32)
    raise TypeError(f"optserve trains floating-point parameters only, got dtype {tensor.dtype}")


def gradient_to_numpy(grad: torch.Tensor) -> np.ndarray:
    """A gradient's NumPy values for a push: like :func:`tensor_to_numpy`, except bfloat16.

    A bfloat16 CPU gradient is sent as its own 16 bits when ``ml_dtypes`` is importable (a
    zero-copy view; the server widens it exactly to float32, so the values are identical)
    and widened to float32 here otherwise.
    """
    if grad.dtype == torch.bfloat16 and grad.device.type == "cpu" and _ml_bfloat16() is not None:
        return grad.detach().contiguous().view(torch.int16).numpy().view(_ml_bfloat16())
    return tensor_to_numpy(grad)


@functools.cache
def _ml_bfloat16() -> Optional[np.dtype]:
    """ml_dtypes' bfloat16, imported on first use (the client never imports it at import time)."""
    try:  # optional: present wherever jax is, never required by the client
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def viewed_without_copy(grad: torch.Tensor) -> bool:
    """Whether :func:`gradient_to_numpy` returns a view of ``grad``'s storage."""
    if grad.device.type != "cpu":
        return False
    return grad.dtype == torch.float32 or (grad.dtype == torch.bfloat16 and _ml_bfloat16() is not None)


def write_numpy_(target: torch.Tensor, values: np.ndarray) -> None:
    """Copies ``values`` into ``target`` in place, converting dtype (rounding) and device.

    ``values`` may be read-only (a view of received bytes); it is only read.
    """
    if tuple(values.shape) != tuple(target.shape):
        raise ValueError(f"shape {tuple(values.shape)} from the server does not match the parameter's {tuple(target.shape)}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        source = torch.from_numpy(np.asarray(values))
    with torch.no_grad():
        target.copy_(source)


def checked_named_parameters(named_parameters: Iterable) -> list[tuple[str, torch.nn.Parameter]]:
    """The ``(name, parameter)`` pairs that train (``requires_grad``), in order: the session's tensors.

    Raises:
      TypeError: bare parameters (``model.parameters()``), or one that is not floating-point.
      ValueError: no parameter requires grad, or a name appears twice.
    """
    named = []
    for item in named_parameters:
        if isinstance(item, torch.Tensor) or not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError("RemoteOptimizer needs (name, parameter) pairs: pass model.named_parameters(), not "
                            "model.parameters() (the session's tensors are named)")
        if item[1].requires_grad:
            named.append((str(item[0]), item[1]))
    if not named:
        raise ValueError("RemoteOptimizer got no parameters that require grad")
    seen: set[str] = set()
    for name, p in named:
        if name in seen:
            raise ValueError(f"parameter name {name!r} appears twice; names must be unique")
        seen.add(name)
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters train")
    return named
