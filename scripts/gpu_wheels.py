"""Builds the wheel folder the GPU kit installs on a lent device (``make gpu-wheels``; needs PyPI).

    .venv/bin/python scripts/gpu_wheels.py [--python-version 3.12] [--out .gpu-wheels]

The device image has JAX with CUDA, numpy, optax, orbax, prometheus-client and tqdm, but no Ray and
no network. This downloads, at the versions ``constraints.txt`` pins, the packages it lacks
(:data:`DEVICE_LACKS`) as manylinux x86-64 wheels for that Python, plus those whose version the
committed generated code checks (grpcio, protobuf). Ray's wheel is repacked without the parts the
server never loads (:data:`RAY_UNUSED`: its Java jars, the dashboard's web page, RLlib), and an
optserve wheel is built from the working tree. The folder must stay under :data:`LIMIT_BYTES`
(the device's transfer budget is shared with the tree). ``--python-version`` of this interpreter
gives a folder this machine can install: the kit's dry run installs it to prove the recipe.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_LACKS = ("ray", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "grpcio",
                "grpcio-health-checking", "grpcio-reflection", "protobuf", "cryptography", "cffi", "pycparser",
                "google-crc32c")
RAY_UNUSED = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/")
LIMIT_BYTES = 60 * 2**20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def pinned(names, constraints_path: str = os.path.join(ROOT, "constraints.txt")) -> list[str]:
    """``name==version`` for each of ``names`` as ``constraints.txt`` pins it.

    Raises:
      SystemExit: a name ``constraints.txt`` does not pin.
    """
    pins = {}
    with open(constraints_path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                pins[name.strip().lower().replace("_", "-")] = version.strip()
    missing = [n for n in names if n not in pins]
    if missing:
        raise SystemExit(f"gpu_wheels: constraints.txt pins no version of {', '.join(missing)}")
    return [f"{n}=={pins[n]}" for n in names]


def strip_wheel(path: str, unused_prefixes) -> int:
    """Rewrites the wheel at ``path`` without the files under ``unused_prefixes`` (its RECORD
    rewritten to match, so pip installs it); returns the bytes saved."""
    before = os.path.getsize(path)
    kept_dir = tempfile.mkdtemp(dir=os.path.dirname(path))
    try:
        out_path = os.path.join(kept_dir, os.path.basename(path))
        with zipfile.ZipFile(path) as source, zipfile.ZipFile(out_path, "w", zipfile.ZIP_DEFLATED) as out:
            record_name = next(n for n in source.namelist() if n.endswith(".dist-info/RECORD"))
            records = []
            for info in source.infolist():
                if info.filename == record_name or info.filename.startswith(tuple(unused_prefixes)):
                    continue
                data = source.read(info)
                out.writestr(info, data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                records.append(f"{info.filename},sha256={digest},{len(data)}")
            records.append(f"{record_name},,")
            out.writestr(record_name, "\n".join(records) + "\n")
        os.replace(out_path, path)
    finally:
        shutil.rmtree(kept_dir, ignore_errors=True)
    return before - os.path.getsize(path)


def download(requirements, out: str, python_version: str) -> None:
    """Binary wheels of ``requirements`` (no dependencies) for CPython ``python_version`` on x86-64 Linux."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "-d", out,
                    *requirements], check=True)


def build(out: str, python_version: str) -> int:
    """Fills ``out`` (emptied first); returns the folder's bytes.

    Raises:
      SystemExit: the folder is over :data:`LIMIT_BYTES`.
    """
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    download(pinned(DEVICE_LACKS), out, python_version)
    (ray_wheel,) = [n for n in os.listdir(out) if n.startswith("ray-")]
    saved = strip_wheel(os.path.join(out, ray_wheel), RAY_UNUSED)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", out, ROOT], check=True)
    sizes = {name: os.path.getsize(os.path.join(out, name)) for name in sorted(os.listdir(out))}
    total = sum(sizes.values())
    for name, size in sizes.items():
        print(f"{size / 2**20:7.2f} MiB  {name}")
    print(f"{total / 2**20:7.2f} MiB  in all, for CPython {python_version} (Ray repacked without "
          f"{', '.join(RAY_UNUSED)}: {saved / 2**20:.1f} MiB less)")
    if total > LIMIT_BYTES:
        raise SystemExit(f"gpu_wheels: {total / 2**20:.1f} MiB is over the kit's {LIMIT_BYTES / 2**20:.0f} MiB")
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12", help="the device's Python (3.12 in its image)")
    parser.add_argument("--out", default=os.path.join(ROOT, ".gpu-wheels"))
    args = parser.parse_args(argv)
    build(args.out, args.python_version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
