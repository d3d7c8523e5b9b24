"""Durable sessions on disk: checkpoints (orbax), the step log, the ticket journal, the session catalog.

One folder per session under ``DIR/sessions/`` (the name percent-quoted)::

    session.json                     the session's definition and shard map (the catalog entry)
    shard-<i>/checkpoint-<v>/        orbax checkpoint of shard i's part at version v:
                                     {"params": {name: array}, "opt_state": the optax state}
    shard-<i>/checkpoint-<v>.json    its manifest, written last (the commit marker): progress,
                                     clock state (home shard), CRC-32C of every array
    shard-<i>/steps-<k>.log          step log segment k (records after the checkpoint whose
                                     manifest names segment k, in order)
    shard-<i>/tickets-<k>.log        ticket journal segment k (home shard: one JSON line per ticket)

A checkpoint becomes visible only once its manifest is renamed into place, after orbax committed
its folder; older checkpoints and log segments are deleted only after that. A checkpoint whose
arrays do not match their manifest's checksums is reported (:class:`CorruptCheckpoint`), never
loaded. A step-log record is ``"OSLR" | payload length (u64) | payload | header length (u32) |
header JSON | crc32(header) (u32) | "OSLE"``; a record torn by a crash (no end marker) ends the
log: it was never acknowledged. With direct I/O (``LogIO.DIRECT``) the record starts ``"OSLA"``
and its payload is block aligned: zeros after the prefix up to the next multiple of
:data:`_BLOCK` bytes in the file, and after each tensor up to the next multiple too, so that the
tensors' page-aligned memory goes to the disk by DMA, without a copy. The payload is written while the step's update runs and the header
after it; a step whose update failed gets the header ``{"aborted": true}`` and is skipped on replay.

Loading a session's parameters and optimizer state into your own JAX program: see
:func:`load_checkpoint`.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
import urllib.parse
import zlib
from typing import Any, Callable, Optional

import numpy as np

log = logging.getLogger(__name__)

_REC_START, _REC_END = b"OSLR", b"OSLE"
_REC_ALIGNED = b"OSLA"  # a record written with direct I/O: its payload is block aligned
_BLOCK = 4096  # direct I/O's unit: file offsets, lengths and memory addresses are multiples of it
_ZEROS = memoryview(bytes(_BLOCK))
_DIRECT_MAX = 1 << 30  # bytes per direct write call (one call writes at most ~2 GiB)
_PREFIX = struct.Struct("<4sQ")
_U32 = struct.Struct("<I")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)\.json$")
_SEGMENT_RE = re.compile(r"^(steps|tickets)-(\d+)\.log$")
_IOV_MAX = 1024  # buffers per writev call (Linux's IOV_MAX)


class CorruptCheckpoint(Exception):
    """A checkpoint or log on disk is damaged (the message names the file)."""


def session_dir(root: str, name: str) -> str:
    return os.path.join(root, "sessions", urllib.parse.quote(name, safe=""))


def _write_atomically(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file, fsync and rename (never torn)."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the session catalog
class SessionCatalog:
    """The sessions a durable server holds: one ``session.json`` each (written at creation,
    removed first at close, so a half-deleted session is never restored)."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(os.path.join(root, "sessions"), exist_ok=True)

    def save(self, name: str, entry: dict) -> None:
        folder = session_dir(self.root, name)
        os.makedirs(folder, exist_ok=True)
        _write_atomically(os.path.join(folder, "session.json"), json.dumps(entry).encode())

    def remove(self, name: str) -> None:
        folder = session_dir(self.root, name)
        try:
            os.unlink(os.path.join(folder, "session.json"))
        except FileNotFoundError:
            pass
        shutil.rmtree(folder, ignore_errors=True)

    def entries(self) -> list[dict]:
        """Every saved session's entry (unreadable ones are logged and skipped)."""
        out = []
        base = os.path.join(self.root, "sessions")
        for folder in sorted(os.listdir(base)):
            path = os.path.join(base, folder, "session.json")
            if not os.path.exists(path):
                continue
            try:
                with open(path, "rb") as fh:
                    out.append(json.loads(fh.read()))
            except (OSError, ValueError) as exc:
                log.error("event=catalog_entry_unreadable path=%s error=%s", path, exc)
        return out


