"""Adafactor, by name: T5X (:func:`adafactor`), HuggingFace/fairseq (:func:`adafactor_hf`) and
tensor2tensor (:func:`adafactor_t2t`).

Each constructor takes the reference's argument names and defaults and returns an optax
transformation chaining the links of :mod:`optserve.optim_kernels.adafactor.links`,
:mod:`~optserve.optim_kernels.adafactor.second_moment` and
:mod:`~optserve.optim_kernels.adafactor.param_dtype`; the variants differ only in which links
they pick and how they configure them.

Contract shared by the three:

* ``update(grads, state, params)`` needs params; grads must have the params' tree and shapes
  (ValueError naming the path otherwise). Apply with ``optax.apply_updates``.
* Math is float32. Updates come back in the param dtype (optax's contract), chosen so that
  ``optax.apply_updates`` gives the float32 result rounded once to a bf16/f16 param's dtype
  (exactly, whenever the update is smaller than about half the param). State is float32
  (momentum in ``dtype_momentum``).
* Jit compiles once per tree structure (hyper-parameters are Python constants, the step is
  an int32 in the state); params and state can be donated (every state buffer maps to an
  output of the same shape and dtype; absent buffers are ``None``, not placeholders).
* Step numbering: ``count`` (0-based) in the state. T5X's ``step``, t2t's ``global_step`` and
  HF's ``state["step"] - 1`` all equal ``count``.

The step counter lives in each link that needs it (second moment, lr schedule, ...).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

import jax.numpy as jnp
import optax

from optserve.optim_kernels import arg_rules as rules
from optserve.optim_kernels.adafactor import factoring as fct
from optserve.optim_kernels.adafactor import links, param_dtype, schedules, second_moment

__all__ = [
    "ADAFACTOR_ARG_RULES",
    "ADAFACTOR_HF_ARG_RULES",
    "ADAFACTOR_T2T_ARG_RULES",
    "adafactor",
    "adafactor_hf",
    "adafactor_t2t",
    "adafactor_partial_statistic",
]

RuleSource = Callable[[str], Any]


# --------------------------------------------------------------------------- T5X

# The value of each option of :func:`adafactor` (the registry checks them, and so does the
# constructor). Decay exponent >= 0 keeps the second-moment decay 1 - t**-decay_rate in [0, 1);
# epsilon1 > 0 keeps an all-zero gradient from dividing 0 by 0.
ADAFACTOR_ARG_RULES = rules.ArgRules(
    rules.non_negative("learning_rate", none=True, schedule=True),  # None: refused below as required
    rules.flag("factored"),
    rules.delegated("multiply_by_parameter_scale", "a bool, or a {regex: bool} map searched in order"),
    rules.unit_interval("beta1", none=True),
    rules.non_negative("decay_rate"),
    rules.integer("step_offset", 0),
    rules.positive("clipping_threshold", none=True),
    rules.non_negative("weight_decay_rate", none=True),
    rules.integer("min_dim_size_to_factor", 0),
    rules.positive("epsilon1"),
    rules.non_negative("epsilon2"),
    rules.dtype("dtype_momentum"),
    rules.delegated("factor_map", "a {regex: factor rule} map, or None"),
    rules.delegated("logical_factor_rules", "a {logical axis: factor rule} map, or None"),
    rules.real("weight_decay_rate_lr_exponent", none=True),
    rules.positive("global_norm_clip_threshold", none=True),
    rules.positive("max_parameter_scale", none=True),
    rules.flag("skip_nan_updates"),
    rules.delegated("param_logical_axes", "a {path: axis names} map (nested allowed), or None"),
)


def adafactor(
    learning_rate: Optional[schedules.ScalarOrSchedule] = None,
    factored: bool = True,
    multiply_by_parameter_scale: Union[bool, Mapping[str, bool], Sequence[Tuple[str, bool]]] = True,
    beta1: Optional[float] = None,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    clipping_threshold: Optional[float] = 1.0,
    weight_decay_rate: Optional[float] = None,
    min_dim_size_to_factor: int = 128,
    epsilon1: float = 1e-30,
    epsilon2: float = 1e-3,
    dtype_momentum: Any = jnp.float32,
    factor_map: Optional[Union[Mapping[str, Any], Sequence[Tuple[str, Any]]]] = None,
    logical_factor_rules: Optional[Mapping[str, Any]] = None,
    weight_decay_rate_lr_exponent: Optional[float] = None,
    global_norm_clip_threshold: Optional[float] = None,
    max_parameter_scale: Optional[float] = None,
    skip_nan_updates: bool = False,
    param_logical_axes: Optional[Mapping[str, Any]] = None,
) -> optax.GradientTransformationExtraArgs:
    """T5X's Adafactor (``t5x.adafactor.Adafactor``), same names and defaults.

    Per parameter (path ``p``, '/'-joined keys), with ``d = 1 - (count - step_offset + 1)**-decay_rate``:
    factored second moment (rule from ``logical_factor_rules`` + ``param_logical_axes``, else
    ``factor_map[p]``, else T5X's heuristic: the two largest axes of a rank <= 2 parameter when
    both are >= ``min_dim_size_to_factor``; rank > 2 without a rule is a ValueError), update
    clipping at ``clipping_threshold``, times ``learning_rate``, times the parameter RMS
    (clipped to [epsilon2, max_parameter_scale]) when ``multiply_by_parameter_scale`` (bool, or
    ``{regex: bool}`` searched in order), momentum ``beta1`` stored in ``dtype_momentum``,
    weight decay ``new = (1 - wd) param - update`` with ``wd = weight_decay_rate`` or
    ``(weight_decay_rate or 1) * learning_rate ** weight_decay_rate_lr_exponent``.
    BATCH axes are never averaged over: a stack of k params gives, slice by slice, what the k
    separate params give. ``global_norm_clip_threshold`` clips all gradients by their global
    norm first; pass ``global_grad_sq_norm=`` to ``update`` when the model is sharded (see
    :func:`adafactor_partial_statistic`). ``skip_nan_updates`` keeps values that would be NaN.

    Args beyond T5X's:
      param_logical_axes: ``{path: (axis names...)}`` (nested dicts allowed), what T5X's
        ``set_param_axes`` receives; required with ``logical_factor_rules``. Rules from it
        supersede ``factor_map``.
    Deviations: parameter RMS and global norm are computed in float32 for bf16 params;
    factor rules with only ROW or only COLUMN are rejected instead of half-factored.

    Returns:
      optax.GradientTransformationExtraArgs; ``update(grads, state, params,
      global_grad_sq_norm=None)``.
    """
    name = "adafactor"
    ADAFACTOR_ARG_RULES.check(name, locals())
    momentum_dtype = _check_t5x_options(
        name, learning_rate, factored, factor_map, logical_factor_rules, param_logical_axes, dtype_momentum
    )
    rule_source = _t5x_rule_source(factor_map, logical_factor_rules, param_logical_axes)
    factoring = _t5x_factoring(factored, rule_source, min_dim_size_to_factor)
    param_scale_on = _t5x_param_scale_on(name, multiply_by_parameter_scale)

    chain = [links.check_inputs(name)]
    if global_norm_clip_threshold:
        chain.append(links.clip_by_global_norm(global_norm_clip_threshold))
    decay = schedules.decay_rate_pow(decay_rate, step_offset)
    chain.append(second_moment.scale_by_factored_rms(factoring, decay, epsilon1, clipping_threshold))
    chain.append(optax.scale_by_learning_rate(learning_rate, flip_sign=False))
    if param_scale_on is not False:
        chain.append(links.scale_by_param_block_rms(epsilon2, max_parameter_scale, factoring, param_scale_on))
    if beta1 is not None:
        chain.append(links.momentum(beta1, momentum_dtype))
    weight_decay = _t5x_weight_decay(learning_rate, weight_decay_rate, weight_decay_rate_lr_exponent)
    if weight_decay is not None:
        chain.append(weight_decay)
    chain.append(optax.scale(-1.0))
    tx = optax.chain(*chain)
    if skip_nan_updates:
        tx = links.skip_nan_updates(tx)
    return optax.chain(tx, param_dtype.cast_to_param_dtype())


def _check_t5x_options(
    name, learning_rate, factored, factor_map, logical_factor_rules, param_logical_axes, dtype_momentum
) -> jnp.dtype:
    """The checks of :func:`adafactor`'s options that involve several of them (ValueError naming
    the option); returns ``dtype_momentum`` as a dtype."""
    if learning_rate is None:
        raise ValueError(f"{name}: option `learning_rate` is required (T5X has no default)")
    if not factored and (factor_map is not None or logical_factor_rules is not None):
        raise ValueError(
            f"{name}: option `factored` is False but factorization rules were given "
            "(`factor_map` / `logical_factor_rules`)"
        )
    if logical_factor_rules is not None and param_logical_axes is None:
        raise ValueError(
            f"{name}: option `logical_factor_rules` needs `param_logical_axes` "
            "(the logical axis names of every parameter)"
        )
    try:
        return jnp.dtype(dtype_momentum)
    except TypeError as exc:
        raise ValueError(f"{name}: option `dtype_momentum` {dtype_momentum!r}: {exc}") from None


def _t5x_factoring(factored: bool, rule_source: Optional[RuleSource], min_dim_size_to_factor: int) -> fct.Factoring:
    """T5X's ``factoring(path, shape)``: unfactored when not ``factored``, else the rule of the
    path (``rule_source``), else T5X's heuristic."""

    def factoring(path: str, shape: fct.Shape) -> fct.FactorSpec:
        if not factored:
            return fct.unfactored(shape)
        if rule_source is None:
            return fct.heuristic(shape, min_dim_size_to_factor, path)
        return fct.from_rule(rule_source(path), shape, path, min_dim_size_to_factor)

    return factoring


