"""DiLoCo with SparseLoCo compression on the shared server (torch adapter, two workers in threads):
exact against dense DiLoCo when everything is sent, exact against an in-process reference of
top-k with error feedback when not, and the bytes a 2-bit exchange takes."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

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
                        outer=OUTER, **kwargs)
        for batch in _batches(i, H * rounds):
            _inner_step(model, opt, batch)
            diloco.step()
        diloco.close()
        return {n: v.copy() for n, v in diloco._core.shared().items()}, diloco.exchanges

    return _in_threads(work)


def _reference(chunk: int, topk: int, decay: float):
    """SparseLoCo in this process, float32 values: per worker an error buffer
    ``e = decay * e + pseudo_gradient``, the top ``topk`` of each chunk sent and subtracted, the
    mean over both workers of what was sent as SGD's gradient at learning rate 1."""
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
                p_shared -= torch.from_numpy((sent[0][name] + sent[1][name]) / np.float32(WORKERS))
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


def test_top_k_with_error_feedback_equals_the_in_process_reference(server, unique_name):
    try:
        results = _run(server.address, unique_name,
                       compression={"name": "sparseloco", "topk": 3, "chunk": 4, "bits": 32, "error_decay": 0.9})
        want = _reference(chunk=4, topk=3, decay=0.9)
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
                assert exchange.bytes_down == 4 * parameters  # the pull is dense float32 still
    finally:
        _close_all(server, unique_name)
