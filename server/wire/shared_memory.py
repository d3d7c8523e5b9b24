"""A shard's side of the same-host fast path: probe offers, per-client data regions, cleanup.

The contract (names, layout, OS calls) is :mod:`optserve.protos.shared_memory`. The shard owns
every region it serves: it creates them, unlinks their names within ``NAME_TTL_S`` (the client
unlinks them as soon as it has mapped them), and unmaps them when the session closes (its
:class:`~optserve.server.domain.shard.shard_session.ShardSession` is no longer the registry's), when
the client closes them, when the client process is gone (it holds a shared lock on the region
while it lives: :func:`~optserve.protos.shared_memory.peer_alive`), or when they go unused for
``idle_s``. A reaper thread checks every ``sweep_s``.

A region is read only while serving a step message that names it with the right nonce; the
gradients are read through the same :class:`~optserve.server.domain.shard.assembly.TensorAssembler`
as chunks (validation, finiteness, staging in pooled buffers), so a region written without its
step, or a client killed while writing it, applies nothing.

On an accelerator the shard maps each region for its device's DMA while the region lives
(:class:`~optserve.server.compute.host_link.HostLink`): the gradients go up at the link's speed
(no bounce buffer), and a reply goes from the device into the region in one transfer per tensor
(:func:`reply_into`), under the session's lock so that no step donates the buffers meanwhile.
"""

from __future__ import annotations

import dataclasses
import gc
import hmac
import logging
import mmap
import os
import secrets
import threading
import time
from typing import Any, Iterator, Mapping, Optional

import numpy as np

from optserve.protos import chunk_codec
from optserve.protos import shared_memory as shm
from optserve.server.domain.errors import InvalidArgument, NotFound, PermissionDenied
from optserve.server.domain.shard import ShardRegistry, ShardSession, parallel_copy

_log = logging.getLogger(__name__)

OFFER_TTL_S = 10.0


@dataclasses.dataclass
class _Offer:
    session: ShardSession
    client_id: str
    probe: str
    mapping: mmap.mmap
    nonce: bytes
    created: float