# ------------------------------------------------------------------ step log
class _Segments:
    """Numbered append-only segment files ``<kind>-<k>.log`` in one folder.

    ``direct``: step payloads go to the disk with direct I/O where they can
    (:meth:`write_payload`); the segment is then written at offsets this object tracks (direct
    I/O does not mix with ``O_APPEND``), through two descriptors of the same file.
    """

    def __init__(self, folder: str, kind: str, start: int, direct: bool = False):
        self.folder, self.kind = folder, kind
        self.index = start
        self.direct = direct
        self.direct_bytes = 0  # payload bytes written with direct I/O (this object's segments)
        self._direct_fd = -1
        self._open(start)

    def _open(self, index: int) -> None:
        path = self.path(index)
        if not self.direct:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._offset = None
            return
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        self._offset = os.fstat(self._fd).st_size
        try:
            self._direct_fd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
        except OSError as exc:  # e.g. a filesystem without direct I/O
            log.warning("event=step_log_direct_io_unavailable path=%s error=%s (writes go through the page cache)",
                        path, exc)
            self._direct_fd = -1

    @property
    def writes_direct(self) -> bool:
        """Whether payloads go to the disk with direct I/O now."""
        return self._direct_fd >= 0

    def path(self, index: int) -> str:
        return os.path.join(self.folder, f"{self.kind}-{index}.log")

    def rotate(self) -> tuple[int, int]:
        """Opens the next segment; returns its index and the previous segment's file descriptor,
        which the caller flushes and closes (off the step path)."""
        old = self._fd
        self._close_direct()
        self.index += 1
        self._open(self.index)
        return self.index, old

    def _close_direct(self) -> None:
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1

    def write_payload(self, arrays: list) -> None:
        """Appends a step record's start: its prefix and the gradient ``arrays`` (C order)."""
        views = [memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B") for a in arrays]
        total = sum(view.nbytes for view in views)
        if not self.direct:
            self.write([_PREFIX.pack(_REC_START, total), *views])
            return
        prefix = _PREFIX.pack(_REC_ALIGNED, total)
        self.write([prefix, _ZEROS[:_pad(self._offset + len(prefix))]])
        for view in views:
            bulk = view.nbytes - view.nbytes % _BLOCK
            if bulk and self._direct_fd >= 0 and _address(view) % _BLOCK == 0:
                done = self._write_direct(view[:bulk])
                view = view[done:]
            self.write([view, _ZEROS[:_pad(self._offset + view.nbytes)]])

    def _write_direct(self, view: memoryview) -> int:
        """Writes block-aligned ``view`` at the segment's end with direct I/O; returns the bytes
        written (fewer if direct I/O failed: the rest goes through the page cache)."""
        done = 0
        try:
            while done < view.nbytes:
                count = os.pwrite(self._direct_fd, view[done:done + _DIRECT_MAX], self._offset + done)
                done += count
                if count <= 0 or count % _BLOCK:
                    break
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.warning("event=step_log_direct_io_failed path=%s error=%s (writes go through the page cache)",
                        self.path(self.index), exc)
            self._close_direct()
        self._offset += done
        self.direct_bytes += done
        return done

    def write(self, parts: list) -> None:
        """Appends ``parts`` (bytes-like) whole: ``writev`` takes at most ``IOV_MAX`` buffers and
        writes at most ~2 GiB per call, so a large record takes several calls."""
        views = [view for view in (memoryview(p).cast("B") for p in parts) if view.nbytes]
        first = 0  # views before it are written
        while first < len(views):
            if self._offset is None:
                written = os.writev(self._fd, views[first:first + _IOV_MAX])
            else:
                written = os.pwritev(self._fd, views[first:first + _IOV_MAX], self._offset)
                self._offset += written
            while written:  # skip what was written; the rest of a part written partly stays
                head = views[first]
                if written >= head.nbytes:
                    written -= head.nbytes
                    first += 1
                else:
                    views[first] = head[written:]
                    written = 0

    def fsync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        self._close_direct()
        try:
            os.close(self._fd)
        except OSError:
            pass

    def drop_before(self, index: int) -> None:
        for name in os.listdir(self.folder):
            match = _SEGMENT_RE.match(name)
            if match and match.group(1) == self.kind and int(match.group(2)) < index:
                os.unlink(os.path.join(self.folder, name))


_BACKGROUND_NICE = 19
_IO_THREAD_PREFIX = "ts_pool"  # tensorstore's I/O threads' names (orbax writes through them)


def _yield_cpu_to_steps() -> None:
    """Lowers the CPU priority (nice 19) of the threads that write checkpoints: the calling one
    and tensorstore's (made at its first use), so a checkpoint written in the background takes
    the CPU the steps leave idle instead of slowing them down. Linux only (per-thread nice); a
    no-op elsewhere or when ``/proc`` cannot be read. (An unprivileged process cannot raise the
    priority back: those threads stay background threads, which restores can afford.)"""
    try:
        tids = [threading.get_native_id()]
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if fh.read().startswith(_IO_THREAD_PREFIX):
                    tids.append(int(tid))
        for tid in tids:
            if os.getpriority(os.PRIO_PROCESS, tid) < _BACKGROUND_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, _BACKGROUND_NICE)
    except (OSError, AttributeError):
        pass


