"""tensorstore's spec-to-JSON conversion, made leak-free for orbax's checkpoint writes: equal
results, nothing kept per call or per checkpoint."""

from __future__ import annotations

import gc
import sys
import threading
import tracemalloc

import numpy as np
import pytest

ts = pytest.importorskip("tensorstore")

from optserve.server.storage import tensorstore_json  # noqa: E402
from optserve.server.storage.orbax_trees import restore_tree, write_tree  # noqa: E402


def _bytes_kept_per_call(fn, calls: int) -> float:
    fn()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(calls):
            fn()
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / calls
    finally:
        tracemalloc.stop()


_read_back = tensorstore_json._literal_to_json(lambda _spec: None)  # None where it would fall back


def test_the_leak_free_conversion_equals_tensorstores_own_for_paths_of_any_characters():
    assert tensorstore_json.install()
    assert tensorstore_json.probe_disagreement() is None  # against tensorstore's own, kept aside
    own = tensorstore_json.own_to_json("KvStore.Spec")
    assert ts.KvStore.Spec.to_json is not own
    for path in ("/data/run 1/", "/d/it's \"quoted\" \\ x/", "/caf\u00e9/\u2603/\U0001f600/", "/x/" + "y" * 4000 + "/"):
        spec = ts.KvStore.Spec({"driver": "file", "path": path})
        assert _read_back(spec) == spec.to_json() == own(spec)  # (tensorstore reads a backslash as /)
    memory = ts.KvStore.Spec({"driver": "memory", "path": "a\\b'c\u00e91\x01"})  # kept as given: \\ read back
    assert _read_back(memory) == memory.to_json() == own(memory) == {"driver": "memory", "path": "a\\b'c\u00e91\x01"}
    ocdbt = ts.KvStore.Spec({"driver": "ocdbt", "base": {"driver": "file", "path": "/d/"}, "path": "p.q",
                             "config": {"compression": None, "max_inline_value_bytes": 7}})
    assert _read_back(ocdbt) == ocdbt.to_json() == own(ocdbt)
    assert ocdbt.to_json(include_defaults=True) == own(ocdbt, include_defaults=True)  # tensorstore's own path
    array = ts.Spec({"driver": "zarr", "kvstore": {"driver": "memory"},
                     "metadata": {"dtype": "<f8", "shape": [2, 3], "chunks": [2, 3], "fill_value": 1e-300,
                                  "compressor": None}})
    assert array.to_json() == tensorstore_json.own_to_json("Spec")(array)
    # a spec with no JSON form raises as tensorstore does (its repr is "Spec(...)")
    virtual = ts.virtual_chunked(lambda domain, array, params: None, dtype=ts.uint8, shape=[2]).spec()
    with pytest.raises(NotImplementedError):
        virtual.to_json()


def test_a_tensorstore_whose_specs_do_not_read_back_keeps_its_own_conversion_and_says_so_once(caplog):
    refused_probe = [("KvStore.Spec", {"driver": "file", "path": "/x/", "no_such_member": 1})]
    assert "no_such_member" in tensorstore_json.probe_disagreement(refused_probe)
    before = ts.KvStore.Spec.to_json
    replacement = tensorstore_json._Replacement(refused_probe)
    with caplog.at_level("WARNING", logger=tensorstore_json.__name__):
        assert not replacement.install() and not replacement.install()
    assert ts.KvStore.Spec.to_json is before
    assert [r.message.split()[0] for r in caplog.records] == ["event=tensorstore_to_json_kept"]


def test_converting_a_spec_compiles_nothing_so_threads_may_convert_at_once():
    # CPython 3.11's compiler keeps its AST depth per interpreter: ast.literal_eval in several
    # threads at once can fail with "SystemError: AST constructor recursion depth mismatch"
    # (seen in a soak's checkpoint writes), in this conversion or in any other thread's compile
    assert tensorstore_json.install()
    spec = ts.KvStore.Spec({"driver": "ocdbt", "base": {"driver": "file", "path": "/d/"}, "path": "p"})
    events = []
    watching = threading.local()
    sys.addaudithook(lambda event, _args: events.append(event) if getattr(watching, "on", False)
                     and event == "compile" else None)
    watching.on = True
    try:
        assert spec.to_json()["driver"] == "ocdbt"
    finally:
        watching.on = False
    assert events == []


def test_converting_a_spec_keeps_no_memory_once_installed():
    assert tensorstore_json.install()
    spec = ts.KvStore.Spec({"driver": "file", "path": "/data/checkpoints/"})
    assert _bytes_kept_per_call(spec.to_json, 2000) < 8


def test_a_checkpoint_write_and_restore_convert_every_spec_without_tensorstores_conversion(tmp_path):
    tree = {f"t{i}": np.full((8, 4), i, np.float32) for i in range(6)}
    before = tensorstore_json.conversions()
    write_tree(str(tmp_path / "ckpt"), tree)
    restored = restore_tree(str(tmp_path / "ckpt"))
    after = tensorstore_json.conversions()
    assert all(np.array_equal(restored[k], v) for k, v in tree.items())
    assert after["read_back"] - before["read_back"] >= 8 + 6  # orbax's per-array specs, written and read
    assert after["fell_back"] == before["fell_back"]
