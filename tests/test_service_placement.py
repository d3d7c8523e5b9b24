"""Placement: the one function that decides which shard holds which tensor."""

import numpy as np
import pytest

from optserve.client import Client
from optserve.server.domain.config import DType, TensorSpec
from optserve.server.domain.sessions.placement import place_tensors


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


def test_a_small_session_stays_on_the_least_loaded_shard():
    tensors = [_spec("w", 64, 64), _spec("b", 64)]  # 16.6 KB
    assert place_tensors(tensors, 3, min_shard_bytes=1 << 20) == [["w", "b"], [], []]
    assert place_tensors(tensors, 3, min_shard_bytes=1 << 20, shard_loads=[500, 20, 300]) == [[], ["w", "b"], []]


def test_a_session_spreads_over_as_many_shards_as_give_each_min_shard_bytes():
    tensors = [_spec(f"m{i}", 256, 256) for i in range(4)]  # 4 x 256 KB = 1 MB
    two = place_tensors(tensors, 4, min_shard_bytes=400 << 10, shard_loads=[9, 0, 9, 0])
    assert two == [[], ["m0", "m2"], [], ["m1", "m3"]]  # 1 MB // 400 KB = 2 shards: the two empty ones
    assert all(place_tensors(tensors, 4, min_shard_bytes=0, shard_loads=[9, 0, 9, 0]))  # 0: every shard


def test_placement_rejects_bad_arguments_by_name():
    with pytest.raises(ValueError, match="min_shard_bytes"):
        place_tensors([_spec("w", 2)], 2, min_shard_bytes=-1)
    with pytest.raises(ValueError, match="shard_loads"):
        place_tensors([_spec("w", 2)], 2, shard_loads=[0])


@pytest.fixture(scope="module")
def thrifty_server(ray_local):
    """Two shards; sessions below 2 x 8 KB stay on one shard."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=8 << 10))
    yield running
    running.stop()


def test_server_keeps_small_sessions_on_one_shard_alternating_and_spreads_large_ones(thrifty_server, unique_name):
    client = Client(thrifty_server.address)
    small = {"w": np.ones((8, 8), np.float32), "b": np.zeros(8, np.float32)}
    large = {f"m{i}": np.ones((32, 32), np.float32) for i in range(4)}  # 16 KB: two shards of 8 KB
    optimizer = {"name": "sgd", "args": {"learning_rate": 0.5}}
    first = client.create_session(unique_name + "-a", small, optimizer=optimizer)
    second = client.create_session(unique_name + "-b", small, optimizer=optimizer)
    spread = client.create_session(unique_name + "-c", large, optimizer=optimizer)
    try:
        first_shards = [s.index for s in first.status().shards]
        second_shards = [s.index for s in second.status().shards]
        assert len(first_shards) == 1 and len(second_shards) == 1
        assert first_shards != second_shards  # the second small session goes to the idle shard
        assert sorted(s.index for s in spread.status().shards) == [0, 1]
        for session, params in ((first, small), (spread, large)):  # both kinds step correctly
            result = session.push_pull({k: np.ones_like(v) for k, v in params.items()})
            for name, value in params.items():
                np.testing.assert_array_equal(result[name], value - 0.5, err_msg=name)
    finally:
        for session in (first, second, spread):
            session.close()
        client.close()