def _t5x_param_scale_on(name: str, multiply_by_parameter_scale) -> Union[bool, Callable[[str], bool]]:
    """``multiply_by_parameter_scale`` as a bool or a ``path -> bool`` predicate (the first
    ``{regex: bool}`` entry whose pattern the path matches)."""
    if isinstance(multiply_by_parameter_scale, bool):
        return multiply_by_parameter_scale
    if isinstance(multiply_by_parameter_scale, (Mapping, list, tuple)):
        scale_map = fct.PathMap(multiply_by_parameter_scale, "multiply_by_parameter_scale")
        return lambda path: bool(scale_map[path])
    raise ValueError(
        f"{name}: option `multiply_by_parameter_scale` must be a bool or a "
        f"{{regex: bool}} map, got {type(multiply_by_parameter_scale).__name__}"
    )


def _t5x_weight_decay(learning_rate, weight_decay_rate, weight_decay_rate_lr_exponent):
    """T5X's weight-decay link, or ``None``: the rate is ``weight_decay_rate`` or, with
    ``weight_decay_rate_lr_exponent``, ``(weight_decay_rate or 1) * learning_rate ** exponent``."""
    if weight_decay_rate_lr_exponent:
        factor = 1.0 if weight_decay_rate is None else weight_decay_rate
        return links.add_decayed_weights(schedules.power_of(learning_rate, weight_decay_rate_lr_exponent, factor))
    if weight_decay_rate is not None:
        return links.add_decayed_weights(weight_decay_rate)
    return None


