"""Placement: the one function that decides which shard holds which tensor."""

from optserve.server.config import DType, TensorSpec
from optserve.server.placement import place_tensors


def _spec(name, *shape):
    return TensorSpec(name, DType.FLOAT32, tuple(shape))


def test_placement_balances_bytes_and_places_every_tensor_once():
    tensors = [_spec("a", 1000), _spec("b", 600), _spec("c", 500), _spec("d", 400), _spec("e", 10), _spec("s")]
    shards = place_tensors(tensors, 2)
    assert sorted(n for names in shards for n in names) == ["a", "b", "c", "d", "e", "s"]
    loads = [sum(t.nbytes for t in tensors if t.name in names) for names in shards]
    assert sorted(loads) == [4444, 5600]  # the best split of these sizes: {a, d} vs {b, c, e, s}
    assert shards == place_tensors(tensors, 2)  # deterministic


def test_fewer_tensors_than_shards_leaves_shards_empty():
    shards = place_tensors([_spec("only", 3)], 3)
    assert shards == [["only"], [], []]
