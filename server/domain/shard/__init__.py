"""A session on one shard: the step path from a push's chunks to its applied update.

``ShardSession`` receives a push (assembled, validated and staged), asks the session clock for its
ticket, applies tickets in order through the updater (``StepRunner``), makes each step durable
(``StepJournal``: the step log, checkpoints, recovery) and answers reads and status; a user's saved
state leaves and enters here (``saved_state``). On an accelerator, a session's ``device_plane``
(``DevicePlane``) is what the same-host data plane asks of it: the host link a client's region is
mapped with, the upload of a push's gradients, the parameters read on the device. ``ShardRegistry``
holds the sessions of one shard.

Exports: ``ShardSession``, ``ShardRegistry``; the records ``PushHeader``, ``Receipt``,
``ShardSessionStatus``, ``StepObserver``, ``StartState``; a hot standby's side of replication
(``StandbyFollower``, ``Standbys``, ``HeldVersions``, ``ReplicaStart``, ``StateLeaves``,
``RootInstall``: the offloaded roots a shipped step carries); and the
helpers the wire shares (``wire_dtype``, ``parallel_copy``, ``log_value``).
"""

from optserve.server.domain.shard.assembly import wire_dtype
from optserve.server.domain.shard.host_passes import parallel_copy
from optserve.server.domain.shard.refusals import log_value
from optserve.server.domain.shard.replica import (HeldVersions, ReplicaStart, RootInstall, StandbyFollower, Standbys,
                                                  StateLeaves)
from optserve.server.domain.shard.saved_state import StartState
from optserve.server.domain.shard.shard_records import PushHeader, Receipt, ShardSessionStatus, StepObserver
from optserve.server.domain.shard.shard_registry import ShardRegistry
from optserve.server.domain.shard.shard_session import ShardSession

__all__ = ["HeldVersions", "PushHeader", "Receipt", "ReplicaStart", "RootInstall", "ShardRegistry", "ShardSession",
           "ShardSessionStatus", "StandbyFollower", "Standbys", "StartState", "StateLeaves", "StepObserver",
           "log_value", "parallel_copy", "wire_dtype"]
