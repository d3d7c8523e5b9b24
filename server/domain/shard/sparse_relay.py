"""SparseLoCo's compact answer: a sync step's sparse parts instead of the new parameters.

When every push of a sync step sent a tensor as a SparseLoCo selection, each worker of the round
can rebuild the step's new values of that tensor from what it held before the step and the
step's parts (:func:`optserve.protos.sparse_codec.apply_parts`: the values minus the parts'
mean), if the session's optimizer made exactly that update (SGD at learning rate 1, SparseLoCo's
outer step). Whether it did is not assumed from the optimizer's name: :class:`SparseRelay` keeps
a copy of such tensors before the step and, after it, rebuilds them from the parts as a client
would and compares the result bit for bit with the shard's new values. Tensors that match may
be answered with their parts (``PullRequest.sparse_update``); the others, and every other step,
go back as values.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Mapping, Optional

import numpy as np

from optserve.protos import sparse_codec


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
    def step(self, parts: Mapping[str, list], params: Callable[[], Mapping[str, np.ndarray]], before: int,
             after: int) -> Iterator[None]:
        """Around a step from version ``before`` to ``after`` (``parts``: its sparse parts by
        tensor, empty for a step of values; ``params()``: the shard's parameters as host arrays):
        copies those tensors first and, once the step ran, keeps those its parts rebuild bit for
        bit as :attr:`last` (a step that raises leaves none)."""
        self.last = None
        old = {name: np.array(values, np.float32) for name, values in params().items() if name in parts} \
            if parts else {}
        yield
        if parts:
            new = params()
            exact = {name: tensor_parts for name, tensor_parts in parts.items()
                     if _same_bits(sparse_codec.apply_parts(old[name], tensor_parts, self._over_senders), new[name])}
            self.last = RelayedStep(before, after, exact) if exact else None

    def parts_for(self, base_version: int, version: int) -> dict[str, list]:
        """The parts a reply at ``version`` may carry to a client whose parameters are of
        ``base_version`` (none unless that is the last step's start and ``version`` its end)."""
        last = self.last
        if last is None or last.before != base_version or last.after != version:
            return {}
        return last.parts


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and bool(
        np.array_equal(a.reshape(-1).view(np.uint32), np.ascontiguousarray(b).reshape(-1).view(np.uint32)))
