"""The host passes of a shared-memory step split across threads: the parameters' copy into a region
and the gradients' finite check give what one pass gives, wherever the pieces fall; and the
parameters' read-back (``to_host``) is a view on a CPU device (no copy)."""

from __future__ import annotations

import numpy as np
import pytest

from optserve.server.domain.shard.assembly import all_finite, _all_finite_piece
from optserve.server.domain.shard.host_passes import SPLIT_MIN_BYTES, parallel_all_finite, parallel_copy

SIZE = SPLIT_MIN_BYTES // 4 * 3 + 7  # float32 elements: over the split size, not divisible by the threads


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_a_split_copy_writes_every_byte_once(threads):
    source = np.random.default_rng(0).standard_normal(SIZE, dtype=np.float32).reshape(-1, 1)
    region = np.zeros(SIZE * 4 + 16, np.uint8)  # the slot is a byte range of a larger mapping
    parallel_copy(region[8: 8 + SIZE * 4], source, threads=threads)
    assert np.array_equal(region[8: 8 + SIZE * 4].view(np.float32), source.reshape(-1))
    assert not region[:8].any() and not region[8 + SIZE * 4:].any()


def test_a_copy_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="copy of 8 bytes into 4"):
        parallel_copy(np.zeros(4, np.uint8), np.zeros(2, np.float32))


@pytest.mark.parametrize("where", [0, SIZE // 3 + 1, SIZE // 2, SIZE - 1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_split_finite_check_finds_a_bad_value_in_any_piece(where, bad):
    values = np.ones(SIZE, np.float32)
    assert parallel_all_finite(values, _all_finite_piece, threads=3)
    values[where] = bad
    assert not parallel_all_finite(values, _all_finite_piece, threads=3)
    assert not all_finite(values)


def test_large_finite_values_whose_sum_overflows_are_finite():
    values = np.full(SIZE, 3e38, np.float32)
    assert parallel_all_finite(values, _all_finite_piece, threads=4)


def test_parameters_read_back_from_a_cpu_device_are_views():
    import jax

    from optserve.server.compute.host_transfer import to_host

    on_device = jax.device_put({"w": np.arange(6, dtype=np.float32), "count": np.int32(3)}, jax.devices("cpu")[0])
    host = to_host(on_device)
    assert np.array_equal(host["w"], np.arange(6, dtype=np.float32)) and int(host["count"]) == 3
    assert host["w"].ctypes.data == on_device["w"].unsafe_buffer_pointer()
