"""A session's state as a user saves and loads it, on one shard.

A user's checkpoint (``RemoteOptimizer.state_dict()``, ``Session.state()``) holds, at one
version, every parameter and the optimizer state kept for it, named by tensor
(:mod:`optserve.server.compute.state_leaves`), so that it loads on any server. This module is
the shard's side of it:

- :func:`read_state`: the shard's part at its current version (between steps);
- :class:`StartState` and :func:`start_from`: a new session that starts from a saved state: its
  leaves assembled and checked against what the optimizer keeps for this shard's tensors, then
  installed, the version and the hyperparameters in force set, all before any step runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

import numpy as np

from optserve.server.compute import state_leaves
from optserve.server.domain.errors import FailedPrecondition, InvalidArgument

_MAX_START_VERSION = 1 << 62


@dataclasses.dataclass(frozen=True)
class SavedState:
    """A shard's part of a session's state at one version.

    Attributes:
      version: the version the state is at.
      hyper: the hyperparameters in force for the next step, ``{group: {option: value}}``.
      leaves: ``{key: host array}`` (see :mod:`~optserve.server.compute.state_leaves`); on a CPU
        device views of the state at ``version`` (a later step does not change them).
      incarnation: the session's incarnation (``SessionConfig.incarnation``).
    """

    version: int
    hyper: dict
    leaves: dict
    incarnation: str = ""


@dataclasses.dataclass(frozen=True)
class StartState:
    """Where a session created from a saved state starts (the first message of its InitTensors).

    Attributes:
      version: the session's version once its values are in (its next step makes version + 1).
      hyper: the hyperparameters in force then (``{}``: as the optimizer was built).
    """

    version: int
    hyper: dict

    def __post_init__(self):
        if not 0 <= self.version < _MAX_START_VERSION:
            raise InvalidArgument(f"a saved state's version must be >= 0, got {self.version}")
        if not isinstance(self.hyper, dict) or not all(
                isinstance(g, str) and isinstance(v, dict) and all(isinstance(o, str) and _is_number(x)
                                                                   for o, x in v.items())
                for g, v in self.hyper.items()):
            raise InvalidArgument("a saved state's hyperparameters must be {group: {option: number}}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_state(updater, version: int, incarnation: str = "") -> SavedState:
    """The shard's state now (call between steps, with the session's lock held).

    Raises:
      FailedPrecondition: the optimizer's state cannot be named by tensor (the message says why).
    """
    try:
        leaves = state_leaves.export_leaves(updater)
    except state_leaves.StateMismatch as exc:
        raise FailedPrecondition(f"the optimizer's state cannot be saved: {exc}") from None
    hyper = {group: {option: float(value) for option, value in values.items()}
             for group, values in updater.hyper.items()}
    return SavedState(version, hyper, leaves, incarnation)


def expected_leaves(updater) -> dict[str, tuple]:
    """``{key: (shape, dtype)}`` of the optimizer-state leaves a saved state must give this shard
    (its parameters come as the session's initial values)."""
    return {key: spec for key, spec in state_leaves.leaf_specs(updater).items()
            if not key.startswith(state_leaves.PARAM)}


def assemble_leaves(where: str, specs: Mapping[str, tuple], chunks: Iterable) -> dict[str, np.ndarray]:
    """The leaves ``chunks`` carry (each with ``key``, ``dtype``, ``shape``, ``offset``, ``data``;
    a leaf's pieces consecutive, in order), checked against ``specs``. A session's shared leaves
    go to each of its shards; those a shard does not keep (a parameter group's step count where
    no tensor of the group is) are skipped.

    Raises:
      InvalidArgument: naming the leaf that is unknown, misshapen, of another dtype, sent twice,
        out of order or incomplete, or the leaves that are missing.
    """
    out: dict[str, np.ndarray] = {}
    filled: dict[str, int] = {}
    for chunk in chunks:
        key = chunk.key
        if key not in specs and key.startswith(state_leaves.SHARED):
            continue  # another shard's (a parameter group with no tensor here keeps its count there)
        if key not in specs:
            raise InvalidArgument(f"{where}: the saved state has a leaf {key!r} that the optimizer's state for this "
                                  f"shard's tensors does not have")
        shape, dtype = specs[key]
        if tuple(chunk.shape) != tuple(shape) or _dtype(chunk.dtype, key, where) != np.dtype(dtype):
            raise InvalidArgument(f"{where}: saved state leaf {key!r} is {chunk.dtype}{list(chunk.shape)}, the "
                                  f"optimizer's state here has {np.dtype(dtype).str}{list(shape)}")
        if key not in out:
            out[key], filled[key] = np.empty(shape, dtype), 0
        target = out[key].reshape(-1).view(np.uint8)
        if chunk.offset != filled[key] or filled[key] + len(chunk.data) > target.size:
            raise InvalidArgument(f"{where}: saved state leaf {key!r}: a piece at byte {chunk.offset} of "
                                  f"{len(chunk.data)} bytes does not follow the {filled[key]} bytes before it "
                                  f"(leaf of {target.size} bytes)")
        target[filled[key]:filled[key] + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)
        filled[key] += len(chunk.data)
    short = [key for key, array in out.items() if filled[key] != array.nbytes]
    missing = [key for key in specs if key not in out]
    if short or missing:
        raise InvalidArgument(f"{where}: the saved state is incomplete: leaves missing {missing[:5]}, leaves cut "
                              f"short {short[:5]}")
    return out


def _dtype(name: str, key: str, where: str) -> np.dtype:
    try:
        if name == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(name)
    except TypeError:
        raise InvalidArgument(f"{where}: saved state leaf {key!r} has an unknown dtype {name!r}") from None


def install(updater, leaves: Mapping[str, Any]) -> None:
    """Replaces the optimizer state just initialised on ``updater`` with ``leaves`` (its
    parameters are the session's initial values, already installed).

    Raises:
      InvalidArgument: the leaves do not fit (named; nothing changed).
    """
    params = updater.host_params()
    whole = {**{state_leaves.PARAM + name: value for name, value in params.items()}, **leaves}
    try:
        state_leaves.install_leaves(updater, whole, keep_params=True)
    except state_leaves.StateMismatch as exc:
        raise InvalidArgument(f"the saved state does not fit this optimizer: {exc}") from None


def start_from(updater, steps, clock, start: StartState, leaves: Mapping[str, Any]) -> None:
    """Installs a saved state over the initial one just built (the session's lock held, before any
    step): its optimizer state, the hyperparameters in force, and the version ``steps`` (the
    shard's ``StepRunner``) and, on the home shard, ``clock`` start at (the first step makes
    ``start.version + 1``). A state that does not fit leaves the session uninitialised, as before
    the values came.

    Raises:
      InvalidArgument: the leaves do not fit (named).
    """
    try:
        hyper = _checked_hyper(updater, start.hyper)
        install(updater, leaves)
    except BaseException:
        updater.params = updater.opt_state = None
        raise
    updater.set_hyper(hyper)
    steps.version = int(start.version)
    if clock.is_home:
        clock.start_at(steps.version)


def _checked_hyper(updater, hyper: Mapping[str, Mapping[str, float]]) -> dict:
    """A saved state's hyperparameters checked as ``set_hyperparams`` checks them (each value
    against its option's rule; a decay rate's complement computed afresh); options that cannot
    be set (the kernel's own, such as a complement) are left to the check to derive.

    Raises:
      InvalidArgument: an unknown group, or a value that breaks its option's rule (named).
    """
    settable = {group.label: set(group.hyper) for group in updater.optimizer.groups}
    checked: dict = {}
    for label, values in hyper.items():
        if label not in settable:
            raise InvalidArgument(f"the saved state's hyperparameters name a parameter group {label!r} this "
                                  f"optimizer does not have (it has {sorted(settable)})")
        given = {option: value for option, value in values.items() if option in settable[label]}
        if not given:
            continue
        try:
            for group, options in updater.optimizer.checked_hyperparams(given, label).items():
                checked.setdefault(group, {}).update(options)
        except ValueError as exc:
            raise InvalidArgument(f"the saved state's hyperparameters: {exc}") from None
    return checked