class Region:
    """One client's data region of one session on this shard; ``link``: the shard device's
    :class:`~optserve.server.compute.host_link.HostLink` (an accelerator), which maps the region
    for its DMA while the region lives, or None (a CPU shard reads and writes it in place)."""

    def __init__(self, session: ShardSession, client_id: str, nonce: bytes, name: str, mapping: mmap.mmap,
                 fd: int, layout: shm.Layout, link=None):
        self.session = session
        self.client_id = client_id
        self.nonce = nonce
        self.name = name
        self.layout = layout
        self.created = self.last_used = time.monotonic()
        self.name_unlinked = False
        self._mapping = mapping
        self._fd = fd  # the client's shared lock on this file says it is alive (shm.peer_alive)
        self.used = False
        self._link = None  # set while the region is mapped for the device
        self._address = 0
        self._link_lock = threading.Lock()  # a copy into the region and its unmapping never overlap
        self._device_reads = 0  # pushes whose gradients the device may be reading from the region
        self._closing = False  # closed while such a read went on: the last one unmaps (guarded by _link_lock)
        if link is not None:
            self._map_for(link)

    def _map_for(self, link) -> None:
        """Maps the region for ``link``'s device (host <-> device copies at the link's speed); a
        region the device cannot map keeps working through XLA's own copies (logged in one line)."""
        view = np.frombuffer(self._mapping, np.uint8)
        address = view.ctypes.data
        del view  # an export held would keep the mapping from closing
        try:
            link.map(address, shm.page_span(len(self._mapping)))
        except Exception as error:  # noqa: BLE001 - any refusal leaves the slower path, which works
            _log.warning("event=shm_region_not_mapped region=%s device=%s reason=%s", self.name, link.device,
                         _one_line(error))
            return
        self._link, self._address = link, address

    def begin_device_read(self) -> None:
        """A push starts reading its gradients from the region (the device may copy them up until
        :meth:`end_device_read`): the region stays mapped for the device until then, closed or not."""
        with self._link_lock:
            self._device_reads += 1

    def end_device_read(self) -> None:
        with self._link_lock:
            self._device_reads -= 1
            if self._closing and not self._device_reads:
                self._unmap_locked()

    def _unmap_locked(self) -> None:
        if self._link is not None:
            try:
                self._link.unmap(self._address)
            except Exception as error:  # noqa: BLE001 - the memory is unmapped all the same
                _log.warning("event=shm_region_unmap_failed region=%s reason=%s", self.name,
                             _one_line(error))
            self._link = None

    @property
    def device_writable(self) -> bool:
        """Whether :meth:`write_device_params` can write the reply part (mapped for the device)."""
        return self._link is not None

    def gradient_chunks(self) -> Iterator[chunk_codec.ChunkView]:
        """The push part as chunks (views into the region, read by the assembler once)."""
        view = self._view()
        for slot in self.layout.push:
            yield chunk_codec.ChunkView(slot.name, slot.dtype, slot.shape, 0,
                                        view[slot.offset: slot.offset + slot.nbytes])

    def parameter_chunks(self) -> Iterator[chunk_codec.ChunkView]:
        """The reply part as chunks, each tensor in its own dtype (a session's initial values)."""
        view = self._view()
        for slot in self.layout.reply:
            yield chunk_codec.ChunkView(slot.name, slot.dtype, slot.shape, 0,
                                        view[slot.offset: slot.offset + slot.nbytes])

    def _view(self) -> memoryview:
        """The whole region; NotFound (``REGION_UNKNOWN``) if it was closed meanwhile."""
        try:
            return memoryview(self._mapping)
        except ValueError:
            if self._mapping.closed:
                raise NotFound(f"{shm.REGION_UNKNOWN}: {self.name!r} was closed while its step used it "
                               "(its client gone)") from None
            raise

    def write_params(self, params: Mapping[str, np.ndarray]) -> int:
        """Writes the parameters into the reply part (one copy each); returns the bytes written.

        Raises:
          NotFound: (``REGION_UNKNOWN``) the region was closed meanwhile (its client gone, or
            reaped): a step whose client left, answered to nobody, not a fault.
        """
        written = 0
        for slot in self.layout.reply:
            target = np.frombuffer(self._view(), np.uint8, slot.nbytes, slot.offset)
            try:
                parallel_copy(target, params[slot.name])
            finally:
                del target  # a view held (by a traceback) would keep the region from closing
            written += slot.nbytes
        return written

    def write_device_params(self, params: Mapping[str, Any]) -> int:
        """Writes device ``params`` (by name, each in its tensor's dtype) into the reply
        part, one device-to-host transfer each; returns the bytes written. The arrays must not be
        donated before this returns (the caller holds the session's lock).

        Raises:
          NotFound: (``REGION_UNKNOWN``) the region was closed meanwhile (as :meth:`write_params`).
        """
        with self._link_lock:
            view = self._view()  # held while the copies land: the mapping cannot go meanwhile
            try:
                if self._link is None or self._closing:
                    raise NotFound(f"{shm.REGION_UNKNOWN}: {self.name!r} was closed while its step used it "
                                   "(its client gone)")
                pieces = []
                for slot in self.layout.reply:
                    value = params[slot.name]
                    if value.nbytes != slot.nbytes:
                        raise InvalidArgument(f"tensor {slot.name!r}: {value.nbytes} bytes on the device, "
                                              f"{slot.nbytes} in the region's reply slot")
                    pieces.append((self._address + slot.offset, value))
                return self._link.copy_down(pieces)
            finally:
                del view

    def close(self) -> None:
        with self._link_lock:
            self._closing = True
            if not self._device_reads:  # else the last read unmaps: its views keep the memory mapped
                self._unmap_locked()
        if not self.name_unlinked:
            shm.unlink(self.name)
            self.name_unlinked = True
        try:
            self._mapping.close()
        except BufferError:  # a step's gradients read in place may still be held by a reference cycle
            gc.collect()
            shm.close_quietly(self._mapping)  # else unmapped when the last view goes
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def client_gone(self) -> bool:
        """The client closed the region or died (it no longer holds its lock); asked only once
        the client had time to take it (after its first step or ``NAME_TTL_S``)."""
        settled = self.used or time.monotonic() - self.created > shm.NAME_TTL_S
        return settled and self._fd >= 0 and not shm.peer_alive(self._fd)


