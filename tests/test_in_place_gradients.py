"""Gradients read where they lie: a shared-memory push's whole float32 tensors are used in place
by the shard (server/domain/shard/assembly.py), and a client never writes again into a region whose
step it gave up on (client/_session.py), since the shard may still read it."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from _service_helpers import make_grads, make_params
from optserve.client import Client
from optserve.client.errors import DeadlineExceededError
from optserve.protos import chunk_codec, contract
from optserve.server.compute.buffers import BufferPool, aligned_empty
from optserve.server.domain.config import DType, TensorSpec
from optserve.server.domain.errors import NonFinite
from optserve.server.domain.shard.assembly import IN_PLACE_ALIGNMENT, TensorAssembler

SPECS = {"w": TensorSpec("w", DType.FLOAT32, (64, 32)), "b": TensorSpec("b", DType.FLOAT32, (32,))}
SGD = {"name": "sgd", "args": {"learning_rate": 0.1}}


def _region_chunk(name: str, values: np.ndarray, misalign: int = 0) -> chunk_codec.ChunkView:
    """A chunk whose bytes lie in an aligned (or deliberately misaligned) buffer, as in a region."""
    raw = aligned_empty((values.nbytes + IN_PLACE_ALIGNMENT,), np.uint8)
    view = memoryview(raw)[misalign: misalign + values.nbytes]
    np.frombuffer(view, np.float32)[:] = values.reshape(-1)
    return chunk_codec.ChunkView(name, contract.FLOAT32, values.shape, 0, view)


def test_whole_aligned_float32_tensors_are_used_in_place_and_the_rest_copied():
    pool = BufferPool([(n, s.shape) for n, s in SPECS.items()])
    buffers = pool.acquire()
    w, b = np.full((64, 32), 2.0, np.float32), np.arange(32, dtype=np.float32)
    w_chunk, b_chunk = _region_chunk("w", w), _region_chunk("b", b, misalign=4)
    assembler = TensorAssembler(SPECS, buffers, check_finite=True, in_place=True)
    assembler.add(w_chunk)
    assembler.add(b_chunk)
    grads = assembler.finish()
    assert np.shares_memory(grads["w"], np.frombuffer(w_chunk.data, np.uint8))  # read where it lies
    assert not np.shares_memory(grads["w"], buffers["w"])
    assert grads["b"] is buffers["b"] and np.array_equal(grads["b"], b)  # misaligned: copied
    pool.release(grads)  # only the pool's own buffers go back
    again = pool.acquire()
    assert again["w"] is buffers["w"] and again["b"] is buffers["b"]


def test_without_in_place_every_tensor_is_copied():
    buffers = {n: aligned_empty(s.shape, np.float32) for n, s in SPECS.items()}
    assembler = TensorAssembler(SPECS, buffers, check_finite=True)
    for name, spec in SPECS.items():
        assembler.add(_region_chunk(name, np.ones(spec.shape, np.float32)))
    grads = assembler.finish()
    assert all(grads[n] is buffers[n] for n in SPECS)


def test_non_finite_values_read_in_place_are_refused_naming_the_tensor():
    buffers = {n: aligned_empty(s.shape, np.float32) for n, s in SPECS.items()}
    w = np.zeros((64, 32), np.float32)
    w[3, 4] = np.nan
    assembler = TensorAssembler(SPECS, buffers, check_finite=True, in_place=True)
    with pytest.raises(NonFinite, match="'w'"):
        assembler.add(_region_chunk("w", w))


def test_a_step_the_client_gave_up_on_leaves_its_regions_unwritten(server, unique_name):
    """Sync, 2 workers: the impatient worker's step outlives its deadline (the other worker is
    late), so its regions may still be read; its next step negotiates new ones, and the session
    applies both steps exactly."""
    params = make_params()
    patient = Client(server.address, timeout=60)
    impatient = Client(server.address, timeout=3)
    creator = patient.create_session(unique_name, params, optimizer=SGD, num_workers=2)
    late = impatient.session(unique_name)
    try:
        g0, g1, g2, g3 = (make_grads(params, i) for i in range(4))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = [pool.submit(creator.push_pull, g0), pool.submit(late.push_pull, g1)]
            for f in first:
                f.result(timeout=60)
        assert set(late.data_paths().values()) == {"shared_memory"}
        regions_before = {i: r.region_id for i, r in late._shm.ensure(late._shards).items()}
        with pytest.raises(DeadlineExceededError):
            late.push_pull(g2)  # the other worker has not pushed: this step cannot close in time
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(creator.push_pull, g3)  # closes the step holding g2
            got = pending.result(timeout=60)
        regions_after = {i: r.region_id for i, r in late._shm.ensure(late._shards).items()}
        assert all(regions_after[i] != regions_before[i] for i in regions_before)
        mean0 = {k: (g0[k] + g1[k]) / np.float32(2) for k in params}
        mean1 = {k: (g2[k] + g3[k]) / np.float32(2) for k in params}
        for name in params:
            expected = params[name] - np.float32(0.1) * mean0[name] - np.float32(0.1) * mean1[name]
            np.testing.assert_allclose(got[name], expected, rtol=0, atol=1e-6)
        assert set(late.data_paths().values()) == {"shared_memory"}
    finally:
        creator.close()
        impatient.close()
        patient.close()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_finiteness_check_finds_any_non_finite_value_and_accepts_huge_finite_ones(bad):
    from optserve.server.domain.shard.assembly import all_finite

    values = np.ones(10_000, np.float32)
    assert all_finite(values)
    values[7777] = bad
    assert not all_finite(values)
    both = np.ones(10_000, np.float32)
    both[[10, 20]] = [np.inf, -np.inf]  # their sum is NaN, still not finite
    assert not all_finite(both)
    huge = np.full(10_000, np.finfo(np.float32).max, np.float32)  # finite values whose sum overflows
    assert all_finite(huge)


def test_on_an_accelerator_gradients_read_in_place_go_to_the_device_and_are_checked_there():
    """The upload an accelerator shard passes (its device here a CPU one: the same code): the
    tensors read in place arrive on the device with the push, a NaN among them refuses the push
    naming its tensor, and the tensors copied into buffers are checked on the host as before."""
    import functools

    import jax

    from optserve.server.compute.device_upload import upload_checked

    upload = functools.partial(upload_checked, jax.devices("cpu")[0])
    w, b = np.full((64, 32), 2.0, np.float32), np.arange(32, dtype=np.float32)
    buffers = {n: aligned_empty(s.shape, np.float32) for n, s in SPECS.items()}
    assembler = TensorAssembler(SPECS, buffers, check_finite=True, in_place=True, upload=upload)
    assembler.add(_region_chunk("w", w))
    assembler.add(_region_chunk("b", b, misalign=4))
    grads = assembler.finish()
    assert set(grads.on_device) == {"w"} and isinstance(grads.on_device["w"], jax.Array)
    assert np.array_equal(np.asarray(grads.on_device["w"]), w) and np.array_equal(grads["b"], b)

    bad = w.copy()
    bad[3, 5] = np.nan
    assembler = TensorAssembler(SPECS, buffers, check_finite=True, in_place=True, upload=upload)
    assembler.add(_region_chunk("w", bad))  # accepted here: checked on the device at finish
    assembler.add(_region_chunk("b", b, misalign=4))
    with pytest.raises(NonFinite, match=r"tensor 'w': NaN or Inf in elements \[0, 2048\)"):
        assembler.finish()

    assembler = TensorAssembler(SPECS, buffers, check_finite=False, in_place=True, upload=upload)
    assembler.add(_region_chunk("w", bad))  # allow_nonfinite: uploaded, not refused
    assembler.add(_region_chunk("b", b, misalign=4))
    assert np.isnan(np.asarray(assembler.finish().on_device["w"])[3, 5])

    host_bad = b.copy()
    host_bad[7] = np.inf
    assembler = TensorAssembler(SPECS, buffers, check_finite=True, in_place=True, upload=upload)
    with pytest.raises(NonFinite, match=r"tensor 'b'"):  # copied into its buffer: the host check, at once
        assembler.add(_region_chunk("b", host_bad, misalign=4))
