"""The GPU kit proven here: its dry run end to end (a Ray node declaring a logical GPU, the GPU
tests and the bench with the GPU rehearsed, the page written), and the wheel folder's recipe (pins
for everything the device lacks; Ray's wheel repacked so pip installs it)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from bench.gpu_check import REPORT_MARK
from scripts.gpu_wheels import DEVICE_LACKS, pinned, strip_wheel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_kits_dry_run_runs_the_gpu_tests_and_the_bench_and_writes_the_page(tmp_path):
    out = tmp_path / "gpu.md"
    out.write_text(f"# guide\n\nhow to install\n\n{REPORT_MARK}\n\nan old report\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OUT")}
    result = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu", "--small", "--wheels", "",
                             "--out", str(out), "--log-dir", str(tmp_path / "logs")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    page = out.read_text()
    assert "| gpu-tests | ok |" in page and "| bench | ok |" in page, page
    assert "service step, host-resident (CPU shard), 2 shard(s) at 0.5 GPU" in page and "Shampoo step" in page, page
    assert page.startswith(f"# guide\n\nhow to install\n\n{REPORT_MARK}\n\n## The GPU kit's report") and "old report" not in page
    tests_log = (tmp_path / "logs" / "gpu-tests.log").read_text()
    assert "3 passed" in tests_log, tests_log[-3000:]  # run, not skipped


def test_the_kit_on_a_machine_without_a_gpu_says_so_in_one_line_and_leaves_the_page_alone(tmp_path):
    out = tmp_path / "gpu.md"
    out.write_text("the H200 report")
    env = dict(os.environ, PATH=str(tmp_path))  # no nvidia-smi on the PATH: no GPU listed
    result = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--wheels", str(tmp_path / "none"),
                             "--out", str(out), "--log-dir", str(tmp_path / "logs")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "no GPU here" in result.stderr and out.read_text() == "the H200 report"


def test_every_package_the_device_lacks_is_pinned():
    requirements = pinned(DEVICE_LACKS)
    assert len(requirements) == len(DEVICE_LACKS) and all("==" in r for r in requirements)
    assert any(r.startswith("ray==") for r in requirements)


def test_a_repacked_wheel_drops_the_unused_parts_and_still_installs(tmp_path):
    wheel = tmp_path / "demo_pkg-1.0-py3-none-any.whl"
    files = {"demo_pkg/__init__.py": "VALUE = 1\n", "demo_pkg/jars/big.jar": "x" * 10000,
             "demo_pkg/core.py": "def f():\n    return 2\n",
             "demo_pkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: demo_pkg\nVersion: 1.0\n",
             "demo_pkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("demo_pkg-1.0.dist-info/RECORD", "".join(f"{n},,\n" for n in files) + "demo_pkg-1.0.dist-info/RECORD,,\n")
    saved = strip_wheel(str(wheel), ("demo_pkg/jars/",))
    assert saved > 0
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("demo_pkg-1.0.dist-info/RECORD").decode()
    assert "demo_pkg/jars/big.jar" not in names and "demo_pkg/jars/" not in record
    assert "demo_pkg/core.py,sha256=" in record
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, timeout=120)
    assert (site / "demo_pkg" / "core.py").exists() and not (site / "demo_pkg" / "jars").exists()
