"""``Session.history`` of plain sync and async sessions on the shared 2-shard server: every version
listed exactly once with the pushes that formed it (clients, sequences, base versions, staleness,
scales as applied), and an in-process replay of the records reaching the served parameters.
(Elastic sessions: tests/test_elastic_sync.py; durable restarts: tests/test_history_durable.py.)"""

from __future__ import annotations

import concurrent.futures

import numpy as np

from optserve.client import Client
from optserve.client.status import RoundRecord
from tests._service_helpers import InProcess, make_params, max_abs_diff

ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}  # a step's scale is not a gradient's: replay must use it


def grads_of(params: dict, worker: str, base_version: int) -> dict[str, np.ndarray]:
    """The gradient ``worker`` computes from version ``base_version`` (so a record names it)."""
    rng = np.random.default_rng((sum(map(ord, worker)) * 7_919 + base_version) % (2**32))
    return {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in params.items()}


class ScaledReference(InProcess):
    """The registry's kernel in process (:class:`InProcess`), each step scaled as a shard scales it."""

    def __init__(self, name: str, args: dict, params: dict):
        import jax

        from optserve.optim_kernels import build_optimizer
        from optserve.server.compute.updater import step_function

        super().__init__(name, args, params)
        built = build_optimizer(name, args)
        assert built.partial_statistic is None  # no cross-shard statistic to sum here
        self._scaled, self._hyper = jax.jit(step_function(built)), built.hyperparams

    def step_scaled(self, grads: dict, scale: float) -> dict[str, np.ndarray]:
        self.params, self.state = self._scaled(self.params, self.state, grads, np.float32(scale), np.float32(0.0),
                                               self._hyper)
        return {k: np.asarray(v) for k, v in self.params.items()}


def replay(optimizer: dict, params: dict, records, grads=grads_of) -> dict[str, np.ndarray]:
    """The parameters a session's history makes from ``params``: a sync round's update runs on the
    scaled mean of its pushes' gradients, an async push's on its gradient with the step scaled."""
    reference, result = ScaledReference(optimizer["name"], optimizer["args"], params), params
    for record in records:
        pushed = [grads(params, w, b) for w, b in zip(record.participants, record.base_versions)]
        if record.closed_by == "push":  # async: one push, the step scaled
            result = reference.step_scaled(pushed[0], record.scales[0])
        else:
            mean = {n: sum(np.float32(s) * g[n] for s, g in zip(record.scales, pushed)) / np.float32(len(pushed))
                    for n in params}
            result = reference.step_scaled(mean, 1.0)
    return result


def rounds(history) -> list[RoundRecord]:
    """The version records of a ``Session.history`` answer (hyperparameter changes left out)."""
    return [r for r in history if isinstance(r, RoundRecord)]


def sync_rounds(sessions, params, count: int) -> None:
    """Each session pushes its worker's gradient from the version it has seen, concurrently."""
    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        for _ in range(count):
            for f in [pool.submit(s.push_pull, grads_of(params, s.worker_id, s.version)) for s in sessions]:
                f.result()


def async_pushes(a, b, params, start: int) -> None:
    """Four pushes from version ``start`` in a fixed order: fresh, one stale, fresh, two stale."""
    for session, base in ((a, start), (b, start), (a, start + 2), (b, start + 1)):
        session.push(grads_of(params, session.worker_id, base), base_version=base)


def check_sync_history(records, sessions, first: int, last: int) -> None:
    """Versions ``first..last`` once each, each formed by one push of every session, fresh, weight 1."""
    assert [r.version for r in records] == list(range(first, last + 1))
    clients = sorted(s.client_id for s in sessions)
    for record in records:
        assert sorted(record.clients) == clients and record.closed_by == "num_workers"
        assert sorted(record.participants) == sorted(s.worker_id for s in sessions)
        assert record.scales == (1.0,) * len(sessions) and record.staleness == (0,) * len(sessions)
        assert record.base_versions == (record.version - 1,) * len(sessions)
    for client in clients:  # each client's pushes, one per version, in sequence order
        sequences = [r.sequences[r.clients.index(client)] for r in records]
        assert sequences == sorted(set(sequences))


def check_async_history(records, a, b, start: int) -> None:
    """The four pushes of :func:`async_pushes` from ``start``: one version each, their base
    versions, staleness and scales (SCALE: 1 / (1 + staleness))."""
    assert [r.version for r in records] == list(range(start + 1, start + 5))
    assert [r.clients for r in records] == [(a.client_id,), (b.client_id,), (a.client_id,), (b.client_id,)]
    assert [r.participants for r in records] == [("a",), ("b",), ("a",), ("b",)]
    assert [r.base_versions for r in records] == [(start,), (start,), (start + 2,), (start + 1,)]
    assert [r.staleness for r in records] == [(0,), (1,), (0,), (2,)]
    assert [r.scales for r in records] == [(1.0,), (0.5,), (1.0,), (1.0 / 3.0,)]
    assert {r.closed_by for r in records} == {"push"} and {r.duration_s for r in records} == {0.0}
    for session in (a, b):  # each client's two pushes, one after the other
        first, second = (r.sequences[0] for r in records if r.clients == (session.client_id,))
        assert second == first + 1


def test_sync_history_lists_each_round_with_both_clients_and_replays_exactly(server, unique_name):
    params = make_params(41)
    with Client(server.address, timeout=60.0) as client:
        owner = client.create_session(unique_name, params, ADAM, mode="sync", num_workers=2)
        a, b = (client.session(unique_name, worker_id=w) for w in ("a", "b"))
        try:
            sync_rounds([a, b], params, 4)
            records = rounds(a.history())
            check_sync_history(records, [a, b], 1, 4)
            assert rounds(b.history(since=2)) == records[2:]  # paged by version
            assert max_abs_diff(a.pull(), replay(ADAM, params, records)) <= 1e-6
        finally:
            a.detach(), b.detach()
            owner.close()


def test_async_history_lists_each_push_with_base_version_staleness_and_scale_and_replays_exactly(
        server, unique_name):
    params = make_params(43)
    with Client(server.address, timeout=60.0) as client:
        owner = client.create_session(unique_name, params, ADAM, mode="async", staleness_policy="scale")
        a, b = (client.session(unique_name, worker_id=w) for w in ("a", "b"))
        try:
            async_pushes(a, b, params, 0)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # then both at once, as they come
                for f in [pool.submit(lambda s=s: [s.push_pull(grads_of(params, s.worker_id, s.version))
                                                   for _ in range(4)]) for s in (a, b)]:
                    f.result()
            records = rounds(a.history())
            check_async_history(records[:4], a, b, 0)
            assert [r.version for r in records] == list(range(1, 13))  # every push once, none skipped
            assert sorted(r.clients[0] for r in records[4:]) == sorted([a.client_id] * 4 + [b.client_id] * 4)
            assert all(r.scales == (1.0 / (1 + r.staleness[0]),) for r in records)
            assert rounds(a.history(since=10)) == records[10:]
            assert max_abs_diff(a.pull(), replay(ADAM, params, records)) <= 1e-6
        finally:
            a.detach(), b.detach()
            owner.close()
