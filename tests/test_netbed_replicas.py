"""``--replicas 2`` across separate hosts (bench/netbed.py): the deployment of docs/operating.md
(durable: ``--checkpoint-dir`` on the folder every host sees) with each shard's state held in two
hosts' memory too; a promoted standby takes its shard's files, and a primary cut off is fenced
off them. A client on h4 trains a sync
session pushing every 50 ms while a shard host is lost; every step is checked by the chaos
checker (bench/checker.py): nothing acknowledged lost, nothing applied twice, versions contiguous,
the final parameters equal to an in-process replay of the session's history.

One bed for the module, the tests in order. Skipped where hosts cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import time

import pytest

from bench.checker import FaultRecord
from bench.netbed import NetBed, Workload, stall, start_cluster, unavailable_reason
from bench.netbed_replicas import host_of, server_status, wait_in_sync

pytestmark = [pytest.mark.serial,  # a namespace's host copies the machine's mount table
              pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None, reason=f"no test bed: {unavailable_reason()}")]

STEP_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def bed():
    with NetBed() as made:
        yield made


@pytest.fixture(scope="module")
def cluster(bed):
    return start_cluster(bed, replicas=2, durable=True)


@pytest.fixture(scope="module")
def workload(cluster):
    work = Workload(cluster, timeout_s=STEP_TIMEOUT_S)
    work.wait_steps(5)
    return work


def test_each_shards_standby_runs_on_the_other_host_and_holds_the_session_in_sync(bed, cluster, workload):
    deadline = time.monotonic() + 60
    while True:  # the standbys start once the session has its initial values
        shards = server_status(bed, cluster.address)
        if all(s["standby"] and s["standby"]["in_sync"] == 1 for s in shards) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(host_of(bed, s["address"]) for s in shards) == ["h2", "h3"], shards
    for shard in shards:
        standby = shard["standby"]
        assert standby == {"node_id": standby["node_id"], "healthy": True, "in_sync": 1}, shards
        assert standby["node_id"] and standby["node_id"] != shard["node_id"], shards
    assert {s["standby"]["node_id"] for s in shards} == {s["node_id"] for s in shards}, shards


def test_a_primarys_host_cut_off_is_failed_over_and_both_shards_get_fresh_standbys_once_it_is_back(bed, cluster,
                                                                                                      workload):
    """The host of shard 0's primary is cut off for 6 s: its primary is failed over to the standby
    on the other host, the other shard's standby (there too) is forgotten, and a fresh standby's
    start on the cut-off host (Ray still counts it alive) fails. Once the host is back as a new Ray
    node, both shards get fresh standbys caught up from their primaries' memory."""
    host = host_of(bed, wait_in_sync(bed, cluster.address)[0]["address"])
    cut = time.time()
    bed.partition(host)
    workload.wait_steps(10, after=cut, timeout_s=3 * STEP_TIMEOUT_S)
    print(f"host cut off -> next acknowledged step: {stall([c.ended for c in workload.acknowledged()], cut):.2f} s")
    assert [host_of(bed, s["address"]) for s in server_status(bed, cluster.address)] != [host, host]
    time.sleep(max(0.0, cut + 6.0 - time.time()))
    bed.heal(host)
    workload.faults.append(FaultRecord("partition", host, cut, time.time()))
    cluster.rejoin(host)
    shards = wait_in_sync(bed, cluster.address, timeout_s=120)
    assert all(host_of(bed, s["address"]) != host for s in shards), shards


def test_a_lost_host_is_served_by_the_standbys_on_the_other_and_nothing_is_lost(bed, cluster, workload):
    """The host of shard 0's primary lost (link down, every process SIGKILLed): its primary's
    sessions are promoted on their standby on the other host, and the other shard's primary,
    whose standby was on the lost host, goes on with one copy; the client on h4 trains on with
    no step lost or applied twice."""
    host = host_of(bed, wait_in_sync(bed, cluster.address)[0]["address"])
    other = ({"h2", "h3"} - {host}).pop()
    workload.wait_steps(10, after=time.time())
    lost = time.time()
    bed.lose_host(host)
    workload.faults.append(FaultRecord("host_lost", host, lost, lost))
    workload.wait_steps(10, after=lost, timeout_s=3 * STEP_TIMEOUT_S)
    waited = stall([c.ended for c in workload.acknowledged()], lost)
    print(f"host lost -> next acknowledged step: {waited:.2f} s")
    assert waited < STEP_TIMEOUT_S
    shards = server_status(bed, cluster.address)
    assert sorted(host_of(bed, s["address"]) for s in shards) == [other, other], shards
    report = workload.stop()
    assert report.clean, report.problems()
    (session,) = report.sessions
    assert session.acked >= 20 and report.lost == 0 and report.duplicated == 0
    assert session.replay_max_diff <= session.tolerance
