"""The GPU kit: one command that, on a lent GPU machine, installs what its image lacks, runs the GPU
tests and the GPU bench, and writes ``docs/gpu.md``; with ``--cpu``, the same end to end here.

    make gpu-check        # on the device: python3 -m bench.gpu_check (carry .gpu-wheels)
    make gpu-check-dry    # here: python -m bench.gpu_check --cpu --small

Steps, each timed and reported in the page:

1. install: ``pip install --no-index --no-deps --target SITE WHEELS/*.whl`` (the folder
   ``scripts/gpu_wheels.py`` builds: Ray without its jars, the gRPC and protobuf versions the
   generated code needs, an optserve wheel of the tree), then ``SITE`` leads ``PYTHONPATH`` for
   every later step. Skipped without ``--wheels`` (``--wheels ''``).
2. a Ray node (``ray start`` of the installed Ray) declaring the machine's GPUs (``nvidia-smi -L``);
   with ``--cpu``, one logical GPU, and every server runs ``--rehearse-gpus`` (JAX on the CPU).
3. the GPU tests (``tests/test_gpu_service.py``) against that node.
4. the bench (:mod:`bench.gpu`) against it.
5. the page: the machine, each step's outcome and time, the bench's table and the targets.

Only the standard library is imported before step 1 (the image may lack what the rest needs), and
``$OUT`` (the device tool's output folder), when set, receives the page and every step's log.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("service step with shared memory <= 1.5x its floor: the same host passes and transfers in one process "
           "(finite check, host to device, kernel, device to pinned host, copy into the region; 100M parameters). "
           "The kernel alone is not a reachable baseline on a GPU: the bytes cross the host link twice",
           "Shampoo with its roots on a GPU worker <= 1.2x Adafactor's step",
           "issue 57, host-resident: service step <= 1.3x its link floor (kernel + both crossings at the link's "
           "measured speed, memory mapped for the device)",
           "issue 57, device-resident (a PyTorch client on the same GPU): service step <= 3x the kernel")


DEADLINE = [float("inf")]  # monotonic time by which every step has ended (``--budget-s``)


class Step:
    """One step's outcome: its name, exit status, seconds and the tail of its output."""

    def __init__(self, name: str, log_dir: str):
        self.name, self.log_path = name, os.path.join(log_dir, f"{name}.log")
        self.returncode, self.seconds, self.tail = None, 0.0, ""

    def run(self, argv: list[str], timeout_s: float, env=None) -> bool:
        """Runs ``argv``, killed after ``timeout_s`` or at the check's deadline (:data:`DEADLINE`), whichever
        comes first, so the page is always written inside the device call's limit."""
        started = time.monotonic()
        timeout_s = max(1.0, min(timeout_s, DEADLINE[0] - started))
        with open(self.log_path, "w") as log:
            try:
                self.returncode = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                                 timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                self.returncode = 124
        self.seconds = time.monotonic() - started
        with open(self.log_path) as f:
            self.tail = "".join(f.readlines()[-15:])
        print(f"gpu-check: {self.name}: {'ok' if self.ok else f'FAILED ({self.returncode})'} "
              f"in {self.seconds:.0f} s", flush=True)
        if not self.ok:
            print(self.tail, flush=True)
        return self.ok

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def line(self) -> str:
        return f"| {self.name} | {'ok' if self.ok else f'failed ({self.returncode})'} | {self.seconds:.0f} s |"


