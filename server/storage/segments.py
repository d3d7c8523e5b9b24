"""Append-only log segments: the step log's and the ticket journal's files, and their records.

A step-log record (format 3)::

    "OSLC" | payload length (u64) | payload | header length (u32) | header JSON | CRC-32C (u32) | "OSLE"

The CRC-32C covers everything before it but the magic: the payload length, the payload (the
step's gradient, tensor after tensor, C order), the header length and the header (the step's
``StepRecord``). With direct I/O (``LogIO.DIRECT``) the record starts ``"OSLD"`` and its payload
is block aligned: zeros after the prefix up to the next multiple of :data:`BLOCK` bytes in the
file, and after each tensor up to the next multiple too (the zeros are not checksummed), so that
the tensors' page-aligned memory goes to the disk by DMA, without a copy. The payload is written
while the step's update runs and the header after it; a step whose update failed gets the header
``{"aborted": true}`` and is skipped on replay. Formats 1 and 2 wrote ``"OSLR"`` / ``"OSLA"``
records whose CRC (zlib's CRC-32) covered the header only; they are still read. Each segment
starts with its format header (:mod:`optserve.server.storage.format`); a journal segment with a
first line naming its format.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import re
import struct
import threading

import numpy as np

from optserve.server.storage.checksums import crc32c_extend
from optserve.server.storage.disk_health import log_write_failure
from optserve.server.storage.format import FORMAT_KEY, FORMAT_VERSION, SEGMENT_HEADER, SEGMENT_MAGIC

log = logging.getLogger(__name__)

REC_START, REC_END = b"OSLC", b"OSLE"
REC_ALIGNED = b"OSLD"  # a record written with direct I/O: its payload is block aligned
OLD_START, OLD_ALIGNED = b"OSLR", b"OSLA"  # formats 1 and 2: the CRC (zlib's) covers the header only
BLOCK = 4096  # direct I/O's unit: file offsets, lengths and memory addresses are multiples of it
PREFIX = struct.Struct("<4sQ")
U32 = struct.Struct("<I")
_ZEROS = memoryview(bytes(BLOCK))
_DIRECT_MAX = 1 << 30  # bytes per direct write call (one call writes at most ~2 GiB)
_SEGMENT_RE = re.compile(r"^(steps|tickets)-(\d+)\.log$")
_IOV_MAX = 1024  # buffers per writev call (Linux's IOV_MAX)
STEPS, TICKETS = "steps", "tickets"


def pad(offset: int) -> int:
    """Bytes from ``offset`` to the next multiple of :data:`BLOCK`."""
    return -offset % BLOCK


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if view.nbytes else 0


_checksummer: "concurrent.futures.ThreadPoolExecutor | None" = None
_checksummer_lock = threading.Lock()


def _checksum_async(first: bytes, views: list) -> concurrent.futures.Future:
    """The CRC-32C of ``first`` and then ``views``, computed on a thread of its own (the checksum
    releases the GIL): a payload's checksum runs while its bytes are being written."""
    global _checksummer
    with _checksummer_lock:
        if _checksummer is None:
            _checksummer = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="optserve-crc")

    def checksum() -> int:
        crc = crc32c_extend(0, first)
        for view in views:
            crc = crc32c_extend(crc, view)
        return crc

    return _checksummer.submit(checksum)


def segment_indices(folder: str, kind: str, start: int) -> list[int]:
    """The indices >= ``start`` of the ``kind`` segments in ``folder``, ascending."""
    found = []
    for name in os.listdir(folder):
        match = _SEGMENT_RE.match(name)
        if match and match.group(1) == kind and int(match.group(2)) >= start:
            found.append(int(match.group(2)))
    return sorted(found)


_KEEP_SIZE = 1  # fallocate's FALLOC_FL_KEEP_SIZE: reserve blocks past the end without growing the file
_fallocate = None


