"""Shape handling, statistics and grafting pieces of Shampoo."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from optserve.optim_kernels.shampoo.blocking import BlockLayout, merge_small_dims
from optserve.optim_kernels.shampoo.grafting import GraftingType, graft_direction, parse_graft_type
from optserve.optim_kernels.shampoo.quantization import decode, encode_matrix, encode_momentum
from optserve.optim_kernels.shampoo.statistics import gram, precondition_block, update_block_statistics


@pytest.mark.parametrize(
    "shape, max_dim, expected",
    [
        ((1, 2, 512, 1, 2048, 1, 3, 4), 1024, (1024, 2048, 12)),
        ((1, 2, 768, 1, 2048), 1024, (2, 768, 2048)),
        ((1, 1), 8, (1,)),
        ((), 8, (1,)),
        ((3, 5), 8, (3, 5)),
        ((2, 3, 4), 4096, (24,)),
    ],
)
def test_merge_small_dims_collapses_neighbours_up_to_max_dim(shape, max_dim, expected):
    assert merge_small_dims(shape, max_dim) == expected


def test_split_then_merge_gives_back_the_tensor_and_blocks_follow_row_major_order():
    layout = BlockLayout.create((7, 5), block_size=3, merge_dims=False, merge_max_dim=4096)
    x = jnp.arange(35.0).reshape(7, 5)
    blocks = layout.split(x)
    assert [b.shape for b in blocks] == layout.block_shapes == [
        (3, 3), (3, 2), (3, 3), (3, 2), (1, 3), (1, 2)]
    np.testing.assert_array_equal(np.asarray(blocks[1]), np.asarray(x[0:3, 3:5]))
    np.testing.assert_array_equal(np.asarray(layout.merge(blocks)), np.asarray(x))
    assert layout.statistic_sizes == [3, 3, 3, 2, 3, 3, 3, 2, 1, 3, 1, 2]


def test_merged_layout_reshapes_before_blocking():
    layout = BlockLayout.create((2, 3, 4), block_size=10, merge_dims=True, merge_max_dim=4096)
    assert layout.working_shape == (24,) and layout.block_shapes == [(10,), (10,), (4,)]
    x = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(np.asarray(layout.merge(layout.split(x))), np.asarray(x))


def test_statistics_are_a_running_average_of_unfolded_gram_matrices():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((2, 3, 4)).astype(np.float32)
    stats = [jnp.eye(d) for d in g.shape]
    new = update_block_statistics(stats, jnp.asarray(g), beta2=0.9)
    for axis, s in enumerate(new):
        unfolded = np.moveaxis(g, axis, 0).reshape(g.shape[axis], -1)
        np.testing.assert_allclose(np.asarray(s), 0.9 * np.eye(g.shape[axis]) + 0.1 * unfolded @ unfolded.T, rtol=1e-5)
    summed = update_block_statistics(stats, jnp.asarray(g), beta2=1.0)
    np.testing.assert_allclose(np.asarray(summed[0]), np.eye(2) + np.asarray(gram(jnp.asarray(g), 0)), rtol=1e-6)


def test_preconditioning_a_matrix_block_is_left_and_right_multiplication():
    rng = np.random.default_rng(1)
    g = rng.standard_normal((3, 4)).astype(np.float32)
    left = rng.standard_normal((3, 3)).astype(np.float32)
    right = rng.standard_normal((4, 4)).astype(np.float32)
    left, right = left + left.T, right + right.T
    out = precondition_block(jnp.asarray(g), [jnp.asarray(left), jnp.asarray(right)])
    np.testing.assert_allclose(np.asarray(out), left @ g @ right, rtol=1e-5, atol=1e-5)


def test_graft_types_parse_from_names_and_ints_and_reject_unknown_ones():
    assert parse_graft_type("rmsprop_normalized") is GraftingType.RMSPROP_NORMALIZED
    assert parse_graft_type(5) is GraftingType.SQRT_N
    with pytest.raises(ValueError, match="graft_type"):
        parse_graft_type("lion")


def test_rmsprop_graft_clips_its_rms_to_the_scaled_norm_limit():
    g = jnp.asarray([3.0, -4.0, 0.5])
    direction, _ = graft_direction(g, jnp.zeros(3), GraftingType.RMSPROP, beta2=0.99, diagonal_epsilon=0.0,
                                   clip_by_scaled_gradient_norm=0.5)
    assert abs(float(jnp.linalg.norm(direction) / jnp.sqrt(3.0)) - 0.5) < 1e-5
    sqrt_n, _ = graft_direction(g, None, GraftingType.SQRT_N, beta2=0.99, diagonal_epsilon=0.0)
    np.testing.assert_array_equal(np.asarray(sqrt_n), [1.0, -1.0, 1.0])


def test_quantized_matrices_and_momentum_round_trip_closely():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 6)).astype(np.float32)
    spd = x @ x.T + 10 * np.eye(6, dtype=np.float32)
    back = np.asarray(decode(encode_matrix(jnp.asarray(spd), True)))
    np.testing.assert_allclose(np.diag(back), np.diag(spd), rtol=1e-7)
    assert np.max(np.abs(back - spd)) <= np.max(np.abs(spd - np.diag(np.diag(spd)))) / 32767 + 1e-6
    m = rng.standard_normal((5, 4)).astype(np.float32)
    assert np.max(np.abs(np.asarray(decode(encode_momentum(jnp.asarray(m), True))) - m)) <= np.abs(m).max() / 127
    assert encode_momentum(jnp.asarray(m[0]), True).dtype == jnp.float32  # vectors stay f32
