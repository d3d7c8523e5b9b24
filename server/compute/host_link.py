"""An accelerator's direct path to host memory: mapped ranges, copied at the link's speed.

XLA copies a host array to a GPU through a pinned bounce buffer of its own, at a fraction of the
link's speed, unless the range was DMA-mapped for its client. :class:`HostLink` maps a range (a
client's shared-memory region) for the shard's device, so that ``jax.device_put`` of arrays lying
in it runs at the link's speed, and copies device arrays into such a range in one transfer each
(``cudaMemcpyAsync`` through ``cuda.bindings``, on a stream of the calling thread), where a
read-back through XLA would land in pinned memory of its own first and need a host copy after.

:func:`host_link` gives None where there is nothing to gain or nothing to do it with: a CPU device
(it reads host memory where it lies), a device other than CUDA, or a machine without
``cuda.bindings`` (then the shard keeps the bounce-buffer path, and says why once, in one line).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Optional, Sequence

_log = logging.getLogger(__name__)


class HostLink:
    """Mapped host ranges and copies into them for one CUDA device (thread-safe).

    Args:
      device: the JAX device (platform ``gpu``, CUDA).
      runtime: the ``cuda.bindings.runtime`` module.
    """

    def __init__(self, device, runtime):
        self.device = device
        self._cudart = runtime
        self._ordinal = int(device.local_hardware_id)
        self._streams = threading.local()

    def map(self, address: int, size: int) -> None:
        """Maps ``[address, address + size)`` (page-aligned) for the device's DMA. Raises what the
        client raises (the range stays usable, through the bounce buffer)."""
        self.device.client.dma_map(address, size)

    def unmap(self, address: int) -> None:
        """Undoes :meth:`map` of the range starting at ``address`` (before the memory is unmapped)."""
        self.device.client.dma_unmap(address)

    def copy_down(self, pieces: Sequence[tuple[int, Any]]) -> int:
        """Copies each ``(address, array)``'s device buffer to host memory at ``address`` (a
        mapped range, ``array.nbytes`` bytes there), all on one stream, and returns once every
        byte has landed; returns the bytes copied. Each array is waited for first (XLA computes
        on streams of its own: a buffer's address is known before its values are); they must stay
        alive and undonated until this returns.

        Raises:
          RuntimeError: a CUDA call failed (naming it and CUDA's message).
        """
        cudart = self._cudart
        self._check(cudart.cudaSetDevice(self._ordinal), "cudaSetDevice")
        stream = self._stream()
        copied = 0
        for address, array in pieces:
            nbytes = int(array.nbytes)
            array.block_until_ready()
            if nbytes:
                self._check(cudart.cudaMemcpyAsync(int(address), array.unsafe_buffer_pointer(), nbytes,
                                                   cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream),
                            "cudaMemcpyAsync")
            copied += nbytes
        self._check(cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        return copied

    def _stream(self):
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            (err, stream) = self._cudart.cudaStreamCreateWithFlags(getattr(self._cudart, "cudaStreamNonBlocking", 1))
            self._check((err,), "cudaStreamCreateWithFlags")
            self._streams.stream = stream
        return stream

    def _check(self, result, call: str) -> None:
        err = result[0]
        if err != self._cudart.cudaError_t.cudaSuccess:
            _, message = self._cudart.cudaGetErrorString(err)
            raise RuntimeError(f"{call} on {self.device}: {err.name}: {message.decode(errors='replace')}")


@functools.lru_cache(maxsize=None)
def host_link(device) -> Optional[HostLink]:
    """The :class:`HostLink` of ``device``, or None (a CPU device reads host memory in place; a
    non-CUDA accelerator or a missing ``cuda.bindings`` keeps XLA's own copies, logged once)."""
    if device.platform == "cpu":
        return None
    if device.platform != "gpu" or "rocm" in str(getattr(device.client, "platform_version", "")).lower():
        _log.info("event=host_link_unavailable device=%s reason=%s", device, "not a CUDA device")
        return None
    if not hasattr(device.client, "dma_map"):
        _log.warning("event=host_link_unavailable device=%s reason=%s", device,
                     "this jaxlib's client has no dma_map: host transfers go through XLA's bounce buffer")
        return None
    try:
        from cuda.bindings import runtime
    except ImportError as error:
        _log.warning("event=host_link_unavailable device=%s reason=%s", device,
                     f"cuda.bindings is not installed ({error}): host transfers go through XLA's bounce buffer")
        return None
    return HostLink(device, runtime)
