"""A shard's whole state as named leaves, whatever layout the shard keeps it in.

A user's checkpoint must load on a server with another number of shards, or another way of
chunking a shard's tensors, so it cannot be a shard's pytree as it is. Here a shard's
parameters and optimizer state become a flat ``{key: array}``:

- ``param/<tensor>``: a parameter's values;
- ``tensor/<tensor>/<path>``: a leaf of the optimizer state kept for one tensor (Adam's
  moments, Adafactor's factored statistics, Shampoo's statistics and roots, ...): a leaf whose
  path in the state passes through a dict key that names one of the shard's tensors; ``path``
  is the rest of the path, dot-separated (``0.mu`` for the first moment of ``optax.adam``; a
  ``/`` in a step of it is written ``%2F``, so the key splits at its last ``/``);
- ``shared/<path>``: a leaf no tensor owns (a step count), the same on every shard of a session
  and in every chunk of one shard (a shard updated in chunks keeps one state per chunk: the
  chunk's index is not part of the path).

A kernel with a root offload seam may keep bookkeeping stacked over all of a shard's statistics
(Shampoo's ``preconditioner_info``, one row per statistic); its seam names those leaves
(``per_statistic_state``) and their rows become ``tensor/<tensor>/<path>`` leaves of the rows
of that tensor's statistics, so they too follow a tensor to whichever shard holds it.

The optimizer's own structure is never sent: :func:`leaf_specs` derives every key, shape and
dtype from the optimizer and the shard's tensors, and :func:`install_leaves` rebuilds the tree
from it, so a leaf that is missing, unknown or misshapen is named before anything changes.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

PARAM = "param/"
TENSOR = "tensor/"
SHARED = "shared/"


class StateMismatch(ValueError):
    """Leaves that do not fit the optimizer's state on this shard (the message names them)."""


def _key_part(key) -> str:
    """One step of a path, without "/" (keys split at their last "/": tensor names may hold it)."""
    for attribute in ("name", "key", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute)).replace("/", "%2F")
    return str(key).replace("/", "%2F")


def _leaf_key(path, tensors: frozenset, grouped: bool) -> str:
    """The key of the optimizer-state leaf at ``path`` (a jax key path, without the chunk index).
    Its owner is the first dict key on the path that names a tensor; ``grouped``: the state is
    ``{group label: state}`` (parameter groups), and a label ("0", "1", ...) is never taken for a
    tensor so named."""
    owner_at = next((i for i, key in enumerate(path) if (i > 0 or not grouped)
                     and isinstance(getattr(key, "key", None), str) and key.key in tensors), None)
    owner = path[owner_at].key if owner_at is not None else None
    parts = [_key_part(key) for i, key in enumerate(path) if i != owner_at]
    rest = ".".join(parts) or "value"
    return f"{TENSOR}{owner}/{rest}" if owner is not None else f"{SHARED}{rest}"


