"""The client: connects to a server's coordinator and opens sessions.

    client = Client("127.0.0.1:50051")
    session = client.create_session("run-1", params, optimizer={"name": "adafactor_hf", "args": {}})
    new_params = session.push_pull(grads)

    # a server started with TLS and tenant tokens:
    client = Client("optserve.example:50051", token=os.environ["OPTSERVE_TOKEN"], tls="ca.pem")

Every channel (the coordinator's and each shard's) is opened by one
:class:`~optserve.client._transport.Transport`: same credentials, same options, the token on every call.
The SDK's own modules reach a shard through :meth:`Client.channel` and :meth:`Client.shard_data`
(the stub generated from data.proto), and the coordinator through :attr:`Client.control`.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any, Mapping, Optional

import grpc
import numpy as np

from optserve.client import _heap, _loop, _retry, _saved_state, _shm
from optserve.client._inputs import check_worker_id
from optserve.client._session import Session
from optserve.client._transport import ClientCert, TLSArg, Transport
from optserve.client.options import SessionOptions
from optserve.client.status import ServerShardStatus, SessionSeries, SessionStatus
from optserve.protos import contract
from optserve.protos.optserve.v1 import control_pb2, control_pb2_grpc, data_pb2_grpc

_LOOP_CLOSE_S = 5.0  # how long close() waits for a grpc.aio channel to close (its calls are cancelled)


class Client:
    """A connection to an optserve server.

    Args:
      address: the coordinator's "host:port".
      token: the tenant token, sent with every call (control and data plane) as metadata
        ``authorization: Bearer <token>``; never shown in ``repr`` or error messages. ``None``:
        no token (servers started without ``--auth-tokens``).
      tls: ``False``: plaintext; ``True``: TLS, verifying the server with gRPC's default root
        certificates; a path (``str`` / ``os.PathLike``) of a PEM CA bundle to verify the server with.
      client_cert: ``(cert_chain_path, private_key_path)`` (PEM) for mutual TLS; needs ``tls``.
      tls_server_name: the name the server certificates are verified against instead of the
        dialled host (gRPC's ``grpc.ssl_target_name_override``), e.g. when shards advertise IPs.
      timeout: per-RPC deadline in seconds (a sync push waits for its step within it).
      chunk_bytes: tensor chunk size on the wire, for pushes and pulls (default 1 MiB, clamped to
        64 KiB - 4 MiB: ``optserve.protos.contract.clamp_chunk_bytes``; 1 MiB measured fastest:
        each chunk is copied three times on its way out, best while it is in cache).
      retry: retry policy for UNAVAILABLE.
      stream_idle_s: each session keeps one PushPull call open per shard for consecutive
        ``push_pull`` steps (a few times cheaper than a call per step); a call unused this long is
        ended and the next step opens a new one. An open call costs neither side a thread or
        polling while it waits (the shard bounds how many it keeps: ``--max-open-streams``).
      retain_freed_memory: keep freed message memory in this process (glibc malloc thresholds,
        see :mod:`optserve.client._heap`) instead of page-faulting fresh pages for every received
        chunk; process-wide, costs up to 1 GiB of free heap kept resident. False: leave malloc as is.
      shared_memory: "auto" (default): a session moves tensor bytes to a shard through POSIX shared
        memory when the shard proves it is on this host (a nonce this process must read from the
        shard's region), gRPC bytes otherwise; True: fail (FailedPreconditionError) where it
        cannot; False: always gRPC bytes. The step messages travel over gRPC either way.

    Attributes:
      client_id: this client's unguessable identity (``secrets.token_hex(16)``): a session it
        creates takes its initial values from this client only.
      control: the coordinator's ``Control`` stub (generated from control.proto); a call on it
        has no deadline and no retry unless the caller gives them (the methods below do).

    Raises:
      InvalidArgumentError: naming the security argument that is wrong (a missing file, a client
        certificate without TLS, a malformed token), before anything is sent.
    """

    def __init__(self, address: str, *, token: Optional[str] = None, tls: TLSArg = False,
                 client_cert: Optional[ClientCert] = None, tls_server_name: Optional[str] = None,
                 timeout: float = 120.0, chunk_bytes: Optional[int] = None,
                 retry: _retry.RetryPolicy = _retry.RetryPolicy(), stream_idle_s: float = 60.0,
                 retain_freed_memory: bool = True, shared_memory: _shm.SharedMemoryArg = "auto"):
        if not stream_idle_s > 0:
            raise ValueError(f"stream_idle_s must be > 0, got {stream_idle_s}")
        self._transport = Transport(token=token, tls=tls, client_cert=client_cert, tls_server_name=tls_server_name)
        if retain_freed_memory:
            _heap.retain_freed_memory()
        self.address = address
        self.timeout = timeout
        self.stream_idle_s = float(stream_idle_s)
        self.chunk_bytes = contract.clamp_chunk_bytes(chunk_bytes)
        self.retry = retry
        self.shared_memory = _shm.check_mode(shared_memory)
        self.client_id = secrets.token_hex(16)
        self._channels: dict[str, grpc.Channel] = {}
        self._shard_stubs: dict[str, data_pb2_grpc.ShardDataStub] = {}
        self._loop_channels: dict[str, grpc.aio.Channel] = {}  # on the process's loop (client/_loop.py)
        self._lock = threading.Lock()  # guards the three dicts above
        self.control = control_pb2_grpc.ControlStub(self.channel(address))

    def channel(self, address: str) -> grpc.Channel:
        """The channel to ``address`` (``"host:port"``: the coordinator or a shard), opened on first
        use with this client's credentials, options and token, and kept until :meth:`close`."""
        with self._lock:
            return self._channel_locked(address)

    def loop_channel(self, address: str) -> "grpc.aio.Channel":
        """The ``grpc.aio`` channel to ``address`` for the data plane's long-lived stream calls
        (:mod:`optserve.client._loop_call`), opened on first use and kept until :meth:`close`;
        called on the process's event loop (:func:`optserve.client._loop.shared`)."""
        with self._lock:
            channel = self._loop_channels.get(address)
            if channel is None:
                channel = self._loop_channels[address] = self._transport.open_on_loop(address)
            return channel

    def shard_data(self, address: str) -> data_pb2_grpc.ShardDataStub:
        """The ``ShardData`` stub (generated from data.proto) on the shard at ``address``, made once
        per address on :meth:`channel`. A call on it has no deadline and no retry unless the caller
        gives them. (The chunk-carrying methods, which need the copy-saving codecs of
        :mod:`optserve.protos.chunk_codec`, are :class:`optserve.client._fanout.ShardCalls`.)"""
        with self._lock:
            stub = self._shard_stubs.get(address)
            if stub is None:
                stub = self._shard_stubs[address] = data_pb2_grpc.ShardDataStub(self._channel_locked(address))
            return stub

    def _channel_locked(self, address: str) -> grpc.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._transport.open(address)
        return channel

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r}, {self._transport.describe()})"

    def _call(self, method, request):
        """``method(request)`` on :attr:`control` with this client's deadline, retried by its policy."""
        return _retry.call(lambda: method(request, timeout=self.timeout), self.retry)

    def create_session(self, name: str, params: Optional[Mapping[str, np.ndarray]] = None,
                       optimizer: Optional[Mapping[str, Any]] = None, *, worker_id: Optional[str] = None,
                       state: Optional[Mapping[str, Any]] = None, **options: Any) -> Session:
        """Creates a session holding ``params`` (name -> array; float32/bfloat16/float16; float64 is kept as float32).

        The keyword form of :meth:`create_session_with`. With ``state`` (a
        :meth:`Session.state`, e.g. saved with ``optserve sessions save``), ``params``,
        ``optimizer`` and the session's options (``mode``, ``num_workers``, staleness, elastic)
        default to the state's, and the session starts where the state was: its parameters,
        optimizer state, version and hyperparameters.

        Args:
          optimizer: ``{"name": registry name, "args": {keyword arguments}}``; Shampoo also takes
            ``"preconditioners": {"in_process": bool, "max_age": int}`` (where its inverse roots are
            computed and their age bound in steps; see ``PreconditionerOptions`` in control.proto).
          worker_id: the returned object's worker id (see :class:`Session`). Creating a session does
            not make the creating object a member of an elastic session: its first push does.
          options: the other fields of :class:`~optserve.client.SessionOptions` by keyword (``mode``,
            ``num_workers``, ``max_staleness``, ``staleness_policy``, ``wire_dtype``,
            ``allow_nonfinite``, and the elastic ``min_workers``, ``max_workers``, ``lease_s``,
            ``straggler_s``, ``late``); its defaults apply to those left out.

        Raises:
          AlreadyExistsError, InvalidArgumentError (naming the option or tensor); TypeError: a
          keyword that is no session option.
        """
        if state is not None:  # the saved session's options, unless given
            params = state["params"] if params is None else params
            optimizer = state.get("optimizer") if optimizer is None else optimizer
            for key, value in {"mode": state.get("mode", "sync"), **state.get("options", {})}.items():
                options.setdefault(key, value)
        if params is None or optimizer is None:
            raise TypeError("create_session needs params and optimizer (or a saved state that holds them)")
        return self.create_session_with(name, params, SessionOptions.from_spec(optimizer, **options),
                                        worker_id=worker_id, state=state)

    def create_session_with(self, name: str, params: Mapping[str, np.ndarray], options: SessionOptions,
                            worker_id: Optional[str] = None, state: Optional[Mapping[str, Any]] = None) -> Session:
        """Creates session ``name`` holding ``params`` (name -> array; float32/bfloat16/float16; float64 as float32),
        configured by ``options``, and sends the initial values to its shards. ``state``: a saved
        state (:meth:`Session.state`) the session starts from: its parameters (``params`` then
        only name the tensors, which must be the state's), optimizer state, version and
        hyperparameters.

        Raises:
          AlreadyExistsError, InvalidArgumentError (naming the option, tensor or state leaf).
        """
        if not isinstance(options, SessionOptions):
            raise TypeError(f"options must be a SessionOptions, got {type(options).__name__}")
        if state is not None:
            params = _saved_state.checked(state, params)["params"]
        # float64 (NumPy's default) is kept as float32: the server's math is float32
        arrays = {n: np.asarray(v, dtype=np.float32) if np.asarray(v).dtype == np.float64 else np.asarray(v)
                  for n, v in params.items()}
        config = options.to_config(name, arrays)
        request = control_pb2.CreateSessionRequest(config=config, client_id=self.client_id)
        info = self._call(self.control.CreateSession, request).session
        session = Session(self, info, worker_id=worker_id)
        if options.wire_dtype == contract.INT8_NAME:  # a client-side gradient encoding (see Session.wire_dtype)
            session.wire_dtype = contract.INT8
        try:
            session._initialize(arrays, state)
        except BaseException:
            self.close_session(name)
            session.detach()
            raise
        return session

    def session(self, name: str, expect: Optional[SessionOptions] = None, worker_id: Optional[str] = None) -> Session:
        """Attaches to an existing session (e.g. after a client restart); version = the server's.

        Args:
          expect: the options this client means to train with; the server refuses the attach if
            the session's optimizer (name, args, preconditioner options) or mode differs.
            ``None``: attach to whatever the session is.
          worker_id: attach as this worker (see :class:`Session`; default: a generated id).

        Raises:
          NotFoundError; FailedPreconditionError (``expect`` given): the message names the difference.
        """
        if worker_id is not None:
            check_worker_id(worker_id)
        request = control_pb2.GetSessionRequest(name=name)
        if expect is not None:
            if not isinstance(expect, SessionOptions):
                raise TypeError(f"expect must be a SessionOptions or None, got {type(expect).__name__}")
            request.expect_optimizer.CopyFrom(expect.to_optimizer_spec())
            request.expect_mode = expect.to_mode()
        info = self._call(self.control.GetSession, request).session
        status = self._call(self.control.GetStatus, control_pb2.GetStatusRequest(name=name))
        return Session(self, info, version=status.version, worker_id=worker_id)

    def list_sessions(self) -> list[str]:
        return list(self._call(self.control.ListSessions, control_pb2.ListSessionsRequest()).names)

    def session_options(self, name: str) -> SessionOptions:
        """A session's options as the server holds them, without attaching to it."""
        info = self._call(self.control.GetSession, control_pb2.GetSessionRequest(name=name)).session
        return SessionOptions.from_config(info.config)

    def session_status(self, name: str) -> SessionStatus:
        """A session's status without attaching to it (see ``Session.status``)."""
        return SessionStatus.from_proto(self._call(self.control.GetStatus, control_pb2.GetStatusRequest(name=name)))

    def session_series(self, name: str) -> SessionSeries:
        """A session's accepted pushes (version, staleness, loss, scalars) and refused ones."""
        return SessionSeries.from_proto(self._call(self.control.GetSeries, control_pb2.GetSeriesRequest(name=name)))

    def server_status(self) -> list[ServerShardStatus]:
        """The server's shard actors: address, Ray node, sessions, bytes, memory, whether they answer."""
        response = self._call(self.control.GetServerStatus, control_pb2.GetServerStatusRequest())
        return [ServerShardStatus.from_proto(s) for s in response.shards]

    def close_session(self, name: str) -> None:
        self._call(self.control.CloseSession, control_pb2.CloseSessionRequest(name=name))

    def close(self) -> None:
        """Closes the channels (sessions stay open on the server)."""
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._shard_stubs.clear()
            loop_channels = list(self._loop_channels.values())
            self._loop_channels.clear()
        if loop_channels and _loop.running():  # (a forked child's copies are not its own to close)
            loop = _loop.shared()
            for channel in loop_channels:
                loop.run(channel.close(), timeout=_LOOP_CLOSE_S)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
