"""optserve across separate hosts (bench/netbed.py: Linux network namespaces on a bridge, each its
own /dev/shm): the deployment docs/operating.md describes, a partition healed and a host lost
while a client on a fourth host trains, every step checked by the chaos checker (bench/checker.py):
nothing acknowledged lost, nothing applied twice, versions contiguous, the final parameters equal
to an in-process replay of the session's history.

One bed for the module, the tests in order: placement, the shared-memory path, a partition, a
partition long enough that the shard is replaced (the old one fenced), the verdict on a second
client on h2 (shared memory with the shards there), a host lost, the verdict on the client on h4. Skipped where hosts cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from bench.checker import FaultRecord
from bench.netbed import NetBed, Workload, start_cluster, unavailable_reason

pytestmark = [pytest.mark.serial,  # a namespace's host copies the machine's mount table
              pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"no test bed: {unavailable_reason()}")]

STEP_TIMEOUT_S = 30.0  # the training client's timeout: one step's deadline, its retries included
PROBE = os.path.join(os.path.dirname(__file__), "_netbed_probe.py")


@pytest.fixture(scope="module")
def bed():
    with NetBed() as made:
        yield made


@pytest.fixture(scope="module")
def cluster(bed):
    return start_cluster(bed)


@pytest.fixture(scope="module")
def workload(cluster):
    work = Workload(cluster, timeout_s=STEP_TIMEOUT_S)
    work.wait_steps(5)
    return work


@pytest.fixture(scope="module")
def neighbour(cluster):
    """A second training client, on h2, sharing memory with the shards on its own host."""
    work = Workload(cluster, host="h2", name="netbed-h2", timeout_s=STEP_TIMEOUT_S, shared_memory=True)
    work.wait_steps(5)
    return work


def probe(bed: NetBed, host: str, address: str, session: str) -> list[dict]:
    """What a client on ``host`` sees of ``session``'s shards (tests/_netbed_probe.py)."""
    run = bed.hosts[host].spawn(f"probe-{host}-{time.monotonic_ns()}", [sys.executable, PROBE, address, session])
    assert run.process.wait(timeout=120) == 0, run.output()[-3000:]
    return json.loads(run.output().strip().splitlines()[-1])["shards"]


def test_shards_spread_over_the_ray_nodes_and_advertise_their_hosts_address(bed, cluster, workload):
    shards = probe(bed, "h4", cluster.address, workload.name)
    hosts = {h.address: name for name, h in bed.hosts.items()}
    placed = sorted(hosts[s["address"].rsplit(":", 1)[0]] for s in shards)
    assert placed == ["h2", "h3"], shards  # never 127.0.0.1, never the head (no CPU for tasks there)
    assert len({s["node_id"] for s in shards}) == 2 and all(s["node_id"] for s in shards), shards