def _state_paths(opt_state, chunked: bool, tensors: frozenset, grouped: bool) -> list[list[tuple[str, Any]]]:
    """``[[(key, leaf), ...] per state]``: one list for a whole-tree state, one per chunk."""
    import jax

    states = list(opt_state) if chunked else [opt_state]
    return [[(_leaf_key(path, tensors, grouped), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]
            for state in states]


def _grouped(updater) -> bool:
    """Whether the optimizer keeps its state by parameter group (``param_groups``)."""
    return len(getattr(updater.optimizer, "groups", ()) or ()) > 1


class _StatisticRows:
    """The shard's statistics in export order (a tensor name per row) and the shared leaves
    stacked over them (see the module's docstring)."""

    def __init__(self, updater):
        preconditioners = getattr(updater, "preconditioners", None)
        seam = getattr(preconditioners, "seam", None)
        prefixes = tuple(getattr(seam, "per_statistic_state", ()) or ())
        self.owners = [label.tensor for label in preconditioners.labels] if prefixes else []
        self._prefixes = tuple(SHARED + prefix for prefix in prefixes)

    def stacked(self, key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in self._prefixes)

    def split(self, key: str, rows) -> dict[str, Any]:
        """``{tensor key: that tensor's rows}`` of the stacked leaf ``key`` (``rows``: an array or a spec)."""
        if len(rows[0] if isinstance(rows, tuple) else rows.shape) < 1:
            raise StateMismatch(f"state leaf {key!r} is declared stacked over statistics but is a scalar")
        rest = key[len(SHARED):]
        parts = {}
        for tensor in dict.fromkeys(self.owners):
            index = [i for i, owner in enumerate(self.owners) if owner == tensor]
            parts[f"{TENSOR}{tensor}/{rest}"] = ((len(index),) + tuple(rows[0][1:]), rows[1]) \
                if isinstance(rows, tuple) else rows[np.asarray(index)]
        return parts

    def join(self, key: str, spec: tuple, leaves: Mapping[str, np.ndarray]) -> np.ndarray:
        """The stacked leaf ``key`` from its tensors' rows in ``leaves``."""
        whole = np.empty(spec[0], spec[1])
        rest = key[len(SHARED):]
        for tensor in dict.fromkeys(self.owners):
            index = np.asarray([i for i, owner in enumerate(self.owners) if owner == tensor])
            whole[index] = leaves[f"{TENSOR}{tensor}/{rest}"]
        return whole


def _layout_specs(updater) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{key: (shape, dtype)}`` as the shard lays the state out (stacked leaves whole)."""
    abstract = updater.abstract_state()
    tensors = frozenset(abstract["params"])
    specs = {PARAM + name: (tuple(s.shape), np.dtype(s.dtype)) for name, s in abstract["params"].items()}
    for leaves in _state_paths(abstract["opt_state"], bool(updater.chunk_tensors), tensors, _grouped(updater)):
        for key, leaf in leaves:
            spec = (tuple(leaf.shape), np.dtype(leaf.dtype))
            if specs.setdefault(key, spec) != spec:
                raise StateMismatch(f"the optimizer's state has two leaves {key!r} of different shapes or dtypes "
                                    f"({specs[key]} and {spec}); it cannot be saved by tensor")
    return specs


def leaf_specs(updater) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{key: (shape, dtype)}`` of every leaf of the shard's state (parameters included), in order."""
    rows = _StatisticRows(updater)
    specs: dict[str, tuple] = {}
    for key, spec in _layout_specs(updater).items():
        specs.update(rows.split(key, spec) if rows.stacked(key) else {key: spec})
    return specs


def export_leaves(updater) -> dict[str, np.ndarray]:
    """The shard's state as host arrays by key (see the module's docstring). On a CPU device the
    arrays are views of the live state (see ``Updater.host_state``); take them between steps.

    Raises:
      StateMismatch: a shared leaf differs between the shard's chunks.
    """
    params, opt_state = updater.host_state()
    tensors = frozenset(params)
    rows = _StatisticRows(updater)
    leaves = {PARAM + name: np.asarray(value) for name, value in params.items()}
    for chunk in _state_paths(opt_state, bool(updater.chunk_tensors), tensors, _grouped(updater)):
        for key, leaf in chunk:
            leaf = np.asarray(leaf)
            if rows.stacked(key):
                leaves.update(rows.split(key, leaf))
                continue
            held = leaves.setdefault(key, leaf)
            if held is not leaf and not np.array_equal(held, leaf):
                raise StateMismatch(f"shared state leaf {key!r} differs between this shard's chunks")
    return leaves


def check_leaves(specs: Mapping[str, tuple], leaves: Mapping[str, np.ndarray]) -> Optional[str]:
    """Why ``leaves`` do not fit ``specs`` (missing, unknown, misshapen: the first few named), or None."""
    missing = [key for key in specs if key not in leaves]
    unknown = sorted(key for key in leaves if key not in specs)
    if missing or unknown:
        return f"missing leaves {missing[:5]}, unknown leaves {unknown[:5]}"
    for key, (shape, dtype) in specs.items():
        value = leaves[key]
        if tuple(value.shape) != tuple(shape) or np.dtype(value.dtype) != np.dtype(dtype):
            return f"leaf {key!r} is {value.dtype}{list(value.shape)}, the optimizer's state here has {dtype}{list(shape)}"
    return None


def install_leaves(updater, leaves: Mapping[str, np.ndarray], keep_params: bool = False) -> None:
    """Sets the shard's parameters and optimizer state to ``leaves`` (host arrays by key; the
    updater holds its initial state already, which is replaced). ``keep_params``: the parameters
    stay those installed (the ``param/`` leaves are only checked).

    Raises:
      StateMismatch: naming the leaves that do not fit (nothing changed).
    """
    import jax

    specs = leaf_specs(updater)
    problem = check_leaves(specs, leaves)
    if problem is not None:
        raise StateMismatch(problem)
    rows = _StatisticRows(updater)
    layout = _layout_specs(updater)
    whole = {key: rows.join(key, spec, leaves) if rows.stacked(key) else leaves[key] for key, spec in layout.items()}
    abstract = updater.abstract_state()
    tensors = frozenset(abstract["params"])
    params = {name: whole[PARAM + name] for name in abstract["params"]}
    chunked = bool(updater.chunk_tensors)
    states = list(abstract["opt_state"]) if chunked else [abstract["opt_state"]]
    rebuilt = []
    for state, keyed in zip(states, _state_paths(abstract["opt_state"], chunked, tensors, _grouped(updater))):
        treedef = jax.tree.structure(state)
        rebuilt.append(treedef.unflatten([whole[key] for key, _ in keyed]))
    opt_state = tuple(rebuilt) if chunked else rebuilt[0]
    if keep_params:  # copies: on a CPU device the host views are the live buffers, which a step donates
        params = {name: np.array(value) for name, value in updater.host_params().items()}
    updater.restore(params, opt_state)
    if updater.preconditioners is not None:  # roots' bookkeeping as the updates that made the state left it
        updater.preconditioners.resume(updater.opt_state)
