"""The compute side's door to the kernel registry for the layers above, which only name kernels."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence


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


ROOT_EXCHANGE_COPIES = 3
"""Stacked statistics a shard holds at once while roots are exchanged: the export (until it is in
the object store), the roots received, and their copy into the update's memory."""


def traced_bytes(name: str, args: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
                 ) -> tuple[Optional[int], int]:
    """``(state, roots)``: bytes optimizer ``name`` (built with ``args``) keeps for float32
    parameters of ``shapes`` (tensor name -> shape), traced abstractly once (``jax.eval_shape``:
    nothing allocated or compiled).

    ``state``: its own ``init``'s state, so factored (Adafactor's row and column statistics),
    blocked (Shampoo's statistics and roots), quantized or per-tensor states count what they are;
    None when ``init`` does not trace for these tensors (the shard opening the session refuses
    it, naming why). ``roots``: what a shard holds beyond it while matrix roots (Shampoo) or
    eigenbases (SOAP) are exchanged with the preconditioner workers or computed in its update,
    :data:`ROOT_EXCHANGE_COPIES` times an export's stacked statistics; 0 for an optimizer without
    such roots, or when its export does not trace.
    """
    import jax
    import numpy as np

    from optserve.optim_kernels import build_optimizer, resolve_schedules
    from optserve.optim_kernels.registry import optimizer_entry

    def nbytes(tree) -> int:
        return sum(int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))

    try:
        params = {tensor: jax.ShapeDtypeStruct(tuple(shape), np.float32) for tensor, shape in shapes.items()}
        state = jax.eval_shape(build_optimizer(name, dict(args)).transformation.init, params)
        state_total = nbytes(state)
    except Exception:  # noqa: BLE001 - the kernel's refusal (the shard's own check words it), or a leaf of no size
        return None, 0
    try:
        seam = optimizer_entry(name).root_offload
        if seam is None:
            return state_total, 0
        config = seam.config(**resolve_schedules(name, dict(args)))
        exported = jax.eval_shape(lambda s: seam.export(s, config), state)
        stacked = [exported.statistics, getattr(exported, "previous", None)]
        return state_total, ROOT_EXCHANGE_COPIES * nbytes([x for x in stacked if x is not None])
    except Exception:  # noqa: BLE001 - as above: the shard's own check words the refusal
        return state_total, 0


def compiled_step_bytes(name: str, args: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                        roots_in_step: bool) -> int:
    """Host bytes the compiled step of optimizer ``name`` (built with ``args``) keeps for float32
    parameters of ``shapes`` (tensor name -> shape): its seam's ``code_cost`` times its
    preconditioned tensors and blocks (``seam.block_labels``); 0 for an optimizer that declares
    none (its code grows with the tensors of one program, which a shard caps by updating many
    tensors in chunks whose programs are shared, and sessions of one model share a step), or whose
    options do not build (the shard's own check words that refusal)."""
    from optserve.optim_kernels import resolve_schedules
    from optserve.optim_kernels.registry import optimizer_entry

    try:
        seam = optimizer_entry(name).root_offload
    except ValueError:  # no such optimizer: the shard's own check words that refusal
        return 0
    cost = seam.code_cost.get(roots_in_step) if seam is not None else None
    if cost is None:
        return 0
    try:
        labels = seam.block_labels(seam.config(**resolve_schedules(name, dict(args))), shapes)
    except Exception:  # noqa: BLE001 - as in traced_bytes
        return 0
    tensors = {label.tensor for label in labels}
    blocks = {(label.tensor, label.block) for label in labels}
    return cost.per_tensor * len(tensors) + cost.per_block * len(blocks)