def gpu_names() -> list[str]:
    """The machine's GPUs as ``nvidia-smi -L`` names them (empty: none, or no driver)."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split(":", 1)[1].split("(")[0].strip() for line in listing.splitlines() if line.startswith("GPU ")]


def install(wheels: str, site: str, step: Step) -> bool:
    """Step 1: the wheels into ``site`` (emptied first)."""
    found = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not found:
        step.returncode, step.tail = 2, f"no wheels in {wheels!r}: build them here with `make gpu-wheels`"
        print(f"gpu-check: {step.tail}", flush=True)
        return False
    shutil.rmtree(site, ignore_errors=True)
    return step.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                     "--no-cache-dir", "--target", site, *found], timeout_s=300)


def page(args, gpus: list[str], steps: list[Step], table: str, wheel_bytes: int) -> str:
    """The markdown page (``docs/gpu.md``)."""
    mode = "dry run: JAX on the CPU, GPUs rehearsed in Ray" if args.cpu else "on the GPU"
    machine = ", ".join(gpus) or "no GPU"
    lines = [
        "## The GPU kit's report", "",
        f"Written by `{' '.join(['python -m bench.gpu_check'] + args.argv)}` ({mode}) on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.", "",
        f"- machine: {machine}; {os.cpu_count()} CPUs; Python {platform.python_version()}",
        f"- wheels installed: {wheel_bytes / 2**20:.1f} MiB" if wheel_bytes else "- wheels installed: none",
        "", "| step | outcome | time |", "| --- | --- | --- |", *[s.line() for s in steps], "",
        "### Bench", "", "```", table.strip() or "(the bench did not run)", "```", "",
        "### Targets", "", *[f"- {t}" for t in TARGETS], "",
    ]
    failed = [s for s in steps if not s.ok]
    if failed:
        lines += ["### Failures", ""]
        for s in failed:
            lines += [f"#### {s.name}", "", "```", s.tail.strip(), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run: one logical GPU, JAX on the CPU")
    parser.add_argument("--small", action="store_true", help="the bench's small model (seconds, not minutes)")
    parser.add_argument("--wheels", default=os.path.join(ROOT, ".gpu-wheels"), help="'' to skip the install")
    parser.add_argument("--site", default="/tmp/optserve-gpu-site")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "gpu.md"))
    parser.add_argument("--log-dir", default="/tmp/optserve-gpu-check")
    parser.add_argument("--sections", default="kernel,service,shampoo", help="the bench's sections (bench.gpu)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="every step ends within this many seconds of the start (the device call's limit)")
    args = parser.parse_args(argv)
    DEADLINE[0] = time.monotonic() + args.budget_s
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.log_dir, exist_ok=True)
    steps, table, wheel_bytes = [], "", 0
    gpus = gpu_names()
    if not gpus and not args.cpu:  # before anything is installed or written: the page stays as it is
        print("gpu-check: no GPU here (nvidia-smi lists none): --cpu runs the dry run", file=sys.stderr)
        return 2
    if args.wheels:
        step = Step("install", args.log_dir)
        steps.append(step)
        if not install(args.wheels, args.site, step):
            return finish(args, [], steps, table, 0)
        wheel_bytes = sum(os.path.getsize(w) for w in glob.glob(os.path.join(args.wheels, "*.whl")))
        os.environ["PYTHONPATH"] = os.pathsep.join([args.site, ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # this process's JAX: what it uses
    from bench.ray_cluster import ray_cluster  # standard library only

    with ray_cluster(num_cpus=min(8, os.cpu_count() or 1), num_gpus=len(gpus) if gpus and not args.cpu else 1) as ray:
        env = dict(os.environ, OPTSERVE_GPU_RAY_ADDRESS=ray, OPTSERVE_GPU_REHEARSAL="1" if args.cpu else "0")
        tests = Step("gpu-tests", args.log_dir)
        steps.append(tests)
        tests.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_service.py"],
                  timeout_s=360, env=env)
        bench = Step("bench", args.log_dir)
        steps.append(bench)
        table_path = os.path.join(args.log_dir, "bench.txt")
        if os.path.exists(table_path):
            os.remove(table_path)
        bench.run([sys.executable, "-m", "bench.gpu", "--ray-address", ray, "--out", table_path,
                   "--log-dir", os.path.join(args.log_dir, "servers"), "--sections", args.sections] + (["--rehearse"] if args.cpu else [])
                  + (["--small"] if args.small else []), timeout_s=420, env=env)
        if os.path.exists(table_path):  # the bench rewrites it after each section: a cut run leaves a part
            with open(table_path) as f:
                table = f.read()
    return finish(args, gpus, steps, table, wheel_bytes)


REPORT_MARK = "<!-- the GPU kit's report follows: bench/gpu_check.py rewrites everything below -->"


def kept_guide(path: str) -> str:
    """What ``path`` holds above :data:`REPORT_MARK` (the users' guide the page opens with), with
    the mark; empty when it has no mark (the whole page is the report)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return ""
    head, mark, _ = text.partition(REPORT_MARK)
    return head + mark + "\n\n" if mark else ""


def finish(args, gpus, steps, table, wheel_bytes) -> int:
    """Writes the page (and copies it with the logs to ``$OUT``); 0 when every step passed."""
    text = kept_guide(args.out) + page(args, gpus, steps, table, wheel_bytes)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"gpu-check: wrote {args.out}", flush=True)
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        shutil.copy(args.out, os.path.join(out, "gpu.md"))
        for log in glob.glob(os.path.join(args.log_dir, "*.log")):
            shutil.copy(log, out)
    return 0 if steps and all(s.ok for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
