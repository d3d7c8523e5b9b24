"""Step semantics: the one place that decides whether a push joins a step, and how.

Decisions are made by the session clock (:mod:`optserve.server.domain.clock.home_clock`), where the session's
version lives; shards only execute them, in the clock's order.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from optserve.server.domain.config import Mode, StalenessPolicy
from optserve.server.domain.errors import FutureBase, InvalidArgument, Stale


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one accepted push is applied.

    Attributes:
      staleness: version at decision time - the push's base version (0 in sync mode).
      scale: factor for this push's step (1 unless the SCALE policy applies).
      closes_step: True when this push completes a step (async: always; sync: the K-th push).
    """

    staleness: int
    scale: float
    closes_step: bool


def decide(
    *,
    mode: Mode,
    version: int,
    base_version: int,
    num_workers: int,
    pushes_in_step: int,
    client_in_step: bool,
    max_staleness: Optional[int],
    policy: StalenessPolicy,
    client_id: str,
) -> Decision:
    """Decides one push.

    Sync: the push must be computed from the current version, once per client per step; the
    K-th push closes the step. Async: staleness = ``version - base_version``; pushes with
    staleness > ``max_staleness`` (None: unlimited) are refused; under SCALE the step is
    scaled by ``1 / (1 + staleness)``.

    Raises:
      Stale: refused as too old (ABORTED), carrying the current version.
      InvalidArgument: a base version from the future, or a second push of one client in one
        sync step.
    """
    if base_version > version:
        raise FutureBase(f"push from client {client_id!r} has base_version {base_version} > current version {version}",
                         version)
    if mode is Mode.SYNC:
        if base_version != version:
            raise Stale(
                f"sync push from client {client_id!r} was computed from version {base_version}; "
                f"current version is {version}",
                version,
            )
        if client_in_step:
            raise InvalidArgument(f"client {client_id!r} already pushed for version {version}")
        return Decision(0, 1.0, pushes_in_step + 1 >= num_workers)
    staleness = version - base_version
    if max_staleness is not None and staleness > max_staleness:
        raise Stale(
            f"push from client {client_id!r} has staleness {staleness} > max_staleness {max_staleness}; "
            f"current version is {version}",
            version,
        )
    scale = 1.0 / (1.0 + staleness) if policy is StalenessPolicy.SCALE else 1.0
    return Decision(staleness, scale, True)
