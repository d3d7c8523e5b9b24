"""Durable sessions on disk: the versioned on-disk format, the step log and ticket journal,
checkpoints with their manifests (atomic commit, GC), the session catalog, and reading a
checkpoint back. No grpc, no ray; jax and orbax only for array I/O.

Modules: :mod:`.format` (format versions, errors), :mod:`.files` (layout, atomic writes),
:mod:`.catalog`, :mod:`.segments` (log files and records), :mod:`.log_reader`,
:mod:`.step_log` (appending), :mod:`.manifests` (commit markers, checksums, GC),
:mod:`.snapshots`, :mod:`.shard_store` (one session on one shard), :mod:`.export`
(:func:`load_checkpoint` for users).
"""

from optserve.server.storage.catalog import SessionCatalog
from optserve.server.storage.export import load_checkpoint
from optserve.server.storage.files import session_dir
from optserve.server.storage.format import FORMAT_VERSION, CorruptCheckpoint, UnsupportedFormat
from optserve.server.storage.log_reader import StepLogReader, read_journal, read_step_log
from optserve.server.storage.shard_store import ShardStore

__all__ = ["FORMAT_VERSION", "CorruptCheckpoint", "SessionCatalog", "ShardStore", "StepLogReader", "UnsupportedFormat",
           "load_checkpoint", "read_journal", "read_step_log", "session_dir"]
