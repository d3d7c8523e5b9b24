"""The client's side of the same-host fast path: proving a shard's shared memory is reachable,
mapping the session's data regions, and moving tensors through them.

The contract (names, layout, OS calls) is :mod:`optserve.protos.shared_memory`; the handshake
is data.proto's ``OfferSharedMemory`` / ``OpenSharedMemory``. A region is used for a shard only
after this process read the nonce the shard wrote into its probe region and the shard accepted
it; ``shared_memory="auto"`` falls back to gRPC bytes, silently, for a shard where any step of
that fails (another host, another mount namespace or user, an older shard).

The client creates no region: it maps what its shards made and unlinks their names at once, so
nothing stays in ``/dev/shm`` whichever process dies; its mappings go when the session object
is detached, closed or collected (or the process exits).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Callable, Mapping, Optional, Sequence, Union

import grpc
import numpy as np

from optserve.client import _wire
from optserve.client.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from optserve.protos import contract
from optserve.protos import shared_memory as shm
from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc

SharedMemoryArg = Union[bool, str]
_swept = False


def check_mode(value: SharedMemoryArg) -> SharedMemoryArg:
    """``Client(shared_memory=...)``: "auto", True or False."""
    if value is True or value is False or value == "auto":
        return value
    raise InvalidArgumentError(f"shared_memory: must be 'auto', True or False, got {value!r}")


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype and a.flags.c_contiguous
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


class ShardRegion:
    """One shard's data region for one session object: gradients in, parameters out."""

    def __init__(self, shard_index: int, region_id: str, nonce: bytes, mapping, fd: int, layout: shm.Layout):
        self.shard_index = shard_index
        self.region_id = region_id
        self._nonce = nonce
        self._mapping = mapping
        self._fd = fd  # holds the shared lock that tells the shard this process uses the region
        self.lock = threading.Lock()  # one step at a time uses the region
        self.push = {slot.name: np.frombuffer(mapping, np.float32, slot.nbytes // 4, slot.offset).reshape(slot.shape)
                     for slot in layout.push}
        self._reply = {slot.name: (slot.dtype, np.frombuffer(mapping, np.uint8, slot.nbytes, slot.offset))
                       for slot in layout.reply}

    def holds(self, grads: Optional[Mapping]) -> bool:
        """Whether ``grads``' arrays are this region's push arrays (:meth:`Session.gradient_buffers`)."""
        if not grads or not self.push:
            return False
        name, target = next(iter(self.push.items()))
        source = grads.get(name)
        return isinstance(source, np.ndarray) and _same_memory(source, target)

    def parameters(self) -> dict[str, np.ndarray]:
        """Writable float32 arrays over the reply part's float32 slots (tensors stored otherwise
        are left out): the parameters of the last step or pull answered through this region,
        overwritten in place by the next one (:meth:`Session.parameter_buffers`)."""
        return {name: raw.view(np.float32).reshape(self.push[name].shape)
                for name, (dtype, raw) in self._reply.items() if dtype == contract.FLOAT32}

    def write_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Writes ``params`` into the reply part, each tensor in its slot's dtype (a session's
        initial values: the shard reads them there, and :meth:`parameters` are then them)."""
        for name, (dtype, raw) in self._reply.items():
            np.copyto(raw, np.frombuffer(contract.wire_bytes(params[name], dtype), np.uint8))

    def step(self, reply: bool) -> data_pb2.SharedMemoryStep:
        """The step message's reference to this region."""
        return data_pb2.SharedMemoryStep(region=self.region_id, nonce=self._nonce, reply=reply)

    def write(self, grads: Mapping[str, np.ndarray]) -> None:
        """Copies the shard's gradients into the push part (skipped for arrays that already live
        there: :meth:`Session.gradient_buffers`)."""
        for name, target in self.push.items():
            source = grads[name]
            if not _same_memory(source, target):
                np.copyto(target, source, casting="unsafe")

    def read(self, out: Optional[Mapping[str, np.ndarray]] = None, views: bool = False) -> dict[str, np.ndarray]:
        """The parameters from the reply part: read-only views (``views``; valid until this
        region's next step; bfloat16 tensors are always converted), else copies into ``out``'s
        arrays where they fit, else into fresh ones."""
        out = out or {}
        result = {}
        for name, (dtype, raw) in self._reply.items():
            shape = self.push[name].shape
            if dtype == contract.BFLOAT16:
                values = raw.view(np.uint16).reshape(shape)
            else:
                values = raw.view(np.float32 if dtype == contract.FLOAT32 else np.float16).reshape(shape)
            if views and dtype != contract.BFLOAT16:
                view = values.view()
                view.flags.writeable = False
                result[name] = view
                continue
            given = out.get(name)
            wanted = _wire.output_dtype(dtype)
            target = given if (given is not None and given.shape == shape and given.dtype == wanted
                               and given.flags.c_contiguous and given.flags.writeable) else np.empty(shape, wanted)
            if dtype == contract.BFLOAT16:
                contract.bf16_bits_to_f32(values, out=target)
            else:
                np.copyto(target, values)
            result[name] = target
        return result

    def close(self) -> None:
        self.push = {}
        self._reply = {}
        shm.close_quietly(self._mapping)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _raise_if_transient(exc: grpc.RpcError, shard_index: int) -> None:
    """A handshake that met a shard restarting or unreachable says nothing about shared memory:
    raises UnavailableError (the call is retried, and the handshake with it)."""
    if exc.code() in _TRANSIENT:
        raise UnavailableError(f"shard {shard_index} could not be asked for shared memory now "
                               f"({exc.code().name}: {exc.details()}); retry", "UNAVAILABLE") from None


