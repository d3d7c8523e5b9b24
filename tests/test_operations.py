"""Operating optserve against a real server: Prometheus metrics that move, health and reflection,
draining on SIGTERM, and ``optserve status``."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from _service_helpers import make_grads, make_params
from optserve.client import Client, InvalidArgumentError
from optserve.server.ops.metrics import METRICS, unpack_families

ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}
SHAMPOO = {"name": "shampoo", "args": {"learning_rate": 0.01, "block_size": 4, "start_preconditioning_step": 1}}
STEPS = 5


@pytest.fixture(scope="module")
def observed(ray_local):
    """A server exporting metrics, with an Adam session (5 steps and one refused NaN push) and a
    Shampoo session (5 steps), both spread over two shards."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0, metrics_port=0,
                                        vote_timeout_s=8.0))
    client = Client(running.address, timeout=60)
    params = make_params()
    adam = client.create_session("ops-adam", params, optimizer=ADAM)
    shampoo = client.create_session("ops-shampoo", params, optimizer=SHAMPOO, mode="async")
    for step in range(STEPS):
        adam.push_pull(make_grads(params, step), loss=1.0 / (step + 1))
        shampoo.push_pull(make_grads(params, step))
    bad = make_grads(params, 99)
    bad["dense/w"][0, 0] = np.nan
    with pytest.raises(InvalidArgumentError):
        adam.push(bad)
    # an elastic session: two members, a round committed at its straggler deadline, a late gradient
    elastic = client.create_session("ops-elastic", params, optimizer=ADAM, num_workers=3, min_workers=1,
                                    straggler_s=0.3)
    a, b = client.session("ops-elastic", worker_id="a"), client.session("ops-elastic", worker_id="b")
    b.join()
    a.push_pull(make_grads(params, 0))  # b never pushes: committed at the deadline, short
    b.push_pull(make_grads(params, 0), base_version=0)  # late: dropped
    yield running, client, params
    a.detach(), b.detach(), elastic.detach()
    client.close()
    running.stop()


def _scrape(running) -> dict[str, list]:
    text = urllib.request.urlopen(f"http://{running.metrics_address}/metrics", timeout=30).read().decode()
    samples: dict[str, list] = {}
    seen = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in seen, f"duplicate series {key}"  # one series, one exporter
            seen.add(key)
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _total(samples, name, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_metric_is_exported(observed):
    samples = _scrape(observed[0])
    for name, (kind, _, _) in METRICS.items():
        exported = f"{name}_count" if kind == "histogram" else name
        assert exported in samples, name


def test_elastic_metrics_report_members_short_rounds_and_late_gradients(observed):
    samples = _scrape(observed[0])
    assert _total(samples, "optserve_elastic_members", session="ops-elastic") == 2, observed[1].session_status("ops-elastic").elastic
    assert _total(samples, "optserve_elastic_stragglers", session="ops-elastic") == 1
    assert _total(samples, "optserve_elastic_rounds_short_total", session="ops-elastic") == 1
    assert _total(samples, "optserve_elastic_late_dropped_total", session="ops-elastic") == 1
    assert _total(samples, "optserve_elastic_departures_total", session="ops-elastic") == 0
    assert _total(samples, "optserve_elastic_round_seconds", session="ops-elastic") >= 0.3


def test_metrics_move_with_the_steps(observed):
    running, client, params = observed
    samples = _scrape(running)
    nbytes = sum(a.nbytes for a in params.values())
    for session in ("ops-adam", "ops-shampoo"):
        steps = [s.value for s in samples["optserve_steps_applied_total"] if s.labels["session"] == session]
        assert steps == [STEPS, STEPS]  # every shard applied every step
        assert _total(samples, "optserve_session_version", session=session) == STEPS
        assert _total(samples, "optserve_staleness_count", session=session) == STEPS  # one per accepted push
        assert _total(samples, "optserve_param_bytes", session=session) == nbytes
        assert _total(samples, "optserve_push_seconds_count", session=session) >= 2 * STEPS
        assert _total(samples, "optserve_sent_bytes_total", session=session) >= STEPS * nbytes
    # the NaN push: the shard holding dense/w refused it (nonfinite) after validating nothing of it;
    # the other shard received its clean part, then dropped it when its peer refused (aborted)
    info = client.session("ops-adam").info
    clean_part = sum(params[n].nbytes for s in info.shards if "dense/w" not in s.tensor_names for n in s.tensor_names)
    assert _total(samples, "optserve_received_bytes_total", session="ops-adam") == STEPS * nbytes + clean_part
    assert _total(samples, "optserve_pushes_rejected_total", session="ops-adam", reason="nonfinite") == 1
    assert _total(samples, "optserve_pushes_rejected_total", session="ops-adam", reason="aborted") == 1
    assert _total(samples, "optserve_pushes_rejected_total", session="ops-shampoo") == 0
    assert _total(samples, "optserve_root_age_steps", session="ops-shampoo") >= 0
    assert "ops-adam" not in {s.labels.get("session") for s in samples["optserve_root_error"]}
    assert _total(samples, "optserve_loss", session="ops-adam") == 1.0 / STEPS
    assert "ops-shampoo" not in {s.labels.get("session") for s in samples["optserve_loss"]}
    processes = {s.labels["process"] for s in samples["optserve_process_resident_bytes"] if s.value > 0}
    assert processes == {"coordinator", "shard-0", "shard-1"}
    heap = {(s.labels["process"], s.labels["state"]): s.value for s in samples["optserve_process_heap_bytes"]}
    assert set(heap) == {(p, state) for p in processes for state in ("in_use", "free")}
    assert all(heap[p, "in_use"] > 0 for p in processes)
    assert _total(samples, "optserve_sessions") == 3
    adam = client.session("ops-adam")
    adam.push_pull(make_grads(params, 7))
    adam.detach()
    later = _scrape(running)
    assert _total(later, "optserve_steps_applied_total", session="ops-adam") == 2 * (STEPS + 1)


def test_health_is_serving_on_every_port_and_reflection_lists_the_control_service(observed):
    running = observed[0]
    for address in [running.address] + running.shard_addresses:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(running.address)).get_services()
    assert "optserve.v1.Control" in services and "grpc.health.v1.Health" in services


