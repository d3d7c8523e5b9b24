"""SparseLoCo's compact answer: a sync step's sparse parts instead of the new parameters.

When every push of a sync step sent a tensor as a SparseLoCo selection, each worker of the round
can rebuild the step's new values of that tensor from what it held before the step and the
step's parts (:func:`optserve.protos.sparse_codec.apply_parts`: the values minus the parts'
mean, summed and divided as the step does it), if the session's optimizer made exactly that
update (SGD at learning rate 1, SparseLoCo's outer step). Whether it did is not assumed from the
optimizer's name: :class:`SparseRelay` keeps a copy of such tensors and of the step's mean
before the step and, after it, compares the old values minus the mean with the shard's new
values bit for bit. Tensors that match, and whose parts are smaller than their values, may be
answered with their parts (``PullRequest.sparse_update``); the others, and every other step, go
back as values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Iterator, Mapping, Optional

import numpy as np

from optserve.server.compute.kernel_words import error_line

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RelayedStep:
    """The tensors of the step from ``before`` to ``after`` that its parts rebuild exactly."""

    before: int
    after: int
    parts: dict[str, list]


class SparseRelay:
    """The last step's relayable tensors of one session on one shard (``over_senders``: the
    session averages sparse entries over the pushes that named them)."""

    def __init__(self, over_senders: bool):
        self._over_senders = over_senders
        self.last: Optional[RelayedStep] = None

    @contextlib.contextmanager
    def step(self, parts: Mapping[str, list], params: Callable[[], Mapping[str, np.ndarray]],
             mean: Mapping[str, np.ndarray], before: int, after: int) -> Iterator[None]:
        """Around a step from version ``before`` to ``after`` (``parts``: its sparse parts by
        tensor, empty for a step of values; ``params()``: the shard's parameters as host arrays;
        ``mean``: the step's mean gradient, which the sparse parts' rebuild computes alike, bit for
        bit): copies those tensors and their means first and, once the step ran, keeps as
        :attr:`last` those whose new values are the old minus the mean, bit for bit, and whose
        parts take fewer bytes than their values (a step that raises leaves none; the check
        itself never fails a step: a tensor it cannot check goes back as values)."""
        self.last = None
        held = {}
        if parts:
            now = params()
            held = {name: (np.array(now[name], np.float32), np.array(mean[name], np.float32)) for name in parts}
        yield
        if not held:
            return
        try:
            new = params()
            exact = {name: parts[name] for name, (old, step_mean) in held.items()
                     if _smaller(parts[name], new[name]) and _same_bits(old - step_mean, new[name])}
        except Exception as exc:  # noqa: BLE001 - the answer falls back to the values
            _log.warning("event=sparse_relay_check_failed error=%s", error_line(exc))
            exact = {}
        self.last = RelayedStep(before, after, exact) if exact else None

    def parts_for(self, base_version: int, version: int) -> dict[str, list]:
        """The parts a reply at ``version`` may carry to a client whose parameters are of
        ``base_version`` (none unless that is the last step's start and ``version`` its end)."""
        last = self.last
        if last is None or last.before != base_version or last.after != version:
            return {}
        return last.parts


def _smaller(parts: list, values: np.ndarray) -> bool:
    """Whether ``parts`` (lists of ``(offset, data)`` chunks) take fewer bytes than ``values``."""
    return sum(len(data) for part in parts for _, data in part) < np.asarray(values).nbytes


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and bool(
        np.array_equal(a.reshape(-1).view(np.uint32), np.ascontiguousarray(b).reshape(-1).view(np.uint32)))
