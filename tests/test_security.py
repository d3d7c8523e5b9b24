"""Security against a real server: real TLS (a CA made in the test), tenant tokens, ownership,
and internal endpoints only the server's own processes may call.

Each attack from the security issue is replayed: a second tenant reading, pushing into, closing
and re-creating another's session; a third party initializing a session before its creator; a
forged Commit to a shard's clock endpoint. Each is refused, and the victim's trajectory stays
exactly that of an untouched twin session.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest

from _certs import make_pki
from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import (AlreadyExistsError, Client, FailedPreconditionError, PermissionDeniedError,
                             SessionOptions, UnauthenticatedError, UnavailableError)
from optserve.client._retry import RetryPolicy
from optserve.protos.optserve.v1 import clock_pb2, clock_pb2_grpc, control_pb2, data_pb2, data_pb2_grpc, tensor_pb2

ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}
TOKENS = "tok-alice-5b1f alice\ntok-bob-9c2e bob\ntok-ops-77aa admin\n"
ONCE = RetryPolicy(attempts=1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_server(ray_local, pki, tmp_path_factory):
    """TLS on every port and two tenants; sessions spread over both shards."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(TOKENS)
    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0, vote_timeout_s=8.0,
                                        tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                                        auth_tokens=str(tokens), health_port=0))
    yield running
    running.stop()


def _client(server, pki, token, **kwargs):
    return Client(server.address, token=token, tls=str(pki.ca), timeout=30, **kwargs)


@pytest.fixture(scope="module")
def alice(secure_server, pki):
    with _client(secure_server, pki, "tok-alice-5b1f") as c:
        yield c


@pytest.fixture(scope="module")
def bob(secure_server, pki):
    with _client(secure_server, pki, "tok-bob-9c2e") as c:
        yield c


def _secure_channel(pki, address):
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes()))


def _token(value):
    return (("authorization", f"Bearer {value}"),)


def test_tls_client_with_its_token_trains_exactly_as_in_process(alice, unique_name):
    params = make_params()
    session = alice.create_session(unique_name, params, optimizer=ADAM)
    reference = InProcess("adam", ADAM["args"], params)
    try:
        for step in range(3):
            grads = make_grads(params, step)
            assert max_abs_diff(session.push_pull(grads), reference.step(grads)) <= 1e-6
        assert unique_name in alice.list_sessions()
    finally:
        session.close()