def adafactor_partial_statistic(**kwargs) -> Optional[Callable]:
    """Cross-shard statistic of :func:`adafactor` (registry contract), same kwargs.

    Returns ``None`` unless ``global_norm_clip_threshold`` is set; else
    ``partial(grads, state, params) -> float32 scalar``, the sum of squared gradient entries
    of the given tree. Summed over all shards and passed as ``global_grad_sq_norm`` to each
    shard's update, it reproduces the global-norm clip of the whole model in one process.
    """
    try:
        bound = inspect.signature(adafactor).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"adafactor: {exc}") from None
    if not bound.arguments.get("global_norm_clip_threshold"):
        return None

    def partial(grads, state=None, params=None):
        del state, params
        return links.grad_sq_norm(grads)

    return partial


def _t5x_rule_source(factor_map, logical_factor_rules, param_logical_axes) -> Optional[RuleSource]:
    """path -> T5X factor rule, from logical axes (preferred, as T5X) or the regex factor_map."""
    if logical_factor_rules is not None:
        axes_by_path = _flatten_paths(param_logical_axes, "param_logical_axes")

        def from_logical(path: str):
            if path not in axes_by_path:
                raise ValueError(
                    f"parameter {path!r}: no entry in option `param_logical_axes` "
                    f"(it has {sorted(axes_by_path)[:5]}...)"
                )
            return fct.rule_from_logical_axes(axes_by_path[path], logical_factor_rules, path)

        return from_logical
    if factor_map is not None:
        return fct.PathMap(factor_map, "factor_map").__getitem__
    return None


