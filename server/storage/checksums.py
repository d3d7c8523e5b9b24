"""Checksums of what storage writes: CRC-32C (google-crc32c: hardware instructions where the CPU
has them), and zlib's CRC-32 for files written before it."""

from __future__ import annotations

import zlib

import numpy as np


def crc32c_extend(crc: int, data) -> int:
    """``crc`` extended over ``data`` (any bytes-like object or array, read as its raw bytes)."""
    import google_crc32c

    if isinstance(data, (bytes, np.ndarray)):
        return google_crc32c.extend(crc, data)
    return google_crc32c.extend(crc, np.frombuffer(data, np.uint8))


def array_checksum(array, kind: str = "crc32c") -> int:
    """The checksum of an array's bytes in C order: ``"crc32c"``, or ``"crc32"`` (zlib's)."""
    values = np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)
    if kind == "crc32":
        return zlib.crc32(values)
    return crc32c_extend(0, values)
