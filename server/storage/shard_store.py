"""One durable session's files on one shard: its checkpoints and its step log.

A checkpoint is a host copy of the shard's state (:class:`~.snapshots.Snapshots`) written in the
background by one writer thread with orbax, then committed by its manifest
(:mod:`~.manifests`); the log segments it replaces are deleted only after that. The step log and
ticket journal are :class:`~.step_log.StepLog`'s: the store holds it as :attr:`ShardStore.log`
(the domain's ``StepLogPort``) beside its own checkpoints (the domain's ``CheckpointPort``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

from optserve.server.storage.disk_health import log_write_failure
from optserve.server.storage.files import session_dir
from optserve.server.storage.format import CorruptCheckpoint
from optserve.server.storage.manifests import (checkpoint_versions, checksums_match, commit_manifest,
                                               drop_checkpoints_newer_than, drop_checkpoints_older_than,
                                               latest_manifest, read_manifest)
from optserve.server.storage.log_reader import StepLogReader
from optserve.server.storage.orbax_trees import restore_tree, write_tree
from optserve.server.storage.segments import close_segments
from optserve.server.storage.snapshots import Snapshots, leaves, yield_cpu_to_steps
from optserve.server.storage.step_log import StepLog

log = logging.getLogger(__name__)


class LogReach(NamedTuple):
    """How far a shard's part of a session can be restored: ``checkpoint_version`` (its latest
    checkpoint; 0: the initial values') and ``logged_version`` (the last step its log holds after
    it), with ``checkpoint_path`` for messages; both -1 when the shard has no checkpoint (its
    folder then). A shard keeps the checkpoint before its latest and the log since: from
    ``fallback_version`` (that checkpoint's; -1: none) every version up to ``fallback_reach``
    (the log holds each step after it, none missing) can be restored too, so a shard that
    checkpointed a step its peers never logged can still be rolled back to where they are."""

    checkpoint_version: int
    logged_version: int
    checkpoint_path: str
    fallback_version: int = -1
    fallback_reach: int = -1


class ShardStore:
    """One durable session's files on one shard: its checkpoints (the domain's ``CheckpointPort``)
    and, as :attr:`log`, its step log and ticket journal (the domain's ``StepLogPort``).

    Args:
      root: the server's checkpoint folder.
      session: the session's name.
      shard_index: this shard.
      config: the server's :class:`~optserve.server.domain.durability.DurabilityConfig`.
      home: this shard keeps the session's clock (writes the ticket journal).
      fence: the shard's :class:`~.ownership.ShardFence` (None: not checked): checked where the
        store writes (the log's records, a checkpoint before it is written, committed, and before
        what it replaces is deleted).

    Attributes:
      log: the session's :class:`~.step_log.StepLog` on this shard.
    """

    def __init__(self, root: str, session: str, shard_index: int, config, home: bool, fence=None):
        self.folder = os.path.join(session_dir(root, session), f"shard-{shard_index}")
        os.makedirs(self.folder, exist_ok=True)
        self._session, self._shard = session, shard_index
        self._fence = fence
        self.log = StepLog(self.folder, session, shard_index, config, home, fence)
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="optserve-ckpt")
        self._snapshots = Snapshots()
        self._copy_max_bytes = getattr(config, "checkpoint_copy_max_bytes", 1 << 30)
        self._pending: Optional[tuple] = None  # (version, snapshot, manifest) waiting for the writer
        self._busy = False  # the writer thread is draining _pending
        self._done = threading.Condition()
        self.durable_version = -1
        self.recoveries = 0
        self.checkpoint_seconds = 0.0
        self.checkpoints_written = 0
        self.last_error: Optional[str] = None

    # ------------------------------------------------------------- opening
    def latest(self) -> Optional[dict]:
        """The latest committed checkpoint's manifest (None: none), after removing what a crash
        left half-written.

        Raises:
          CorruptCheckpoint: the manifest is unreadable; UnsupportedFormat: a newer optserve's.
        """
        return latest_manifest(self.folder)

    def start_logs(self, manifest: Optional[dict], version: int = 0) -> None:
        """Opens fresh log segments after everything on disk (call after replaying, which reached
        ``version``: every step up to it is in the log)."""
        self.log.open(manifest, version)
        if manifest is not None:
            self.durable_version = int(manifest["progress"]["version"])

    def restore_arrays(self, manifest: dict, abstract: dict) -> dict:
        """The checkpoint's ``{"params", "opt_state"}`` (NumPy leaves), checked against the
        manifest's checksums. ``abstract``: the same tree of ``jax.ShapeDtypeStruct``."""
        path = manifest["path"]
        try:
            restored = restore_tree(path, abstract)
        except Exception as exc:  # noqa: BLE001 - orbax raises many kinds on damaged files
            raise CorruptCheckpoint(f"checkpoint {path} cannot be read: {type(exc).__name__}: {exc}") from None
        if not checksums_match(manifest, [np.asarray(x) for x in leaves(restored)]):
            raise CorruptCheckpoint(f"checkpoint {path} does not match its checksums: its arrays are damaged")
        return restored

    def reachable(self, arrays: Callable[[], dict]) -> LogReach:
        """How far this shard's part can be restored exactly, read without loading anything: the
        latest checkpoint's version and the last version its step log reaches after it, and the
        range the checkpoint kept before it reaches (every record is read into ``arrays()``'s
        buffers, one set reused, and its checksum checked).

        Raises:
          CorruptCheckpoint: a manifest or a record before a log's end is damaged.
        """
        manifest = self.latest()
        if manifest is None:  # nothing to replay a log onto
            return LogReach(-1, -1, self.folder)
        checkpoint = int(manifest["progress"]["version"])
        buffers = arrays()
        after_latest = self.log.segments(manifest)
        versions = self._logged_versions(after_latest, buffers)
        reach = LogReach(checkpoint, max([checkpoint, *versions]), manifest["path"])
        earlier = self._kept_before(checkpoint)
        if earlier is None:
            return reach
        # Only the segments between the two checkpoints: damage there costs the fallback, never
        # the restore from the latest checkpoint.
        between = [s for s in self.log.segments(earlier) if s not in after_latest]
        try:
            versions = self._logged_versions(between, buffers)
        except CorruptCheckpoint:
            return reach
        contiguous = int(earlier["progress"]["version"])
        for version in versions:
            if version == contiguous + 1:
                contiguous = version
        return reach._replace(fallback_version=int(earlier["progress"]["version"]), fallback_reach=contiguous)

    def logged_through(self, manifest: dict, arrays: Callable[[], dict]) -> int:
        """The last version the step log reaches after ``manifest``'s checkpoint with no step
        missing (the checkpoint's own when it holds none after it), every record read into
        ``arrays()``'s buffers (one set, reused) and its checksum checked; a segment a later one
        was sealed after is read up to the seal.

        Raises:
          CorruptCheckpoint: a record before a segment's end is damaged.
        """
        reach = int(manifest["progress"]["version"])
        for version in self._logged_versions(self.log.segments(manifest), arrays()):
            if version == reach + 1:
                reach = version
        return reach

    def journaled_through(self, manifest: dict) -> int:
        """The last ticket ordinal the clock's journal holds after ``manifest``'s checkpoint (the
        ordinal before the checkpoint's next one when it holds none after it; home shard)."""
        tickets = [entry[0] for entry in self.log.journal(manifest) if isinstance(entry, list)]
        return max(tickets, default=int((manifest.get("clock") or {}).get("next_ordinal", 0)) - 1)

    def _logged_versions(self, segments: list[str], buffers: dict) -> list[int]:
        """The versions of the records in ``segments``, in order (a segment a later one was sealed
        after is read up to the sealed version: see ``LogFiles.stray_after``)."""
        versions = []
        for segment in segments:
            stray_after = self.log.stray_after(segment)
            for header, _ in StepLogReader(segment, lambda: buffers):
                version = int(header["version"])
                if stray_after is not None and version > stray_after:
                    break  # a replaced owner's late write
                versions.append(version)
                if version == stray_after:
                    break
        return versions

    def _kept_before(self, version: int) -> Optional[dict]:
        """The manifest of the newest checkpoint before ``version`` kept in the folder (None: none,
        or it cannot be read: only the latest is then restorable)."""
        earlier = [v for v in checkpoint_versions(self.folder) if v < version]
        if not earlier:
            return None
        try:
            return read_manifest(self.folder, max(earlier))
        except CorruptCheckpoint:
            return None

    def roll_back_to(self, version: int) -> Optional[dict]:
        """The manifest of the newest checkpoint at or before ``version`` (None: none), after
        deleting every later one: the session is restored there and goes on from it (a later
        checkpoint left in place would be taken as the latest by the next restore)."""
        kept = [v for v in checkpoint_versions(self.folder) if v <= version]
        if not kept:
            return None
        self._check_owner(f"rolling {self.folder} back to version {version}")
        drop_checkpoints_newer_than(self.folder, version)
        return read_manifest(self.folder, max(kept))

    # ------------------------------------------------------------- checkpoints
    def checkpoint(self, progress, params: dict, opt_state: Any, clock_state_fn: Optional[Callable] = None,
                   wait: bool = False, copied: bool = False) -> bool:
        """Snapshots the state at ``progress.version`` and writes it in the background (before
        returning with ``wait``); later log records go to a fresh segment.

        One checkpoint is written at a time; one that is due while another is being written
        waits for it, and a newer one supersedes it. A state larger than the configuration's
        ``checkpoint_copy_max_bytes`` is not copied: it is written from where it lies before this
        returns (the caller's steps wait). ``copied``: ``params`` and ``opt_state`` are a host copy
        already (an accelerator's state): written as they are, never copied again (over the bound
        the steps still wait, so no second host copy is made while it is written).
        ``clock_state_fn(rotate)``: the home
        shard's clock state, taken with the ticket journal's rotation under the clock's lock.
        Returns True.

        Raises:
          OSError: the log could not start its fresh segments (no checkpoint is taken; the log
            keeps every step in the segments it writes).
        """
        state = {"params": params, "opt_state": opt_state}
        copy = self._copies(state)
        # Over the copy bound the steps wait while it is written: from the live state, or from the
        # one host copy an accelerator's state needs (no second one made while it is written).
        wait = wait or not copy
        # A host copy made already (copied) is written where it lies, as a view of the live state is.
        tree = self._snapshots.take(state, copy and not copied)
        try:
            steps_from, tickets_from, closed_fds, clock_state = self.log.rotate(clock_state_fn)
        except BaseException:  # no fresh segment (a full disk): no checkpoint; the log goes on as it was
            self._snapshots.give_back(tree)
            raise
        manifest = {"progress": progress.to_json(), "clock": clock_state, "steps_from": steps_from,
                    "tickets_from": tickets_from, "closed_fds": closed_fds}
        with self._done:
            superseded = self._pending
            if superseded is not None:  # its segments are flushed and closed with this one's
                manifest["closed_fds"] = superseded[2]["closed_fds"] + manifest["closed_fds"]
            self._pending = (progress.version, tree, manifest)
            if not self._busy:
                self._busy = True
                self._writer.submit(self._drain)
        if superseded is not None:
            self._snapshots.give_back(superseded[1])
            log.info("event=checkpoint_superseded session=%s shard=%d version=%d by=%d", self._session, self._shard,
                     superseded[0], progress.version)
        if wait:
            self.wait()
        return True

    def _copies(self, state: dict) -> bool:
        """Whether a checkpoint of ``state`` is taken as a copy (see ``checkpoint_copy_max_bytes``)."""
        size = sum(int(getattr(leaf, "nbytes", 0)) for leaf in leaves(state))
        return size <= self._copy_max_bytes

    def _drain(self) -> None:
        """The writer thread: writes the pending checkpoint until there is none."""
        yield_cpu_to_steps()
        while True:
            with self._done:
                job, self._pending = self._pending, None
                if job is None:
                    self._busy = False
                    self._done.notify_all()
                    return
            try:
                self._write(*job)
            except Exception:  # noqa: BLE001 - logged in _write; the log keeps every step
                pass
            yield_cpu_to_steps()  # tensorstore's threads exist from the first write on
            self._snapshots.give_back(job[1])
            del job

    def _write(self, version: int, tree: dict, manifest: dict) -> None:
        started = time.monotonic()
        path = os.path.join(self.folder, f"checkpoint-{version}")
        closed_fds = manifest.pop("closed_fds")  # the segments this checkpoint replaces
        try:
            self._check_owner(f"writing {path}")
            if os.path.exists(path):  # a checkpoint of this version without a manifest, or a re-save
                shutil.rmtree(path)
            # Uncompressed: zstd would cost more CPU than the step itself on a busy host; the
            # format is orbax's own (a StandardCheckpointHandler restores it), written with no
            # copy of the tree (the snapshot is given back, or the steps resume, after this).
            write_tree(path, tree)
            self._check_owner(f"committing {path}")
            commit_manifest(path, manifest, leaves(tree), time.time())
        except BaseException as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            # a full or failing disk: one line (the log keeps every step); anything else: its traceback
            log_write_failure(log, "checkpoint_failed", exc, session=self._session, shard=self._shard, version=version)
            close_segments(closed_fds, flush=True)  # they stay the only copy of their steps
            raise
        close_segments(closed_fds, flush=False)  # replaced by the committed checkpoint
        try:
            self._check_owner(f"deleting what {path} replaces")
        except OSError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("event=checkpoint_not_pruned session=%s shard=%d version=%d error=%s", self._session,
                      self._shard, version, exc)
            raise
        self._prune(version, manifest)
        self.durable_version = version
        self.checkpoint_seconds = time.monotonic() - started
        self.checkpoints_written += 1
        log.info("event=checkpoint_written session=%s shard=%d version=%d seconds=%.3f", self._session, self._shard,
                 version, self.checkpoint_seconds)

    def _prune(self, version: int, manifest: dict) -> None:
        """After checkpoint ``version`` (``manifest``) committed: what is older than the checkpoint
        before it goes, so that one and the log since it stay (see :class:`LogReach`)."""
        earlier = self._kept_before(version)
        keep = earlier if earlier is not None else manifest
        drop_checkpoints_older_than(self.folder, int(keep["progress"]["version"]))
        self.log.drop_before(keep)

    def _check_owner(self, before: str) -> None:
        if self._fence is not None:
            self._fence.check(before)

    @property
    def checkpoint_writing(self) -> bool:
        """A checkpoint is being written or waits to be."""
        return self._busy

    def wait(self) -> None:
        """Returns once no checkpoint is being written or waiting to be."""
        with self._done:
            self._done.wait_for(lambda: not self._busy)

    def close(self) -> None:
        """Writes what the log has queued and the checkpoint pending, then closes the files."""
        self.log.close()
        self.wait()
        self._writer.shutdown(wait=True)
