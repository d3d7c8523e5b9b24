"""What a shared-memory step costs a GPU shard beyond the kernel: the host <-> device transfers and
host passes its data makes, each timed alone in this process, and their sum as the floor a service
step over host memory cannot go under (the baseline :mod:`bench.gpu` compares the service with).

A shard's shared-memory step, on its device: the gradients are read where the client wrote them
(checked finite on the host, then ``device_put`` from that pageable memory), the kernel runs, and the
parameters come back (device to pinned host memory, ``to_host``) and are copied into the client's
region. The rows time each piece on the same 6 matrices, with the sources in page-aligned anonymous
mappings like the regions, and the plain ``np.asarray`` read-back the pinned one replaces.
"""

from __future__ import annotations

import mmap
import statistics
from typing import Callable, Optional

import numpy as np

from bench.service import in_process_step, interleaved_seconds


def _mapped_like(arrays: dict[str, np.ndarray]) -> tuple[list[mmap.mmap], dict[str, np.ndarray]]:
    """Copies of ``arrays`` in page-aligned anonymous mappings (as a shared-memory region's slots)."""
    maps, views = [], {}
    for name, value in arrays.items():
        region = mmap.mmap(-1, value.nbytes)
        view = np.frombuffer(region, value.dtype).reshape(value.shape)
        view[...] = value
        maps.append(region)
        views[name] = view
    return maps, views


def transfer_rows(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], repeats: int
                  ) -> tuple[list[list], float, Optional[float]]:
    """Rows (what, ms, GB/s, note) of each piece, the in-process floor's median seconds, and the
    link floor's (kernel + both crossings with the memory mapped for the device; None on a CPU)."""
    import jax

    from optserve.server.compute.host_transfer import to_host
    from optserve.server.domain.shard.assembly import all_finite
    from optserve.server.domain.shard.host_passes import parallel_copy

    device = jax.devices()[0]
    nbytes = sum(v.nbytes for v in grads.values())
    _maps, region_grads = _mapped_like(grads)
    _reply_maps, region_reply = _mapped_like(params)
    resident = {k: jax.device_put(v, device) for k, v in params.items()}
    jax.block_until_ready(resident)
    kernel = in_process_step(params, grads)

    def fresh() -> dict:  # np.asarray caches an array's host copy: read back new arrays each time
        out = {k: v + 0 for k, v in resident.items()}
        return jax.block_until_ready(out)

    def h2d_each() -> None:
        jax.block_until_ready({k: jax.device_put(v, device) for k, v in region_grads.items()})

    def h2d_batched() -> None:
        jax.block_until_ready(jax.device_put(region_grads, device))

    def d2h_each() -> None:
        for value in fresh().values():
            np.asarray(value)

    def d2h_pinned() -> None:
        to_host(fresh())

    host = {k: np.asarray(v) for k, v in fresh().items()}

    def host_copy() -> None:
        for name, value in host.items():
            parallel_copy(region_reply[name], value)

    def finite() -> None:
        for value in region_grads.values():
            all_finite(value)

    def floor() -> None:  # what the shard does, each piece once, in order (x + 0 included)
        finite()
        h2d_each()
        kernel()
        for name, value in to_host(fresh()).items():
            parallel_copy(region_reply[name], value)

    fns: dict[str, Callable[[], None]] = {"finite": finite, "h2d": h2d_each, "h2d batched": h2d_batched,
                                          "d2h": d2h_each, "d2h pinned": d2h_pinned, "host copy": host_copy,
                                          "floor": floor}
    fresh_cost, _ = interleaved_seconds({"fresh": fresh}, rounds=repeats)
    samples, _ = interleaved_seconds(fns, rounds=repeats)
    fresh_s = statistics.median(fresh_cost["fresh"])
    notes = {"finite": "all_finite over the gradients where they lie (host, one pass)",
             "h2d": "jax.device_put of each gradient from pageable mapped memory",
             "h2d batched": "one jax.device_put of the whole dict",
             "d2h": "np.asarray of each parameter (x + 0 excluded): what to_host replaces",
             "d2h pinned": "to_host: one batch into pinned host memory, read-only views (x + 0 excluded)",
             "host copy": "parallel_copy of the parameters into mapped memory",
             "floor": "finite + h2d + kernel + d2h pinned + host copy, in process (the shard's passes)"}
    rows = []
    for name, values in samples.items():
        seconds = statistics.median(values) - (fresh_s if name.startswith("d2h") else 0.0)
        rows.append([f"{name} ({nbytes / 2**20:.0f} MiB)", seconds * 1e3,
                     f"{nbytes / seconds / 1e9:.1f} GB/s" if name != "floor" else "", notes[name]])
    link_rows, link_floor_s = _link_rows(grads, params, kernel, repeats)
    return rows + link_rows, statistics.median(samples["floor"]), link_floor_s


def _link_rows(grads: dict[str, np.ndarray], params: dict[str, np.ndarray], kernel: Callable[[], None],
               repeats: int) -> tuple[list[list], Optional[float]]:
    """The link's speed each way with the memory mapped for the device (as a GPU shard maps a
    client's region: :class:`~optserve.server.compute.host_link.HostLink`), and the link floor:
    the kernel plus both crossings at that speed. None on a device without a host link (a CPU)."""
    import jax

    from optserve.server.compute.host_link import host_link

    device = jax.devices()[0]
    link = host_link(device)
    if link is None:
        return [["link floor", "", "", f"no host link on {device.platform}: the CPU reads host memory in place"]], None
    maps, up_grads = _mapped_like(grads)
    reply_maps, reply = _mapped_like(params)
    addresses = []
    resident = jax.block_until_ready({k: jax.device_put(v, device) for k, v in params.items()})
    try:
        for region in maps + reply_maps:
            address = np.frombuffer(region, np.uint8).ctypes.data
            link.map(address, len(region))  # whole pages: each tensor is its own mapping
            addresses.append(address)

        def up() -> None:
            jax.block_until_ready({k: jax.device_put(v, device) for k, v in up_grads.items()})

        def down() -> None:
            link.copy_down([(reply[k].ctypes.data, v) for k, v in resident.items()])

        samples, _ = interleaved_seconds({"up": up, "kernel": kernel, "down": down}, rounds=repeats)
    finally:
        for address in addresses:
            link.unmap(address)
    up_s, kernel_s, down_s = (statistics.median(samples[k]) for k in ("up", "kernel", "down"))
    nbytes = sum(v.nbytes for v in grads.values())
    floor = kernel_s + up_s + down_s
    return [[f"link up, mapped ({nbytes / 2**20:.0f} MiB)", up_s * 1e3, f"{nbytes / up_s / 1e9:.1f} GB/s",
             "jax.device_put of each gradient from memory mapped for the device (HostLink.map)"],
            [f"link down, mapped ({nbytes / 2**20:.0f} MiB)", down_s * 1e3, f"{nbytes / down_s / 1e9:.1f} GB/s",
             "HostLink.copy_down of each parameter into mapped memory (one transfer each)"],
            ["link floor", floor * 1e3, "", f"kernel {kernel_s * 1e3:.2f} + up + down at the link's measured speed"]
            ], floor
