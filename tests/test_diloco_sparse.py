"""DiLoCo with SparseLoCo compression on the shared server (torch adapter, two workers in threads):
exact against dense DiLoCo when everything is sent, exact against an in-process reference of
top-k with error feedback when not, and the bytes a 2-bit exchange takes."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from optserve.client import Client, InvalidArgumentError  # noqa: E402
from optserve.client.torch import DiLoCo  # noqa: E402
from tests.test_diloco import H, WORKERS, _batches, _close_all, _in_threads, _inner_step, _model  # noqa: E402
from tests.test_sparse_codec import _reference_topk  # noqa: E402

ROUNDS = 10
OUTER = {"name": "sgd", "args": {"learning_rate": 1.0}}  # SparseLoCo's outer step


def _run(address, session, model_of=_model, rounds=ROUNDS, **kwargs):
    """Each worker's shared parameters after ``rounds`` rounds, and its exchanges."""
    models = [model_of() for _ in range(WORKERS)]

    def work(i):
        model = models[i]
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        diloco = DiLoCo(model, opt, address, session=session, sync_every=H, num_workers=WORKERS, worker_id=f"w{i}",
                        **{"outer": OUTER, **kwargs})
        for batch in _batches(i, H * rounds):
            _inner_step(model, opt, batch)
            diloco.step()
        diloco.close()
        return {n: v.copy() for n, v in diloco._core.shared().items()}, diloco.exchanges

    return _in_threads(work)


def _reference(chunk: int, topk: int, decay: float, aggregation: str):
    """SparseLoCo in this process, float32 values: per worker an error buffer
    ``e = decay * e + pseudo_gradient``, the top ``topk`` of each chunk sent and subtracted; the
    mean of what was sent, per entry over the workers that sent it ("senders") or over both
    ("all"), is SGD's gradient at learning rate 1."""
    shared = _model()
    workers = [copy.deepcopy(shared) for _ in range(WORKERS)]
    inner = [torch.optim.AdamW(w.parameters(), lr=0.01) for w in workers]
    data = [_batches(i, H * ROUNDS) for i in range(WORKERS)]
    errors = [{n: np.zeros(p.shape, np.float32) for n, p in shared.named_parameters()} for _ in range(WORKERS)]
    for r in range(ROUNDS):
        sent = []
        for i, (w, opt) in enumerate(zip(workers, inner)):
            for step in range(H):
                _inner_step(w, opt, data[i][r * H + step])
                opt.step()
            part = {}
            for (name, p_shared), p in zip(shared.named_parameters(), w.parameters()):
                e = errors[i][name]
                e *= np.float32(decay)
                e += (p_shared.detach() - p.detach()).numpy()
                part[name] = _reference_topk(e, chunk, topk)
                e -= part[name]
            sent.append(part)
        with torch.no_grad():
            for name, p_shared in shared.named_parameters():
                total = sent[0][name] + sent[1][name]
                # (the random pseudo-gradients have no entry exactly 0: a sent entry is a nonzero one)
                senders = (sent[0][name] != 0).astype(np.float32) + (sent[1][name] != 0).astype(np.float32)
                mean = total / np.maximum(senders, 1) if aggregation == "senders" else total / np.float32(WORKERS)
                p_shared -= torch.from_numpy(mean.astype(np.float32))
        for w in workers:
            w.load_state_dict(shared.state_dict())
    return {n: p.detach().numpy().copy() for n, p in shared.named_parameters()}


def _max_diff(a, b):
    return max(float(np.max(np.abs(a[n] - b[n]))) for n in b)


def test_sending_every_entry_in_float32_equals_dense_diloco(server, unique_name):
    try:
        dense = _run(server.address, unique_name + "-dense")
        everything = {"name": "sparseloco", "topk": 16, "chunk": 4, "bits": 32, "error_decay": 0.95}
        sparse = _run(server.address, unique_name + "-sparse", compression=everything)
        for (got, _), (want, _) in zip(sparse, dense):
            assert _max_diff(got, want) < 1e-6
    finally:
        _close_all(server, unique_name + "-dense", unique_name + "-sparse")


