"""The committed *_pb2*.py files are exactly what scripts/generate_protos.py produces."""

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("generate_protos", REPO / "scripts" / "generate_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_generated_code_matches_a_fresh_regeneration(tmp_path):
    fresh = _load_generator().generate(tmp_path)
    committed_dir = REPO / "protos" / "optserve" / "v1"
    assert {p.name for p in fresh} == {p.name for p in committed_dir.glob("*_pb2*.py")}
    for path in fresh:
        assert path.read_text() == (committed_dir / path.name).read_text(), (
            f"{path.name} is out of date: run scripts/generate_protos.py"
        )


def test_generated_imports_resolve_inside_the_installed_package():
    from optserve.protos.optserve.v1 import control_pb2_grpc, data_pb2_grpc, tensor_pb2

    assert tensor_pb2.DTYPE_UNSPECIFIED == 0
    assert hasattr(control_pb2_grpc, "ControlStub") and hasattr(data_pb2_grpc, "ShardDataStub")