def _close_segments(fds: list, flush: bool) -> None:
    """Closes closed-off log segments' descriptors, flushing them to the disk first when they
    still hold the only copy of their records (a checkpoint meant to replace them failed)."""
    for fd in fds:
        try:
            if flush:
                os.fsync(fd)
        except OSError:
            log.exception("event=step_log_flush_failed")
        finally:
            os.close(fd)


_CHECKSUM = "crc32c"  # the manifest's key for its arrays' checksums (older manifests: "crc32", zlib's)


def _checksum(array, kind: str = _CHECKSUM) -> int:
    """The checksum of an array's bytes (C order): CRC-32C (google-crc32c: hardware instructions,
    ~3x faster than zlib's CRC-32, which checkpoints written before it carry)."""
    values = np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)
    if kind == "crc32":
        return zlib.crc32(values)
    import google_crc32c

    return google_crc32c.value(values)


def _manifest_checksums(manifest: dict) -> tuple[str, list]:
    """``(kind, checksums)`` of a manifest's arrays."""
    for kind in (_CHECKSUM, "crc32"):
        if kind in manifest:
            return kind, manifest[kind]
    raise CorruptCheckpoint(f"checkpoint manifest of version {manifest.get('progress', {}).get('version')} "
                            f"has no checksums")


def _pad(offset: int) -> int:
    """Bytes from ``offset`` to the next multiple of :data:`_BLOCK`."""
    return -offset % _BLOCK


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0


def _segment_indices(folder: str, kind: str, start: int) -> list[int]:
    found = []
    for name in os.listdir(folder):
        match = _SEGMENT_RE.match(name)
        if match and match.group(1) == kind and int(match.group(2)) >= start:
            found.append(int(match.group(2)))
    return sorted(found)