@pytest.mark.parametrize("aggregation", ["senders", "all"])
def test_top_k_with_error_feedback_equals_the_in_process_reference(server, unique_name, aggregation):
    try:
        results = _run(server.address, unique_name, compression={
            "name": "sparseloco", "topk": 3, "chunk": 4, "bits": 32, "error_decay": 0.9, "aggregation": aggregation})
        want = _reference(chunk=4, topk=3, decay=0.9, aggregation=aggregation)
        for got, exchanges in results:
            assert _max_diff(got, want) < 1e-6
            assert len(exchanges) == ROUNDS and all(e.version is not None for e in exchanges)
    finally:
        _close_all(server, unique_name)


def _wide_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 3))


def test_a_two_bit_exchange_sends_under_half_a_bit_per_parameter(server, unique_name):
    try:
        results = _run(server.address, unique_name, model_of=_wide_model, rounds=2,
                       compression={"name": "sparseloco"})
        parameters = sum(p.numel() for p in _wide_model().parameters())
        for shared, exchanges in results:
            assert len(exchanges) == 2 and all(np.isfinite(v).all() for v in shared.values())
            for exchange in exchanges:
                assert exchange.bytes_up * 8 / parameters < 0.5, exchange
                # the answer: both workers' parts (SGD at learning rate 1 is rebuilt from them exactly)
                assert 0 < exchange.bytes_down * 8 / parameters < 2 * 0.5, exchange
        with Client(server.address) as client:  # what the workers rebuilt is the session's, bit for bit
            held = client.session(unique_name).pull()
        for shared, _ in results:
            for name, value in held.items():
                np.testing.assert_array_equal(shared[name], value)
    finally:
        _close_all(server, unique_name)


def test_jax_workers_in_an_elastic_session_with_two_fragments_equal_a_numpy_reference(server, unique_name):
    """The JAX adapter, streaming fragments (each its own session and its own sends) and elastic
    rounds (min_workers=1; both workers push every round here): SGD at learning rate 1 on the mean
    over senders of the float32 top-2 of each 2x2 tile (2-piece) of the error buffers."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import optax

    from optserve.client.jax import DiLoCo as JaxDiLoCo

    rng = np.random.default_rng(9)
    init = {"w": rng.standard_normal((6, 3)).astype(np.float32), "b": np.zeros((3,), np.float32)}
    data = [[(rng.standard_normal((16, 6)).astype(np.float32), rng.standard_normal((16, 3)).astype(np.float32))
             for _ in range(H * 4)] for _ in range(WORKERS)]

    def loss(params, x, y):
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    grad = jax.jit(jax.grad(loss))
    # both workers are members before the first round, and a round waits for every member
    options = dict(sync_every=H, fragments=2, num_workers=WORKERS, min_workers=1, straggler_s=60.0, outer=OUTER,
                   compression={"name": "sparseloco", "topk": 2, "chunk": 2, "bits": 32, "error_decay": 0.9})
    joined = threading.Barrier(WORKERS)

    def work(i):
        diloco = JaxDiLoCo({k: jnp.asarray(v) for k, v in init.items()}, optax.sgd(0.05), server.address,
                           session=unique_name, worker_id=f"j{i}", **options)
        for session in diloco.sessions:
            session.join()
        joined.wait(timeout=120)
        for batch in data[i]:
            diloco.step(grad(diloco.params, *batch))
        diloco.close()
        return {k: np.asarray(v) for k, v in diloco._core.shared().items()}, diloco.exchanges

    # the reference: fragment 0 holds "b" (first in JAX's sorted order), synced at inner steps
    # H, 2H, ...; fragment 1 holds "w", synced at H // 2 + k H
    shared = {k: v.copy() for k, v in init.items()}
    local = [{k: v.copy() for k, v in init.items()} for _ in range(WORKERS)]
    errors = [{k: np.zeros_like(v) for k, v in init.items()} for _ in range(WORKERS)]
    for step in range(1, H * 4 + 1):
        for i in range(WORKERS):
            g = grad({k: jnp.asarray(v) for k, v in local[i].items()}, *data[i][step - 1])
            local[i] = {k: (local[i][k] - np.float32(0.05) * np.asarray(g[k])).astype(np.float32) for k in init}
        for names, offset in ((["b"], 0), (["w"], H // 2)):
            if step % H != offset:
                continue
            for name in names:
                sent = []
                for i in range(WORKERS):
                    errors[i][name] *= np.float32(0.9)
                    errors[i][name] += shared[name] - local[i][name]
                    sent.append(_reference_topk(errors[i][name], 2, 2))
                    errors[i][name] -= sent[-1]
                senders = sum((s != 0).astype(np.float32) for s in sent)
                shared[name] = (shared[name] - sum(sent) / np.maximum(senders, 1)).astype(np.float32)
                for i in range(WORKERS):
                    local[i][name] = shared[name].copy()
    try:
        for got, exchanges in _in_threads(work):
            assert {e.fragment for e in exchanges} == {0, 1} and all(e.bytes_down > 0 for e in exchanges)
            assert _max_diff(got, shared) < 1e-5
    finally:
        _close_all(server, unique_name + ".f0", unique_name + ".f1")


def test_an_outer_step_the_parts_do_not_rebuild_comes_back_as_values(server, unique_name):
    """Nesterov momentum moves entries no worker sent: the shard's bit-for-bit check fails, so
    the answer is the parameters themselves, and the workers hold the session's values."""
    try:
        results = _run(server.address, unique_name, rounds=3, outer={"name": "sgd", "args": {
            "learning_rate": 0.7, "momentum": 0.9, "nesterov": True}}, compression={"name": "sparseloco"})
        parameters = sum(p.numel() for p in _model().parameters())
        with Client(server.address) as client:
            held = client.session(unique_name).pull()
        for shared, exchanges in results:
            assert [e.bytes_down for e in exchanges] == [4 * parameters] * 3
            for name, value in held.items():
                np.testing.assert_array_equal(shared[name], value)
    finally:
        _close_all(server, unique_name)