def negotiate(shard: data_pb2_grpc.ShardDataStub, session: str, client_id: str, shard_index: int, specs: Mapping,
              timeout: float) -> tuple[Optional[ShardRegion], str]:
    """Runs the handshake with one shard (``shard``: its ``ShardData`` stub); returns
    ``(region, "")`` or ``(None, why not)``.

    ``specs``: name -> (spec dtype value, shape) of the session's tensors.

    Raises:
      UnavailableError: the shard could not be reached (restarting): nothing is decided about
        shared memory with it, and the next call asks again.
    """
    global _swept
    if not shm.available():
        return None, f"no {shm.SHM_DIR} on this host"
    if not _swept:
        _swept = True
        shm.sweep_stale()
    try:
        offer = shard.OfferSharedMemory(data_pb2.OfferSharedMemoryRequest(session=session, client_id=client_id), timeout=timeout)
    except grpc.RpcError as exc:
        _raise_if_transient(exc, shard_index)
        return None, f"the shard offers no shared memory ({exc.code().name}: {exc.details()})"
    try:
        probe = shm.open_existing(offer.probe, shm.NONCE_BYTES, writable=False)
        nonce = bytes(probe[:])
        shm.close_quietly(probe)
    except (OSError, ValueError) as exc:
        return None, f"cannot open the shard's probe region ({exc})"
    finally:
        _unlink_quietly(offer.probe)
    try:
        opened = shard.OpenSharedMemory(data_pb2.OpenSharedMemoryRequest(session=session, client_id=client_id, offer=offer.offer,
                                                             nonce=nonce), timeout=timeout)
    except grpc.RpcError as exc:
        _raise_if_transient(exc, shard_index)
        return None, f"the shard refused the nonce ({exc.code().name}: {exc.details()})"
    try:
        layout = shm.layout([(name, *specs[name]) for name in opened.tensor_names])
        mapping, fd = shm.open_existing(opened.name, layout.size, hold=True) if layout.size == opened.size else (None, -1)
    except (OSError, ValueError, KeyError) as exc:
        mapping, why = None, f"cannot map the data region ({exc})"
    else:
        why = "" if mapping is not None else "the data region's size does not match its layout"
    finally:
        _unlink_quietly(opened.name)
    if mapping is None:
        try:
            shard.CloseSharedMemory(data_pb2.CloseSharedMemoryRequest(session=session, region=opened.region),
                                    timeout=timeout)
        except grpc.RpcError:
            pass
        return None, why
    return ShardRegion(shard_index, opened.region, nonce, mapping, fd, layout), ""


def _unlink_quietly(name: str) -> None:
    try:
        shm.unlink(name)
    except (OSError, ValueError):
        pass


REGIONS_PER_SHARD = 2  # double buffering: a step in flight on one, the next gradient written into the other