def test_probes_check_health_in_plaintext_on_the_health_port_and_without_a_token_over_tls(secure_server, pki):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    plain = health_pb2_grpc.HealthStub(grpc.insecure_channel(secure_server.health_address))
    assert plain.Check(health_pb2.HealthCheckRequest(service="optserve.v1.Control"), timeout=10).status == serving
    over_tls = health_pb2_grpc.HealthStub(_secure_channel(pki, secure_server.address))
    assert over_tls.Check(health_pb2.HealthCheckRequest(), timeout=10).status == serving  # no token needed
    with pytest.raises(grpc.RpcError) as info:  # the health port serves health only
        control_pb2_grpc_stub = grpc.insecure_channel(secure_server.health_address).unary_unary(
            "/optserve.v1.Control/ListSessions", request_serializer=control_pb2.ListSessionsRequest.SerializeToString,
            response_deserializer=control_pb2.ListSessionsResponse.FromString)
        control_pb2_grpc_stub(control_pb2.ListSessionsRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_client_to_the_tls_server_is_unavailable(secure_server):
    with Client(secure_server.address, token="tok-alice-5b1f", timeout=5, retry=ONCE) as plain:
        with pytest.raises(UnavailableError):
            plain.list_sessions()


@pytest.mark.parametrize("token", [None, "tok-nobody"])
def test_missing_or_unknown_token_is_unauthenticated_on_control_and_data_planes(secure_server, pki, alice,
                                                                                unique_name, token):
    session = alice.create_session(unique_name, make_params(), optimizer=ADAM)
    try:
        with Client(secure_server.address, token=token, tls=str(pki.ca), timeout=10, retry=ONCE) as stranger:
            with pytest.raises(UnauthenticatedError) as info:
                stranger.list_sessions()
            assert "tok-nobody" not in str(info.value)
        stub = data_pb2_grpc.ShardDataStub(_secure_channel(pki, session.info.shards[0].address))
        metadata = _token(token) if token else ()
        with pytest.raises(grpc.RpcError) as raw:
            list(stub.Pull(data_pb2.PullRequest(session=unique_name), metadata=metadata, timeout=10))
        assert raw.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        session.close()


def test_another_tenant_can_neither_see_nor_touch_a_session(secure_server, pki, alice, bob, unique_name):
    params = make_params()
    victim = alice.create_session(unique_name + "-v", params, optimizer=ADAM)
    twin = alice.create_session(unique_name + "-t", params, optimizer=ADAM)
    try:
        assert victim.name not in bob.list_sessions() and victim.name in alice.list_sessions()
        with pytest.raises(PermissionDeniedError):
            bob.session(victim.name)
        with pytest.raises(PermissionDeniedError):
            bob.close_session(victim.name)
        with pytest.raises(AlreadyExistsError):  # no re-creating under a live name
            bob.create_session(victim.name, params, optimizer={"name": "sgd", "args": {"learning_rate": 100.0}})
        grads = make_grads(params, 9)
        for shard in victim.info.shards:  # raw data-plane calls with bob's valid token
            stub = data_pb2_grpc.ShardDataStub(_secure_channel(pki, shard.address))
            with pytest.raises(grpc.RpcError) as pull:
                list(stub.Pull(data_pb2.PullRequest(session=victim.name), metadata=_token("tok-bob-9c2e"), timeout=10))
            assert pull.value.code() == grpc.StatusCode.PERMISSION_DENIED
            header = data_pb2.PushHeader(session=victim.name, client_id="bob", sequence=1, base_version=0,
                                         auto_commit=True)
            chunks = [tensor_pb2.TensorChunk(name=n, dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(grads[n].shape),
                                             data=grads[n].tobytes()) for n in shard.tensor_names]
            requests = [data_pb2.PushRequest(header=header)] + [data_pb2.PushRequest(chunk=c) for c in chunks]
            with pytest.raises(grpc.RpcError) as push:
                stub.Push(iter(requests), metadata=_token("tok-bob-9c2e"), timeout=10)
            assert push.value.code() == grpc.StatusCode.PERMISSION_DENIED
        for step in range(3):  # the owner's trajectory is untouched: bit-identical to the twin's
            grads = make_grads(params, step)
            assert max_abs_diff(victim.push_pull(grads), twin.push_pull(grads)) == 0.0
        assert victim.status().pushes_accepted == 3
    finally:
        victim.close()
        twin.close()


def test_server_status_shows_a_tenant_its_own_sessions_only_and_the_admin_all(secure_server, pki, alice, bob,
                                                                             unique_name):
    session = alice.create_session(unique_name, make_params(), optimizer=ADAM)
    try:
        mine, theirs = alice.server_status(), bob.server_status()
        assert sum(s.sessions for s in mine) >= 1 and sum(s.param_bytes for s in mine) > 0
        assert all(s.healthy for s in theirs) and {s.address for s in theirs} == {s.address for s in mine}
        assert not bob.list_sessions()
        assert [(s.sessions, s.param_bytes, s.resident_bytes) for s in theirs] == [(0, 0, 0)] * len(theirs)
        with _client(secure_server, pki, "tok-ops-77aa") as admin:
            everyone = admin.server_status()
        assert all(s.resident_bytes > 0 for s in everyone)
        assert sum(s.sessions for s in everyone) >= sum(s.sessions for s in mine)
    finally:
        session.close()


def test_only_the_creating_client_may_initialize_a_session(server, unique_name):
    # The race: between CreateSession and the creator's InitTensors, a third party sends values.
    params = make_params()
    owner = Client(server.address, timeout=30)
    try:
        spec = [tensor_pb2.TensorSpec(name=n, dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(a.shape))
                for n, a in params.items()]
        config = control_pb2.SessionConfig(name=unique_name, tensors=spec, mode=control_pb2.MODE_SYNC, num_workers=1,
                                           max_staleness=-1,
                                           optimizer=control_pb2.OptimizerSpec(name="adam", args_json='{"learning_rate": 0.01}'))
        info = owner.control.CreateSession(control_pb2.CreateSessionRequest(config=config, client_id=owner.client_id),
                                            timeout=30).session
        for shard in info.shards:
            stub = data_pb2_grpc.ShardDataStub(grpc.insecure_channel(shard.address))
            chunks = [data_pb2.InitTensorsRequest(chunk=tensor_pb2.TensorChunk(
                name=n, dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(params[n].shape),
                data=np.full(params[n].shape, 666, np.float32).tobytes())) for n in shard.tensor_names]
            with pytest.raises(grpc.RpcError) as info_error:
                stub.InitTensors(iter([data_pb2.InitTensorsRequest(session=unique_name, client_id="intruder")] + chunks),
                                 timeout=30)
            assert info_error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        session = owner.session(unique_name)
        session._initialize({n: np.asarray(a) for n, a in params.items()})  # the creator's own init still works
        reference = InProcess("adam", {"learning_rate": 0.01}, params)
        for step in range(2):
            grads = make_grads(params, step)
            assert max_abs_diff(session.push_pull(grads), reference.step(grads)) <= 1e-6
        session.close()
    finally:
        owner.close()


def test_a_forged_clock_commit_is_refused_and_the_session_keeps_its_trajectory(server, unique_name):
    params = make_params()
    client = Client(server.address, timeout=30)
    session = client.create_session(unique_name, params, optimizer=ADAM)
    reference = InProcess("adam", ADAM["args"], params)
    try:
        assert len(session.info.shards) == 2  # a multi-shard session: its home shard serves the clock
        session.push_pull(make_grads(params, 0))
        reference.step(make_grads(params, 0))
        forged = clock_pb2.ClockCommitRequest(session=unique_name, client_id=session.client_id, sequence=99,
                                              base_version=session.version)
        for address in server.clock_addresses:
            stub = clock_pb2_grpc.SessionClockStub(grpc.insecure_channel(address))
            for metadata in ((), (("x-optserve-internal", "guess"),)):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Commit(forged, metadata=metadata, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for step in range(1, 4):
            grads = make_grads(params, step)
            assert max_abs_diff(session.push_pull(grads), reference.step(grads)) <= 1e-6
    finally:
        session.close()
        client.close()


def test_attaching_with_another_optimizer_or_mode_names_the_difference(client_for_attach, unique_name):
    client = client_for_attach
    session = client.create_session(unique_name, make_params(), optimizer=ADAM, mode="sync")
    try:
        assert client.session(unique_name, expect=SessionOptions.from_spec(ADAM)).name == unique_name
        with pytest.raises(FailedPreconditionError, match="learning_rate"):
            client.session(unique_name, expect=SessionOptions.from_spec({"name": "adam", "args": {"learning_rate": 0.5}}))
        with pytest.raises(FailedPreconditionError, match="sgd"):
            client.session(unique_name, expect=SessionOptions.from_spec({"name": "sgd", "args": {"learning_rate": 0.01}}))
        with pytest.raises(FailedPreconditionError, match="async"):
            client.session(unique_name, expect=SessionOptions.from_spec(ADAM, mode="async"))
    finally:
        session.close()


@pytest.fixture(scope="module")
def client_for_attach(server):
    with Client(server.address, timeout=30) as c:
        yield c


def test_mutual_tls_refuses_a_client_without_a_certificate(ray_local, pki, unique_name):
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=1, tls_cert=str(pki.server_cert),
                                        tls_key=str(pki.server_key), tls_client_ca=str(pki.ca)))
    try:
        with Client(running.address, tls=str(pki.ca), timeout=5, retry=ONCE) as anonymous:
            with pytest.raises(UnavailableError):
                anonymous.list_sessions()
        with Client(running.address, tls=str(pki.ca), client_cert=(str(pki.client_cert), str(pki.client_key)),
                    timeout=30) as known:
            session = known.create_session(unique_name, make_params(), optimizer=ADAM)
            session.push_pull(make_grads(make_params(), 0))
            session.close()
    finally:
        running.stop()