def _flatten_paths(tree, option: str, prefix: str = "") -> dict:
    """Nested mappings whose leaves are axis-name sequences -> {'a/b': axes}."""
    if not isinstance(tree, Mapping):
        raise ValueError(f"option `{option}` must be a mapping from parameter path to axis names")
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten_paths(value, option, path))
        else:
            out[path] = tuple(value) if value is not None else ()
    return out


# --------------------------------------------------------------------------- HuggingFace

# The value of each option of :func:`adafactor_hf`. HF's beta2 at step t is 1 - t**decay_rate,
# in [0, 1) only for decay_rate <= 0; eps[0] > 0 keeps an all-zero gradient from dividing 0 by 0.
ADAFACTOR_HF_ARG_RULES = rules.ArgRules(
    rules.non_negative("lr", none=True, schedule=True),
    rules.pair("eps", rules.positive("eps[0]"), rules.non_negative("eps[1]")),
    rules.positive("clip_threshold"),
    rules.real("decay_rate", high=0),
    rules.unit_interval("beta1", none=True),
    rules.non_negative("weight_decay"),
    rules.flag("scale_parameter"),
    rules.flag("relative_step"),
    rules.flag("warmup_init"),
)


def adafactor_hf(
    lr: Optional[schedules.ScalarOrSchedule] = None,
    eps: Tuple[float, float] = (1e-30, 1e-3),
    clip_threshold: float = 1.0,
    decay_rate: float = -0.8,
    beta1: Optional[float] = None,
    weight_decay: float = 0.0,
    scale_parameter: bool = True,
    relative_step: bool = True,
    warmup_init: bool = False,
) -> optax.GradientTransformation:
    """HuggingFace/fairseq ``transformers.Adafactor``, same names, defaults and errors.

    Rank >= 2 params factor their last two axes (any size; leading axes slice by slice);
    beta2 at 1-based step t is ``1 - t**decay_rate``; update clipping by the RMS of the whole
    tensor; step size ``lr`` or, with ``relative_step``, ``min(1e-6 t if warmup_init else 1e-2,
    t**-0.5)``, times ``max(eps[1], rms(param))`` when ``scale_parameter`` (RMS of the param
    before the update); momentum ``beta1`` in float32; weight decay
    ``param -= weight_decay * effective_lr * param``.
    """
    name = "adafactor_hf"
    ADAFACTOR_HF_ARG_RULES.check(name, locals())
    if lr is not None and relative_step:
        raise ValueError(f"{name}: cannot combine manual `lr` and `relative_step=True` options")
    if warmup_init and not relative_step:
        raise ValueError(f"{name}: `warmup_init=True` requires `relative_step=True`")
    if lr is None and not relative_step:
        raise ValueError(f"{name}: option `lr` is required when `relative_step=False`")
    try:
        eps1, eps2 = (float(e) for e in eps)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: option `eps` must be a pair of floats, got {eps!r}") from None

    step_size = schedules.relative_step_hf(warmup_init) if relative_step else lr
    chain = [
        links.check_inputs(name),
        second_moment.scale_by_factored_rms(
            lambda path, shape: fct.last_two_axes(shape),
            schedules.decay_rate_pow(-decay_rate),
            eps1,
            clip_threshold,
        ),
    ]
    chain.append(optax.scale_by_learning_rate(step_size, flip_sign=False))
    if scale_parameter:
        chain.append(links.scale_by_param_block_rms(eps2))
    if beta1 is not None:
        chain.append(links.momentum(beta1, jnp.float32))
    if weight_decay:
        chain.append(
            links.add_decayed_weights(
                schedules.product(weight_decay, step_size),
                param_rms_epsilon=eps2 if scale_parameter else None,
            )
        )
    chain += [optax.scale(-1.0), param_dtype.cast_to_param_dtype()]
    return optax.chain(*chain)


