"""Shampoo (google-research distributed Shampoo semantics) with a separable root computation.

``shampoo(learning_rate, block_size, ...)`` is an ``optax.GradientTransformation`` with the seed's
option names and defaults. One update at step ``t = state.count``:

1. every ``statistics_compute_steps``: fold the gradient into each block's statistics
   (:mod:`shampoo_statistics`, blocks from :mod:`shampoo_blocking`);
2. in-process mode only, every ``preconditioning_compute_steps``: export the statistics, run
   :func:`compute_preconditioners` on them and install the roots (exactly steps 1-3 below);
3. graft (:mod:`shampoo_grafting`), precondition, rescale to the graft's norm, weight decay,
   momentum / nesterov; before ``start_preconditioning_step`` the grafted direction is used.

Offload seam (what preconditioner workers build on)
---------------------------------------------------
With ``inline_preconditioners=False`` the update never computes roots; it preconditions with
whatever the state holds (identity until the first install, which with the default grafting
reproduces the grafted step's norm). Roots are produced outside with three pure functions:

* ``export_statistics(state, config, grads=None) -> StatisticsExport``: every statistic of the
  whole tree, identity-padded to ``[B, n, n]`` in a stable order (parameters in tree-flatten
  order, then blocks row-major, then block dimensions), with ``exponents [B]``, real ``sizes [B]``
  and ``step``: the index of the last update whose gradient the statistics contain. Given the
  pending ``grads`` of the next update it returns the statistics that update will hold
  (``step = state.count``).
* ``compute_preconditioners(statistics, exponents, *, sizes, matrix_epsilon, method, ...)
  -> (preconditioners [B, n, n], errors [B])``: pure and jittable; what workers run. Identity
  padding (inside a matrix when ``sizes`` is given, or extra identity blocks) does not change the
  real blocks' results. float64 when ``jax_enable_x64`` is on.
* ``install_preconditioners(state, config, preconditioners, errors, step) -> state``: per block,
  keeps the previous preconditioner where ``error >= inverse_failure_threshold`` or is NaN (and
  counts a failure), else installs the new one and records ``step`` as its source;
  ``preconditioner_age(state)`` is then ``state.count - source_step`` (the age at the next update).

Age-0 equivalence: calling ``export(state, config, grads) -> compute -> install`` right before
``update(grads, ...)`` on the steps where ``count % preconditioning_compute_steps == 0`` gives
exactly the in-process trajectory (the in-process update runs the same three functions). Calling
them right after an update gives age-1 preconditioners, the natural asynchronous mode.

``config = shampoo_config(**same_kwargs_as_shampoo)`` builds the validated :class:`ShampooConfig`
the seam functions take.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optserve.optim_kernels import matrix_roots
from optserve.optim_kernels.shampoo_blocking import BlockLayout, merge_small_dims
from optserve.optim_kernels.shampoo_grafting import (
    GraftingType,
    graft_direction,
    has_diagonal_statistics,
    parse_graft_type,
)
from optserve.optim_kernels.shampoo_quantization import (
    decode,
    encode_diagonal,
    encode_matrix,
    encode_momentum,
)
from optserve.optim_kernels.shampoo_statistics import (
    block_exponent,
    init_statistics,
    precondition_block,
    update_block_statistics,
)

__all__ = [
    "GraftingType",
    "ParamState",
    "PreconditionerInfo",
    "ShampooConfig",
    "ShampooState",
    "StatisticsExport",
    "compute_preconditioners",
    "default_root_method",
    "export_statistics",
    "install_preconditioners",
    "merge_small_dims",
    "preconditioner_age",
    "shampoo",
    "shampoo_config",
]

# Guards the norm ratio of grafting when the preconditioned direction is zero.
_TINY = 1e-25

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]


def default_root_method(backend: Optional[str] = None) -> str:
    """The root method ``root_method="auto"`` picks: eigh on CPU, coupled Newton elsewhere.

    On CPU (bench/shampoo.py) a Shampoo step with roots for 52 blocks of 128 took 0.11 s with
    eigh and 0.28 s with coupled Newton, and eigh reaches ~1e-15 residuals in f64 for every ``p``
    (the issue measured coupled Newton 2-13x slower than eigh on CPU). On an H100 (jax 0.11.2,
    bench/shampoo.py) coupled Newton is the one that holds up: per block of 512 / 1024 it took
    2.5 / 10.6 ms in f32 against eigh's 7.5 / 71 ms, and f32 eigh there misses the f32 accuracy
    tolerances of tests/test_matrix_roots.py at condition 1e6 (error 0.21 for p = 1), which
    coupled Newton meets. eigh is faster on the GPU only for blocks up to 256 (0.12 against
    0.65 ms at 128); pass ``root_method="eigh"`` with f64 roots there if that matters.
    """
    backend = backend or jax.default_backend()
    return "eigh" if backend == "cpu" else "coupled_newton"


@dataclasses.dataclass(frozen=True)
class ShampooConfig:
    """Validated Shampoo options (names and defaults of the seed's ``distributed_shampoo``).

    ``root_method``, ``root_num_iters`` and ``inline_preconditioners`` are optserve's: the
    root algorithm (``"auto"``, ``"eigh"``, ``"coupled_newton"``), coupled Newton's iteration cap,
    and whether the update computes roots itself (see the module docstring).
    """

    learning_rate: ScalarOrSchedule
    block_size: int = 128
    beta1: float = 0.9
    beta2: float = 0.999
    diagonal_epsilon: float = 1e-10
    matrix_epsilon: float = 1e-6
    weight_decay: float = 0.0
    start_preconditioning_step: int = 5
    preconditioning_compute_steps: int = 1
    statistics_compute_steps: int = 1
    best_effort_shape_interpretation: bool = True
    graft_type: GraftingType = GraftingType.SGD
    nesterov: bool = True
    exponent_override: int = 0
    best_effort_memory_usage_reduction: bool = False
    inverse_failure_threshold: float = 0.1
    moving_average_for_momentum: bool = False
    skip_preconditioning_dim_size_gt: int = 4096
    clip_by_scaled_gradient_norm: Optional[float] = None
    relative_matrix_epsilon: bool = True
    merge_small_dims_block_size: int = 4096
    decoupled_learning_rate: bool = True
    decoupled_weight_decay: bool = False
    root_method: str = "auto"
    root_num_iters: int = 100
    inline_preconditioners: bool = True

    def __post_init__(self):
        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise ValueError(f"shampoo: option {name!r} {rule}, got {getattr(self, name)!r}")

        lr = self.learning_rate
        need(callable(lr) or (isinstance(lr, (int, float)) and not isinstance(lr, bool)),
             "learning_rate", "must be a number or a schedule")
        for name in ("block_size", "start_preconditioning_step", "exponent_override"):
            need(_is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "must be an integer >= 0")
        for name in ("preconditioning_compute_steps", "statistics_compute_steps",
                     "skip_preconditioning_dim_size_gt", "merge_small_dims_block_size", "root_num_iters"):
            need(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        need(_is_num(self.beta1) and 0.0 <= self.beta1 < 1.0, "beta1", "must be in [0, 1)")
        need(_is_num(self.beta2) and 0.0 < self.beta2 <= 1.0, "beta2", "must be in (0, 1]")
        for name in ("diagonal_epsilon", "matrix_epsilon", "weight_decay"):
            need(_is_num(getattr(self, name)) and getattr(self, name) >= 0.0, name, "must be a number >= 0")
        need(_is_num(self.inverse_failure_threshold) and self.inverse_failure_threshold > 0,
             "inverse_failure_threshold", "must be a number > 0")
        clip = self.clip_by_scaled_gradient_norm
        need(clip is None or (_is_num(clip) and clip > 0), "clip_by_scaled_gradient_norm", "must be None or > 0")
        need(self.root_method in ("auto",) + matrix_roots.ROOT_METHODS, "root_method",
             f"must be one of {('auto',) + matrix_roots.ROOT_METHODS}")
        object.__setattr__(self, "graft_type", parse_graft_type(self.graft_type))
        for name in ("best_effort_shape_interpretation", "nesterov", "best_effort_memory_usage_reduction",
                     "moving_average_for_momentum", "relative_matrix_epsilon", "decoupled_learning_rate",
                     "decoupled_weight_decay", "inline_preconditioners"):
            need(isinstance(getattr(self, name), bool), name, "must be a bool")

    @property
    def method(self) -> str:
        """The concrete root method (``"auto"`` resolved for the current backend)."""
        return default_root_method() if self.root_method == "auto" else self.root_method

    def layout(self, shape) -> Optional[BlockLayout]:
        """The block layout of a parameter of ``shape``, or ``None`` when it is not preconditioned."""
        if len(shape) < 1 or any(d > self.skip_preconditioning_dim_size_gt for d in shape):
            return None
        return BlockLayout.create(shape, self.block_size, self.best_effort_shape_interpretation,
                                  self.merge_small_dims_block_size)

    def exponent(self, layout: BlockLayout) -> int:
        return block_exponent(len(layout.working_shape), self.exponent_override)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def shampoo_config(learning_rate: ScalarOrSchedule, **kwargs) -> ShampooConfig:
    """The :class:`ShampooConfig` for the same keyword arguments as :func:`shampoo`."""
    return ShampooConfig(learning_rate, **kwargs)


class ParamState(NamedTuple):
    """Shampoo state of one parameter.

    Attributes:
      diagonal_statistics: grafting accumulator (shape of the parameter) or ``None``.
      statistics: one [d, d] matrix per block dimension (blocks row-major), maybe quantized.
      preconditioners: same shapes as ``statistics``; identity at init.
      diagonal_momentum: momentum of the grafted direction (shape of the parameter).
      momentum: momentum of the Shampoo direction (shape of the parameter).
    """

    diagonal_statistics: Any
    statistics: tuple
    preconditioners: tuple
    diagonal_momentum: Any
    momentum: Any


class PreconditionerInfo(NamedTuple):
    """Per-statistic bookkeeping over the whole tree, in export order ([B] each).

    Attributes:
      exponents: the root ``p`` of each statistic (constant).
      source_step: step of the statistics each preconditioner was computed from (-1: identity
        from init).
      failures: number of rejected roots (error above the threshold or NaN).
      last_error: error of the latest root offered for the block.
    """

    exponents: jax.Array
    source_step: jax.Array
    failures: jax.Array
    last_error: jax.Array


class ShampooState(NamedTuple):
    count: jax.Array
    params: Any
    preconditioner_info: PreconditionerInfo


class StatisticsExport(NamedTuple):
    """What a preconditioner worker receives.

    Attributes:
      statistics: f32 [B, n, n], each block's statistic in its top-left corner, identity below.
      exponents: int32 [B], the root ``p`` of each block.
      sizes: int32 [B], each block's real size.
      step: int32 scalar, the index of the last update whose gradient the statistics contain.
    """

    statistics: jax.Array
    exponents: jax.Array
    sizes: jax.Array
    step: jax.Array


def compute_preconditioners(
    stacked_statistics: jax.Array,
    exponents: jax.Array,
    *,
    sizes: Optional[jax.Array] = None,
    matrix_epsilon: float = 1e-6,
    method: str = "coupled_newton",
    relative_matrix_epsilon: bool = True,
    error_tolerance: Optional[float] = None,
    num_iters: int = 100,
    precision=lax.Precision.HIGHEST,
) -> tuple[jax.Array, jax.Array]:
    """Inverse p-th roots of a stack of statistics: the function preconditioner workers run.

    Args:
      stacked_statistics: [B, n, n] symmetric PSD matrices (padding rows/columns arbitrary when
        ``sizes`` is given, e.g. identity).
      exponents: int [B], the root of each block.
      sizes: int [B] real sizes, or ``None`` when every matrix is fully real.
      matrix_epsilon, relative_matrix_epsilon: the ridge (see :mod:`matrix_roots`).
      method: ``"coupled_newton"`` or ``"eigh"`` (``"auto"`` resolves per backend).
      error_tolerance, num_iters, precision: coupled Newton's controls.

    Returns:
      ``(preconditioners, errors)``: [B, n, n] in the input dtype (zero past each size) and
      f32 [B] errors (``inf`` for non-finite input).
    """
    method = default_root_method() if method == "auto" else matrix_roots.validate_method(method)
    if stacked_statistics.ndim != 3 or stacked_statistics.shape[1] != stacked_statistics.shape[2]:
        raise ValueError(f"stacked_statistics: expected [B, n, n], got shape {stacked_statistics.shape}")
    if exponents.shape != stacked_statistics.shape[:1]:
        raise ValueError(f"exponents: expected shape {stacked_statistics.shape[:1]}, got {exponents.shape}")

    def one(matrix, p, size):
        return matrix_roots.matrix_inverse_pth_root(
            matrix, p, method=method, ridge_epsilon=matrix_epsilon, relative_epsilon=relative_matrix_epsilon,
            error_tolerance=error_tolerance, num_iters=num_iters, size=size, precision=precision)

    if stacked_statistics.shape[0] == 0:
        return stacked_statistics, jnp.zeros((0,), jnp.float32)
    if sizes is None:
        return jax.vmap(lambda m, p: one(m, p, None))(stacked_statistics, exponents.astype(jnp.int32))
    return jax.vmap(one)(stacked_statistics, exponents.astype(jnp.int32), sizes.astype(jnp.int32))


def _param_states(state: ShampooState) -> list[ParamState]:
    return jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, ParamState))


def _block_meta(config: ShampooConfig, params_like) -> tuple[list[int], list[int]]:
    """(sizes, exponents) of every statistic of the tree in export order."""
    sizes, exponents = [], []
    for leaf in jax.tree.leaves(params_like):
        layout = config.layout(leaf.shape)
        if layout is None:
            continue
        for d in layout.statistic_sizes:
            sizes.append(d)
            exponents.append(config.exponent(layout))
    return sizes, exponents


def _fold_statistics(config: ShampooConfig, param_state: ParamState, layout: BlockLayout, grad) -> tuple:
    rank = len(layout.working_shape)
    blocks = layout.split(grad.astype(jnp.float32))
    stats = [decode(s) for s in param_state.statistics]
    new = []
    for j, block in enumerate(blocks):
        new += update_block_statistics(stats[j * rank:(j + 1) * rank], block, config.beta2)
    q = config.best_effort_memory_usage_reduction
    return tuple(encode_matrix(s, q) for s in new)


def _update_statistics(config: ShampooConfig, state: ShampooState, grads) -> ShampooState:
    """Folds ``grads`` into the statistics if ``state.count`` is a statistics step."""
    treedef = jax.tree.structure(grads)
    grads_flat = jax.tree.leaves(grads)
    pstates = _param_states(state)
    new_pstates = []
    for g, ps in zip(grads_flat, pstates):
        layout = config.layout(g.shape)
        if layout is None or not ps.statistics:
            new_pstates.append(ps)
            continue
        if config.statistics_compute_steps == 1:
            stats = _fold_statistics(config, ps, layout, g)
        else:
            stats = lax.cond(state.count % config.statistics_compute_steps == 0,
                             lambda: _fold_statistics(config, ps, layout, g), lambda: ps.statistics)
        new_pstates.append(ps._replace(statistics=stats))
    return state._replace(params=jax.tree.unflatten(treedef, new_pstates))


def export_statistics(state: ShampooState, config: ShampooConfig, grads=None) -> StatisticsExport:
    """The identity-padded stack of all statistics (see the module docstring).

    With ``grads`` (the pending gradients of the next update) the statistics are those the next
    update will hold and ``step = state.count``; without, ``step = state.count - 1``.
    """
    if grads is None:
        return _stack_statistics(state, state.count - 1)
    _check_tree(config, state, grads, "grads")
    return _stack_statistics(_update_statistics(config, state, grads), state.count)


def _stack_statistics(state: ShampooState, step) -> StatisticsExport:
    mats = [decode(s) for ps in _param_states(state) for s in ps.statistics]
    step = jnp.asarray(step, jnp.int32)
    if not mats:
        empty = jnp.zeros((0,), jnp.int32)
        return StatisticsExport(jnp.zeros((0, 1, 1), jnp.float32), empty, empty, step)
    n = max(m.shape[0] for m in mats)
    padded = [jnp.pad(m, ((0, n - m.shape[0]),) * 2) + jnp.diag((jnp.arange(n) >= m.shape[0]).astype(m.dtype))
              for m in mats]
    sizes = jnp.asarray([m.shape[0] for m in mats], jnp.int32)
    return StatisticsExport(jnp.stack(padded), state.preconditioner_info.exponents, sizes, step)


def install_preconditioners(
    state: ShampooState, config: ShampooConfig, preconditioners: jax.Array, errors: jax.Array, step
) -> ShampooState:
    """Installs roots computed from an export (see the module docstring).

    Args:
      state: the state to update (may have advanced since the export).
      config: the optimizer's config (for ``inverse_failure_threshold`` and quantization).
      preconditioners: [B, n, n] as returned by :func:`compute_preconditioners`.
      errors: [B] their errors.
      step: the export's ``step``.
    """
    info = state.preconditioner_info
    count = info.source_step.shape[0]
    if preconditioners.shape[0] != count or errors.shape != (count,):
        raise ValueError(
            f"preconditioners: expected [{count}, n, n] roots and [{count}] errors for this state, "
            f"got {preconditioners.shape} and {errors.shape}")
    errors = errors.astype(jnp.float32)
    failed = jnp.logical_or(jnp.isnan(errors), errors >= config.inverse_failure_threshold)
    q = config.best_effort_memory_usage_reduction
    treedef = jax.tree.structure(state.params, is_leaf=lambda x: isinstance(x, ParamState))
    new_pstates, k = [], 0
    for ps in _param_states(state):
        new_p = []
        for old in ps.preconditioners:
            d = decode(old).shape[0]
            root = preconditioners[k, :d, :d].astype(jnp.float32)
            new_p.append(encode_matrix(jnp.where(failed[k], decode(old), root), q))
            k += 1
        new_pstates.append(ps._replace(preconditioners=tuple(new_p)))
    new_info = PreconditionerInfo(
        exponents=info.exponents,
        source_step=jnp.where(failed, info.source_step, jnp.asarray(step, jnp.int32)),
        failures=info.failures + failed.astype(jnp.int32),
        last_error=errors,
    )
    return state._replace(params=jax.tree.unflatten(treedef, new_pstates), preconditioner_info=new_info)


def preconditioner_age(state: ShampooState) -> jax.Array:
    """int32 [B]: how many steps old each preconditioner will be at the next update."""
    return state.count - state.preconditioner_info.source_step


def _refresh_preconditioners(config: ShampooConfig, state: ShampooState) -> ShampooState:
    """In-process mode: export -> compute -> install, on preconditioning steps.

    Runs inside update ``state.count`` after its gradient is folded in, so the export's step is
    ``state.count`` (the same as ``export_statistics(state_before_update, config, grads)``).
    """
    def refresh(s):
        exported = _stack_statistics(s, s.count)
        roots, errors = compute_preconditioners(
            exported.statistics, exported.exponents, sizes=exported.sizes, matrix_epsilon=config.matrix_epsilon,
            method=config.method, relative_matrix_epsilon=config.relative_matrix_epsilon,
            num_iters=config.root_num_iters)
        return install_preconditioners(s, config, roots, errors, exported.step)

    if config.preconditioning_compute_steps == 1:
        return refresh(state)
    due = state.count % config.preconditioning_compute_steps == 0
    return lax.cond(due, refresh, lambda s: s, state)


def _check_tree(config: ShampooConfig, state: ShampooState, tree, what: str):
    pstates = _param_states(state)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if len(leaves) != len(pstates):
        raise ValueError(f"shampoo: {what} has {len(leaves)} tensors but the state was built for {len(pstates)}")
    for (path, leaf), ps in zip(leaves, pstates):
        expected = decode(ps.diagonal_momentum).shape
        if tuple(leaf.shape) != tuple(expected):
            raise ValueError(f"shampoo: {what} at {jax.tree_util.keystr(path)!r} has shape {tuple(leaf.shape)}, "
                             f"the state was built for {tuple(expected)}")


def _transform(config: ShampooConfig, grad, ps: ParamState, param, count, lr) -> tuple[jax.Array, ParamState]:
    """The per-parameter step (grafting, preconditioning, weight decay, momentum)."""
    q = config.best_effort_memory_usage_reduction
    grad = grad.astype(jnp.float32)
    diag = None if ps.diagonal_statistics is None else decode(ps.diagonal_statistics)
    graft, new_diag = graft_direction(
        grad, diag, config.graft_type, beta2=config.beta2, diagonal_epsilon=config.diagonal_epsilon,
        clip_by_scaled_gradient_norm=config.clip_by_scaled_gradient_norm)
    if not config.decoupled_learning_rate:
        graft = graft * lr
    layout = config.layout(grad.shape)
    if layout is None:
        precond = graft
    else:
        rank = len(layout.working_shape)
        preconditioners = [decode(p) for p in ps.preconditioners]
        blocks = [precondition_block(b, preconditioners[j * rank:(j + 1) * rank])
                  for j, b in enumerate(layout.split(grad))]
        precond = layout.merge(blocks)
    if config.graft_type != GraftingType.NONE:
        precond = precond * (jnp.linalg.norm(graft) / (jnp.linalg.norm(precond) + _TINY))
    shampoo_dir, graft_dir = precond, graft
    if config.weight_decay and not config.decoupled_weight_decay:
        shampoo_dir = shampoo_dir + config.weight_decay * param
        graft_dir = graft_dir + config.weight_decay * param
    w = (1.0 - config.beta1) if config.moving_average_for_momentum else 1.0
    shampoo_mom = config.beta1 * decode(ps.momentum) + w * shampoo_dir
    graft_mom = config.beta1 * decode(ps.diagonal_momentum) + w * graft_dir
    run_shampoo = count >= config.start_preconditioning_step
    direction = jnp.where(run_shampoo, shampoo_mom, graft_mom)
    if config.nesterov:
        direction = w * jnp.where(run_shampoo, shampoo_dir, graft_dir) + config.beta1 * direction
    if config.weight_decay and config.decoupled_weight_decay:
        direction = direction + lr * config.weight_decay * param
    scale = lr if config.decoupled_learning_rate else 1.0
    update = -scale * direction
    new_ps = ParamState(
        diagonal_statistics=None if new_diag is None else encode_diagonal(new_diag, q),
        statistics=ps.statistics,
        preconditioners=ps.preconditioners,
        diagonal_momentum=encode_momentum(graft_mom, q),
        momentum=encode_momentum(shampoo_mom, q),
    )
    return update, new_ps


def shampoo(
    learning_rate: ScalarOrSchedule,
    block_size: int = 128,
    beta1: float = 0.9,
    beta2: float = 0.999,
    diagonal_epsilon: float = 1e-10,
    matrix_epsilon: float = 1e-6,
    weight_decay: float = 0.0,
    start_preconditioning_step: int = 5,
    preconditioning_compute_steps: int = 1,
    statistics_compute_steps: int = 1,
    best_effort_shape_interpretation: bool = True,
    graft_type: Union[GraftingType, int, str] = GraftingType.SGD,
    nesterov: bool = True,
    exponent_override: int = 0,
    best_effort_memory_usage_reduction: bool = False,
    inverse_failure_threshold: float = 0.1,
    moving_average_for_momentum: bool = False,
    skip_preconditioning_dim_size_gt: int = 4096,
    clip_by_scaled_gradient_norm: Optional[float] = None,
    relative_matrix_epsilon: bool = True,
    merge_small_dims_block_size: int = 4096,
    decoupled_learning_rate: bool = True,
    decoupled_weight_decay: bool = False,
    root_method: str = "auto",
    root_num_iters: int = 100,
    inline_preconditioners: bool = True,
) -> optax.GradientTransformation:
    """Shampoo as an optax transformation (the returned updates already include ``-lr``).

    Args mirror the seed's ``distributed_shampoo`` (see :class:`ShampooConfig`); ``graft_type``
    may be a :class:`GraftingType`, its int value or its name. ``block_size`` defaults to 128
    (the seed's recommendation; it has no default there).

    Raises:
      ValueError: an option out of range, naming it.
    """
    config = ShampooConfig(**{k: v for k, v in locals().items()})

    def init_fn(params):
        q = config.best_effort_memory_usage_reduction
        exponents = []

        def init_one(p):
            layout = config.layout(p.shape)
            stats: tuple = ()
            if layout is not None:
                sizes = layout.statistic_sizes
                stats = tuple(encode_matrix(s, q) for s in init_statistics(sizes, config.matrix_epsilon))
                precs = tuple(encode_matrix(jnp.eye(d, dtype=jnp.float32), q) for d in sizes)
                exponents.extend([config.exponent(layout)] * len(sizes))
            else:
                precs = ()
            zeros = jnp.zeros(p.shape, jnp.float32)
            diag = encode_diagonal(zeros, q) if has_diagonal_statistics(config.graft_type) else None
            return ParamState(diag, stats, precs, encode_momentum(zeros, q), encode_momentum(zeros, q))

        pstates = jax.tree.map(init_one, params)
        b = len(exponents)
        info = PreconditionerInfo(
            exponents=jnp.asarray(exponents, jnp.int32),
            source_step=jnp.full((b,), -1, jnp.int32),
            failures=jnp.zeros((b,), jnp.int32),
            last_error=jnp.zeros((b,), jnp.float32),
        )
        return ShampooState(jnp.zeros([], jnp.int32), pstates, info)

    def update_fn(updates, state, params=None):
        _check_tree(config, state, updates, "updates")
        if params is None:
            if config.weight_decay:
                raise ValueError("shampoo: weight_decay needs params in update()")
            params = updates
        state = _update_statistics(config, state, updates)
        if config.inline_preconditioners:
            state = _refresh_preconditioners(config, state)
        lr = config.learning_rate(state.count) if callable(config.learning_rate) else config.learning_rate
        treedef = jax.tree.structure(updates)
        outs = [
            _transform(config, g, ps, p, state.count, lr)
            for g, ps, p in zip(jax.tree.leaves(updates), _param_states(state), jax.tree.leaves(params))
        ]
        new_updates = jax.tree.unflatten(treedef, [u.astype(g.dtype) for (u, _), g in
                                                   zip(outs, jax.tree.leaves(updates))])
        new_params_state = jax.tree.unflatten(treedef, [ps for _, ps in outs])
        return new_updates, ShampooState(state.count + 1, new_params_state, state.preconditioner_info)

    return optax.GradientTransformation(init_fn, update_fn)
