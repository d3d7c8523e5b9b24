"""Muon through the real service: sync mode, one client, two shards reproduce the kernel in process.

20 steps of push_pull must equal 20 jitted steps of the same kernel over the whole model in this
process (max abs difference <= 1e-6). The model holds matrices (one labelled for AdamW), a 3-D
tensor given matrix axes, vectors and a scalar, split across both shards: each shard decides its
tensors' paths from their names and shapes alone, so the split must not change any update.
"""

from __future__ import annotations

import pytest
from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import Client

STEPS = 20
SHAPES = {"embed": (16, 12), "hidden/w": (12, 20), "hidden/b": (20,), "out/w": (20, 6), "experts": (2, 6, 4),
          "gain": ()}

CASES = {
    "defaults": {"learning_rate": 0.01},
    "labels_axes_and_decay": {
        "learning_rate": 0.01,
        "nesterov": False,
        "ns_steps": 4,
        "weight_decay": 0.05,
        "adam_weight_decay": 0.01,
        "adam_learning_rate": 0.003,
        "adam_tensors": ["embed"],
        "muon_weight_dimension_numbers": {"experts": {"reduction_axis": 1, "output_axis": 2}},
    },
}


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


@pytest.mark.parametrize("case", list(CASES))
def test_muon_on_two_shards_matches_the_in_process_kernel_for_20_steps(client, unique_name, case):
    args = CASES[case]
    params = make_params(seed=4, shapes=SHAPES)
    reference = InProcess("muon", args, params)
    session = client.create_session(unique_name, params, optimizer={"name": "muon", "args": args})
    try:
        assert len(session.info.shards) == 2
        worst = 0.0
        for step in range(STEPS):
            grads = make_grads(params, step, seed=7)
            got = session.push_pull(grads)
            expected = reference.step(grads)
            worst = max(worst, max_abs_diff(got, expected))
        assert session.version == STEPS
        assert worst <= 1e-6, f"muon {case}: max abs difference {worst:.3g} over {STEPS} steps"
        assert max_abs_diff(got, params) > 1e-3  # the optimizer really moved the parameters
    finally:
        session.close()
