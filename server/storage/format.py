"""The on-disk format's version, and the errors of reading what is on disk.

Every file a durable server writes carries the format version it was written in:

* ``session.json`` (the catalog entry) and each checkpoint manifest: the key ``"format"``;
* each step-log segment: a segment header, :data:`SEGMENT_MAGIC` then the version (u32, little
  endian), before its first record;
* each ticket-journal segment: a first line ``{"format": <version>}``.

Format 1 is what optserve wrote before versions existed: no key, no segment header, no first
line. Readers take every version from 1 to :data:`FORMAT_VERSION`; a newer one is refused with
:class:`UnsupportedFormat` naming the file and both versions (a checkpoint folder written by a
newer optserve is never half-read by an older one).
"""

from __future__ import annotations

import struct

FORMAT_VERSION = 3
"""The version this optserve writes. 1: no version marker (the first format); 2: markers; 3: each
step-log record's CRC-32C covers its payload too (:mod:`optserve.server.storage.segments`)."""

SEGMENT_MAGIC = b"OSLF"
SEGMENT_HEADER = struct.Struct("<4sI")  # magic, format version
FORMAT_KEY = "format"


class CorruptCheckpoint(Exception):
    """A checkpoint or log on disk is damaged (the message names the file)."""


class UnsupportedFormat(CorruptCheckpoint):
    """A file was written in a format version this optserve does not read (a newer optserve's)."""


def check_format(path: str, found: int) -> int:
    """Returns ``found`` (a file's format version) if this optserve reads it.

    Raises:
      UnsupportedFormat: ``found`` is not a version from 1 to :data:`FORMAT_VERSION`.
    """
    if not isinstance(found, int) or isinstance(found, bool) or not 1 <= found <= FORMAT_VERSION:
        raise UnsupportedFormat(f"{path} is in on-disk format version {found!r}; this optserve reads format versions "
                                f"1 to {FORMAT_VERSION} (a newer optserve wrote it: run that version)")
    return found


def format_of(path: str, document: dict) -> int:
    """The format version of a JSON document (catalog entry, manifest); 1 without the key."""
    return check_format(path, document.get(FORMAT_KEY, 1))