def read_step_log(path: str, arrays: Callable[[], dict]):
    """Yields ``(record_json, grads)`` from a step-log segment; ``arrays()`` gives fresh buffers
    (name -> array, in tensor order) to read each record's gradient into. A torn last record
    ends the log; damage before the end raises :class:`CorruptCheckpoint`."""
    size = os.path.getsize(path)
    with open(path, "rb", buffering=0) as fh:
        while True:
            at = fh.tell()
            prefix = fh.read(_PREFIX.size)
            if not prefix:
                return
            torn = len(prefix) < _PREFIX.size
            if not torn:
                magic, payload_len = _PREFIX.unpack(prefix)
                if magic not in (_REC_START, _REC_ALIGNED):
                    raise CorruptCheckpoint(f"step log {path}: no record starts at byte {at}")
                grads = arrays()
                expected = sum(a.nbytes for a in grads.values())
                if payload_len != expected:
                    raise CorruptCheckpoint(f"step log {path}: record at byte {at} holds {payload_len} gradient "
                                            f"bytes, the shard's tensors have {expected}")
                torn = not _read_payload(fh, grads.values(), aligned=magic == _REC_ALIGNED)
                header_len_raw = fh.read(_U32.size)
                torn = torn or len(header_len_raw) < _U32.size
            if not torn:
                (header_len,) = _U32.unpack(header_len_raw)
                tail = fh.read(header_len + _U32.size + len(_REC_END))
                torn = len(tail) < header_len + _U32.size + len(_REC_END)
            if torn:
                log.warning("event=step_log_torn_tail path=%s at=%d size=%d (an unacknowledged step)", path, at, size)
                return
            header, crc, end = tail[:header_len], tail[header_len:header_len + 4], tail[header_len + 4:]
            if end != _REC_END or _U32.unpack(crc)[0] != zlib.crc32(header):
                if fh.tell() < size:
                    raise CorruptCheckpoint(f"step log {path}: record at byte {at} is damaged")
                log.warning("event=step_log_torn_tail path=%s at=%d", path, at)
                return
            record = json.loads(header)
            if not record.get("aborted"):  # a step whose update failed: never applied
                yield record, grads


def _read_payload(fh, arrays, aligned: bool) -> bool:
    """Reads a record's payload into ``arrays`` (skipping an aligned record's padding); returns
    whether it was all there."""
    if aligned and not _skip(fh, _pad(fh.tell())):
        return False
    for array in arrays:
        target = memoryview(array.reshape(-1)).cast("B")
        if _read_fully(fh, target) < target.nbytes or (aligned and not _skip(fh, _pad(fh.tell()))):
            return False
    return True


def _skip(fh, count: int) -> bool:
    return len(fh.read(count)) == count if count else True


def _read_fully(fh, target: memoryview) -> int:
    """Fills ``target`` from ``fh`` (one read returns at most ~2 GiB); returns the bytes read,
    fewer only at the end of the file."""
    got = 0
    while got < target.nbytes:
        count = fh.readinto(target[got:])
        if not count:
            break
        got += count
    return got


def read_journal(path: str) -> list:
    """The entries (tickets' and sums' JSON) of a journal segment; a torn last line is dropped."""
    out = []
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break
            out.append(json.loads(line))
    return out


# ------------------------------------------------------------------ one shard's part of a session
def _leaves(tree) -> list:
    import jax

    return jax.tree.leaves(tree)


def _host_tree(tree):
    """The tree with every leaf a NumPy array (0-d for scalars): views of CPU device buffers."""
    import jax

    return jax.tree.map(lambda x: np.asarray(x), tree)


class _Snapshots:
    """Host copies of a shard's state for checkpoints, in buffers reused from one checkpoint to
    the next (one spare set kept). A copy, not views of the live buffers: a view would stop the
    next update from donating (reusing) those buffers, so it would allocate fresh outputs whose
    pages the kernel zeroes on first touch, at every checkpoint; the copy runs once, into warm
    memory. Thread-safe."""

    def __init__(self):
        self._spare = None
        self._lock = threading.Lock()

    def take(self, tree) -> Any:
        """A host copy of ``tree`` (device or host arrays)."""
        import jax

        live = _host_tree(tree)
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None or not _same_layout(spare, live):
            spare = jax.tree.map(np.empty_like, live)
        jax.tree.map(np.copyto, spare, live)
        return spare

    def give_back(self, tree) -> None:
        """Takes back a copy once written (or superseded)."""
        with self._lock:
            self._spare = tree


