"""Reading log segments back: the step log's records and the ticket journal's entries."""

from __future__ import annotations

import json
import logging
import os
import zlib
from typing import Callable, Iterator, Optional

from optserve.server.storage.format import (FORMAT_KEY, SEGMENT_HEADER, SEGMENT_MAGIC, CorruptCheckpoint,
                                            check_format)
from optserve.server.storage.checksums import crc32c_extend
from optserve.server.storage.segments import (OLD_ALIGNED, OLD_START, PREFIX, REC_ALIGNED, REC_END, REC_START, U32,
                                              pad)

log = logging.getLogger(__name__)

_MAGICS = (REC_START, REC_ALIGNED, OLD_START, OLD_ALIGNED)


def _skip_segment_header(fh, path: str) -> bool:
    """Positions ``fh`` at a step-log segment's first record, checking its format version;
    returns False if the segment ends inside its header (torn: it holds no record)."""
    head = fh.read(SEGMENT_HEADER.size)
    if not head or not SEGMENT_MAGIC.startswith(head[:len(SEGMENT_MAGIC)]):
        fh.seek(0)  # format 1: the first record starts the file
        return True
    if len(head) < SEGMENT_HEADER.size:
        return False
    check_format(path, SEGMENT_HEADER.unpack(head)[1])
    return True


class StepLogReader:
    """The records of one step-log segment, read in order.

    Iterating yields ``(record_json, grads)`` for each applied step (aborted ones are skipped),
    reading each record's gradient into fresh buffers from ``arrays()`` (name -> array, in tensor
    order) and checking its checksum. A record torn by a crash at the end of the segment ends the
    iteration; :attr:`torn_at` is then its byte offset (None: the segment ended cleanly).

    Raises (while iterating):
      CorruptCheckpoint: a damaged record before the segment's end (naming the file and byte).
      UnsupportedFormat: the segment was written in a newer format.
    """

    def __init__(self, path: str, arrays: Callable[[], dict]):
        self.path = path
        self._arrays = arrays
        self.torn_at: Optional[int] = None
        self.last_at = 0  # byte offset of the record yielded last
        self.records = 0  # records read (applied and aborted)

    def __iter__(self) -> Iterator[tuple[dict, dict]]:
        size = os.path.getsize(self.path)
        with open(self.path, "rb", buffering=0) as fh:
            if not _skip_segment_header(fh, self.path):
                self.torn_at = 0
                return
            while True:
                at = fh.tell()
                read = self._record(fh, at, size)
                if read is None:
                    return
                record, grads = read
                self.records += 1
                if not record.get("aborted"):  # a step whose update failed: never applied
                    self.last_at = at
                    yield record, grads

    def _record(self, fh, at: int, size: int) -> Optional[tuple[dict, dict]]:
        """The record at ``at`` (None: the end, or a torn tail, see :attr:`torn_at`)."""
        prefix = fh.read(PREFIX.size)
        if not prefix:
            return None
        if len(prefix) < PREFIX.size:
            return self._torn(at)
        magic, payload_len = PREFIX.unpack(prefix)
        if magic not in _MAGICS:
            raise CorruptCheckpoint(f"step log {self.path}: no record starts at byte {at}")
        grads = self._arrays()
        expected = sum(a.nbytes for a in grads.values())
        if payload_len != expected:
            raise CorruptCheckpoint(f"step log {self.path}: record at byte {at} holds {payload_len} gradient "
                                    f"bytes, the shard's tensors have {expected}")
        checksummed = magic in (REC_START, REC_ALIGNED)
        crc = crc32c_extend(0, prefix[len(magic):]) if checksummed else 0
        crc = _read_payload(fh, grads.values(), magic in (REC_ALIGNED, OLD_ALIGNED), crc if checksummed else None)
        if crc is False:
            return self._torn(at)
        header_len_raw = fh.read(U32.size)
        if len(header_len_raw) < U32.size:
            return self._torn(at)
        (header_len,) = U32.unpack(header_len_raw)
        tail = fh.read(header_len + U32.size + len(REC_END))
        if len(tail) < header_len + U32.size + len(REC_END):
            return self._torn(at)
        header, stored, end = tail[:header_len], U32.unpack(tail[header_len:header_len + 4])[0], tail[header_len + 4:]
        if checksummed:
            intact = stored == crc32c_extend(crc32c_extend(crc, header_len_raw), header)
        else:
            intact = stored == zlib.crc32(header)
        if end != REC_END or not intact:
            if fh.tell() < size:
                raise CorruptCheckpoint(f"step log {self.path}: record at byte {at} is damaged (its checksum does "
                                        f"not match)")
            return self._torn(at)
        return json.loads(header), grads

    def _torn(self, at: int) -> None:
        self.torn_at = at
        log.warning("event=step_log_torn_tail path=%s at=%d (an unacknowledged step)", self.path, at)
        return None


def read_step_log(path: str, arrays: Callable[[], dict], cut_torn: bool = False) -> Iterator[tuple[dict, dict]]:
    """Yields ``(record_json, grads)`` from a step-log segment (see :class:`StepLogReader`). With
    ``cut_torn``, a torn tail is cut off the file once the records before it were read (so that
    the log on disk ends with its last whole record)."""
    reader = StepLogReader(path, arrays)
    yield from reader
    if cut_torn and reader.torn_at is not None:
        os.truncate(path, reader.torn_at)
        log.warning("event=step_log_torn_tail_cut path=%s at=%d", path, reader.torn_at)


def _read_payload(fh, arrays, aligned: bool, crc: Optional[int]):
    """Reads a record's payload into ``arrays`` (skipping an aligned record's padding), extending
    ``crc`` over the tensors' bytes (None: no checksum). Returns the checksum (True when ``crc``
    is None), or False if the payload was not all there."""
    if aligned and not _skip(fh, pad(fh.tell())):
        return False
    for array in arrays:
        target = memoryview(array.reshape(-1)).cast("B")
        if read_fully(fh, target) < target.nbytes or (aligned and not _skip(fh, pad(fh.tell()))):
            return False
        if crc is not None:
            crc = crc32c_extend(crc, target)
    return True if crc is None else crc


def _skip(fh, count: int) -> bool:
    return len(fh.read(count)) == count if count else True


def read_fully(fh, target: memoryview) -> int:
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
    """The entries (tickets' and sums' JSON) of a journal segment; a torn last line is dropped.

    Raises:
      CorruptCheckpoint: a damaged line before the last.
      UnsupportedFormat: the segment was written in a newer format.
    """
    out = []
    with open(path, "rb") as fh:
        for number, line in enumerate(fh):
            if not line.endswith(b"\n"):
                break
            try:
                entry = json.loads(line)
            except ValueError:
                raise CorruptCheckpoint(f"ticket journal {path}: line {number + 1} is damaged") from None
            if number == 0 and isinstance(entry, dict) and FORMAT_KEY in entry:
                check_format(path, entry[FORMAT_KEY])
                continue
            out.append(entry)
    return out
