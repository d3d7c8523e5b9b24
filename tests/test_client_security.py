"""The client SDK's security: TLS / mutual TLS channels, the tenant token on every call, the
creating client's identity, attaching with expectations, and argument checks at the edge.

Against real gRPC servers started in the test (plaintext, TLS, mutual TLS; certificates from
:mod:`_certs`): a small servicer that speaks just enough of Control and ShardData for the SDK
(and its adapters) to create, initialize, pull, push and push_pull a session, and records the
metadata and requests of every call it receives.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import threading

import grpc
import numpy as np
import pytest

from optserve.client import (
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    RetryPolicy,
    SessionOptions,
    UnauthenticatedError,
    UnavailableError,
)
from optserve.protos import contract
from optserve.protos.optserve.v1 import control_pb2, data_pb2, tensor_pb2
from _certs import make_pki

TOKEN = "tok-3f9a-SECRET-b1c2"
OTHER_TOKEN = "tok-other-tenant-77"
ONE_TRY = RetryPolicy(attempts=1)
PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
SGD = {"name": "sgd", "args": {"learning_rate": 0.1}}


# --- an in-test server ---------------------------------------------------------------------------


class RecordingServer:
    """A ``grpc.server`` on 127.0.0.1:0 answering Control and ShardData for one-shard sessions.

    Args:
      credentials: ``grpc.ssl_server_credentials`` for a TLS port; ``None``: plaintext.
      tokens: token -> tenant; when given, a call without ``authorization: Bearer <known token>``
        is refused with UNAUTHENTICATED and another tenant's session with PERMISSION_DENIED.

    Attributes:
      calls: ``(method, metadata dict, [request messages])`` per call received, in arrival order.
    """

    def __init__(self, credentials=None, tokens=None):
        self.tokens = tokens
        self.calls: list[tuple[str, dict, list]] = []
        self.sessions: dict[str, tuple[control_pb2.SessionInfo, str]] = {}  # name -> (info, tenant)
        self._lock = threading.Lock()
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(8), options=contract.SERVER_OPTIONS)
        uu, us = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        su, ss = grpc.stream_unary_rpc_method_handler, grpc.stream_stream_rpc_method_handler
        out = lambda message: message.SerializeToString()  # noqa: E731
        self._server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler("optserve.v1.Control", {
                "CreateSession": uu(self.create_session, control_pb2.CreateSessionRequest.FromString, out),
                "GetSession": uu(self.get_session, control_pb2.GetSessionRequest.FromString, out),
                "GetStatus": uu(self.get_status, control_pb2.GetStatusRequest.FromString, out),
                "ListSessions": uu(self.list_sessions, control_pb2.ListSessionsRequest.FromString, out),
                "CloseSession": uu(self.close_session, control_pb2.CloseSessionRequest.FromString, out),
            }),
            grpc.method_handlers_generic_handler("optserve.v1.ShardData", {
                "InitTensors": su(self.init_tensors, data_pb2.InitTensorsRequest.FromString, out),
                "Pull": us(self.pull, data_pb2.PullRequest.FromString, out),
                "Push": su(self.push, data_pb2.PushRequest.FromString, out),
                "PushPull": ss(self.push_pull, data_pb2.PushPullRequest.FromString, out),
            }),
        ])
        if credentials is None:
            port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            port = self._server.add_secure_port("127.0.0.1:0", credentials)
        self.address = f"127.0.0.1:{port}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None)

    def methods(self) -> list[str]:
        return [method for method, _, _ in self.calls]

    # -- admission: what the real server's interceptor decides -----------------------------------
    def _admit(self, method: str, context, requests: list) -> str:
        metadata = dict(context.invocation_metadata())
        with self._lock:
            self.calls.append((method, metadata, requests))
        if self.tokens is None:
            return ""
        value = metadata.get("authorization", "")
        tenant = self.tokens.get(value[len("Bearer "):]) if value.startswith("Bearer ") else None
        if tenant is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown token")
        return tenant

    def _session(self, name: str, tenant: str, context) -> control_pb2.SessionInfo:
        if name not in self.sessions:
            context.abort(grpc.StatusCode.NOT_FOUND, f"session {name!r} not found")
        info, owner = self.sessions[name]
        if owner != tenant:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"session {name!r} belongs to another tenant")
        return info

    # -- Control ---------------------------------------------------------------------------------
    def create_session(self, request, context):
        tenant = self._admit("CreateSession", context, [request])
        config = request.config
        if config.name in self.sessions:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"session {config.name!r} exists")
        shard = control_pb2.ShardAssignment(shard_index=0, address=self.address,
                                            tensor_names=[t.name for t in config.tensors])
        info = control_pb2.SessionInfo(config=config, shards=[shard])
        self.sessions[config.name] = (info, tenant)
        return control_pb2.CreateSessionResponse(session=info)

    def get_session(self, request, context):
        info = self._session(request.name, self._admit("GetSession", context, [request]), context)
        have = info.config
        if request.HasField("expect_optimizer"):
            want = request.expect_optimizer
            if want.name != have.optimizer.name:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"optimizer differs: session has {have.optimizer.name!r}, expected {want.name!r}")
            if json.loads(want.args_json or "{}") != json.loads(have.optimizer.args_json or "{}"):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"optimizer args differ: session has {have.optimizer.args_json}, expected {want.args_json}")
        if request.expect_mode and request.expect_mode != have.mode:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "mode differs")
        return control_pb2.GetSessionResponse(session=info)

    def get_status(self, request, context):
        self._session(request.name, self._admit("GetStatus", context, [request]), context)
        return control_pb2.GetStatusResponse(name=request.name, version=0)

    def list_sessions(self, request, context):
        tenant = self._admit("ListSessions", context, [request])
        return control_pb2.ListSessionsResponse(names=sorted(n for n, (_, t) in self.sessions.items() if t == tenant))

    def close_session(self, request, context):
        self._session(request.name, self._admit("CloseSession", context, [request]), context)
        del self.sessions[request.name]
        return control_pb2.CloseSessionResponse()

    # -- ShardData (every tensor on this one shard; parameters reported as zeros) ----------------
    def _zeros(self, info) -> list:
        return [tensor_pb2.TensorChunk(name=t.name, dtype=contract.FLOAT32, shape=list(t.shape), offset=0,
                                       data=bytes(4 * int(np.prod(t.shape))))
                for t in info.config.tensors]

    def init_tensors(self, request_iterator, context):
        requests = list(request_iterator)
        self._session(requests[0].session, self._admit("InitTensors", context, requests), context)
        return data_pb2.InitTensorsResponse(version=0)

    def pull(self, request, context):
        info = self._session(request.session, self._admit("Pull", context, [request]), context)
        yield data_pb2.PullResponse(version=0)
        for chunk in self._zeros(info):
            yield data_pb2.PullResponse(chunk=chunk)

    def push(self, request_iterator, context):
        requests = list(request_iterator)
        self._session(requests[0].header.session, self._admit("Push", context, requests), context)
        return data_pb2.PushResponse(version=1, committed=True)

    def push_pull(self, request_iterator, context):
        requests: list = []
        tenant = self._admit("PushPull", context, requests)
        for request in request_iterator:  # the SDK sends small steps as one `step` message each
            requests.append(request)
            info = self._session(request.step.header.session, tenant, context)
            done = data_pb2.StepDone(version=request.step.header.sequence, committed=True)
            yield data_pb2.PushPullResponse(step_result=data_pb2.PushPullStepResult(done=done, chunks=self._zeros(info)))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def plain_server():
    server = RecordingServer(tokens={TOKEN: "tenant-a", OTHER_TOKEN: "tenant-b"})
    yield server
    server.stop()


def _tls_server(pki, *, require_client_cert: bool) -> RecordingServer:
    credentials = grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
        root_certificates=pki.ca.read_bytes() if require_client_cert else None,
        require_client_auth=require_client_cert)
    return RecordingServer(credentials, tokens={TOKEN: "tenant-a"})


@pytest.fixture
def tls_server(pki):
    server = _tls_server(pki, require_client_cert=False)
    yield server
    server.stop()


@pytest.fixture
def mtls_server(pki):
    server = _tls_server(pki, require_client_cert=True)
    yield server
    server.stop()


def _authorization(server: RecordingServer) -> set:
    """The ``authorization`` values the server received (``None`` for a call without one)."""
    return {metadata.get("authorization") for _, metadata, _ in server.calls}


# --- the token -------------------------------------------------------------------------------------


def test_token_reaches_the_server_on_every_call_kind_control_and_data_plane(plain_server):
    with Client(plain_server.address, token=TOKEN, timeout=30) as client:
        session = client.create_session("s", PARAMS, optimizer=SGD)  # unary + stream-unary (InitTensors)
        session.pull()  # unary-stream, custom deserializer
        session.push(PARAMS)  # stream-unary, custom serializer
        session.push_pull(PARAMS)  # stream-stream on the reused PushPull call
        session.push_pull(PARAMS)
        session.status()
        assert client.list_sessions() == ["s"]
        session.detach()
    methods = set(plain_server.methods())
    assert {"CreateSession", "InitTensors", "Pull", "Push", "PushPull", "GetStatus", "ListSessions"} <= methods
    assert _authorization(plain_server) == {f"Bearer {TOKEN}"}


def test_client_without_token_sends_none_and_is_refused_as_unauthenticated(plain_server):
    client = Client(plain_server.address, timeout=30, retry=ONE_TRY)
    with pytest.raises(UnauthenticatedError, match="token") as refused:
        client.list_sessions()
    assert refused.value.code == "UNAUTHENTICATED"
    assert "authorization" not in plain_server.calls[0][1]
    client.close()


def test_unknown_token_is_unauthenticated_and_never_appears_in_the_error_or_repr(plain_server):
    secret = "tok-never-show-me-0xC0FFEE"
    client = Client(plain_server.address, token=secret, timeout=30, retry=ONE_TRY)
    with pytest.raises(UnauthenticatedError) as refused:
        client.create_session("s", PARAMS, optimizer=SGD)
    assert plain_server.calls[0][1]["authorization"] == f"Bearer {secret}"  # sent ...
    for text in (str(refused.value), repr(refused.value), repr(client), str(vars(client)),
                 repr(client._transport), repr(client.channel(plain_server.address))):
        assert secret not in text  # ... but shown nowhere
    assert "token=<redacted>" in repr(client)
    client.close()


def test_another_tenants_session_is_permission_denied(plain_server):
    with Client(plain_server.address, token=TOKEN, timeout=30) as owner:
        owner.create_session("mine", PARAMS, optimizer=SGD).detach()
    with Client(plain_server.address, token=OTHER_TOKEN, timeout=30) as other:
        with pytest.raises(PermissionDeniedError, match="another tenant") as refused:
            other.session("mine")
        assert refused.value.code == "PERMISSION_DENIED"
        assert other.list_sessions() == []


def test_unreachable_server_error_does_not_show_the_token():
    client = Client("127.0.0.1:1", token=TOKEN, timeout=5, retry=ONE_TRY)
    with pytest.raises(UnavailableError) as unavailable:
        client.list_sessions()
    assert TOKEN not in str(unavailable.value)
    client.close()


# --- the creating client's identity and attaching with expectations ------------------------------------


def test_create_session_and_its_initial_values_carry_the_clients_identity(plain_server):
    with Client(plain_server.address, token=TOKEN, timeout=30) as client, \
            Client(plain_server.address, token=TOKEN, timeout=30) as other:
        assert len(client.client_id) == 32 and int(client.client_id, 16) >= 0
        assert client.client_id != other.client_id
        session = client.create_session("s", PARAMS, optimizer=SGD)
        session.push(PARAMS)
        session.detach()
    requests = {method: messages for method, _, messages in plain_server.calls}
    assert requests["CreateSession"][0].client_id == client.client_id
    first, *chunks = requests["InitTensors"]
    assert first.session == "s" and first.client_id == client.client_id
    assert chunks and all(c.WhichOneof("item") == "chunk" and not c.client_id for c in chunks)
    push_identity = requests["Push"][0].header.client_id
    assert push_identity and push_identity != client.client_id  # pushes keep the session object's own id
    assert client.client_id not in repr(client)


def test_attach_sends_expected_optimizer_and_mode_built_like_the_session_config(plain_server):
    options = SessionOptions("shampoo", {"learning_rate": 0.01, "block_size": 8},
                             preconditioners={"max_age": 3}, mode="async")
    with Client(plain_server.address, token=TOKEN, timeout=30) as client:
        client.create_session_with("s", PARAMS, options).detach()
        client.session("s").detach()
        client.session("s", expect=options).detach()
        with pytest.raises(TypeError, match="expect"):
            client.session("s", expect={"name": "shampoo"})
    gets = [messages[0] for method, _, messages in plain_server.calls if method == "GetSession"]
    assert not gets[0].HasField("expect_optimizer") and gets[0].expect_mode == control_pb2.MODE_UNSPECIFIED
    config = options.to_config("s", PARAMS)
    assert gets[1].expect_optimizer == config.optimizer
    assert gets[1].expect_optimizer.preconditioners.max_age == 3
    assert gets[1].expect_mode == config.mode == control_pb2.MODE_ASYNC


def test_attach_with_other_expectations_surfaces_the_servers_refusal(plain_server):
    with Client(plain_server.address, token=TOKEN, timeout=30) as client:
        client.create_session("s", PARAMS, optimizer=SGD).detach()
        other_lr = SessionOptions.from_spec({"name": "sgd", "args": {"learning_rate": 0.2}})
        with pytest.raises(FailedPreconditionError, match="learning_rate"):
            client.session("s", expect=other_lr)


# --- TLS -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_path", [str, pathlib.Path], ids=["str", "Path"])
def test_tls_client_verifies_the_server_with_the_ca_bundle_and_sends_the_token(tls_server, pki, as_path):
    with Client(tls_server.address, token=TOKEN, tls=as_path(pki.ca), timeout=30, retry=ONE_TRY) as client:
        session = client.create_session("s", PARAMS, optimizer=SGD)
        session.push_pull(PARAMS)  # the shard's data-plane channel is TLS too
        assert client.list_sessions() == ["s"]
        session.detach()
    assert {"CreateSession", "InitTensors", "PushPull", "ListSessions"} <= set(tls_server.methods())
    assert _authorization(tls_server) == {f"Bearer {TOKEN}"}


def test_plaintext_client_to_a_tls_server_is_unavailable(tls_server):
    client = Client(tls_server.address, token=TOKEN, timeout=10, retry=ONE_TRY)
    with pytest.raises(UnavailableError):
        client.list_sessions()
    assert tls_server.calls == []
    client.close()


def test_tls_with_default_roots_refuses_a_server_signed_by_an_unknown_ca(tls_server):
    client = Client(tls_server.address, tls=True, timeout=10, retry=ONE_TRY)
    with pytest.raises(UnavailableError):
        client.list_sessions()
    assert tls_server.calls == []
    client.close()


def test_tls_server_name_replaces_the_dialled_host_in_verification(tls_server, pki):
    with Client(tls_server.address, token=TOKEN, tls=pki.ca, tls_server_name="localhost", timeout=10) as client:
        assert client.list_sessions() == []  # "localhost" is in the certificate
    wrong = Client(tls_server.address, token=TOKEN, tls=pki.ca, tls_server_name="elsewhere.example",
                   timeout=10, retry=ONE_TRY)
    with pytest.raises(UnavailableError):  # the certificate is not valid for that name
        wrong.list_sessions()
    wrong.close()
    assert len(tls_server.calls) == 1


def test_mutual_tls_server_accepts_the_client_certificate_and_refuses_a_client_without_one(mtls_server, pki):
    with Client(mtls_server.address, token=TOKEN, tls=pki.ca, client_cert=(pki.client_cert, str(pki.client_key)),
                timeout=10, retry=ONE_TRY) as client:
        session = client.create_session("s", PARAMS, optimizer=SGD)
        session.pull()
        session.detach()
    admitted = len(mtls_server.calls)
    assert admitted >= 3
    anonymous = Client(mtls_server.address, token=TOKEN, tls=pki.ca, timeout=10, retry=ONE_TRY)
    with pytest.raises(UnavailableError):
        anonymous.list_sessions()
    anonymous.close()
    assert len(mtls_server.calls) == admitted


# --- arguments are checked before anything is sent ---------------------------------------------------


def test_security_arguments_are_checked_naming_the_argument(pki, tmp_path):
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("not a certificate")
    cases = [
        (dict(tls=str(tmp_path / "missing-ca.pem")), r"^tls: no CA bundle file"),
        (dict(tls=tmp_path), r"^tls: no CA bundle file"),  # a directory
        (dict(tls=not_pem), r"^tls: .* is not a PEM file"),
        (dict(tls=1), r"^tls must be False, True or the path"),
        (dict(client_cert=(pki.client_cert, pki.client_key)), r"^client_cert needs TLS"),
        (dict(tls=pki.ca, client_cert=(pki.client_cert, tmp_path / "nokey.pem")), r"^client_cert: no private key file"),
        (dict(tls=pki.ca, client_cert=(tmp_path / "nocert.pem", pki.client_key)), r"^client_cert: no certificate chain"),
        (dict(tls=pki.ca, client_cert=str(pki.client_cert)), r"^client_cert must be a \(cert_chain_path, private_key_path\)"),
        (dict(tls_server_name="localhost"), r"^tls_server_name needs TLS"),
        (dict(tls=True, tls_server_name=""), r"^tls_server_name must be a non-empty host name"),
        (dict(token=""), r"^token must be a non-empty string"),
        (dict(token=12345), r"^token must be a str, got int"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            Client("127.0.0.1:1", **kwargs)


@pytest.mark.parametrize("token", ["tok with space", "tok\nnewline", "tok\ttab", "tök-non-ascii", " leading"])
def test_malformed_token_is_refused_without_quoting_it(token):
    with pytest.raises(InvalidArgumentError, match=r"^token must be printable ASCII without whitespace") as refused:
        Client("127.0.0.1:1", token=token)
    assert token.strip() not in str(refused.value)


# --- the adapters pass security through ---------------------------------------------------------------


def test_torch_optimizer_opens_its_client_with_the_security_settings(tls_server, pki):
    torch = pytest.importorskip("torch")
    from optserve.client.torch import RemoteOptimizer

    model = torch.nn.Linear(3, 2)
    optimizer = RemoteOptimizer(model.named_parameters(), tls_server.address, SGD, session="t",
                                token=TOKEN, tls=pki.ca, tls_server_name="localhost")
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert optimizer.created and optimizer._client._transport.secure
    optimizer.close()
    assert {"CreateSession", "InitTensors", "PushPull"} <= set(tls_server.methods())
    assert _authorization(tls_server) == {f"Bearer {TOKEN}"}
    with pytest.raises(InvalidArgumentError, match="^client_cert needs TLS"):
        RemoteOptimizer(model.named_parameters(), tls_server.address, SGD, client_cert=(pki.client_cert, pki.client_key))


def test_torch_optimizer_attaching_with_another_learning_rate_is_refused(plain_server):
    torch = pytest.importorskip("torch")
    from optserve.client.torch import RemoteOptimizer

    model = torch.nn.Linear(3, 2)
    first = RemoteOptimizer(model.named_parameters(), plain_server.address, SGD, session="t", token=TOKEN)
    same = RemoteOptimizer(model.named_parameters(), plain_server.address, SGD, session="t", token=TOKEN)
    assert first.created and not same.created
    rerun = {"name": "sgd", "args": {"learning_rate": 0.5}}
    with pytest.raises(FailedPreconditionError, match="learning_rate"):
        RemoteOptimizer(model.named_parameters(), plain_server.address, rerun, session="t", token=TOKEN)
    gets = [messages[0] for method, _, messages in plain_server.calls if method == "GetSession"]
    assert [json.loads(g.expect_optimizer.args_json) for g in gets] == [{"learning_rate": 0.1}, {"learning_rate": 0.5}]
    assert {g.expect_mode for g in gets} == {control_pb2.MODE_SYNC}
    # Given a Client, the optimizer uses it as it is (its own settings; the keyword arguments are ignored).
    with Client(plain_server.address, token=TOKEN, timeout=30) as client:
        reused = RemoteOptimizer(model.named_parameters(), client, SGD, session="t", token="ignored", tls=False)
        assert reused._client is client and not reused.created
        reused.close()
    for opt in (first, same):
        opt.close()


def test_jax_create_and_attach_with_an_address_pass_the_security_settings(mtls_server, pki):
    pytest.importorskip("jax")
    import optserve.client.jax as ojax

    security = dict(token=TOKEN, tls=pki.ca, client_cert=(pki.client_cert, pki.client_key))
    params = {"dense": {"w": np.ones((2, 3), np.float32)}}
    created = ojax.create_session(mtls_server.address, "j", params, SGD, mode="sync", **security)
    expect = SessionOptions.from_spec(SGD)
    attached = ojax.attach_session(mtls_server.address, "j", params, expect=expect, **security)
    assert attached.pull()["dense"]["w"].shape == (2, 3)
    for session in (created, attached):
        session.raw.detach()
    assert _authorization(mtls_server) == {f"Bearer {TOKEN}"}
    get = next(messages[0] for method, _, messages in mtls_server.calls if method == "GetSession")
    assert get.expect_optimizer == expect.to_optimizer_spec() and get.expect_mode == control_pb2.MODE_SYNC
    with pytest.raises(InvalidArgumentError, match="^tls: no CA bundle"):
        ojax.attach_session(mtls_server.address, "j", params, tls="/no/such/ca.pem")


def test_torch_rerun_with_another_learning_rate_is_refused_by_the_real_server(server, unique_name):
    torch = pytest.importorskip("torch")
    from optserve.client.torch import RemoteOptimizer

    model = torch.nn.Linear(3, 2)
    first = RemoteOptimizer(model.named_parameters(), server.address, SGD, session=unique_name)
    again = RemoteOptimizer(model.named_parameters(), server.address, SGD, session=unique_name)
    assert first.created and not again.created
    rerun = {"name": "sgd", "args": {"learning_rate": 0.5}}
    with pytest.raises(FailedPreconditionError, match="learning_rate") as refused:
        RemoteOptimizer(model.named_parameters(), server.address, rerun, session=unique_name)
    assert "0.5" in str(refused.value) and "0.1" in str(refused.value)
    with pytest.raises(FailedPreconditionError, match="mode"):
        RemoteOptimizer(model.named_parameters(), server.address, SGD, session=unique_name, mode="async")
    again.close()
    first.session.close()
