"""Shape logic of Adafactor's factoring rules (T5X heuristic and rules, HF, t2t)."""

import jax.numpy as jnp
import pytest

from optserve.optim_kernels.adafactor import factoring as fct
from optserve.optim_kernels.adafactor.factoring import FactorDim, FactorSpec

B, R, C, N = FactorDim.BATCH, FactorDim.ROW, FactorDim.COLUMN, FactorDim.NONE


def test_heuristic_makes_the_smaller_of_the_two_largest_axes_the_row():
    wide = fct.heuristic((128, 512), 128)
    tall = fct.heuristic((512, 128), 128)
    assert (wide.row_axes, wide.col_axes) == ((0,), (1,))
    assert (tall.row_axes, tall.col_axes) == ((1,), (0,))
    # v_row is the mean over the columns: it has the length of the row axis.
    assert wide.v_row_shape((128, 512)) == (128,) and wide.v_col_shape((128, 512)) == (512,)
    assert tall.v_row_shape((512, 128)) == (128,) and tall.v_col_shape((512, 128)) == (512,)


def test_heuristic_on_a_square_keeps_axis_order():
    spec = fct.heuristic((256, 256), 128)
    assert (spec.row_axes, spec.col_axes) == ((0,), (1,))


def test_heuristic_leaves_small_matrices_vectors_and_scalars_unfactored():
    for shape in [(127, 4096), (), (4096,)]:
        spec = fct.heuristic(shape, 128)
        assert not spec.factored
        assert spec.averaging_axes == tuple(range(len(shape)))


def test_heuristic_rejects_rank_three_naming_path_shape_and_option():
    with pytest.raises(ValueError, match=r"'enc/attn/q'.*\(4, 8, 16\).*factor_map"):
        fct.heuristic((4, 8, 16), 1, "enc/attn/q")


def test_rank_two_rule_without_batch_falls_back_to_the_heuristic():
    # T5X ignores a 2-D rule without BATCH axes: (COLUMN, ROW) is not honoured.
    spec = fct.from_rule((C, R), (128, 512), "w", 128)
    assert spec == fct.heuristic((128, 512), 128)
    assert not fct.from_rule((C, R), (8, 16), "w", 128).factored


def test_batch_rule_factors_each_slice_and_never_averages_the_batch_axis():
    spec = fct.from_rule((B, R, C), (3, 4, 6), "stack", 128)
    assert spec == FactorSpec((1,), (2,), (1, 2))
    assert spec.v_row_shape((3, 4, 6)) == (3, 4)
    assert spec.v_col_shape((3, 4, 6)) == (3, 6)
    assert spec.row_axes_in_v_row() == (1,)


def test_rule_names_and_multi_axis_columns_are_accepted():
    spec = fct.from_rule(("row", "col", "column"), (4, 2, 3), "q", 128)
    assert spec == FactorSpec((0,), (1, 2), (0, 1, 2))
    assert spec.v_row_shape((4, 2, 3)) == (4,) and spec.v_col_shape((4, 2, 3)) == (2, 3)


def test_none_rule_means_unfactored_even_for_high_rank():
    assert not fct.from_rule(None, (2, 3, 4, 5), "x", 1).factored


def test_bad_rules_raise_value_error_naming_path_and_option():
    with pytest.raises(ValueError, match=r"'a/w'.*\(3, 4, 6\).*rank.*factor_map"):
        fct.from_rule((R, C), (3, 4, 6), "a/w", 128)
    with pytest.raises(ValueError, match=r"'a/w'.*ROW without COLUMN"):
        fct.from_rule((B, R, N), (3, 4, 6), "a/w", 128)
    with pytest.raises(ValueError, match=r"'a/w'.*'diagonal'"):
        fct.from_rule((B, "diagonal", C), (3, 4, 6), "a/w", 128)


def test_logical_axes_map_to_rules_and_half_factored_rules_become_unfactored():
    rules = fct.standard_logical_factor_rules()
    assert fct.rule_from_logical_axes(("layers", "embed", "mlp"), rules, "w") == (B, R, C)
    # ROW without COLUMN: both dropped to NONE, the BATCH axis kept.
    assert fct.rule_from_logical_axes(("layers", "embed"), rules, "w") == (B, N)


def test_logical_axes_incomplete_or_unknown_raise_value_error():
    rules = fct.standard_logical_factor_rules()
    with pytest.raises(ValueError, match=r"'w'.*incomplete.*logical_factor_rules"):
        fct.rule_from_logical_axes(("embed", "mlp", "relpos_buckets"), rules, "w")
    with pytest.raises(ValueError, match=r"'w'.*'nonexistent'.*logical_factor_rules"):
        fct.rule_from_logical_axes(("embed", "nonexistent"), rules, "w")


def test_last_two_axes_factors_every_rank_two_or_more_regardless_of_size():
    assert fct.last_two_axes((1, 7)) == FactorSpec((0,), (1,), (0, 1))
    spec = fct.last_two_axes((2, 1, 3, 4))
    assert spec == FactorSpec((2,), (3,), (0, 1, 2, 3))
    assert spec.v_row_shape((2, 1, 3, 4)) == (2, 1, 3)
    assert spec.v_col_shape((2, 1, 3, 4)) == (2, 1, 4)
    assert not fct.last_two_axes((9,)).factored


def test_matrices_only_factors_rank_two_and_nothing_else():
    assert fct.matrices_only((3, 5)).factored
    assert not fct.matrices_only((2, 3, 5)).factored
    assert not fct.matrices_only((5,)).factored


def test_path_map_takes_the_first_matching_regex_and_names_unmatched_paths():
    rules = fct.PathMap([("bias$", False), ("dense", True)], "multiply_by_parameter_scale")
    assert rules["layer/dense/bias"] is False
    assert rules["layer/dense/kernel"] is True
    with pytest.raises(ValueError, match=r"'embed/table'.*multiply_by_parameter_scale"):
        rules["embed/table"]


def test_leaf_paths_join_dict_keys_and_sequence_indices():
    tree = {"enc": {"layers": [jnp.zeros(1), jnp.zeros(2)]}, "head": jnp.zeros(3)}
    assert fct.leaf_paths(tree) == ["enc/layers/0", "enc/layers/1", "head"]
