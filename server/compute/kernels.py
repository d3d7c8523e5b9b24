"""The compute side's door to the kernel registry for the layers above, which only name kernels."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def check_optimizer(name: str, args: Mapping[str, Any], tensors: Sequence[str] = ()) -> None:
    """Builds optimizer ``name`` with ``args`` once, to check both before a session is placed
    (``tensors``: the session's tensor names, which its parameter groups may name).

    Raises:
      ValueError: an unknown name, an unknown argument, or an argument whose type or value breaks
        the kernel's rule (shape, finiteness, range, declared with the kernel in
        :mod:`optserve.optim_kernels`; the message names the optimizer, the argument, the value and
        the rule), or the optimizer's library is not installed.
    """
    from optserve.optim_kernels import build_optimizer
    from optserve.optim_kernels.hyperparams import check_group_tensors

    try:
        build_optimizer(name, dict(args))
        check_group_tensors(name, args, tensors)
    except ImportError as exc:
        raise ValueError(f"optimizer {name!r} is not available: {exc}") from None