@pytest.mark.parametrize("host", [None, "h1"])
def test_a_server_whose_shards_on_other_hosts_could_not_serve_there_refuses_to_start(bed, cluster, host):
    """``optserve serve --ray-address HEAD`` on h1 without ``--shard-host``: its shards land on h2
    and h3 (the head has no CPU for them), and ``--shard-host`` defaults to ``--host``. Without
    ``--host`` they would advertise 127.0.0.1, which no client on another host reaches; with
    ``--host`` h1's address (docs/operating.md's command less ``--shard-host``) they could not
    listen on it. It exits 2 with one line naming the shard, its node and ``--shard-host``, and
    leaves no shard behind (the running server's two are all the cluster holds)."""
    docs_head = cluster.node_argv[cluster.node_argv.index("--address") + 1]  # the docs' address: h1's port
    head = f"{bed.hosts['h1'].address}:{docs_head.rsplit(':', 1)[1]}"
    on_host = ["--host", bed.hosts[host].address, "--insecure"] if host else []
    argv = [sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0", "--shards", "2", "--ray-address", head]
    run = bed.hosts["h1"].spawn(f"serve-on-{host or 'loopback'}", [*argv, *on_host])
    assert run.process.wait(timeout=180) == 2, run.output()[-3000:]
    said = [line for line in run.output().splitlines() if line.startswith("optserve serve:")]
    assert len(said) == 1, run.output()[-3000:]
    wrong = (f"cannot listen on {bed.hosts[host].address} (--host {bed.hosts[host].address}, which --shard-host "
             "defaults to)") if host else "would advertise 127.0.0.1 (--host 127.0.0.1, which --shard-host defaults to)"
    assert wrong in said[0] and "give --shard-host 0.0.0.0" in said[0], said
    assert any(f"on node {bed.hosts[h].address} " in said[0] for h in ("h2", "h3")), said
    script = ("import json, ray; ray.init(address=%r, log_to_driver=False, include_dashboard=False); print('GROUPS', "
              "json.dumps([g['state'] for g in ray.util.placement_group_table().values()]))" % head)
    driver = bed.hosts["h1"].spawn("groups-after-refusal", [sys.executable, "-c", script])
    assert driver.process.wait(timeout=120) == 0, driver.output()[-3000:]
    groups = json.loads(driver.wait_for("GROUPS ").split(" ", 1)[1])
    assert groups.count("CREATED") == 1, groups


def test_shared_memory_only_where_client_and_shard_share_a_host(bed, cluster, workload):
    assert not any(s["shared_memory"] for s in probe(bed, "h4", cluster.address, workload.name))
    on_h2 = probe(bed, "h2", cluster.address, workload.name)
    local = {s["index"]: s["address"].startswith(bed.hosts["h2"].address + ":") for s in on_h2}
    assert {s["index"]: s["shared_memory"] for s in on_h2} == local and sum(local.values()) == 1, on_h2


def test_a_partitioned_shard_host_healed_trains_on(bed, workload, neighbour):
    cut = time.time()
    bed.partition("h3")
    time.sleep(2.0)  # shorter than Ray takes to declare a node dead (docs/operating.md: about 4.5 s)
    healed = time.time()
    bed.heal("h3")
    for work in (workload, neighbour):
        work.faults.append(FaultRecord("partition", "h3", cut, healed))
    for work in (workload, neighbour):
        work.wait_steps(10, after=healed, timeout_s=STEP_TIMEOUT_S)


def test_a_shard_cut_off_past_rays_death_timeout_is_fenced_and_replaced(bed, cluster, workload, neighbour):
    """h3 cut off for longer than Ray takes to declare its node dead: the server restores h3's
    shard on h2 from the checkpoint folder and training goes on while h3 is still cut off. The old
    shard, alive on h3 and still seeing the shared folder, finds its ownership claimed by its
    replacement and exits on its own (``event=shard_fenced``) before the link comes back: it
    writes nothing after its replacement exists. Then h3 rejoins as a fresh Ray node."""
    h3 = bed.hosts["h3"]
    (old,) = h3.shard_pids()
    cut = time.time()
    bed.partition("h3")
    try:
        for work in (workload, neighbour):  # served by the replacement on h2
            work.wait_steps(5, after=cut, timeout_s=3 * STEP_TIMEOUT_S)
        deadline = time.monotonic() + 30.0
        while old in h3.shard_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert old not in h3.shard_pids(), "the replaced shard still runs on the cut-off host"
        assert _fenced_in_logs(h3.folder), "the old shard did not exit as fenced"
    finally:
        healed = time.time()
        bed.heal("h3")
        for work in (workload, neighbour):
            work.faults.append(FaultRecord("partition", "h3", cut, healed))
    cluster.rejoin("h3")
    workload.wait_steps(5, after=time.time(), timeout_s=STEP_TIMEOUT_S)


def test_a_client_on_a_shard_host_shares_memory_with_its_shards_and_loses_nothing(neighbour):
    """The h2 client through both partitions: once h3's shard was restored on h2, it reaches both
    shards through shared memory; every step it was acknowledged applied exactly once."""
    report = neighbour.stop()
    assert report.clean, report.problems()
    assert report.lost == 0 and report.duplicated == 0 and report.sessions[0].acked >= 20
    assert neighbour.data_paths() == {0: "shared_memory", 1: "shared_memory"}


def _fenced_in_logs(folder: str) -> bool:
    """Whether a process's log under ``folder`` (a host's Ray logs) says a shard exited fenced."""
    for where, _, names in os.walk(folder):
        for name in names:
            try:
                with open(os.path.join(where, name), "rb") as f:
                    if b"event=shard_fenced" in f.read():
                        return True
            except OSError:
                pass
    return False


def test_a_lost_host_costs_the_client_one_slow_step_not_its_session(bed, workload):
    """Link down, every process of h2 SIGKILLed: keepalive ends the client's calls to it, Ray
    declares the node dead, the shard is restored on h3 from the checkpoint folder and step log,
    and the client, reading the shard map again, resends its step there."""
    lost = time.time()
    bed.lose_host("h2")
    workload.faults.append(FaultRecord("host_lost", "h2", lost, lost))
    first = workload.wait_steps(10, after=lost, timeout_s=3 * STEP_TIMEOUT_S)
    assert first - lost < STEP_TIMEOUT_S  # within the step's own deadline: never a dead connection's wait


def test_every_acknowledged_step_applied_exactly_once_and_replays(workload):
    report = workload.stop()
    assert report.clean, report.problems()
    (session,) = report.sessions
    assert session.acked >= 25 and report.lost == 0 and report.duplicated == 0
    assert session.replay_max_diff <= session.tolerance
