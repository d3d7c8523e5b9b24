"""SparseLoCo gradients on the wire: the top entries of each chunk, their values in a few bits.

SparseLoCo (Sarfi et al., 2025) sends, of each chunk of a tensor, the ``topk`` entries of
largest magnitude; their values are quantised to ``bits`` bits and decoded through a small table.

Chunks (:class:`Tiling`):
- a matrix (2-D, R x C) is cut into ``chunk x chunk`` tiles, row-major; the last tile row and
  column are ragged when R or C is not a multiple of ``chunk``. An entry's index is its position in
  the full ``chunk x chunk`` tile, row-major (``r * chunk + c``), also in a ragged tile, whose
  cells past the tensor's edge are never named;
- anything else (a vector, a scalar, a tensor of three or more dims) is flat, cut into pieces of
  ``chunk`` elements (the last one ragged); an entry's index is its position in the piece.

A chunk of ``n`` elements sends ``min(topk, n)`` entries, in ascending index order.

Values (:func:`quantize`): with ``bits`` of 32 the entries' float32 values travel as they are.
Otherwise, over all entries of one tensor: ``shift = mean(v)``, ``c = v - shift``,
``scale = QUANTIZATION_RANGE * std(c) / L`` with ``L = 2**bits`` levels (1 where that is 0 or not
finite), ``code = clip(rint(c / scale + L / 2), 0, L - 1)``; the decoding table holds per code the
mean of the values that got it (``shift`` for a code nobody got), and an entry decodes to
``table[code]``, float32, on both sides alike (the sender's error feedback subtracts exactly what
the receiver adds).

A chunk message (wire dtype :data:`~optserve.protos.contract.SPARSE`) carries whole tile rows of a
matrix, or whole pieces of a flat tensor: ``offset`` is its first element, and ``data`` is
:data:`HEADER` (chunk, topk, bits, elements covered), the float32 table (``L`` entries; none for
32 bits), the indices packed in ``index_bits`` bits each and the codes in ``bits`` bits each (or the
float32 values), each part little-endian and padded to whole bytes. Its length follows from the
header and the tensor's shape; :func:`decode_into` checks every part and raises ``ValueError``
naming what is wrong. NumPy only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import struct
from typing import Callable, Iterator, Optional, Sequence, TypeVar

import numpy as np

HEADER = struct.Struct("<HHB3xQ")  # chunk, topk, bits, elements the message covers
MAX_CHUNK = 256  # indices of a tile fit 16 bits
QUANTIZATION_RANGE = 6.0  # standard deviations the levels span (the reference's range)
VALUE_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 32)
PARALLEL_THREADS = 8  # at most, and at most the machine's cores: each holds a few copies of its tensor
PARALLEL_ELEMENTS = 1 << 20  # tensors smaller together are handled on the calling thread
PARALLEL_IN_FLIGHT = 1 << 26  # elements of tensors handled at once, at most (their temporaries: ~1 GiB)
_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The chunks of a tensor of ``shape`` at ``chunk`` (see the module docstring)."""

    shape: tuple[int, ...]
    chunk: int

    @property
    def matrix(self) -> bool:
        return len(self.shape) == 2

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def index_bits(self) -> int:
        cells = self.chunk * self.chunk if self.matrix else self.chunk
        return max(1, (cells - 1).bit_length())

    @property
    def band_elements(self) -> int:
        """Elements of one band (a tile row of a matrix, a piece of a flat tensor); the last may be short."""
        return self.chunk * self.shape[1] if self.matrix else self.chunk

    @property
    def bands(self) -> int:
        rows = self.shape[0] if self.matrix else self.size
        return -(-rows // self.chunk)

    @property
    def tiles_per_band(self) -> int:
        return -(-self.shape[1] // self.chunk) if self.matrix else 1

    def tile_shapes(self, band_start: int, band_stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(height, width) of each tile of bands ``[band_start, band_stop)``, tile-major (a flat
        tensor's piece: height 1)."""
        c = self.chunk
        bands = np.arange(band_start, band_stop, dtype=np.int64)
        if not self.matrix:
            return np.ones(len(bands), np.int64), np.minimum(c, self.size - bands * c)
        rows, cols = self.shape
        widths = np.minimum(c, cols - np.arange(self.tiles_per_band, dtype=np.int64) * c)
        heights = np.minimum(c, rows - bands * c)
        return np.repeat(heights, len(widths)), np.tile(widths, len(bands))

    def entries(self, band_start: int, band_stop: int, topk: int) -> np.ndarray:
        """Entries per tile of bands ``[band_start, band_stop)``, tile-major."""
        heights, widths = self.tile_shapes(band_start, band_stop)
        return np.minimum(topk, heights * widths)

    def tiles(self, values: np.ndarray, fill: float) -> np.ndarray:
        """``values`` (of ``shape``) as one row per tile (tile-major), cells past the edge ``fill``."""
        c = self.chunk
        if self.matrix:
            rows, cols = self.shape
            tr, tc = -(-rows // c), -(-cols // c)
            padded = np.full((tr * c, tc * c), fill, np.float32)
            padded[:rows, :cols] = values
            return padded.reshape(tr, c, tc, c).transpose(0, 2, 1, 3).reshape(tr * tc, c * c)
        flat = values.reshape(-1)
        padded = np.full(self.bands * c, fill, np.float32)
        padded[:flat.size] = flat
        return padded.reshape(self.bands, c)

    def positions(self, tile: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Flat element positions of entries (``tile``: tile-major number, ``index``: in-tile index)."""
        c = self.chunk
        if not self.matrix:
            return tile.astype(np.int64) * c + index
        cols = self.shape[1]
        tc = -(-cols // c)
        row = (tile // tc) * c + index // c
        col = (tile % tc) * c + index % c
        return row.astype(np.int64) * cols + col


@dataclasses.dataclass
class SparseGradient:
    """One tensor's SparseLoCo selection, ready for the wire.

    ``shape``; ``chunk``, ``topk``, ``bits``: the encoding; ``counts``: entries per tile
    (tile-major); ``indices``: in-tile index per entry (uint16); ``codes``: per entry, uint8 codes
    (or float32 values when ``bits`` is 32); ``table``: float32 decoding table (empty for 32 bits).
    """

    shape: tuple[int, ...]
    chunk: int
    topk: int
    bits: int
    counts: np.ndarray
    indices: np.ndarray
    codes: np.ndarray
    table: np.ndarray

    @property
    def tiling(self) -> Tiling:
        return Tiling(self.shape, self.chunk)

    def decoded(self) -> np.ndarray:
        """The entries' values as the receiver decodes them (float32, entry order)."""
        return self.codes if self.bits == 32 else self.table[self.codes]

    def positions(self) -> np.ndarray:
        """Flat element positions of the entries."""
        tile = np.repeat(np.arange(len(self.counts)), self.counts)
        return self.tiling.positions(tile, self.indices.astype(np.int64))

    def dense(self) -> np.ndarray:
        """The decoded gradient (zeros where nothing was sent), of ``shape``."""
        out = np.zeros(self.tiling.size, np.float32)
        out[self.positions()] = self.decoded()
        return out.reshape(self.shape)

    def payloads(self, max_bytes: int) -> Iterator[tuple[int, bytes]]:
        """``(first element, data)`` of the chunk messages: whole bands, at most ``max_bytes``
        each where a band fits (a band larger than that travels alone)."""
        for first, elements, entries in self._messages(max_bytes):
            yield first, self._payload(elements, entries, self.tiling.index_bits)

    def wire_bytes(self, max_bytes: int) -> int:
        """The bytes of :meth:`payloads`' data, counted without building them."""
        return sum(_payload_bytes(self.bits, entries.stop - entries.start, self.tiling.index_bits)
                   for _, _, entries in self._messages(max_bytes))

    def _messages(self, max_bytes: int) -> Iterator[tuple[int, int, slice]]:
        """``(first element, elements, entries)`` of each chunk message: as many whole bands as fit
        in ``max_bytes`` (at least one), found per message, not per band."""
        tiling = self.tiling
        if not tiling.size:
            return
        tiles_per_band = tiling.tiles_per_band
        band_entries = np.add.reduceat(self.counts, np.arange(0, len(self.counts), tiles_per_band)) \
            if len(self.counts) else np.zeros(tiling.bands, np.int64)
        starts = np.concatenate([[0], np.cumsum(band_entries)])
        fit = _entries_fitting(self.bits, max_bytes, tiling.index_bits)
        band, bands = 0, tiling.bands
        while band < bands:
            stop = max(band + 1, int(np.searchsorted(starts, starts[band] + fit, side="right")) - 1)
            stop = min(stop, bands)
            first, last = band * tiling.band_elements, min(stop * tiling.band_elements, tiling.size)
            yield first, last - first, slice(int(starts[band]), int(starts[stop]))
            band = stop

    def _payload(self, elements: int, entries: slice, index_bits: int) -> bytes:
        values = self.codes[entries]
        packed_values = values.astype("<f4").tobytes() if self.bits == 32 else pack_bits(values, self.bits)
        return b"".join((HEADER.pack(self.chunk, self.topk, self.bits, elements), self.table.astype("<f4").tobytes(),
                         pack_bits(self.indices[entries], index_bits), packed_values))


def _entries_fitting(bits: int, max_bytes: int, index_bits: int) -> int:
    """The most entries whose chunk message takes at most ``max_bytes`` (0 if none does)."""
    fixed = HEADER.size + (0 if bits == 32 else 4 << bits)
    entries = max(0, (max_bytes - fixed) * 8 // (index_bits + bits))
    while entries and _payload_bytes(bits, entries, index_bits) > max_bytes:
        entries -= 1
    return entries


def _payload_bytes(bits: int, entries: int, index_bits: int) -> int:
    """A chunk message's bytes for ``entries`` entries."""
    values = entries * 4 if bits == 32 else (entries * bits + 7) // 8
    return HEADER.size + (0 if bits == 32 else 4 << bits) + (entries * index_bits + 7) // 8 + values


def select(values: np.ndarray, chunk: int, topk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per chunk of ``values`` (float32), its ``min(topk, n)`` entries of largest magnitude:
    ``(counts per tile, in-tile indices ascending per tile, their values)``."""
    tiling = Tiling(tuple(values.shape), chunk)
    tiles = tiling.tiles(values, 0.0)
    magnitude = tiling.tiles(np.abs(values), -1.0)  # cells past the edge: -1, never picked before a real one
    magnitude[np.isnan(magnitude)] = np.inf  # a NaN is sent (and refused by the receiver), never hidden
    k = min(topk, tiles.shape[1])
    picked = np.argpartition(-magnitude, k - 1, axis=1)[:, :k] if k < tiles.shape[1] else \
        np.broadcast_to(np.arange(k), (tiles.shape[0], k))
    picked = np.sort(picked, axis=1)
    real = np.take_along_axis(magnitude, picked, axis=1) >= 0
    counts = real.sum(axis=1)
    indices = picked[real].astype(np.uint16)
    chosen = np.take_along_axis(tiles, picked, axis=1)[real]
    return counts, indices, chosen.astype(np.float32)


def quantize(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, table)`` of float32 ``values`` at ``bits`` (see the module docstring); with 32
    bits the values themselves and an empty table."""
    values = np.asarray(values, np.float32)
    if bits == 32:
        return values.copy(), np.zeros(0, np.float32)
    levels = 1 << bits
    if values.size == 0:
        return np.zeros(0, np.uint8), np.zeros(levels, np.float32)
    shift = np.float32(values.mean(dtype=np.float64))
    centred = values - shift
    std = np.sqrt(np.sum(centred.astype(np.float64) ** 2) / (values.size - 1)) if values.size > 1 else 0.0
    scale = np.float32(QUANTIZATION_RANGE * std / levels)
    if not (np.isfinite(scale) and scale > 0):
        scale = np.float32(1.0)
    codes = np.clip(np.rint(centred / scale + np.float32(levels / 2)), 0, levels - 1).astype(np.uint8)
    sums = np.bincount(codes, weights=centred.astype(np.float64), minlength=levels)
    seen = np.bincount(codes, minlength=levels)
    table = (np.divide(sums, seen, out=np.zeros(levels), where=seen > 0) + np.float64(shift)).astype(np.float32)
    return codes, table


def encode(values: np.ndarray, chunk: int, topk: int, bits: int) -> SparseGradient:
    """The :class:`SparseGradient` of ``values`` (float32, any shape)."""
    values = np.asarray(values, np.float32)
    counts, indices, chosen = select(values, chunk, topk)
    codes, table = quantize(chosen, bits)
    return SparseGradient(tuple(values.shape), chunk, topk, bits, counts, indices, codes, table)


# ----------------------------------------------------------------------------------- decode
def decode_into(destination: np.ndarray, shape: tuple[int, ...], offset: int, data,
                support: Optional[list] = None) -> int:
    """Writes one chunk message's values into ``destination`` (float32, the tensor's flat values:
    zeros, then the sent entries, over the elements the message covers); returns how many
    elements it covers, and appends the sent entries' flat positions to ``support`` if given.
    Raises ``ValueError`` naming the bad part (nothing outside that range is written)."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise ValueError(f"sparse chunk of {len(view)} bytes is shorter than its {HEADER.size}-byte header")
    chunk, topk, bits, elements = HEADER.unpack_from(view)
    if not 1 <= chunk <= MAX_CHUNK or topk < 1 or bits not in VALUE_BITS:
        raise ValueError(f"sparse chunk header: chunk={chunk} (1..{MAX_CHUNK}), topk={topk} (>= 1), bits={bits} "
                         f"(one of {VALUE_BITS})")
    tiling = Tiling(tuple(int(s) for s in shape), chunk)
    band = tiling.band_elements
    if not band:
        raise ValueError(f"sparse chunk for a tensor of shape {list(shape)}, which has no elements to name")
    if offset % band or not 0 < elements <= tiling.size - offset or \
            (elements % band and offset + elements != tiling.size):
        raise ValueError(f"sparse chunk covers elements [{offset}, {offset + elements}): not whole bands of {band} "
                         f"elements (tile rows or pieces of {chunk}) within the tensor's {tiling.size}")
    counts = tiling.entries(offset // band, -(-(offset + elements) // band), topk)
    entries = int(counts.sum())
    table_bytes = 0 if bits == 32 else 4 << bits
    index_bytes = (entries * tiling.index_bits + 7) // 8
    want = _payload_bytes(bits, entries, tiling.index_bits)
    if len(view) != want:
        raise ValueError(f"sparse chunk of {len(view)} bytes; its header and the tensor's shape make {want} "
                         f"({entries} entries of topk={topk} in chunks of {chunk}, {bits} bits)")
    at = HEADER.size
    table = np.frombuffer(view, "<f4", table_bytes // 4, at).astype(np.float32)
    at += table_bytes
    indices = unpack_bits(view[at:at + index_bytes], entries, tiling.index_bits)
    at += index_bytes
    values = np.frombuffer(view, "<f4", entries, at).astype(np.float32) if bits == 32 else \
        table[unpack_bits(view[at:], entries, bits)]
    tile = np.repeat(np.arange(len(counts)), counts)
    _check_indices(tiling, offset // band, tile, indices)
    first_tile = (offset // band) * tiling.tiles_per_band
    out = destination[offset:offset + elements]
    out[:] = 0
    positions = tiling.positions(tile + first_tile, indices)
    out[positions - offset] = values
    if support is not None:
        support.append(positions)
    return elements


def _check_indices(tiling: Tiling, first_band: int, tile: np.ndarray, indices: np.ndarray) -> None:
    """Each entry's index names a cell of its tile, ascending within the tile (none twice)."""
    if not len(indices):
        return
    heights, widths = tiling.tile_shapes(first_band, first_band + int(tile[-1]) // tiling.tiles_per_band + 1)
    height, width = heights[tile], widths[tile]
    c = tiling.chunk
    row, col = (indices // c, indices % c) if tiling.matrix else (np.zeros_like(indices), indices)
    outside = (row >= height) | (col >= width)
    if outside.any():
        bad = int(np.argmax(outside))
        raise ValueError(f"sparse entry {bad}: index {int(indices[bad])} is outside its chunk "
                         f"({int(height[bad])} x {int(width[bad])} of {tiling.chunk})")
    step = np.diff(indices.astype(np.int64))
    same_tile = np.diff(tile) == 0
    if (same_tile & (step <= 0)).any():
        bad = int(np.argmax(same_tile & (step <= 0))) + 1
        raise ValueError(f"sparse entry {bad}: index {int(indices[bad])} repeats or is out of ascending order "
                         f"in its chunk")


# ----------------------------------------------------------------------------------- bit packing
def pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Unsigned ``values`` below ``2**bits``, ``bits`` each, little-endian bit order, padded to bytes."""
    values = np.asarray(values, np.uint32)
    if bits == 8:
        return values.astype(np.uint8).tobytes()
    planes = ((values[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_bits(data, count: int, bits: int) -> np.ndarray:
    """The inverse of :func:`pack_bits`: ``count`` values (uint8 up to 8 bits, else uint32)."""
    raw = np.frombuffer(data, np.uint8)
    if bits == 8:
        return raw[:count].copy()
    planes = np.unpackbits(raw, count=count * bits, bitorder="little").reshape(count, bits)
    values = np.zeros(count, np.uint32 if bits > 8 else np.uint8)  # a byte (or four) per value, not eight per bit
    for bit in range(bits):
        values |= planes[:, bit].astype(values.dtype) << values.dtype.type(bit)
    return values


# ----------------------------------------------------------------------------------- a step's parts
def split_parts(chunks) -> list[list[tuple[int, bytes]]]:
    """A reply's sparse chunks of one tensor, ``(offset, data)`` in the order they came, as the
    step's parts: each part's chunks cover the tensor once in ascending bands from offset 0, so a
    chunk at offset 0 starts the next part."""
    parts: list[list[tuple[int, bytes]]] = []
    for offset, data in chunks:
        if offset == 0 or not parts:
            parts.append([])
        parts[-1].append((offset, data))
    return parts


def apply_parts(base: np.ndarray, parts, over_senders: bool) -> np.ndarray:
    """``base`` minus the mean of a sync step's sparse ``parts`` of one tensor (each a list of
    ``(offset, data)`` chunks covering it), float32, computed as the step does it: the first
    part's values, each later part's added in turn, divided per entry by the parts that named it
    (``over_senders``) or by their number. Raises ``ValueError`` for a part that does not decode."""
    base = np.asarray(base, np.float32)
    total = np.empty(base.size, np.float32)
    counts = np.zeros(base.size, np.int32) if over_senders else None
    scratch = np.empty(base.size, np.float32)
    for index, part in enumerate(parts):
        target = total if index == 0 else scratch
        support: list = []
        covered = sum(decode_into(target, base.shape, offset, data, support) for offset, data in part)
        if covered != base.size:
            raise ValueError(f"a sparse part covers {covered} of {base.size} elements")
        if index:
            total += scratch
        if counts is not None:
            for positions in support:
                counts[positions] += 1
    if counts is None:
        total /= np.float32(len(parts))
    else:
        np.divide(total, counts.astype(np.float32), out=total, where=counts > 0)
    return (base.reshape(-1) - total).reshape(base.shape)


def tensor_map(fn: Callable[[_Item], _Result], items: Sequence[_Item], sizes: Sequence[int]) -> list[_Result]:
    """``[fn(item) for item in items]``, one call per tensor (``sizes``: each one's elements), on
    up to :data:`PARALLEL_THREADS` threads (and the machine's cores) when they hold more than
    :data:`PARALLEL_ELEMENTS` together: NumPy's selection, decoding and arithmetic run without the
    GIL. A call holds temporaries of a few times its tensor, so no more threads run than keep
    :data:`PARALLEL_IN_FLIGHT` elements of the largest tensor in flight (one, for tensors that
    large). Each call must touch its own tensor's buffers only; the first error raised, in order,
    is raised."""
    largest = max(sizes, default=0)
    threads = min(PARALLEL_THREADS, os.cpu_count() or 1, len(items), PARALLEL_IN_FLIGHT // max(largest, 1))
    if threads < 2 or sum(sizes) <= PARALLEL_ELEMENTS:
        return [fn(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="sparse-codec") as pool:
        return list(pool.map(fn, items))
