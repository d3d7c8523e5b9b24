"""One shard's step log and (home shard) ticket journal, appended by one background thread.

A step's gradient is appended while its update runs (:meth:`StepLog.begin_step`), its header
after it (:meth:`StepLog.end_step`), so the log costs the step no wait; the answer that
acknowledges the step waits for its record (:meth:`StepLog.wait_logged`, or without a thread
:meth:`StepLog.logged_future`). A failed write fails that wait and every later one: nothing
unlogged is acknowledged.

With write-ahead order (``DurabilityConfig.write_ahead``) a step's whole record is written
first and the update runs after it (:meth:`StepLog.append_ahead`): a step whose record failed is
applied nowhere.

After a failed write the log is *failed*: each reservation first probes the disk (a small write
and fsync in the folder) and refuses while that fails, so no further step is applied. Once the
disk takes writes again: in the overlapped order the session writes a checkpoint of everything it
applied (the steps whose records were lost included) and :meth:`StepLog.recovered` starts the log
afresh; in write-ahead order :meth:`StepLog.restart` cuts the failed record off and the log goes on.

Reading the files back, sealing a fresh segment and cutting the log are :class:`~.log_files.LogFiles`'s.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from typing import Callable, Optional

from optserve.server.storage.disk_health import DiskHealth, log_write_failure
from optserve.server.storage.log_files import LogFiles
from optserve.server.storage.logged_mark import LoggedMark
from optserve.server.storage.segments import BLOCK, PREFIX, STEPS, TICKETS, Segments, close_segments, segment_indices

log = logging.getLogger(__name__)

_HEADER_ROOM = 64 << 10  # bytes reserved for a record's header (its tickets: one per pushing worker)


class StepLog(LogFiles):
    """The log files of one durable session on one shard.

    Args:
      folder: the shard's folder of the session.
      session / shard: names for messages and log lines.
      config: the server's ``DurabilityConfig`` (fsync policy, log I/O mode).
      home: this shard keeps the session's clock (writes the ticket journal).
      fence: the shard's :class:`~.ownership.ShardFence` (None: not checked), checked before each
        write and once more before a record counts as logged (so a replaced shard acknowledges
        nothing it wrote while its replacement was taking over).
    """

    def __init__(self, folder: str, session: str, shard: int, config, home: bool, fence=None):
        super().__init__(folder, session, shard, fence)
        self._config, self._home = config, home
        self.write_ahead = bool(config.write_ahead)  # records are written before their steps are applied
        self.syncs_each_record = config.fsync_due(1)  # every record is flushed before its step is acknowledged
        self._steps: Optional[Segments] = None
        self._tickets: Optional[Segments] = None
        self._journal_lock = threading.Lock()  # the journal's writes vs rotations
        self._records_since_sync = 0
        self._tickets_since_sync = 0
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="optserve-log")
        self._logged = LoggedMark(folder, shard)  # how far the log is written, and a failed write
        self.records = 0  # step records since the last checkpoint
        self.bytes = 0  # their gradient bytes
        self._begun_bytes = 0  # the gradient bytes of the record begun last
        self._disk = DiskHealth(folder, session, shard)  # degraded after a failed write, until it takes writes

    # ------------------------------------------------------------- writing
    def open(self, manifest: Optional[dict], version: int) -> None:
        """Opens fresh segments after everything on disk (the log reached ``version``)."""
        self._logged.start(version)
        steps_from = manifest["steps_from"] if manifest else 0
        tickets_from = manifest["tickets_from"] if manifest else 0
        next_steps = max(segment_indices(self.folder, STEPS, steps_from), default=steps_from - 1) + 1
        next_tickets = max(segment_indices(self.folder, TICKETS, tickets_from), default=tickets_from - 1) + 1
        if next_steps > steps_from or self.seals():  # a predecessor's segments: sealed before this owner writes
            self.seal(next_steps, version)
        self._steps = Segments(self.folder, STEPS, next_steps, direct=self._config.log_io.tries_direct,
                               quiet_fallback=self._config.log_io.value == "auto")
        if self._home:
            self._tickets = Segments(self.folder, TICKETS, next_tickets)

    def journal_entry(self, entry) -> None:
        """Appends one clock entry (a ticket's or a sum's JSON) to the journal (home shard; called
        under the clock's lock)."""
        line = (json.dumps(entry) + "\n").encode()
        with self._journal_lock:
            self._check_owner("a ticket journal line")
            self._tickets.reserve(len(line))
            self._tickets.write([line])
            self._tickets_since_sync += 1
            if self._config.fsync_due(self._tickets_since_sync):  # the step log's policy
                self._tickets.fsync()
                self._tickets_since_sync = 0

    def reserve(self, payload_bytes: int, tensors: int, steps: int = 1) -> None:
        """Reserves the disk space of the next ``steps`` step records (``payload_bytes`` of
        gradient in ``tensors`` tensors each) before they are applied: a full disk refuses a push
        when it is staged, it does not fail the write of a step already applied. Sets or clears
        :attr:`degraded`.

        Raises:
          OSError: no room (ENOSPC, EDQUOT) or a failing disk (EIO); the message names the folder.
        """
        record = PREFIX.size + payload_bytes + (tensors + 1) * BLOCK + _HEADER_ROOM
        if self._logged.error is not None:
            self.probe()
        try:
            self._steps.reserve(steps * record)
        except OSError as exc:
            self._disk.degrade(exc)
            raise OSError(exc.errno, f"the step log in {self.folder} has no room for the next step: "
                                     f"{exc.strerror or exc}") from None
        if self.degraded and self._logged.error is None:
            log.warning("event=step_log_recovered session=%s shard=%d folder=%s", self._session, self._shard,
                        self.folder)
            self._disk.degraded = ""

    @property
    def degraded(self) -> str:
        """Why the log cannot take a step now (``"disk: <cause> (<folder>)"``; "": it can)."""
        return self._disk.degraded

    def probe(self) -> None:
        """The log failed: checks that the disk takes a write again (see :meth:`DiskHealth.probe`).

        Raises:
          OSError: it does not; the message names the folder and the cause.
        """
        self._disk.probe()

    @property
    def failed(self) -> bool:
        """A write failed since the log was (re)started: records are not written until
        :meth:`recovered`."""
        return self._logged.error is not None

    def recovered(self, version: int) -> None:
        """A checkpoint at ``version`` (taken under the session's lock after the failure, so it
        holds every step applied, those whose records were lost included) was committed: the log
        goes on in the fresh segment the checkpoint started, and the waits up to ``version`` end."""
        self._disk.degraded = ""
        self._logged.recovered(version)
        log.warning("event=step_log_recovered session=%s shard=%d folder=%s version=%d", self._session,
                    self._shard, self.folder, version)

    def begin_step(self, grads: list) -> None:
        """Starts appending the next step's gradient (arrays in tensor order, read but not
        changed by the update); :meth:`end_step` or :meth:`abort_step` must follow, in order."""
        self.records += 1
        self._begun_bytes = sum(g.nbytes for g in grads)
        self.bytes += self._begun_bytes
        self._thread.submit(self._append_payload, grads)

    def end_step(self, record, release: Optional[Callable[[], None]] = None) -> None:
        """Completes the step begun last with ``record`` (flushed per the fsync policy), then
        calls ``release()`` (the gradient arrays may be reused from then on)."""
        self._thread.submit(self._append_header, record, release)

    def abort_step(self) -> None:
        """The step begun last was not applied (its update failed): marks its record skipped."""
        self.records -= 1
        self._thread.submit(self._append_header, None, None)

    def _append_payload(self, grads: list) -> None:
        if self._logged.error is not None:
            return
        try:
            self._check_owner("a step record")
            self._steps.write_payload(grads)
        except BaseException as exc:  # noqa: BLE001 - every later wait_logged raises it
            log_write_failure(log, "step_log_failed", exc, session=self._session, shard=self._shard)
            self._fail(exc)

    def _append_header(self, record, release: Optional[Callable[[], None]]) -> None:
        try:
            if self._logged.error is not None:
                return
            header = json.dumps(record.to_json() if record is not None else {"aborted": True}).encode()
            self._check_owner("a step record's end")
            self._steps.write_record_end(header)
            if record is None:
                return
            self._records_since_sync += 1
            if self._config.fsync_due(self._records_since_sync):
                self._steps.fsync()
                self._records_since_sync = 0
            self._check_owner(f"acknowledging step {record.version}")  # a replacement that claimed meanwhile
            # may have read the log before this record: the step must not count as logged here
        except BaseException as exc:  # noqa: BLE001 - every later wait_logged raises it
            log_write_failure(log, "step_log_failed", exc, session=self._session, shard=self._shard)
            self._fail(exc)
            return
        finally:
            if release is not None:
                release()
        self._logged.advance(record.version)

    def _fail(self, exc: BaseException) -> None:
        self._disk.degrade(exc)
        self._logged.fail(exc)

    def wait_logged(self, version: int) -> None:
        """Returns once the step of ``version`` is in the log.

        Raises:
          OSError: the log could not be written (disk full, ...): the step cannot be acknowledged.
        """
        self._logged.wait(version, self._logged.not_durable(version))

    def append_ahead(self, grads: list, record) -> None:
        """Write-ahead order: appends a step's whole record (its gradient ``grads``, in tensor
        order, and ``record``, flushed per the fsync policy) and returns once it is written, before
        the step is applied.

        Raises:
          OSError: the record could not be written (naming the folder and the cause): the step
            must not be applied; once the disk takes writes again, :meth:`restart` cuts it off.
        """
        self.begin_step(grads)
        self.end_step(record)
        self._logged.wait(record.version, f"step {record.version} is applied nowhere on shard {self._shard}")

    def logged_future(self, version: int) -> concurrent.futures.Future:
        """A future done once the step of ``version`` is in the log (result None), or failed with
        the OSError :meth:`wait_logged` raises: :meth:`wait_logged` for a caller that waits
        without a thread."""
        return self._logged.future(version)

    def restart(self) -> None:
        """Write-ahead order, after a failed write: once the disk takes a write again (see
        :meth:`probe`), cuts the failed record off its segment and takes records again (the
        step whose record failed was not applied; the session applies it, logged, next).

        Raises:
          OSError: the disk still fails (the log stays failed).
        """
        self._thread.submit(lambda: None).result()  # the failed record's queued writes are done
        if self._logged.error is None:
            return
        self.probe()
        try:
            self._steps.cut_record()
        except OSError as exc:
            self._disk.degrade(exc)
            raise OSError(exc.errno, f"the step log in {self.folder} cannot be written: "
                                     f"{exc.strerror or exc}") from None
        self.records -= 1
        self.bytes -= self._begun_bytes
        self._disk.degraded = ""
        self._logged.recovered()
        log.warning("event=step_log_recovered session=%s shard=%d folder=%s version=%d", self._session,
                    self._shard, self.folder, self._logged.version)

    def rotate(self, clock_state_fn: Optional[Callable]) -> tuple[int, int, list, object]:
        """Starts fresh segments for the steps after a checkpoint, once every queued record is
        written. ``clock_state_fn(rotate)`` (home shard): the clock's state, taken with the
        journal's rotation under the clock's lock. Returns ``(steps_from, tickets_from,
        closed descriptors, clock state)``."""
        self._thread.submit(lambda: None).result()
        self._check_owner("starting a fresh segment")
        steps_from, closed = self._steps.rotate()
        closed_fds = [closed]
        clock_state, tickets_from = None, 0
        if self._home and clock_state_fn is not None:
            rotated = []

            def rotate():
                with self._journal_lock:
                    rotated.append(self._tickets.rotate())
                    self._tickets_since_sync = 0

            try:
                clock_state = clock_state_fn(rotate)
            except BaseException:  # no checkpoint: the finished steps segment is flushed and closed all the same
                close_segments(closed_fds, flush=True)
                self._records_since_sync = 0
                raise
            tickets_from, closed = rotated[0]
            closed_fds.append(closed)
        self._records_since_sync = 0
        self.records, self.bytes = 0, 0
        return steps_from, tickets_from, closed_fds, clock_state

    def drop_before(self, manifest: dict) -> None:
        """Deletes the segments a committed checkpoint replaced."""
        self._steps.drop_before(manifest["steps_from"])
        if self._tickets is not None:
            self._tickets.drop_before(manifest["tickets_from"])

    @property
    def writes_direct(self) -> bool:
        """Gradients are written with direct I/O now (``LogIO.DIRECT`` where it works)."""
        return self._steps is not None and self._steps.writes_direct

    @property
    def direct_bytes(self) -> int:
        """Gradient bytes written with direct I/O since the log was opened."""
        return self._steps.direct_bytes if self._steps is not None else 0

    def close(self) -> None:
        """Writes what is queued and closes the files."""
        self._thread.shutdown(wait=True)
        for segments in (self._steps, self._tickets):
            if segments is not None:
                segments.close()
