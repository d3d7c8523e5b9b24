"""A real two-node Ray cluster on this machine, started as a user starts one (``ray start``), and
``optserve serve --ray-address HEAD`` joining it: the shards land on both nodes, and training
through them equals the kernel run in process.

Everything runs in subprocesses: the two Ray nodes (``ray start --block``, each in its own process
group and its own ``--temp-dir``, so neither this pytest process's own local Ray nor the default
``/tmp/ray`` sees them) and the server. Teardown stops exactly those: the server (SIGTERM, then
SIGKILL), each node's ``ray start --block`` (SIGTERM: it stops its node's processes), and then any
process still naming the test's temp dir. It never runs ``ray stop``, which would stop every Ray
on the machine.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

from bench.ray_cluster import driver_value, free_port, ray_cluster, Started, STOP_TIMEOUT_S
from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import Client

pytestmark = pytest.mark.slow

ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head and a worker node (``ray start``), one CPU each; yields the head's GCS address."""
    with ray_cluster(({"node_a": 1}, {"node_b": 1})) as address:
        yield address


def _placement_groups(address: str) -> list[dict]:
    """The cluster's placement groups, as a separate Ray driver sees them."""
    return driver_value(address, "list(ray.util.placement_group_table().values())")


def test_serve_on_a_two_node_cluster_spreads_its_shards_and_trains_like_the_kernel(two_node_cluster, tmp_path):
    server = Started("optserve", [sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0",
                                   "--shards", "4", "--ray-address", two_node_cluster, "--min-shard-bytes", "0"],
                      str(tmp_path))
    try:
        address = server.wait_for("optserve listening on ").split()[-1]
        params = make_params()  # 4 tensors: one on each shard
        with Client(address, timeout=60) as client:
            session = client.create_session("multinode", params, optimizer=ADAM)
            shards = session.status().shards
            assert [s.index for s in shards] == [0, 1, 2, 3]
            nodes = [s.node_id for s in shards]
            assert all(nodes) and sorted(nodes.count(n) for n in set(nodes)) == [2, 2], nodes  # 2 per node

            # the shards run in one SPREAD placement group, a bundle each, on the nodes they report
            (group,) = [g for g in _placement_groups(two_node_cluster) if g["state"] == "CREATED"]
            assert group["strategy"] == "SPREAD" and len(group["bundles"]) == 4, group
            assert sorted(group["bundles_to_node_id"].values()) == sorted(nodes), group

            reference = InProcess(ADAM["name"], ADAM["args"], params)
            for step in range(3):
                grads = make_grads(params, step)
                got = session.push_pull(grads)
                assert max_abs_diff(got, reference.step(grads)) <= 1e-6
            status = session.status()
            assert (status.version, status.steps_applied) == (3, 3)
            session.close()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=STOP_TIMEOUT_S + 30) == 0, server.output()[-4000:]
        assert "optserve shutting down" in server.output()
    finally:
        server.stop()


def test_a_durable_coordinator_killed_on_a_cluster_reattaches_to_its_running_shards(two_node_cluster, tmp_path):
    """``--ray-address`` + ``--checkpoint-dir``: the shard actors are named and detached, so they
    outlive a coordinator killed with SIGKILL; the next coordinator with the same checkpoint folder
    re-attaches to them (same addresses, nothing restored) and training goes on exactly."""
    port = free_port()
    argv = [sys.executable, "-m", "optserve.server.cli", "serve", "--port", str(port), "--shards", "2",
            "--ray-address", two_node_cluster, "--min-shard-bytes", "0", "--precond-workers", "1",
            "--checkpoint-dir", str(tmp_path / "checkpoints")]
    first = Started("optserve-first", argv, str(tmp_path))
    second = None
    try:
        address = first.wait_for("optserve listening on ").split()[-1]
        params = make_params(2)
        reference = InProcess(ADAM["name"], ADAM["args"], params)
        client = Client(address, timeout=120)
        session = client.create_session("reattach", params, optimizer=ADAM)
        shampoo_args = {"learning_rate": 0.01, "block_size": 8, "start_preconditioning_step": 2}
        shampoo_reference = InProcess("shampoo", shampoo_args, params)
        shampoo = client.create_session("reattach-shampoo", params, optimizer={  # roots from the worker
            "name": "shampoo", "args": shampoo_args, "preconditioners": {"max_age": 0}})
        for step in range(3):
            grads = make_grads(params, step)
            got, expected = session.push_pull(grads), reference.step(grads)
            shampoo.push_pull(grads), shampoo_reference.step(grads)
        before = [s.address for s in session.status().shards]

        os.killpg(first.process.pid, signal.SIGKILL)  # the coordinator only: the Ray nodes keep running
        first.process.wait(timeout=STOP_TIMEOUT_S)
        second = Started("optserve-second", argv, str(tmp_path))
        second.wait_for("optserve listening on ")
        assert "event=shards_reattached shards=0,1" in second.output(), second.output()[-4000:]
        status = session.status()
        assert [s.address for s in status.shards] == before
        assert [s.durability.recoveries for s in status.shards] == [0, 0]  # kept in memory, not reloaded
        for step in range(3, 6):
            grads = make_grads(params, step)
            got, expected = session.push_pull(grads), reference.step(grads)
            shampoo_got, shampoo_expected = shampoo.push_pull(grads), shampoo_reference.step(grads)
        assert max_abs_diff(got, expected) <= 1e-6
        assert max_abs_diff(shampoo_got, shampoo_expected) <= 1e-5  # the re-attached worker computes its roots
        assert all(s.root_offload.roots_installed > 0 for s in shampoo.status().shards)
        shampoo.close()
        session.close()
        client.close()
        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(timeout=STOP_TIMEOUT_S + 30) == 0, second.output()[-4000:]
    finally:
        for server in (first, second):
            if server is not None:
                server.stop()