def test_a_workers_state_dict_keeps_its_error_buffers_through_a_file_and_a_restart(server, unique_name, tmp_path):
    """One worker (a session of one): after two rounds its error buffers hold what was not sent;
    its state_dict goes through torch.save and into a fresh worker that attached, whose buffers
    and inner optimizer then equal the first's."""
    try:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        options = dict(session=unique_name, sync_every=H, num_workers=1, outer=OUTER,
                       compression={"name": "sparseloco", "topk": 1, "chunk": 4, "bits": 2})
        first = DiLoCo(model, opt, server.address, worker_id="a", **options)
        for batch in _batches(0, 2 * H):
            _inner_step(model, opt, batch)
            first.step()
        kept = first._core.error_buffers()
        assert kept and all(np.any(buffer != 0) for buffer in kept.values())
        torch.save(first.state_dict(), tmp_path / "worker.pt")
        first.close()

        again = _model(seed=1)
        opt_again = torch.optim.AdamW(again.parameters(), lr=0.01)
        second = DiLoCo(again, opt_again, server.address, worker_id="a", **options)
        assert not second.created
        second.load_state_dict(torch.load(tmp_path / "worker.pt", weights_only=False))
        assert second.inner_steps == 2 * H
        for name, buffer in kept.items():
            np.testing.assert_array_equal(second._core.error_buffers()[name], buffer)
        for mine, theirs in zip(opt_again.state.values(), opt.state.values()):
            assert torch.equal(mine["exp_avg"], theirs["exp_avg"])
        with pytest.raises(InvalidArgumentError, match="error buffer '0.weight' of shape \\[2, 2\\]"):
            second.load_state_dict({**first.state_dict(), "error_buffers": {"0.weight": torch.zeros(2, 2)}})
        second.close()
    finally:
        _close_all(server, unique_name)