class RegionTable:
    """The shard's offers and data regions (thread-safe).

    Args:
      registry: the shard's sessions (a region whose session left it is dropped).
      idle_s: a region unused this long is dropped (its client went away).
      sweep_s: how often the reaper thread checks.
    """

    def __init__(self, registry: ShardRegistry, idle_s: float = 600.0, sweep_s: float = 2.0):
        self._registry = registry
        self._idle_s = idle_s
        self._offers: dict[str, _Offer] = {}
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        shm.sweep_stale()  # names left by a process that died mid-handshake (e.g. this shard's predecessor)
        self._reaper = threading.Thread(target=self._reap_forever, args=(sweep_s,), daemon=True,
                                        name="optserve-shm-reaper")
        self._reaper.start()

    # ------------------------------------------------------------- handshake
    def offer(self, session: ShardSession, client_id: str) -> tuple[str, str]:
        """Creates a probe region holding a fresh nonce; returns (offer id, probe name)."""
        if not client_id:
            raise InvalidArgument("OfferSharedMemory: client_id must be non-empty")
        if not shm.available():
            raise NotFound(f"shared memory is not available on this shard ({shm.SHM_DIR})")
        nonce = secrets.token_bytes(shm.NONCE_BYTES)
        probe, mapping = shm.create(shm.NONCE_BYTES)
        mapping[:] = nonce
        offer_id = secrets.token_hex(16)
        with self._lock:
            self._offers[offer_id] = _Offer(session, client_id, probe, mapping, nonce, time.monotonic())
        return offer_id, probe

    def open(self, session: ShardSession, client_id: str, offer_id: str, nonce: bytes) -> Region:
        """Checks the nonce read back from the probe and creates the client's data region."""
        with self._lock:
            offer = self._offers.pop(offer_id, None)
        if offer is None:
            raise NotFound(f"shared memory offer {offer_id!r} is unknown or expired")
        _drop_offer(offer)
        if offer.session is not session or offer.client_id != client_id:
            raise PermissionDenied("shared memory offer was made to another client or session")
        if not hmac.compare_digest(offer.nonce, bytes(nonce)):
            raise PermissionDenied("shared memory nonce does not match the offer: the region is not used")
        layout = shm.layout([(s.name, s.dtype.value, s.shape) for s in session.specs.values()])
        name, mapping, fd = shm.create(layout.size, keep_fd=True)
        region = Region(session, client_id, offer.nonce, name, mapping, fd, layout, session.device_plane.host_link)
        with self._lock:
            self._regions[secrets.token_hex(16)] = region
        return region

    def region_id(self, region: Region) -> str:
        with self._lock:
            return next(key for key, value in self._regions.items() if value is region)

    def close(self, session: ShardSession, region_id: str) -> bool:
        with self._lock:
            region = self._regions.get(region_id)
            if region is None or region.session is not session:
                return False
            del self._regions[region_id]
        region.close()
        return True

    # ------------------------------------------------------------- steps
    def use(self, session: ShardSession, client_id: Optional[str], step) -> "Region":
        """The region a step (``SharedMemoryStep``) names, after checking that it is this
        session's and client's (``None``: a pull, which names no client) and that the nonce
        matches; marks it used."""
        with self._lock:
            region = self._regions.get(step.region)
        if region is None or region.session is not session:
            raise NotFound(f"{shm.REGION_UNKNOWN}: {step.region!r} (expired, closed, or another session's)")
        if (client_id is not None and region.client_id != client_id) or not hmac.compare_digest(region.nonce, bytes(step.nonce)):
            raise PermissionDenied("shared memory step: wrong nonce or client for the region; nothing was read")
        region.last_used = time.monotonic()
        region.used = True
        return region

    def count(self) -> int:
        with self._lock:
            return len(self._regions)

    # ------------------------------------------------------------- cleanup
    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            offers, regions = list(self._offers.values()), list(self._regions.values())
            self._offers.clear()
            self._regions.clear()
        for offer in offers:
            _drop_offer(offer)
        for region in regions:
            region.close()

    def reap(self) -> None:
        """Drops expired offers, regions of closed sessions and idle regions; unlinks names past
        their time to live."""
        now = time.monotonic()
        live = {id(s) for s in self._registry.sessions()}
        with self._lock:
            offers = [k for k, o in self._offers.items()
                      if now - o.created > OFFER_TTL_S or id(o.session) not in live]
            dropped_offers = [self._offers.pop(k) for k in offers]
            gone = [k for k, r in self._regions.items()
                    if id(r.session) not in live or now - r.last_used > self._idle_s or r.client_gone()]
            dropped = [self._regions.pop(k) for k in gone]
            naming = [r for r in self._regions.values() if not r.name_unlinked and now - r.created > shm.NAME_TTL_S]
        for offer in dropped_offers:
            _drop_offer(offer)
        for region in dropped:
            region.close()
        for region in naming:
            shm.unlink(region.name)
            region.name_unlinked = True

    def _reap_forever(self, sweep_s: float) -> None:
        while not self._stop.wait(sweep_s):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the reaper must keep running
                _log.exception("event=shm_reap_failed")


def _one_line(error: BaseException) -> str:
    """``error``'s message on one line, at most 300 characters (for a log line's ``reason=``)."""
    return " ".join(str(error).split())[:300]


def reply_into(session: ShardSession, region: Region, evaluation: bool = False) -> tuple[int, int]:
    """Writes ``session``'s current parameters (``evaluation``: those to evaluate with) into
    ``region``'s reply part: from the device in one transfer each where the region is mapped for
    it, else from their host views (one copy each). Returns ``(version, bytes written)``.

    Raises:
      NotFound: (``REGION_UNKNOWN``) the region was closed meanwhile (its client gone).
    """
    if region.device_writable and not evaluation:
        try:
            return session.device_plane.read_params(region.write_device_params)
        except RuntimeError as error:  # a CUDA call failed: the host copy below still answers
            _log.warning("event=shm_device_reply_failed region=%s reason=%s", region.name,
                         _one_line(error))
    version, params = session.snapshot(evaluation)
    try:
        return version, region.write_params(params)
    finally:
        del params  # a held view would stop the next update from donating the shard's buffers


def _drop_offer(offer: _Offer) -> None:
    shm.unlink(offer.probe)
    shm.close_quietly(offer.mapping)
