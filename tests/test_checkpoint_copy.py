"""A checkpoint of a shard's state larger than ``checkpoint_copy_max_bytes`` is written from where
the state lies (no host copy of it), before the call returns; a smaller one is copied so steps go
on (its memory kept for the next one), and both restore exactly. The write itself holds no copy
(:mod:`optserve.server.storage.orbax_trees`), so the in-place write peaks at about 0x the state
and the copy at 1x."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = r"""
import json, sys
import numpy as np
from optserve.server.domain.durability import DurabilityConfig, ShardProgress
from optserve.server.storage import ShardStore

folder, copy_max, copied = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "copied"
state_bytes = 96 << 20
params = {"w": np.random.default_rng(0).standard_normal(state_bytes // 8, dtype=np.float32)}
opt_state = {"m": np.ones(state_bytes // 8, np.float32)}


def rss(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))


store = ShardStore(folder, "copy", 0, DurabilityConfig(folder, checkpoint_copy_max_bytes=copy_max), home=False)
store.start_logs(None)
store.checkpoint(ShardProgress(0, 0, {}), {"w": np.ones(8, np.float32)}, {"m": np.ones(8, np.float32)}, wait=True)
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # the peak resident set starts again from here (orbax loaded and warm)
before = rss("VmRSS")
for version in (1, 2):
    store.checkpoint(ShardProgress(version, 0, {}), params, opt_state, copied=copied)
    written = store.durable_version  # read before waiting: a checkpoint written in place is done already
    store.wait()
growth, kept = (rss("VmHWM") - before) / state_bytes, (rss("VmRSS") - before) / state_bytes
restored = store.restore_arrays(store.latest(), {"params": params, "opt_state": opt_state})
exact = bool(np.array_equal(restored["params"]["w"], params["w"]) and np.array_equal(restored["opt_state"]["m"],
                                                                                   opt_state["m"]))
print(json.dumps({"growth": growth, "kept": kept, "written_at_return": written, "exact": exact}))
"""


def _run(tmp_path, copy_max: int, copied: bool = False) -> dict:
    folder = str(tmp_path / f"copy-{copy_max}-{copied}")
    out = subprocess.run([sys.executable, "-c", _CHILD, folder, str(copy_max), "copied" if copied else "live"],
                         capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_a_state_over_the_copy_bound_is_checkpointed_in_place_and_a_smaller_one_as_a_copy(tmp_path):
    in_place, copied = _run(tmp_path, 0), _run(tmp_path, 1 << 40)
    assert in_place["exact"] and copied["exact"]
    assert in_place["written_at_return"] == 2  # the steps waited for it
    assert in_place["growth"] < 0.3, in_place  # no copy at all: written from where it lies
    assert 0.9 < copied["growth"] < 1.4, copied  # one copy, so the steps could go on, and no other
    assert in_place["kept"] < 0.3, in_place  # nothing held between checkpoints
    assert copied["kept"] > 0.9, copied  # the copy's memory, kept for the next checkpoint


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_a_host_copy_made_elsewhere_is_written_as_it_is_without_a_second_copy(tmp_path):
    """An accelerator's state arrives as a host copy already (``copied``): under the copy bound
    its steps go on while that copy is written, and no second copy (nor a spare) is made."""
    adopted = _run(tmp_path, 1 << 40, copied=True)
    assert adopted["exact"]
    assert adopted["written_at_return"] == 1, adopted  # version 2 was still being written: no wait
    assert adopted["growth"] < 0.3 and adopted["kept"] < 0.3, adopted