def _same_layout(a, b) -> bool:
    import jax

    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class ShardStore:
    """One durable session's files on one shard (implements the domain's ``SessionStore``).

    Args:
      root: the server's checkpoint folder.
      session: the session's name.
      shard_index: this shard.
      config: the server's :class:`~optserve.server.domain.durability.DurabilityConfig`.
      home: this shard keeps the session's clock (writes the ticket journal).
    """

    def __init__(self, root: str, session: str, shard_index: int, config, home: bool):
        self.folder = os.path.join(session_dir(root, session), f"shard-{shard_index}")
        os.makedirs(self.folder, exist_ok=True)
        self._session, self._shard = session, shard_index
        self._config = config
        self._home = home
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="optserve-ckpt")
        self._snapshots = _Snapshots()
        self._pending: Optional[tuple] = None  # (version, snapshot, manifest) waiting for the writer
        self._busy = False  # the writer thread is draining _pending
        self._done = threading.Condition()
        self._lock = threading.Lock()  # the journal's writes vs rotations
        self._steps: Optional[_Segments] = None
        self._tickets: Optional[_Segments] = None
        self._records_since_sync = 0
        self._tickets_since_sync = 0
        self._log_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="optserve-log")
        self._logged = threading.Condition()  # guards _logged_version / _log_error
        self._logged_version = 0
        self._log_error: Optional[BaseException] = None
        self.durable_version = -1
        self.log_records = 0
        self.log_bytes = 0
        self.recoveries = 0
        self.checkpoint_seconds = 0.0
        self.checkpoints_written = 0
        self.last_error: Optional[str] = None

    # ------------------------------------------------------------- opening
    def latest(self) -> Optional[dict]:
        """The latest committed checkpoint's manifest (None: none), after removing what a crash
        left half-written (orbax temporary folders, checkpoints without a manifest)."""
        manifests = {}
        for name in os.listdir(self.folder):
            match = _CHECKPOINT_RE.match(name)
            if match:
                manifests[int(match.group(1))] = name
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            if os.path.isdir(path) and (".orbax-checkpoint-tmp" in name or not (
                    name.startswith("checkpoint-") and name[len("checkpoint-"):].isdigit()
                    and int(name[len("checkpoint-"):]) in manifests)):
                shutil.rmtree(path, ignore_errors=True)
        if not manifests:
            return None
        version = max(manifests)
        path = os.path.join(self.folder, manifests[version])
        try:
            with open(path, "rb") as fh:
                manifest = json.loads(fh.read())
        except (OSError, ValueError) as exc:
            raise CorruptCheckpoint(f"checkpoint manifest {path} is unreadable: {exc}") from None
        manifest["path"] = os.path.join(self.folder, f"checkpoint-{version}")
        return manifest

    def start_logs(self, manifest: Optional[dict], version: int = 0) -> None:
        """Opens fresh log segments after everything on disk (call after replaying, which reached
        ``version``: every step up to it is in the log)."""
        self._logged_version = version
        steps_from = manifest["steps_from"] if manifest else 0
        tickets_from = manifest["tickets_from"] if manifest else 0
        next_steps = max(_segment_indices(self.folder, "steps", steps_from), default=steps_from - 1) + 1
        next_tickets = max(_segment_indices(self.folder, "tickets", tickets_from), default=tickets_from - 1) + 1
        self._steps = _Segments(self.folder, "steps", next_steps, direct=self._config.log_io.value == "direct")
        if self._home:
            self._tickets = _Segments(self.folder, "tickets", next_tickets)
        if manifest is not None:
            self.durable_version = int(manifest["progress"]["version"])

    def restore_arrays(self, manifest: dict, abstract: dict) -> dict:
        """The checkpoint's ``{"params", "opt_state"}`` (NumPy leaves), checked against the
        manifest's checksums. ``abstract``: the same tree of ``jax.ShapeDtypeStruct``."""
        import orbax.checkpoint as ocp

        path = manifest["path"]
        try:
            restored = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
                path, args=ocp.args.StandardRestore(abstract))
        except Exception as exc:  # noqa: BLE001 - orbax raises many kinds on damaged files
            raise CorruptCheckpoint(f"checkpoint {path} cannot be read: {type(exc).__name__}: {exc}") from None
        leaves = [np.asarray(x) for x in _leaves(restored)]
        kind, sums = _manifest_checksums(manifest)
        if len(leaves) != len(sums) or any(_checksum(a, kind) != s for a, s in zip(leaves, sums)):
            raise CorruptCheckpoint(f"checkpoint {path} does not match its checksums: its arrays are damaged")
        return restored

    def log_segments(self, manifest: Optional[dict]) -> list[str]:
        start = manifest["steps_from"] if manifest else 0
        return [os.path.join(self.folder, f"steps-{i}.log") for i in _segment_indices(self.folder, "steps", start)]

    def journal(self, manifest: Optional[dict]) -> list:
        start = manifest["tickets_from"] if manifest else 0
        out = []
        for i in _segment_indices(self.folder, "tickets", start):
            out.extend(read_journal(os.path.join(self.folder, f"tickets-{i}.log")))
        return out

    # ------------------------------------------------------------- writing
    def journal_entry(self, entry) -> None:
        """Appends one clock entry (a ticket's or a sum's JSON) to the journal (home shard; called
        under the clock's lock)."""
        line = (json.dumps(entry) + "\n").encode()
        with self._lock:
            self._tickets.write([line])
            self._tickets_since_sync += 1
            if self._config.fsync_due(self._tickets_since_sync):  # the step log's policy
                self._tickets.fsync()
                self._tickets_since_sync = 0

    def log_step(self, record, grads: list, release: Optional[Callable[[], None]] = None) -> None:
        """:meth:`begin_step` and :meth:`end_step` at once (a step whose update already ran)."""
        self.begin_step(grads)
        self.end_step(record, release)

    def begin_step(self, grads: list) -> None:
        """Starts appending the next step's gradient (arrays in tensor order, read but not
        changed by the update) in the background while the update runs; :meth:`end_step` or
        :meth:`abort_step` must follow, in call order."""
        self.log_records += 1
        self.log_bytes += sum(g.nbytes for g in grads)
        self._log_thread.submit(self._append_payload, grads)

    def end_step(self, record, release: Optional[Callable[[], None]] = None) -> None:
        """Completes the step begun last with ``record`` (flushed per the fsync policy), then calls
        ``release()`` (the gradient arrays may be reused from then on). :meth:`wait_logged`
        waits for it."""
        self._log_thread.submit(self._append_header, record, release)

    def abort_step(self) -> None:
        """The step begun last was not applied (its update failed): marks its record skipped."""
        self.log_records -= 1
        self._log_thread.submit(self._append_header, None, None)

    def _append_payload(self, grads: list) -> None:
        if self._log_error is not None:
            return
        try:
            self._steps.write_payload(grads)
        except BaseException as exc:  # noqa: BLE001 - every later wait_logged raises it
            log.exception("event=step_log_failed session=%s shard=%d", self._session, self._shard)
            self._fail(exc)

    def _append_header(self, record, release: Optional[Callable[[], None]]) -> None:
        try:
            if self._log_error is not None:
                return
            header = json.dumps(record.to_json() if record is not None else {"aborted": True}).encode()
            self._steps.write([_U32.pack(len(header)), header, _U32.pack(zlib.crc32(header)), _REC_END])
            if record is None:
                return
            self._records_since_sync += 1
            if self._config.fsync_due(self._records_since_sync):
                self._steps.fsync()
                self._records_since_sync = 0
        except BaseException as exc:  # noqa: BLE001 - every later wait_logged raises it
            log.exception("event=step_log_failed session=%s shard=%d", self._session, self._shard)
            self._fail(exc)
            return
        finally:
            if release is not None:
                release()
        with self._logged:
            self._logged_version = max(self._logged_version, record.version)
            self._logged.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._logged:
            self._log_error = exc
            self._logged.notify_all()

    def wait_logged(self, version: int) -> None:
        """Returns once the step of ``version`` is in the log (what acknowledging it waits for).

        Raises:
          OSError: the log could not be written (disk full, ...): the step cannot be acknowledged.
        """
        with self._logged:
            self._logged.wait_for(lambda: self._logged_version >= version or self._log_error is not None)
            if self._logged_version < version:
                raise OSError(f"session {self._session!r}: the step log on shard {self._shard} could not be "
                              f"written ({self._log_error}); step {version} is not durable")

    def _flush_log(self) -> None:
        """Waits until every queued record is written."""
        self._log_thread.submit(lambda: None).result()

    def checkpoint(self, progress, params: dict, opt_state: Any, clock_state_fn: Optional[Callable] = None,
                   wait: bool = False) -> bool:
        """Snapshots the state at ``progress.version`` and writes it in the background (before
        returning with ``wait``); later log records go to a fresh segment.

        The snapshot is a copy of the state in host buffers reused from one checkpoint to the
        next (:class:`_Snapshots`). One checkpoint is written at a time; one that is due while
        another is being written waits for it, and a newer one supersedes it.
        ``clock_state_fn(rotate)``: the home shard's clock state, taken with the ticket journal's
        rotation under the clock's lock. Returns True."""
        tree = self._snapshots.take({"params": params, "opt_state": opt_state})
        self._flush_log()  # the records before this version go to the segments the checkpoint replaces
        steps_from, closed = self._steps.rotate()
        closed_fds = [closed]
        self._records_since_sync = 0
        clock_state, tickets_from = None, 0
        if self._home and clock_state_fn is not None:
            rotated = []

            def rotate():
                with self._lock:
                    rotated.append(self._tickets.rotate())
                    self._tickets_since_sync = 0

            clock_state = clock_state_fn(rotate)
            tickets_from, closed = rotated[0]
            closed_fds.append(closed)
        self.log_records, self.log_bytes = 0, 0
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

    def _drain(self) -> None:
        """The writer thread: writes the pending checkpoint until there is none."""
        _yield_cpu_to_steps()
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
            _yield_cpu_to_steps()  # tensorstore's threads exist from the first write on
            self._snapshots.give_back(job[1])
            del job

    def _write(self, version: int, tree: dict, manifest: dict) -> None:
        import orbax.checkpoint as ocp

        started = time.monotonic()
        path = os.path.join(self.folder, f"checkpoint-{version}")
        closed_fds = manifest.pop("closed_fds")  # the segments this checkpoint replaces
        try:
            if os.path.exists(path):  # a checkpoint of this version without a manifest, or a re-save
                shutil.rmtree(path)
            # Uncompressed: zstd would cost more CPU than the step itself on a busy host; the
            # format is orbax's own (a StandardCheckpointHandler restores it).
            ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)).save(
                path, args=ocp.args.PyTreeSave(tree))
            manifest[_CHECKSUM] = [_checksum(a, _CHECKSUM) for a in _leaves(tree)]
            manifest["written_unix_s"] = time.time()
            _write_atomically(f"{path}.json", json.dumps(manifest).encode())
        except BaseException as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("event=checkpoint_failed session=%s shard=%d version=%d", self._session, self._shard,
                          version)
            _close_segments(closed_fds, flush=True)  # they stay the only copy of their steps
            raise
        _close_segments(closed_fds, flush=False)  # replaced by the committed checkpoint
        self._drop_older_than(version, manifest)
        self.durable_version = version
        self.checkpoint_seconds = time.monotonic() - started
        self.checkpoints_written += 1
        log.info("event=checkpoint_written session=%s shard=%d version=%d seconds=%.3f", self._session, self._shard,
                 version, self.checkpoint_seconds)

    def _drop_older_than(self, version: int, manifest: dict) -> None:
        for name in os.listdir(self.folder):
            match = _CHECKPOINT_RE.match(name)
            if match and int(match.group(1)) < version:
                os.unlink(os.path.join(self.folder, name))
                shutil.rmtree(os.path.join(self.folder, name[:-len(".json")]), ignore_errors=True)
        self._steps.drop_before(manifest["steps_from"])
        if self._tickets is not None:
            self._tickets.drop_before(manifest["tickets_from"])

    @property
    def log_writes_direct(self) -> bool:
        """The step log writes gradients with direct I/O now (``LogIO.DIRECT`` where it works)."""
        return self._steps is not None and self._steps.writes_direct

    @property
    def log_direct_bytes(self) -> int:
        """Gradient bytes the step log wrote with direct I/O since it was opened."""
        return self._steps.direct_bytes if self._steps is not None else 0

    @property
    def checkpoint_writing(self) -> bool:
        """A checkpoint is being written or waits to be."""
        return self._busy

    def wait(self) -> None:
        """Returns once no checkpoint is being written or waiting to be."""
        with self._done:
            self._done.wait_for(lambda: not self._busy)

    def close(self) -> None:
        self._log_thread.shutdown(wait=True)
        self.wait()
        self._writer.shutdown(wait=True)
        for segments in (self._steps, self._tickets):
            if segments is not None:
                segments.close()


