"""A shared-memory pull naming a region its shard no longer holds (it expired, was closed, or the
shard restarted) is answered as a step is: UNAVAILABLE with the shard's "shared memory region
unknown" message, the region dropped, and the next call negotiates a fresh one.

A Pull's answer is a stream: the shard's refusal arrives while the client reads it, not when the
call opens (gRPC opens a server-streaming call without waiting for the server). Real server (the
run's 2-shard one); the shard drops the regions on the client's real ``CloseSharedMemory`` call.
"""

from __future__ import annotations

import numpy as np
import pytest

from optserve.client import Client, UnavailableError
from optserve.protos import shared_memory as shm_contract
from optserve.protos.optserve.v1 import data_pb2
from tests._service_helpers import make_grads, make_params

SGD = {"name": "sgd", "args": {"learning_rate": 0.1}}


def test_a_pull_naming_a_region_its_shard_dropped_is_unavailable_and_a_fresh_region_follows(server, unique_name):
    params = make_params(6)
    grads = make_grads(params, 0)
    with Client(server.address, timeout=30.0, shared_memory=True) as client:
        session = client.create_session(unique_name, params, optimizer=SGD)
        try:
            expected = session.push_pull(grads)
            assert set(session.data_paths().values()) == {"shared_memory"}
            regions = session._shm.acquire(session._shards)
            session._shm.release(regions)
            for shard in session._shards:  # the shards drop this object's regions
                dropped = client.shard_data(shard.address).CloseSharedMemory(
                    data_pb2.CloseSharedMemoryRequest(session=unique_name, region=regions[shard.index].region_id),
                    timeout=10)
                assert dropped.dropped

            with pytest.raises(UnavailableError) as unknown:  # one attempt of Session.pull
                session._paths.pull(None, None, False)
            assert unknown.value.code == "UNAVAILABLE" and shm_contract.REGION_UNKNOWN in str(unknown.value)

            pulled = session.pull()  # fresh regions, negotiated on this call
            assert set(session.data_paths().values()) == {"shared_memory"}
            fresh = session._shm.acquire(session._shards)
            session._shm.release(fresh)
            assert {i: r.region_id for i, r in fresh.items()}.keys() == regions.keys()
            assert all(fresh[i].region_id != regions[i].region_id for i in regions)
            for name in params:
                np.testing.assert_array_equal(pulled[name], expected[name])
        finally:
            session.close()


def test_a_step_on_regions_its_shard_no_longer_knows_is_tried_again_at_once_on_fresh_ones(server, unique_name):
    """As after a shard restarted at its predecessor's address: the shard answered, so the step
    is sent again without a backoff (here 20 s: the call would take at least 16 s), applied once."""
    import time

    from optserve.client._retry import RetryPolicy

    params = make_params(7)
    slow = RetryPolicy(initial_backoff_s=20.0, max_backoff_s=20.0)
    with Client(server.address, timeout=60.0, shared_memory=True, retry=slow) as client:
        session = client.create_session(unique_name, params, optimizer=SGD)
        try:
            session.push_pull(make_grads(params, 0))
            regions = session._shm.acquire(session._shards)
            session._shm.release(regions)
            for shard in session._shards:  # the shards drop this object's regions
                client.shard_data(shard.address).CloseSharedMemory(
                    data_pb2.CloseSharedMemoryRequest(session=unique_name, region=regions[shard.index].region_id),
                    timeout=10)
            started = time.monotonic()
            session.push_pull(make_grads(params, 1))
            assert time.monotonic() - started < 8.0, "the step waited a backoff"
            assert session.version == 2  # applied once
            assert set(session.data_paths().values()) == {"shared_memory"}
        finally:
            session.close()
