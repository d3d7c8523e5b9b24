"""Muon (MomentUm Orthogonalized by Newton–Schulz) as optax links, with an AdamW fallback.

Two paths, chosen per tensor by :mod:`.selection` and joined by ``optax.partition``:

* **Muon** (2-D weights, or tensors given matrix axes): :func:`~.links.scale_by_orthogonalized_momentum`
  -> :func:`~.links.scale_by_matrix_shape` -> ``optax.add_decayed_weights`` ->
  ``optax.scale_by_learning_rate``;
* **AdamW** (everything else, and tensors named in ``adam_tensors``): ``optax.adamw``.

Semantics, names and defaults follow ``optax.contrib.muon`` (optax 0.2.8); the differences are
summarised in :func:`muon`'s docstring and described in ``docs/optimizers/muon.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import optax
from optserve.optim_kernels.muon import links
from optserve.optim_kernels.muon.config import MuonConfig, ScalarOrSchedule
from optserve.optim_kernels.muon.newton_schulz import STANDARD_COEFFS
from optserve.optim_kernels.muon.selection import ADAM, MUON, name_mask

__all__ = ["muon", "muon_from_config"]


def muon(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: str | Sequence[float] | Sequence[Sequence[float]] = STANDARD_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: ScalarOrSchedule = 0.0,
    weight_decay_mask: Sequence[str] | None = None,
    mu_dtype: Any | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: ScalarOrSchedule = 0.0,
    adam_learning_rate: ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Mapping[str, Any] | None = None,
    consistent_rms: float | None = None,
    adam_tensors: Sequence[str] = (),
) -> optax.GradientTransformation:
    """Muon for matrices, AdamW for the rest.

    Muon-path tensor ``W`` with gradient ``g`` at step ``t`` (1-based)::

        mu <- beta mu + (1 - beta) g
        d   = beta mu / (1 - beta^(t+1)) + (1 - beta) g / (1 - beta^t)   (nesterov)
              mu / (1 - beta^t)                                          (else)
        O   = NS(d)          each (fan_in x fan_out) matrix of d, orthogonalised in float32
        O  <- <d, O> O       (adaptive only)
        W  <- W - lr (s O + weight_decay W),   s = sqrt(max(1, fan_out / fan_in))
                                               or consistent_rms sqrt(max(fan_in, fan_out))

    ``NS`` scales the matrix (``preconditioning``) and runs the quintic Newton–Schulz iteration
    (:mod:`.newton_schulz`) on its wide orientation. Other tensors follow
    ``optax.adamw(adam_learning_rate, adam_b1, adam_b2, eps, adam_eps_root, mu_dtype,
    adam_weight_decay, nesterov=nesterov)``.

    Tensors are named by their '/'-joined key path (the server's dict keys). A tensor takes the
    AdamW path if its name matches ``adam_tensors``, or a ``muon_weight_dimension_numbers``
    pattern mapped to ``None``, or if no pattern matches and it is not 2-D (1-D biases and
    norms, scalars, higher-rank tensors). Otherwise it takes the Muon path, a 2-D tensor as
    ``(fan_in, fan_out)`` (the JAX layout), any other through its pattern's axes.

    Args:
      learning_rate: Muon-path step size (> 0, or a schedule ``count -> lr``), in units of
        spectral norm per step for a square matrix.
      ns_coeffs: Newton–Schulz ``(a, b, c)``: one triple for all ``ns_steps`` iterations, a list
        of triples (one per iteration; at most ``ns_steps`` of them; ``ns_steps`` is then
        ignored), or a preset: ``"standard"`` (the default triple) or ``"dion"`` (5 triples).
      ns_steps: Newton–Schulz iterations (integer >= 1).
      beta: momentum decay in ``[0, 1)``.
      eps: floor of the Newton–Schulz scaling denominators, and AdamW's ``eps``.
      weight_decay: decoupled weight decay of Muon-path tensors, multiplied by the learning
        rate (>= 0, or a schedule).
      weight_decay_mask: ``None`` (decay every Muon-path tensor) or fnmatch patterns: only the
        Muon-path tensors whose names match are decayed.
      mu_dtype: dtype of both paths' first moments (``None``: the param dtype).
      nesterov: Nesterov momentum on both paths.
      adaptive: scale each orthogonalised update by ``<d, O>`` (Bernstein & Newhouse, 2024).
      preconditioning: ``"frobenius"`` (divide by the Frobenius norm), ``"spectral"`` (by the
        spectral norm: one SVD per matrix), ``"aol"`` (row scaling in the first iteration,
        Boissin et al., 2025), ``"schatten"`` (Schatten-4 norm in the first iteration,
        Grishina et al., 2025).
      adam_b1, adam_b2: AdamW's decay rates, each in ``[0, 1)``.
      adam_eps_root: AdamW's ``eps_root`` (>= 0).
      adam_weight_decay: AdamW's decoupled weight decay (>= 0, or a schedule); applies to every
        AdamW-path tensor, biases and norms included.
      adam_learning_rate: AdamW's step size; ``None``: ``learning_rate``.
      muon_weight_dimension_numbers: ``None``, or ``{pattern: axes or None}`` with ``axes`` =
        ``{"reduction_axis": int | [int, ...], "output_axis": int | [int, ...]}``: a matching
        tensor (rank >= 2) takes the Muon path with those fan-in / fan-out axes, the others are
        batch axes (each slice orthogonalised alone); ``None`` sends it to AdamW. A name may
        match at most one pattern; unmatched tensors follow the default rule.
      consistent_rms: ``None``, or a target RMS (> 0) of every Muon update (0.2 matches AdamW's,
        Liu et al., 2025).
      adam_tensors: fnmatch patterns of tensors sent to AdamW whatever their shape (embeddings,
        output heads).

    Returns:
      An ``optax.GradientTransformation``; ``update(grads, state, params)`` needs ``params`` (its
      weight-decay links read them, as optax.contrib.muon's do, even at a decay of 0). Updates
      have each gradient's dtype. The state is ``optax.PartitionState`` with ``inner_states``
      ``{"muon": MaskedState((OrthogonalizedMomentumState(count, mu), EmptyState, weight-decay
      state, learning-rate state)), "adam": MaskedState(optax.adamw's state)}``; in each, the
      other path's tensors are ``optax.MaskedNode`` placeholders without arrays.

    Raises:
      ValueError: an option out of range or malformed (naming it); at init/update, a tensor that
        matches two dimension-number patterns or whose pattern's axes do not fit its shape.

    Differences from ``optax.contrib.muon`` (0.2.8): JSON options (name patterns for
    ``weight_decay_mask`` and ``muon_weight_dimension_numbers``, ``adam_tensors``), Newton–Schulz
    in float32, ``eps`` floors for ``aol`` / ``schatten``, static coefficients; and from Keller
    Jordan's torch reference: momentum, precision, layout, conv filters, which tensors take Adam.
    Each is described in ``docs/optimizers/muon.md``.

    References:
      Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024
      (https://kellerjordan.github.io/posts/muon/); Bernstein & Newhouse, "Old Optimizer, New
      Norm", 2024; Liu et al., "Muon is Scalable for LLM Training", 2025.
    """
    return muon_from_config(MuonConfig(**locals()))


def muon_from_config(config: MuonConfig) -> optax.GradientTransformation:
    """The transformation of :func:`muon` for an already validated config."""
    selection = config.selection
    mu_dtype = None if config.mu_dtype is None else jnp.dtype(config.mu_dtype)
    mask = None if config.weight_decay_mask is None else name_mask(config.weight_decay_mask)
    muon_path = optax.chain(
        links.scale_by_orthogonalized_momentum(
            selection.axes_of,
            config.schedule,
            beta=config.beta,
            nesterov=config.nesterov,
            preconditioning=config.preconditioning,
            eps=config.eps,
            adaptive=config.adaptive,
            mu_dtype=mu_dtype,
        ),
        links.scale_by_matrix_shape(selection.axes_of, config.consistent_rms),
        optax.add_decayed_weights(config.weight_decay, mask),
        optax.scale_by_learning_rate(config.learning_rate),
    )
    adam_learning_rate = config.learning_rate if config.adam_learning_rate is None else config.adam_learning_rate
    adam_path = optax.adamw(
        learning_rate=adam_learning_rate,
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.eps,
        eps_root=config.adam_eps_root,
        mu_dtype=mu_dtype,
        weight_decay=config.adam_weight_decay,
        nesterov=config.nesterov,
    )
    return optax.partition({MUON: muon_path, ADAM: adam_path}, selection.labels)
