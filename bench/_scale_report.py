"""What :mod:`bench.scale` reads off the machine and what it writes: memory sampling, the machine's
description, the markdown section and the PNG curves.

Memory (:class:`MemorySampler`): a thread samples, every ``period_s``, the machine's used memory
(``MemTotal - MemAvailable`` from ``/proc/meminfo``: it counts whatever else the machine runs
meanwhile), the anonymous resident memory (``RssAnon``: private pages, the shared regions left
out) of the client processes and of the server's process tree (the ``optserve serve`` process and
its descendants: Ray's daemons, the shard actors, preconditioner workers), and the allocated bytes
of the ``/dev/shm`` files those processes map (each file once: a region mapped by a client and a
shard is counted once). A window reports each one's peak minus its value when the window opened.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import threading
import time
from typing import Optional, Sequence

BEGIN = "<!-- bench.scale: generated, begin -->"
END = "<!-- bench.scale: generated, end -->"


def markers(section: str = "") -> tuple[str, str]:
    """The begin / end markers of generated section ``section`` ("": the default one)."""
    if not section:
        return BEGIN, END
    return f"<!-- bench.scale: generated {section}, begin -->", f"<!-- bench.scale: generated {section}, end -->"


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            parts = value.split()
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def machine_used() -> int:
    info = meminfo()
    return info["MemTotal"] - info["MemAvailable"]


def tree_pids(pid: Optional[int]) -> list[int]:
    """Process ``pid`` and all its descendants (none without a pid)."""
    if pid is None:
        return []
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid] + [child.pid for child in root.children(recursive=True)]
    except psutil.Error:
        return []


def process_memory(pids: Sequence[int]) -> tuple[int, dict]:
    """``(anonymous resident bytes summed over pids, {file identity: allocated bytes})`` of the
    ``/dev/shm`` files they map. optserve's regions are unlinked once mapped, so a file is read
    through ``/proc/PID/map_files`` (identity: its inode); where that is not readable (no
    privilege), by its name and mapped size."""
    anon, files = 0, {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                anon += next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), 0)
            with open(f"/proc/{pid}/maps") as f:
                mapped = [line.split()[0] + " " + line[line.find(" /dev/shm/") + 1:].rstrip("\n")
                          for line in f if " /dev/shm/" in line]
        except OSError:  # the process exited meanwhile
            continue
        for entry in mapped:
            span, name = entry.split(" ", 1)
            try:
                stat = os.stat(f"/proc/{pid}/map_files/{span}")
                files[stat.st_ino] = stat.st_blocks * 512
            except OSError:
                low, high = (int(v, 16) for v in span.split("-"))
                files[name] = max(files.get(name, 0), high - low)
    return anon, files


class MemorySampler:
    """Samples memory in a thread (see the module docstring). A window's keys: ``machine`` (used
    memory), ``client`` and ``server`` (anonymous resident memory of the client processes, of the
    server's process tree), ``shm`` (/dev/shm files any of them maps) and ``ours`` (the sum of the
    three: every page of ours once)."""

    KEYS = ("machine", "client", "server", "shm", "ours")

    def __init__(self, period_s: float = 0.1):
        self._period_s = period_s
        self._lock = threading.Lock()
        self._server_pid: Optional[int] = None
        self._clients: list[int] = []
        self._base: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scale-memory", daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, int]:
        client_anon, client_files = process_memory(self._clients)
        server_anon, server_files = process_memory(tree_pids(self._server_pid))
        shm = sum({**client_files, **server_files}.values())
        return {"machine": machine_used(), "client": client_anon, "server": server_anon, "shm": shm,
                "ours": client_anon + server_anon + shm}

    def open(self, server_pid: Optional[int], client_pids: Sequence[int] = ()) -> None:
        """Starts a window on the server whose process is ``server_pid`` and on ``client_pids``."""
        with self._lock:
            self._server_pid = server_pid
            self._clients = list(client_pids)
            self._base = self.sample()
            self._peak = dict(self._base)

    def close(self) -> dict[str, int]:
        """The window's growth: each value's peak minus its value at :meth:`open`, bytes."""
        last = self.sample()
        with self._lock:
            peak = {k: max(self._peak.get(k, 0), last[k]) for k in self.KEYS}
            growth = {k: peak[k] - self._base.get(k, 0) for k in self.KEYS}
            self._base = {}
        return growth

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            with self._lock:
                if not self._base:
                    continue
                now = self.sample()
                for key in self.KEYS:
                    self._peak[key] = max(self._peak[key], now[key])


def machine_description() -> str:
    """``"2 cores (Intel ...), 23.4 GiB memory, Linux 6.x, Python 3.11; jax 0.x, torch 2.x"``."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    versions = []
    for name in ("numpy", "jax", "torch", "ray", "grpc"):
        try:
            module = __import__(name)
            versions.append(f"{name} {module.__version__}")
        except Exception:  # noqa: BLE001 - a version we cannot read is left out
            pass
    load = os.getloadavg()
    return (f"{os.cpu_count()} cores ({model or platform.processor() or 'unknown CPU'}), "
            f"{meminfo()['MemTotal'] / 2**30:.1f} GiB memory, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}; {', '.join(versions)}; load average at start {load[0]:.1f}")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value).replace("|", "/")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(path: str, section: str, name: str = "") -> None:
    """Writes ``section`` between the :func:`markers` of section ``name`` in ``path``, keeping the
    text around them (the hand-written part, other sections); a file without them gets them appended."""
    begin, end = markers(name)
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _series(rows: Sequence[dict], key_fields: Sequence[str], x: str, y: str) -> dict[str, tuple[list, list]]:
    """Rows grouped by ``key_fields`` (a label), each group's (xs, ys) sorted by x, rows without y left out."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        if row.get(y) is None or row.get(x) is None:
            continue
        label = ", ".join(f"{row[k]}" if k != "shards" else f"{row[k]} shard(s)" for k in key_fields)
        groups.setdefault(label, []).append((row[x], row[y]))
    return {label: ([p[0] for p in sorted(pts)], [p[1] for p in sorted(pts)]) for label, pts in groups.items()}


def plot(path: str, title: str, series: dict[str, tuple[list, list]], xlabel: str, ylabel: str,
         log: bool = True) -> Optional[str]:
    """One PNG of ``series`` (label -> (xs, ys)); returns the path, or None if there is nothing to draw."""
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    colors = plt.get_cmap("tab20").colors
    for index, (label, (xs, ys)) in enumerate(sorted(series.items())):
        kernel = label.startswith("kernel")
        ax.plot(xs, ys, "--" if kernel else "-", marker="s" if kernel else "o", label=label, linewidth=1.3,
                markersize=4, color="black" if kernel and "adafactor" in label else colors[index % len(colors)])
    if log:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plots(directory: str, steps: Sequence[dict], workers: Sequence[dict], prefix: str = "") -> list[str]:
    """The bench's curves as PNGs in ``directory`` (file names starting with ``prefix``): step time
    and memory per parameter against parameters (log-log), the step per parameter against tensors
    per model, and throughput against workers. Returns the paths written."""
    directory = os.path.join(directory, prefix)  # "DIR/" or "DIR/PREFIX": the file names follow
    sized = [r for r in steps if r["sweep"] == "params"]
    keys = ("optimizer", "path", "shards")
    step_series = _series(sized, keys, "params", "step_ms")
    kernels = {}  # each row timed its own kernel beside it: the median per optimizer and size
    for label, (xs, ys) in _series(sized, ("optimizer",), "params", "kernel_ms").items():
        by_size: dict[float, list[float]] = {}
        for x, y in zip(xs, ys):
            by_size.setdefault(x, []).append(y)
        kernels[f"kernel, {label}"] = (sorted(by_size), [statistics.median(by_size[x]) for x in sorted(by_size)])
    written = [
        plot((directory + "step_vs_params.png"), "step time against parameters (median of rounds)",
             {**step_series, **kernels}, "parameters", "step ms"),
        plot((directory + "memory_vs_params.png"),
             "memory of client + server + regions per parameter (peak growth over create + first steps)",
             _series(sized, keys, "params", "ours_bpp"), "parameters", "bytes per parameter"),
        plot((directory + "machine_memory_vs_params.png"),
             "machine memory growth per parameter (MemTotal - MemAvailable; other programs included)",
             _series(sized, keys, "params", "machine_bpp"), "parameters", "bytes per parameter"),
        plot((directory + "client_memory_vs_params.png"), "client private memory per parameter (RssAnon)",
             _series(sized, keys, "params", "client_bpp"), "parameters", "bytes per parameter"),
        plot((directory + "server_memory_vs_params.png"),
             "server private memory per parameter (RssAnon of its process tree)",
             _series(sized, keys, "params", "server_bpp"), "parameters", "bytes per parameter"),
        plot((directory + "step_vs_tensors.png"), "step time per parameter against tensors per model",
             _series([r for r in steps if r["sweep"] == "tensors"], keys, "tensors", "ns_per_param"),
             "tensors per model", "ns per parameter"),
        plot((directory + "throughput_vs_workers.png"), "throughput against client workers",
             _series(workers, ("optimizer", "path", "shards"), "workers", "mparams_per_s"), "workers",
             "M parameters per second (pushed gradients)", log=False),
    ]
    return [p for p in written if p]


def elapsed(started: float) -> str:
    return f"{time.monotonic() - started:.0f} s"