# ------------------------------------------------------------------ for users
def load_checkpoint(root: str, session: str) -> dict:
    """A session's latest consistent checkpoint, for use in your own JAX program.

    Returns ``{"version": v, "params": {name: np.ndarray}, "opt_state": [state of shard 0, ...]}``
    where ``v`` is the newest version every shard of the session has a checkpoint of and each
    shard's ``opt_state`` is the optimizer's state over that shard's tensors (a pytree of NumPy
    arrays in the optimizer's own structure: rebuild it with ``optimizer.init`` on those tensors
    and ``jax.tree.unflatten``, or read it with orbax directly from
    ``DIR/sessions/<name>/shard-<i>/checkpoint-<v>``).

    Raises:
      FileNotFoundError: no such session, or a shard has no checkpoint.
      CorruptCheckpoint: a checkpoint's arrays do not match their checksums.
    """
    import orbax.checkpoint as ocp

    folder = session_dir(root, session)
    with open(os.path.join(folder, "session.json"), "rb") as fh:
        entry = json.loads(fh.read())
    shards = sorted(int(s) for s in entry["placement"])
    versions = []
    for index in shards:
        found = {int(m.group(1)) for m in map(_CHECKPOINT_RE.match, os.listdir(os.path.join(folder, f"shard-{index}")))
                 if m}
        versions.append(found)
    common = set.intersection(*versions) if versions else set()
    if not common:
        raise FileNotFoundError(f"session {session!r} has no checkpoint of one version on every shard in {folder}")
    version = max(common)
    params, states = {}, []
    for index in shards:
        path = os.path.join(folder, f"shard-{index}", f"checkpoint-{version}")
        with open(f"{path}.json", "rb") as fh:
            manifest = json.loads(fh.read())
        tree = ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(path)
        kind, expected = _manifest_checksums(manifest)
        sums = sorted(_checksum(x, kind) for x in _leaves(tree))
        if sums != sorted(expected):  # restored without the optimizer's structure: order may differ
            raise CorruptCheckpoint(f"checkpoint {path} does not match its checksums")
        params.update({k: np.asarray(v) for k, v in tree["params"].items()})
        states.append(tree["opt_state"])
    return {"version": version, "params": params, "opt_state": states}