def _reserve(fd: int, offset: int, length: int) -> bool:
    """Reserves the file's blocks ``[offset, offset + length)`` without changing its size, so
    that writing them cannot fail for want of space; False where the filesystem (or the C
    library) cannot reserve. Raises OSError (ENOSPC, EDQUOT, EIO) when the space is not there."""
    global _fallocate
    if _fallocate is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _fallocate = libc.fallocate
            _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        except (OSError, AttributeError):
            _fallocate = False
    if _fallocate is False:
        return False
    if _fallocate(fd, _KEEP_SIZE, offset, length) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(code, os.strerror(code))


def segment_number(path: str) -> int:
    """The index ``k`` of a segment file ``<kind>-<k>.log``."""
    return int(_SEGMENT_RE.match(os.path.basename(path)).group(2))


def _format_header(kind: str) -> bytes:
    if kind == TICKETS:
        return (json.dumps({FORMAT_KEY: FORMAT_VERSION}) + "\n").encode()
    return SEGMENT_HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION)


class Segments:
    """Numbered append-only segment files ``<kind>-<k>.log`` in one folder.

    ``direct``: step payloads go to the disk with direct I/O where they can
    (:meth:`write_payload`); the segment is then written at offsets this object tracks (direct
    I/O does not mix with ``O_APPEND``), through two descriptors of the same file. Where the
    filesystem refuses direct I/O it is written through the page cache (logged at INFO with
    ``quiet_fallback``, the automatic mode's expected case, else WARNING).
    """

    def __init__(self, folder: str, kind: str, start: int, direct: bool = False, quiet_fallback: bool = False):
        self.folder, self.kind = folder, kind
        self._fallback_level = logging.INFO if quiet_fallback else logging.WARNING  # no direct I/O here
        self.index = start
        self.direct = direct
        self.direct_bytes = 0  # payload bytes written with direct I/O (this object's segments)
        self._crc = 0  # CRC-32C of the record begun last, so far
        self._record_at = 0  # the file offset where the record begun last starts
        self._reservable = True  # the filesystem reserves blocks (see reserve)
        self._direct_fd = -1
        self._open(start)

    def _open(self, index: int, fresh: bool = False) -> None:
        """Opens segment ``index`` for appending; ``fresh``: it must not exist yet (FileExistsError)."""
        path = self.path(index)
        exclusive = os.O_EXCL if fresh else 0
        if not self.direct:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | exclusive, 0o600)
            self._offset = None
        else:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | exclusive, 0o600)
            self._offset = os.fstat(self._fd).st_size
            try:
                self._direct_fd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
            except OSError as exc:  # e.g. a filesystem without direct I/O
                log.log(self._fallback_level, "event=step_log_direct_io_unavailable path=%s error=%s (writes go "
                        "through the page cache)", path, exc)
                self._direct_fd = -1
        if os.fstat(self._fd).st_size == 0:
            self.write([_format_header(self.kind)])
        self._record_at = os.fstat(self._fd).st_size if self._offset is None else self._offset

    def reserve(self, nbytes: int) -> None:
        """Makes sure the next ``nbytes`` bytes appended to the current segment (and what may be
        queued before them: up to ``nbytes`` more) can be written: their blocks are reserved on
        the disk now. A no-op where the filesystem cannot reserve (a write may then fail later).

        Raises:
          OSError: the disk has no room (ENOSPC, EDQUOT) or failed (EIO).
        """
        end = os.fstat(self._fd).st_size if self._offset is None else self._offset
        if self._reservable:
            self._reservable = _reserve(self._fd, end, 2 * nbytes)

    @property
    def writes_direct(self) -> bool:
        """Whether payloads go to the disk with direct I/O now."""
        return self._direct_fd >= 0

    def path(self, index: int) -> str:
        return os.path.join(self.folder, f"{self.kind}-{index}.log")

    def rotate(self) -> tuple[int, int]:
        """Opens the next segment; returns its index and the previous segment's file descriptor,
        which the caller flushes and closes (off the step path).

        Raises:
          OSError: the next segment could not be started (no room for its header, a failing
            disk): it is removed, and records go on to the current segment as before.
            FileExistsError: it exists already (written by a shard that replaced this one): it
            is left as it is.
        """
        before = (self._fd, self._direct_fd, self._offset, self._record_at)
        self._direct_fd = -1
        try:
            self._open(self.index + 1, fresh=True)
        except FileExistsError:  # another process (this shard's replacement) writes it: never touched here
            self._fd, self._direct_fd, self._offset, self._record_at = before
            raise
        except OSError:
            self._abandon_next(before[0])
            self._fd, self._direct_fd, self._offset, self._record_at = before
            raise
        if before[1] >= 0:
            os.close(before[1])
        self.index += 1
        return self.index, before[0]

    def _abandon_next(self, current_fd: int) -> None:
        """Closes and removes the segment a failed :meth:`rotate` began (whatever of it exists)."""
        for fd in {self._fd, self._direct_fd} - {current_fd, -1}:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(self.path(self.index + 1))
        except OSError:
            pass

    def _close_direct(self) -> None:
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1

    def write_payload(self, arrays: list) -> None:
        """Appends a step record's start: its prefix and the gradient ``arrays`` (C order)."""
        self._record_at = os.fstat(self._fd).st_size if self._offset is None else self._offset
        views = [memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B") for a in arrays]
        total = sum(view.nbytes for view in views)
        checksum = _checksum_async(PREFIX.pack(REC_START, total)[len(REC_START):], views)
        try:
            self._write_payload(views, total)
        finally:
            self._crc = checksum.result()

    def _write_payload(self, views: list, total: int) -> None:
        if not self.direct:
            self.write([PREFIX.pack(REC_START, total), *views])
            return
        prefix = PREFIX.pack(REC_ALIGNED, total)
        self.write([prefix, _ZEROS[:pad(self._offset + len(prefix))]])
        for view in views:
            bulk = view.nbytes - view.nbytes % BLOCK
            if bulk and self._direct_fd >= 0 and _address(view) % BLOCK == 0:
                done = self._write_direct(view[:bulk])
                view = view[done:]
            self.write([view, _ZEROS[:pad(self._offset + view.nbytes)]])

    def write_record_end(self, header: bytes) -> None:
        """Completes the record begun last with its ``header`` (JSON) and checksum."""
        length = U32.pack(len(header))
        crc = crc32c_extend(crc32c_extend(self._crc, length), header)
        self.write([length, header, U32.pack(crc), REC_END])

    def cut_record(self) -> None:
        """Cuts the record begun last off the segment (its write failed part way): the segment
        ends with the record before it again, and the next record is written where it began.

        Raises:
          OSError: the file could not be truncated (the disk still fails).
        """
        os.ftruncate(self._fd, self._record_at)
        if self._offset is not None:
            self._offset = self._record_at

    def _write_direct(self, view: memoryview) -> int:
        """Writes block-aligned ``view`` at the segment's end with direct I/O; returns the bytes
        written (fewer if direct I/O failed: the rest goes through the page cache)."""
        done = 0
        try:
            while done < view.nbytes:
                count = os.pwrite(self._direct_fd, view[done:done + _DIRECT_MAX], self._offset + done)
                done += count
                if count <= 0 or count % BLOCK:
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
        """Deletes this kind's segments numbered below ``index`` (a checkpoint replaced them)."""
        for name in os.listdir(self.folder):
            match = _SEGMENT_RE.match(name)
            if match and match.group(1) == self.kind and int(match.group(2)) < index:
                os.unlink(os.path.join(self.folder, name))


def close_segments(fds: list, flush: bool) -> None:
    """Closes closed-off log segments' descriptors, flushing them to the disk first when they
    still hold the only copy of their records (a checkpoint meant to replace them failed)."""
    for fd in fds:
        try:
            if flush:
                os.fsync(fd)
        except OSError as exc:  # the disk refusing: one line
            log_write_failure(log, "step_log_flush_failed", exc)
        finally:
            os.close(fd)
