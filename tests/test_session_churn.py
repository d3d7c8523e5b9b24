"""Sessions created, trained and closed, one after another, leave nothing behind on the shards:
no thread, open file or shared-memory region per closed session (a server that runs for weeks
creates and closes thousands). Real server (the session-scoped ``server`` fixture: 2 shard
actors), real clients over shared memory and over gRPC streams."""

from __future__ import annotations

import os
import time

import pytest

from _service_helpers import make_grads, make_params
from optserve.client import Client

SESSIONS = 12
OPTIMIZERS = ({"name": "adam", "args": {"learning_rate": 0.01}},
              {"name": "adafactor_hf", "args": {"lr": 1e-2, "relative_step": False, "scale_parameter": False}})


def _counts(pids: list[int]) -> dict[str, int]:
    """The shard processes' threads and open file descriptors, and the shared-memory regions
    they or this process created (a region's name carries its creator's pid)."""
    creators = {str(pid) for pid in pids} | {str(os.getpid())}
    return {"threads": sum(len(os.listdir(f"/proc/{pid}/task")) for pid in pids),
            "fds": sum(len(os.listdir(f"/proc/{pid}/fd")) for pid in pids),
            "regions": sum(1 for n in os.listdir("/dev/shm") if n.startswith("optserve-") and n.split("-")[1] in creators)}


def _churn(address: str, prefix: str, count: int) -> None:
    """``count`` sessions, each created, trained 3 steps by a client over shared memory and one
    over gRPC, and closed."""
    params = make_params(5)
    for i in range(count):
        optimizer = OPTIMIZERS[i % len(OPTIMIZERS)]
        with Client(address, timeout=60) as fast, Client(address, timeout=60, shared_memory=False) as plain:
            name = f"{prefix}-{i}"
            session = fast.create_session(name, params, optimizer=optimizer, mode="async")
            other = plain.session(name)
            for step in range(3):
                (session if step % 2 == 0 else other).push_pull(make_grads(params, step))
            assert set(session.data_paths().values()) == {"shared_memory"}, session.data_paths()
            other.detach()
            session.close()


def _settled(pids: list[int], baseline: dict[str, int], slack: dict[str, int], wait_s: float = 20.0) -> dict:
    """The counts once within ``slack`` of ``baseline`` (threads a burst needed wind down), or
    after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        now = _counts(pids)
        if all(now[k] <= baseline[k] + slack[k] for k in baseline) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def test_sessions_created_and_closed_leave_no_thread_file_or_region_behind(server, unique_name):
    pids = server.fleet.pids()
    _churn(server.address, f"{unique_name}-warm", 4)  # pools, compiled programs, channels: made once
    baseline = _counts(pids)
    _churn(server.address, unique_name, SESSIONS)
    # Far less than one per session: a leak of one thread, file or region per closed session (on
    # either shard) shows as SESSIONS or more.
    slack = {"threads": SESSIONS // 2, "fds": SESSIONS // 2, "regions": 0}  # 6: a pool may grow under load
    after = _settled(pids, baseline, slack)
    print(f"baseline {baseline}, after {SESSIONS} sessions {after}")
    assert all(after[k] <= baseline[k] + slack[k] for k in baseline), (baseline, after)
    with Client(server.address, timeout=60) as client:
        assert not [n for n in client.list_sessions() if n.startswith(unique_name)]


def test_sessions_created_and_closed_leave_no_task_events_in_rays_gcs(server, unique_name):
    """Ray's GCS keeps the events of every actor call up to its cap (100,000 tasks, some 10 kB per
    session opened and closed): the shards' and preconditioner workers' calls record none."""
    import ray

    if ray._config.enable_task_events_to_dashboard_head():
        pytest.skip("this Ray keeps task events in its dashboard, which the tests do not start")
    _churn(server.address, unique_name, 2)
    time.sleep(2.5)  # a worker reports its task events every second
    names = [e.task_info.name for e in ray._private.state.state._get_all_task_events() if e.HasField("task_info")]
    ours = [n for n in names if n.split(".")[0] in ("ShardActor", "PreconditionerWorker")]
    assert not ours, f"{len(ours)} task events of ours in the GCS, e.g. {sorted(set(ours))[:5]}"
