"""Regenerates the committed Python code for protos/optserve/v1/*.proto (the one way to do it).

    .venv/bin/python scripts/generate_protos.py            # writes next to the .proto files
    .venv/bin/python scripts/generate_protos.py --out DIR  # writes DIR/optserve/v1/*_pb2*.py

protoc emits ``from optserve.v1 import x_pb2``; the package is installed as
``optserve.protos.optserve.v1``, so those imports are rewritten to resolve there.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent.parent / "protos"
PROTO_DIR = PROTO_ROOT / "optserve" / "v1"
_IMPORT = re.compile(r"^from optserve\.v1 import (\w+_pb2)", re.MULTILINE)


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Runs protoc on every .proto under protos/optserve/v1 into ``out_root``; returns the files."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = sorted((out_root / "optserve" / "v1").glob("*_pb2*.py"))
    for path in written:
        text = path.read_text()
        path.write_text(_IMPORT.sub(r"from optserve.protos.optserve.v1 import \1", text))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_ROOT, help="output root")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
