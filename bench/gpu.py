"""The service on a GPU: the figures ``make gpu-check`` writes to ``docs/gpu.md``.

    python -m bench.gpu --ray-address ADDR [--rehearse] [--small] [--out FILE]

``ADDR``: a Ray cluster whose nodes declare the GPUs (``bench.gpu_check`` starts one). Each row is
ours against its baseline, measured in the same run in interleaved rounds (a shared machine's speed
drifts), as the median of the per-round ratios:

* kernel: optserve Adafactor's jitted, donated step on ~100M float32 parameters, against the
  device's copy roofline (the bytes a three-pass Adafactor must move at the bandwidth of a donated
  elementwise copy; see :mod:`bench.adafactor`);
* transfers (:mod:`bench.gpu_transfers`): each host pass and host <-> device copy a shared-memory
  step makes, timed alone, and their sum in one process: the floor of a step over host memory;
* service: one client's ``push_pull`` over shared memory (``gradient_buffers()`` and views) with 1
  and 2 shards at half a GPU each, against the same kernel step in this process on the same GPU
  and against the floor (target: <= 1.5x the floor), with the server's own push / update / reply
  times from its metrics;
* Shampoo: its step through the same server with its roots on a preconditioner worker (half a GPU
  beside the shard's half), against Adafactor's (target: <= 1.2x).

``--rehearse`` passes ``--rehearse-gpus`` to the servers (JAX on the CPU; the kit's dry run), and
``--small`` shrinks the model so a dry run takes seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np

from bench.adafactor import copy_bandwidth, roofline_bytes
from bench.gpu_transfers import transfer_rows
from bench.ray_cluster import ray_env, Started
from bench.service import in_process_step, interleaved_seconds
from bench._timing import print_table

ADAFACTOR = {"name": "adafactor", "args": {"learning_rate": 1e-2}}
SHAMPOO = {"name": "shampoo", "args": {"learning_rate": 1e-3, "block_size": 1024, "preconditioning_compute_steps": 10},
           "preconditioners": {"max_age": 20}}
SERVER_START_S = 300.0


def _model(small: bool) -> dict[str, np.ndarray]:
    """Six square matrices: 6 x 4096^2 (~100M parameters), or 6 x 128^2 with ``small`` (the kit's dry
    run: the same paths as 512^2, below the same size thresholds, in a quarter less CPU)."""
    dim = 128 if small else 4096
    rng = np.random.default_rng(0)
    return {f"layer{i}/w": rng.standard_normal((dim, dim), dtype=np.float32) * 0.02 for i in range(6)}


def start_listening(argv: list[str], log_dir: str) -> tuple[Started, str]:
    """``argv`` (an ``optserve serve`` command line) started in ``log_dir``, once it listens, and
    its address (stopped again if it never does)."""
    process = Started(f"optserve-{len(os.listdir(log_dir))}", argv, log_dir)
    try:
        return process, process.wait_for("optserve listening on ", SERVER_START_S).split()[-1]
    except BaseException:
        process.stop()
        raise


class Server:
    """``optserve serve`` joining the cluster at ``ray_address`` (a process of its own)."""

    def __init__(self, ray_address: str, log_dir: str, rehearse: bool, *flags: str):
        argv = [sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0", "--ray-address", ray_address,
                "--min-shard-bytes", "0", *flags] + (["--rehearse-gpus"] if rehearse else [])
        self._process, self.address = start_listening(argv, log_dir)

    def output(self) -> str:
        """What the server printed so far (its log)."""
        return self._process.output()

    def phase_totals(self, session: str) -> dict[tuple[str, str], tuple[float, float]]:
        """``{(phase, shard): (seconds, count)}`` of ``session``'s push, update and reply so far,
        from the server's metrics (``--metrics-port`` must be among the flags)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        url = self._process.wait_for("optserve metrics at ", 10).split()[-1]
        with urllib.request.urlopen(url, timeout=30) as reply:
            text = reply.read().decode()
        totals: dict[tuple[str, str], list[float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                phase = sample.name.removeprefix("optserve_").removesuffix("_sum").removesuffix("_count")
                if sample.labels.get("session") != session or phase not in ("push_seconds", "step_seconds",
                                                                             "pull_seconds"):
                    continue
                pair = totals.setdefault((phase.removesuffix("_seconds"), sample.labels.get("shard", "")), [0.0, 0.0])
                pair[sample.name.endswith("_count")] += sample.value
        return {key: (seconds, count) for key, (seconds, count) in totals.items()}

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self._process.stop()


def phases_between(before: dict, after: dict) -> str:
    """The mean time of each phase on each shard between two :meth:`Server.phase_totals`."""
    means = []
    for (phase, shard), (seconds, count) in sorted(after.items()):
        seconds0, count0 = before.get((phase, shard), (0.0, 0.0))
        if count > count0:
            means.append(f"{phase} {(seconds - seconds0) / (count - count0) * 1e3:.1f}")
    return "; ".join(means) + " ms per shard (server metrics, timed rounds)"


def device_events(output: str) -> dict[str, dict[str, str]]:
    """A server's ``event=device`` log lines, by actor role: their ``key=value`` fields."""
    events = {}
    for line in output.splitlines():
        if "event=device " in line:
            fields = dict(word.split("=", 1) for word in line.split("event=device ", 1)[1].split())
            events[fields["role"]] = fields
    return events


def host_path(output: str, rehearse: bool) -> str:
    """Which data plane a host-resident client's steps took, from the server's log: its regions
    mapped for the device, XLA's bounce buffer (a line says why), or a CPU shard's in-place reads."""
    if rehearse:
        return "host-resident (CPU shard)"
    if "event=host_link_unavailable" in output or "event=shm_region_not_mapped" in output:
        return "host-resident, bounce buffer"
    return "host-resident, mapped"


def _median_ratio(samples: dict[str, list[float]], name: str, baseline: str) -> str:
    ratios = [s / b for s, b in zip(samples[name], samples[baseline])]
    return f"{statistics.median(ratios):.2f} x [{min(ratios):.2f}, {max(ratios):.2f}]"


def _shm_step(client, name: str, params, grads, optimizer) -> tuple[object, Callable[[], object]]:
    """A session, and one shared-memory ``push_pull`` of it with the gradients written into its
    regions (what a program writing its gradients there does: no copy on the client)."""
    session = client.create_session(name, params, optimizer=optimizer)
    buffers = session.gradient_buffers()
    for key, buffer in buffers.items():
        buffer[...] = grads[key]
    return session, lambda: session.push_pull(buffers, views=True)


def kernel_rows(params, grads, repeats: int) -> list[list]:
    """The kernel step against the copy roofline."""
    import jax

    shapes = {name: value.shape for name, value in params.items()}
    bandwidth = copy_bandwidth(shapes, repeats)
    roofline = roofline_bytes(shapes) / bandwidth
    kernel = in_process_step(params, grads)
    samples, _ = interleaved_seconds({"kernel": kernel}, rounds=repeats)
    step = statistics.median(samples["kernel"])
    return [["device", str(jax.devices()[0].device_kind), "", f"jax {jax.__version__}, {jax.default_backend()}"],
            ["copy bandwidth (read + write)", "", f"{bandwidth / 1e9:.0f} GB/s", "donated jitted x * c"],
            ["kernel step (adafactor, donated)", step * 1e3, f"{step / roofline:.2f} x roofline",
             f"roofline {roofline * 1e3:.2f} ms"]]


def service_rows(ray_address: str, log_dir: str, rehearse: bool, params, grads, repeats: int) -> list[list]:
    """The shared-memory service step with 1 and 2 shards at half a GPU each, against the kernel
    and against the in-process floor of the same transfers (:mod:`bench.gpu_transfers`)."""
    from optserve.client import Client

    rows, floor_s, link_floor_s = transfer_rows(params, grads, repeats)
    for shards in (1, 2):
        with Server(ray_address, log_dir, rehearse, "--shards", str(shards), "--gpus-per-shard", "0.5",
                    "--metrics-port", "0") as server:
            with Client(server.address, timeout=600, shared_memory=True) as client:
                name = f"gpu-service-{shards}"
                _, step = _shm_step(client, name, params, grads, ADAFACTOR)
                kernel = in_process_step(params, grads)
                for _ in range(2):  # compiled, warm, before the totals start
                    step(), kernel()
                before = server.phase_totals(name)
                samples, _ = interleaved_seconds({"service": step, "kernel": kernel}, rounds=repeats, warmup=0)
                phases = phases_between(before, server.phase_totals(name))
                device = client.server_status()[0].device
                path = host_path(server.output(), rehearse)
        service = statistics.median(samples["service"])
        versus = f"{service / floor_s:.2f} x floor" + (f"; {service / link_floor_s:.2f} x link floor"
                                                       if link_floor_s else "")
        rows.append([f"service step, {path}, {shards} shard(s) at 0.5 GPU", service * 1e3,
                     f"{_median_ratio(samples, 'service', 'kernel')} kernel; {versus}",
                     f"kernel {statistics.median(samples['kernel']) * 1e3:.2f} ms in process; shards on "
                     f"{device.backend} {','.join(device.devices)}, memory fraction {device.memory_fraction:g}; "
                     f"{phases}"])
    return rows


def shampoo_rows(ray_address: str, log_dir: str, rehearse: bool, params, grads, repeats: int) -> list[list]:
    """Shampoo with its roots on a GPU worker, against Adafactor, through one server."""
    from optserve.client import Client

    flags = ("--shards", "1", "--gpus-per-shard", "0.5", "--precond-workers", "1", "--gpus-per-precond-worker", "0.5")
    with Server(ray_address, log_dir, rehearse, *flags) as server:
        with Client(server.address, timeout=600, shared_memory=True) as client:
            session, shampoo = _shm_step(client, "gpu-shampoo", params, grads, SHAMPOO)
            _, adafactor = _shm_step(client, "gpu-adafactor", params, grads, ADAFACTOR)
            # past the first roots (step 10) before timing, and a refresh inside the timed rounds
            samples, _ = interleaved_seconds({"shampoo": shampoo, "adafactor": adafactor}, rounds=max(repeats, 10),
                                             warmup=12)
            roots = sum(s.root_offload.roots_installed for s in session.status().shards)
    return [["Shampoo step, roots on a worker at 0.5 GPU", statistics.median(samples["shampoo"]) * 1e3,
             f"{_median_ratio(samples, 'shampoo', 'adafactor')} adafactor",
             f"adafactor {statistics.median(samples['adafactor']) * 1e3:.2f} ms; block 1024, roots every 10 steps; "
             f"{roots} roots installed"]]


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ray-address", required=True, help="a Ray cluster that declares the GPUs")
    parser.add_argument("--rehearse", action="store_true", help="servers with --rehearse-gpus (JAX on the CPU)")
    parser.add_argument("--small", action="store_true", help="6 x 128^2 parameters instead of 6 x 4096^2")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--log-dir", default="/tmp/optserve-bench-gpu")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    parser.add_argument("--sections", default="kernel,service,shampoo", help="which of kernel,service,shampoo")
    args = parser.parse_args(argv)
    os.makedirs(args.log_dir, exist_ok=True)
    os.environ.update({k: v for k, v in ray_env().items() if k.startswith("RAY_")})
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the GPU is the servers': take what is used
    params = _model(args.small)
    grads = {k: np.random.default_rng(1).standard_normal(v.shape, dtype=np.float32) * 1e-3 for k, v in params.items()}
    n_params = sum(v.size for v in params.values())
    started = time.monotonic()
    known = {"kernel": lambda: kernel_rows(params, grads, args.repeats),
             "service": lambda: service_rows(args.ray_address, args.log_dir, args.rehearse, params, grads, args.repeats),
             "shampoo": lambda: shampoo_rows(args.ray_address, args.log_dir, args.rehearse, params, grads, args.repeats)}
    sections = [known[name] for name in args.sections.split(",")]
    rows: list[list] = []
    for done, section in enumerate(sections, 1):
        rows += section()
        title = (f"bench.gpu: {n_params / 1e6:.1f}M f32 params in {len(params)} matrices; median of {args.repeats} "
                 f"interleaved rounds{' (rehearsal: JAX on the CPU)' if args.rehearse else ''}; "
                 f"{time.monotonic() - started:.0f} s" + ("" if done == len(sections) else
                                                          f" (partial: {done} of {len(sections)} sections)"))
        table = print_table(title, ["what", "ms", "ratio", "note"], rows)
        if args.out:  # after each section, so a run cut short still leaves what it measured
            with open(args.out, "w") as f:
                f.write(table + "\n")
    return table


if __name__ == "__main__":
    main()