def _optserve(*args, **kwargs):
    return [sys.executable, "-c", "import sys; from optserve.server.cli import main; sys.exit(main())", *args]


def test_status_lists_sessions_and_shards_as_a_table_and_as_json(observed):
    running = observed[0]
    out = subprocess.run(_optserve("status", "--address", running.address, "--json"), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    by_name = {s["name"]: s for s in report["sessions"]}
    assert {"ops-adam", "ops-shampoo"} <= set(by_name)
    assert by_name["ops-adam"]["version"] >= STEPS and by_name["ops-adam"]["rejected"]["nonfinite"] == 1
    assert by_name["ops-shampoo"]["mode"] == "async" and by_name["ops-shampoo"]["optimizer"] == "shampoo"
    assert [s["healthy"] for s in report["shards"]] == [True, True]
    assert all(s["node_id"] and s["sessions"] == 3 for s in report["shards"])
    table = subprocess.run(_optserve("status", "--address", running.address), capture_output=True, text=True,
                           timeout=120)
    assert table.returncode == 0 and "ops-adam" in table.stdout and "healthy" in table.stdout
    down = subprocess.run(_optserve("status", "--address", "127.0.0.1:1", "--timeout", "2"), capture_output=True,
                          text=True, timeout=120)
    assert down.returncode == 2 and len(down.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_sigusr1_prints_every_threads_stack_and_sigterm_drains_health_to_not_serving_before_stopping():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(_optserve("serve", "--port", "0", "--shards", "1", "--drain-s", "4"), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        address = None
        deadline = time.monotonic() + 120
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            match = re.search(r"listening on (\S+)", line)
            address = match.group(1) if match else None
        assert address, "the server did not start"
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        request = health_pb2.HealthCheckRequest(service="optserve.v1.Control")
        assert stub.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGUSR1)  # a hung server tells where: every thread's stack, and it goes on
        dumped = []
        threading.Thread(target=lambda: dumped.extend(iter(proc.stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + 30
        while not any("_serve_until_signalled" in line for line in list(dumped)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("_serve_until_signalled" in line for line in list(dumped)), "".join(dumped[-20:])
        assert stub.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        seen = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen = stub.Check(request, timeout=5).status
            if seen == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.1)
        assert seen == health_pb2.HealthCheckResponse.NOT_SERVING
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()


def test_loss_and_staleness_series_reach_report_plots_csv_and_metrics(observed, tmp_path, unique_name):
    running, client, params = observed
    owner = client.create_session(unique_name, params, optimizer=ADAM, mode="async", max_staleness=1)
    other = Client(running.address, timeout=60).session(unique_name)
    losses = []
    try:
        for step in range(6):  # owner steps every time; other pushes from an old version every other time
            loss = 1.0 / (step + 1)
            owner.push_pull(make_grads(params, step), loss=loss, scalars={"lr": 0.01})
            losses.append((owner.version, loss))
            if step % 2:
                try:
                    other.push(make_grads(params, 50 + step), base_version=0, loss=9.0)
                except Exception:  # noqa: BLE001 - too stale under max_staleness=1: refused, recorded
                    pass
        series = client.session_series(unique_name)
        assert [p.loss for p in series.accepted if p.loss != 9.0] == [loss for _, loss in losses]
        assert all(p.scalars == {"lr": 0.01} for p in series.accepted if p.loss != 9.0)
        assert [p.version for p in series.accepted] == sorted(p.version for p in series.accepted)
        assert max(p.staleness for p in series.accepted) <= 1 and series.rejected
        assert {r.reason for r in series.rejected} == {"stale"}
        assert _total(_scrape(running), "optserve_loss", session=unique_name) == losses[-1][1]

        out = tmp_path / "report"
        proc = subprocess.run(_optserve("report", unique_name, "--address", running.address, "--out", str(out)),
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        import matplotlib.image

        for png in ("loss_vs_step.png", "staleness_histogram.png", "pushes_over_time.png"):
            image = matplotlib.image.imread(out / png)
            assert image.shape[0] > 200 and image.shape[1] > 300 and float(image.std()) > 0.01, png
        import csv

        rows = list(csv.DictReader((out / "series.csv").open()))
        assert len(rows) == len(series.accepted)
        assert [float(r["loss"]) for r in rows] == [p.loss for p in series.accepted]
        assert all(r["lr"] == "0.01" for r in rows if float(r["loss"]) != 9.0)
        missing = subprocess.run(_optserve("report", "no-such-session", "--address", running.address,
                                           "--out", str(tmp_path / "x")), capture_output=True, text=True, timeout=120)
        assert missing.returncode == 2 and "no-such-session" in missing.stderr
    finally:
        other.detach()
        owner.close()


def test_bad_telemetry_is_refused_naming_it(observed, unique_name):
    running, client, params = observed
    session = client.create_session(unique_name, params, optimizer=ADAM)
    try:
        with pytest.raises(InvalidArgumentError, match="loss"):
            session.push(make_grads(params, 0), loss="low")
        with pytest.raises(InvalidArgumentError, match="scalars"):
            session.push(make_grads(params, 0), scalars={f"s{i}": 1.0 for i in range(17)})
        assert session.status().pushes_accepted == 0
    finally:
        session.close()


def test_sparse_exchanges_count_in_the_byte_metrics_as_they_crossed_the_wire(observed):
    """Two DiLoCo workers with SparseLoCo, two rounds: the session's received bytes are exactly the
    parts the workers pushed, and its sent bytes the compact answers they got plus the one dense
    pull of the worker that attached."""
    torch = pytest.importorskip("torch")
    from optserve.client.torch import DiLoCo
    from tests.test_diloco import H, WORKERS, _batches, _in_threads, _inner_step
    from tests.test_diloco_sparse import _wide_model

    running, session = observed[0], "ops-sparseloco"

    def work(i):
        model = _wide_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        diloco = DiLoCo(model, opt, running.address, session=session, sync_every=H, num_workers=WORKERS,
                        worker_id=f"w{i}", outer={"name": "sgd", "args": {"learning_rate": 1.0}},
                        compression={"name": "sparseloco"}, shared_memory=False)
        for batch in _batches(i, 2 * H):
            _inner_step(model, opt, batch)
            diloco.step()
        diloco.close()
        return diloco.created, diloco.exchanges

    results = _in_threads(work)
    samples = _scrape(running)
    with Client(running.address) as client:
        client.session(session).close()
    parameters = sum(p.numel() for p in _wide_model().parameters())
    up = sum(e.bytes_up for _, exchanges in results for e in exchanges)
    down = sum(e.bytes_down for _, exchanges in results for e in exchanges)
    assert sorted(created for created, _ in results) == [False, True]
    assert 0 < up and 0 < down < 4 * parameters  # compact answers, not values
    assert _total(samples, "optserve_received_bytes_total", session=session) == up
    assert _total(samples, "optserve_sent_bytes_total", session=session) == down + 4 * parameters


RAY_INLINE_BYTES = 100 * 1024  # Ray's max_direct_call_object_size: a larger value goes through the object store


def test_a_busy_shards_metrics_cross_ray_inline_not_through_the_object_store(observed):
    # 40 more sessions on the two shards: their families pickled are over Ray's inline limit,
    # packed they are well under it, and every session is still scraped
    running, client, params = observed
    names = [f"ops-busy-{i}" for i in range(40)]
    try:
        for name in names:
            client.create_session(name, params, optimizer=ADAM).push_pull(make_grads(params, 0))
        packed = running.fleet.shard_reports("metrics")
        assert len(packed) == 2 and all(isinstance(p, bytes) and len(p) < RAY_INLINE_BYTES for p in packed)
        assert sum(len(pickle.dumps(unpack_families(p))) for p in packed) > RAY_INLINE_BYTES
        scraped = {s.labels["session"] for s in _scrape(running)["optserve_steps_applied_total"]}
        assert set(names) <= scraped
    finally:
        for name in names:
            client.close_session(name)