@pytest.mark.parametrize("argv, fragment", [
    (["--host", "0.0.0.0"], "--insecure"),
    (["--host", "127.0.0.1", "--shard-host", "0.0.0.0"], "--insecure"),
    (["--metrics-port", "0", "--metrics-host", "0.0.0.0"], "--insecure"),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "--tls-cert"),
    (["--tls-cert", "x.pem"], "--tls-key"),
    (["--auth-tokens", "/nonexistent-tokens"], "--auth-tokens"),
])
def test_serve_refuses_an_unsafe_or_broken_security_setup_in_one_line(argv, fragment):
    proc = subprocess.run([sys.executable, "-c", "import sys; from optserve.server.cli import main; sys.exit(main())",
                           "serve", "--port", "0", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_shared_memory_under_tls_and_tokens_serves_only_the_owning_tenant(secure_server, pki, alice, unique_name):
    params = make_params()
    session = alice.create_session(unique_name, params, optimizer=ADAM)
    reference = InProcess("adam", ADAM["args"], params)
    try:
        for step in range(3):  # tensor bytes through shared memory; the step messages over TLS with the token
            grads = make_grads(params, step)
            assert max_abs_diff(session.push_pull(grads), reference.step(grads)) <= 1e-6
        assert set(session.data_paths().values()) == {"shared_memory"}
        for shard in session.info.shards:  # another tenant's token cannot even get a probe region offered
            channel = _secure_channel(pki, shard.address)
            offer = channel.unary_unary("/optserve.v1.ShardData/OfferSharedMemory",
                                        request_serializer=data_pb2.OfferSharedMemoryRequest.SerializeToString,
                                        response_deserializer=data_pb2.OfferSharedMemoryResponse.FromString)
            for metadata, code in ((_token("tok-bob-9c2e"), grpc.StatusCode.PERMISSION_DENIED),
                                   ((), grpc.StatusCode.UNAUTHENTICATED)):
                with pytest.raises(grpc.RpcError) as refused:
                    offer(data_pb2.OfferSharedMemoryRequest(session=session.name, client_id="bob"),
                          metadata=metadata, timeout=10)
                assert refused.value.code() == code
    finally:
        session.close()
