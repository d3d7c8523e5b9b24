"""The coordinator's sessions: the server-wide table of sessions and what is done to them.

``Coordinator`` admits a session (limits, memory budget, tenant quota), places its tensors on
shards, opens it on them all or not at all, answers status and listing, closes, unloads and
restores sessions (a consistent version on every shard) and watches shards that died. It reaches
the shards through ``ShardFleet`` and a durable server's catalog through ``SessionCatalog``.

Exports: ``Coordinator``, the ports ``ShardFleet`` and ``SessionCatalog``, and the records
``SessionRecord``, ``SessionStatus``, ``ShardOpening``, ``ShardSummary``, ``StandbySummary``,
``AttachExpectation``.
"""

from optserve.server.domain.sessions.coordinator import Coordinator
from optserve.server.domain.sessions.ports import SessionCatalog, ShardFleet
from optserve.server.domain.sessions.session_records import (AttachExpectation, SessionRecord, SessionStatus,
                                                             ShardOpening, ShardSummary, StandbySummary)

__all__ = ["AttachExpectation", "Coordinator", "SessionCatalog", "SessionRecord", "SessionStatus", "ShardFleet",
           "ShardOpening", "ShardSummary", "StandbySummary"]