class SessionRegions:
    """A session object's regions per shard where the handshake succeeded (lazily, on the first
    data-plane call). ``mode``: "auto", True (fail if any shard cannot) or False.

    A shard has one region while this object's steps take turns; a second one is negotiated
    when a step (or :meth:`free_regions`) finds the first busy with a step in flight (overlap
    mode, ``push_pull_async``): the two are then double-buffered, each step on whichever is free.
    """

    def __init__(self, mode: SharedMemoryArg, stub_of: Callable[[str], data_pb2_grpc.ShardDataStub], session: str,
                 client_id: str, specs: Mapping, timeout: float):
        self.mode = mode
        self._stub_of = stub_of  # a shard's address -> its ShardData stub (Client.shard_data)
        self._session = session
        self._client_id = client_id
        self._specs = specs
        self._timeout = timeout
        self._lock = threading.Lock()
        self._regions: dict[int, list[ShardRegion]] = {}  # shard index -> its regions ([]: gRPC bytes)
        self._reserved: dict[int, int] = {}  # id(region) -> queued steps whose gradients lie in it
        self.reasons: dict[int, str] = {}  # shard index -> why it uses gRPC bytes
        self._addresses: dict[int, str] = {}
        self._finalizer = None

    def ensure(self, shards: Sequence) -> dict[int, Optional[ShardRegion]]:
        """Negotiates with every shard not tried yet, or serving at another address than when it
        was tried (a restarted shard knows none of its predecessor's regions: they are dropped);
        returns index -> its first region or None."""
        if self.mode is False:
            return {shard.index: None for shard in shards}
        with self._lock:
            for shard in shards:
                if shard.index in self._regions and self._addresses.get(shard.index) == shard.address:
                    continue
                for moved in self._regions.pop(shard.index, []):
                    moved.close()
                region, why = self._negotiate(shard)
                if region is None and self.mode is True:
                    raise FailedPreconditionError(f"shared_memory=True: shard {shard.index} ({shard.address}): {why}",
                                                  "FAILED_PRECONDITION")
                self._regions[shard.index] = [region] if region is not None else []
                self._addresses[shard.index] = shard.address
                self.reasons[shard.index] = why
            if self._finalizer is None:
                self._finalizer = weakref.finalize(self, _close_all, self._regions)
            return {shard.index: next(iter(self._regions[shard.index]), None) for shard in shards}

    def _negotiate(self, shard) -> tuple[Optional[ShardRegion], str]:
        return negotiate(self._stub_of(shard.address), self._session, self._client_id, shard.index,
                         {n: self._specs[n] for n in shard.names}, self._timeout)

    def acquire(self, shards: Sequence, grads: Optional[Mapping] = None) -> dict[int, ShardRegion]:
        """The regions for a step, each locked (release them after it): per shard the region
        ``grads``' arrays live in if it is free, else a free one, else a second one negotiated
        now; a shard whose regions are all busy (both double buffers in flight) or that has
        none stays on gRPC bytes for this step."""
        taken = {}
        try:
            for shard in shards:
                region = self._free_region(shard, grads, lock=True)
                if region is not None:
                    taken[shard.index] = region
        except BaseException:  # a shard restarting (UnavailableError): the regions locked so far are free again
            self.release(taken)
            raise
        return taken

    def reserve(self, grads: Mapping) -> list[ShardRegion]:
        """Marks the regions ``grads``' arrays live in as taken by a step queued now (it locks
        them when it starts): no other step and no :meth:`free_regions` hands them out until
        :meth:`unreserve`."""
        with self._lock:
            held = [r for regions in self._regions.values() for r in regions if r.holds(grads)]
            for region in held:
                self._reserved[id(region)] = self._reserved.get(id(region), 0) + 1
        return held

    def unreserve(self, regions: Sequence[ShardRegion]) -> None:
        with self._lock:
            for region in regions:
                left = self._reserved.pop(id(region), 0) - 1
                if left > 0:
                    self._reserved[id(region)] = left

    def free_regions(self, shards: Sequence) -> dict[int, Optional[ShardRegion]]:
        """Index -> a region of the shard that no step of this object is using now (a second one
        negotiated if the first is busy), or None (gRPC bytes, or both regions busy); not locked."""
        return {shard.index: self._free_region(shard, None, lock=False) for shard in shards}

    def _free_region(self, shard, grads: Optional[Mapping], lock: bool) -> Optional[ShardRegion]:
        if self.ensure([shard])[shard.index] is None:
            return None
        with self._lock:
            regions = sorted(self._regions.get(shard.index, []), key=lambda r: not r.holds(grads))
            count = len(regions)
            regions = [r for r in regions if id(r) not in self._reserved or r.holds(grads)]
        for region in regions:
            if lock and region.lock.acquire(blocking=False):
                return region
            if not lock and not region.lock.locked():
                return region
        if count >= REGIONS_PER_SHARD:
            return None
        region, _ = self._negotiate(shard)
        if region is None:
            return None
        if lock:
            region.lock.acquire()
        with self._lock:
            regions = self._regions.get(shard.index)
            if regions is None or len(regions) >= REGIONS_PER_SHARD:  # forgotten, or another thread made one
                region.close()
                return None
            regions.append(region)
        return region

    @staticmethod
    def release(taken: Mapping[int, ShardRegion]) -> None:
        for region in taken.values():
            region.lock.release()

    def forget(self, indices) -> None:
        """Drops regions the shard no longer knows (they are negotiated again on the next call)."""
        with self._lock:
            for index in indices:
                for region in self._regions.pop(index, []):
                    region.close()

    def paths(self) -> dict[int, str]:
        """Shard index -> "shared_memory" or "grpc" (shards not tried yet are left out)."""
        with self._lock:
            return {i: "shared_memory" if r else "grpc" for i, r in self._regions.items()}

    def close(self, notify: bool = True) -> None:
        """Drops every region: tells the shards (best effort) and unmaps them here."""
        with self._lock:
            regions = [(i, r) for i, rs in self._regions.items() for r in rs]
            self._regions.clear()
        for index, region in regions:
            if notify:
                try:
                    self._stub_of(self._addresses[index]).CloseSharedMemory(
                        data_pb2.CloseSharedMemoryRequest(session=self._session, region=region.region_id), timeout=2.0)
                except (grpc.RpcError, ValueError, RuntimeError):
                    pass
            region.close()


def _close_all(regions: dict) -> None:
    for shard_regions in list(regions.values()):
        for region in shard_regions:
            region.close()