# --------------------------------------------------------------------------- tensor2tensor

# The value of each option of :func:`adafactor_t2t`. A constant decay_rate is the second-moment
# decay itself, in [0, 1) like beta2; memory_exponent >= 0 keeps 1 - t**-memory_exponent there.
ADAFACTOR_T2T_ARG_RULES = rules.ArgRules(
    rules.flag("multiply_by_parameter_scale"),
    rules.non_negative("learning_rate", none=True, schedule=True),
    rules.unit_interval("decay_rate", none=True, schedule=True),
    rules.unit_interval("beta1"),
    rules.positive("clipping_threshold", none=True),
    rules.flag("factored"),
    rules.choice("decay_type", "pow", "adam"),
    rules.unit_interval("beta2"),
    rules.non_negative("memory_exponent"),
    rules.flag("stochastic_rounding"),
    rules.integer("rounding_seed", 0, 2**63, high_inclusive=False, none=True),
)


def adafactor_t2t(
    multiply_by_parameter_scale: bool = True,
    learning_rate: Optional[schedules.ScalarOrSchedule] = None,
    decay_rate: Optional[schedules.ScalarOrSchedule] = None,
    beta1: float = 0.0,
    clipping_threshold: Optional[float] = 1.0,
    factored: bool = True,
    decay_type: str = "pow",
    beta2: float = 0.999,
    memory_exponent: float = 0.8,
    stochastic_rounding: bool = True,
    rounding_seed: Optional[int] = None,
) -> optax.GradientTransformation:
    """tensor2tensor's ``AdafactorOptimizer`` (+ ``adafactor_optimizer_from_hparams``).

    Only rank-2 params are factored (when ``factored``). ``learning_rate`` defaults to
    ``min(rsqrt(step + 1), 0.01)`` (x0.05 without parameter scale); ``decay_rate`` defaults to
    ``decay_type``: "pow" (``1 - (step + 1)**-memory_exponent``) or "adam" (``beta2`` with the
    bias correction folded in). Momentum when ``beta1`` is non-zero, stored in the param dtype.
    bf16 params are written with unbiased stochastic rounding when ``stochastic_rounding``
    (tensor2tensor's per-step golden-ratio noise, or per-element noise from ``rounding_seed``).
    Not implemented: ``simulated_quantize_bits``.
    """
    name = "adafactor_t2t"
    ADAFACTOR_T2T_ARG_RULES.check(name, locals())
    if decay_rate is None:
        if decay_type.lower() == "adam":
            decay_rate = schedules.decay_rate_adam(beta2)
        else:
            decay_rate = schedules.decay_rate_pow(memory_exponent)
    if learning_rate is None:
        learning_rate = schedules.relative_step_t2t(multiply_by_parameter_scale)

    factor_rule = (lambda path, shape: fct.matrices_only(shape)) if factored else None
    chain = [
        links.check_inputs(name),
        second_moment.scale_by_factored_rms(factor_rule, decay_rate, 1e-30, clipping_threshold),
    ]
    chain.append(optax.scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        chain.append(links.scale_by_param_block_rms(1e-3))
    if beta1:
        chain.append(links.momentum(beta1, dtype=None))
    chain.append(optax.scale(-1.0))
    if stochastic_rounding:
        chain.append(param_dtype.round_to_bfloat16_unbiased(rounding_seed))
    chain.append(param_dtype.cast_to_param_dtype())
    return optax.chain(*chain)