def test_a_jax_worker_restored_from_its_state_dict_continues_as_if_it_never_stopped(server, unique_name, tmp_path):
    """One JAX worker (a session of one) runs three rounds; another, in a second session, runs
    two, pickles its state_dict to a file, leaves, and a fresh worker attaches, loads the file and
    runs the third round: both sessions end bit for bit equal (the error buffers and adam's state
    carried over; without them the third round's selection differs)."""
    import pickle

    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import optax

    from optserve.client.jax import DiLoCo as JaxDiLoCo

    rng = np.random.default_rng(4)
    init = {"w": rng.standard_normal((8, 8)).astype(np.float32), "b": np.zeros((8,), np.float32)}
    data = [(rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((16, 8)).astype(np.float32))
            for _ in range(3 * H)]
    grad = jax.jit(jax.grad(lambda p, x, y: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)))
    options = dict(sync_every=H, num_workers=1, outer=OUTER, worker_id="a",
                   compression={"name": "sparseloco", "topk": 3, "chunk": 4, "bits": 2})

    def worker(session):
        return JaxDiLoCo({k: jnp.asarray(v) for k, v in init.items()}, optax.adam(0.01), server.address,
                         session=session, **options)

    def train(diloco, batches):
        for batch in batches:
            diloco.step(grad(diloco.params, *batch))

    whole, halves = unique_name + "-whole", unique_name + "-restarted"
    try:
        straight = worker(whole)
        train(straight, data)
        straight.close()

        first = worker(halves)
        train(first, data[:2 * H])
        assert any(np.any(e != 0) for e in first.state_dict()["error_buffers"].values())
        (tmp_path / "worker.pkl").write_bytes(pickle.dumps(first.state_dict()))
        first.close()
        second = worker(halves)
        assert not second.created
        second.load_state_dict(pickle.loads((tmp_path / "worker.pkl").read_bytes()))
        train(second, data[2 * H:])
        second.close()
        with Client(server.address) as client:
            expected, got = client.session(whole).pull(), client.session(halves).pull()
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])
        third = worker(halves)
        with pytest.raises(InvalidArgumentError, match="inner_state does not match"):
            third.load_state_dict({**second.state_dict(), "inner_state": optax.sgd(0.1).init(init)})
        third.close()
    finally:
        _close_all(server, whole, halves)


def test_a_worker_taking_smaller_chunks_than_another_cut_its_parts_gets_those_tensors_as_values(server, unique_name):
    """Worker 0's client takes 64 KiB chunks; worker 1 cuts its 2048x2048 part (about 115 KB of
    2-bit entries) in 4 MiB ones. Worker 0 gets that tensor as values (no chunk above its size)
    and the bias as parts, worker 1 gets both workers' parts of both (rebuilt a tensor per
    thread: over the parallel threshold); both hold the session's parameters."""
    size = 2048

    def big_model():
        torch.manual_seed(0)
        return torch.nn.Linear(size, size)

    chunk_bytes = [64 << 10, 4 << 20]

    def work(i):
        model = big_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Client(server.address, chunk_bytes=chunk_bytes[i], shared_memory=False) as client:
            diloco = DiLoCo(model, opt, client, session=unique_name, sync_every=1, num_workers=WORKERS,
                            worker_id=f"w{i}", outer=OUTER, compression={"name": "sparseloco"})
            x = torch.randn(4, size, generator=torch.Generator().manual_seed(i))
            model(x).square().mean().backward()
            diloco.step()
            diloco.close()
            return {n: v.copy() for n, v in diloco._core.shared().items()}, diloco.exchanges

    try:
        (small_shared, small), (large_shared, large) = _in_threads(work)
        assert 4 * size * size < small[0].bytes_down < 4 * size * size + 4 * size  # the weight's values, the bias's parts
        assert large[0].bytes_down < large[0].bytes_up + small[0].bytes_up + 1024  # both parts, a header or two more
        assert large[0].bytes_up > chunk_bytes[0]
        with Client(server.address) as client:
            held = client.session(unique_name).pull()
        for shared in (small_shared, large_shared):
            for name in ("weight", "bias"):
                np.testing.assert_array_equal(shared[name], held[name])
    finally:
        _close_all(server, unique_name)
