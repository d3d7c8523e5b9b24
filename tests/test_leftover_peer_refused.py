"""A push refused on a shard because its peer did not stage its part (ABORTED, ``PeerRefused``:
applied nowhere) is retried by the SDK as UNAVAILABLE is: the same sequence, applied once.

No natural fault was found that makes the SDK's own attempts end with a bare PeerRefused today: an
attempt in which every shard answered PeerRefused is already turned into UNAVAILABLE
(``_fanout.all_or_first_error``), and any other answer beside it is the refusing shard's own
error, raised instead (shard SIGKILLs of a durable 2-shard server under async and sync load gave
none). So the retry's classification is tested on the real server's refusal: the attempt sends the
peer shard a NaN gradient, which it refuses (its vote tells the home shard at once), and reads only
the home shard's answer, ABORTED with ``optserve-peer-refused``. The next attempt sends the whole
push with the same header.
"""

from __future__ import annotations

import numpy as np
import pytest

from optserve.client import Client, InvalidArgumentError, PeerRefusedError
from optserve.client._fanout import call_shard
from optserve.protos.optserve.v1 import data_pb2
from tests._service_helpers import make_grads, make_params

SGD = {"name": "sgd", "args": {"learning_rate": 0.1}}


def _push_part(session, shard, header, grads):
    """The shard's part of the push (gRPC bytes), its answer converted to the SDK's errors."""
    def requests():
        yield data_pb2.PushRequest(header=header)
        yield from session._paths.chunk_messages(shard, grads, None)

    return call_shard(lambda s: s.calls.push(requests(), timeout=30.0), shard)


def test_a_push_its_peer_shard_did_not_stage_is_retried_and_applied_once(server, unique_name):
    params = make_params(4)
    grads = make_grads(params, 0)
    poisoned = {name: np.full_like(value, np.nan) for name, value in grads.items()}
    with Client(server.address, timeout=30.0, shared_memory=False) as client:
        session = client.create_session(unique_name, params, optimizer=SGD, mode="async")
        try:
            assert len(session._shards) == 2
            home, peer = session._shards
            header = session._header()
            attempts, refused = [], []

            def attempt():
                attempts.append(len(attempts))
                if len(attempts) == 1:  # the peer refuses its part; the home shard's answer is PEER_REFUSED
                    with pytest.raises(InvalidArgumentError, match="(?i)finite|nan"):
                        _push_part(session, peer, header, poisoned)
                    try:
                        return _push_part(session, home, header, grads)
                    except PeerRefusedError as exc:
                        refused.append(exc)
                        raise
                return session._push_once(header, grads, None)  # the whole push, same client id and sequence

            assert session._fanout.served(attempt) == 1
            assert len(attempts) == 2 and len(refused) == 1 and refused[0].code == "ABORTED"
            status = session.status()
            assert (status.version, status.pushes_accepted) == (1, 1)  # applied once
            pulled = session.pull()
            for name, value in params.items():
                np.testing.assert_allclose(pulled[name], value - np.float32(0.1) * grads[name], rtol=0, atol=1e-6)
        finally:
            session.close()
