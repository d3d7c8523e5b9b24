"""The primary's end of ``ShardReplica``: one ordered stream to one standby process, and a
:class:`~optserve.server.domain.shard.replica.ReplicaPort` per replicated session over it.

Messages leave in the order the ports were called (one queue, one stream, one sender), each whole
before the next. Ports never block on the network with the session's lock held, but for two
things, both bounded: a clock entry waits for the standby to book it (``clock_timeout_s``; no
ticket leaves the clock before), and a step waits for room while more than ``max_queued_bytes``
wait to be sent (``queue_timeout_s``). A standby that refuses a session, a stream that breaks, a
timeout: each fails the held futures the session's acknowledgements wait for (UNAVAILABLE), so
nothing is acknowledged that two processes do not hold, and the port takes nothing more.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import grpc
import numpy as np

from optserve.protos.optserve.v1 import replica_pb2
from optserve.server.domain.durability import StepRecord
from optserve.server.domain.errors import Unavailable
from optserve.server.domain.shard import HeldVersions, ReplicaStart, RootInstall
from optserve.server.wire.replica_frames import CHUNK_BYTES, clock_frame, start_frames, step_frames
from optserve.server.wire.replica_service import SERVICE
from optserve.server.wire.security import InternalTrust

_log = logging.getLogger(__name__)
_END = object()


class ReplicaTraffic(NamedTuple):
    """Counts a stream's bytes: ``sent(n)`` for each frame to the standby, ``received(n)`` for each answer."""

    sent: Callable[[int], None]
    received: Callable[[int], None]


class ReplicaChannel:
    """One stream to the standby process at ``address`` (its internal port).

    Args:
      address: ``host:port`` of the standby's ``ShardReplica`` service.
      trust: the server's internal secret (and TLS identity).
      clock_timeout_s: how long a clock entry waits for the standby to book it.
      max_queued_bytes: gradient bytes waiting to be sent past which a step waits for room ...
      queue_timeout_s: ... at most this long (then the session's standby is out of sync).
      out_of_sync: ``(session, why)``, called on a thread of its own once a session's standby
        holds nothing more (refused, broken stream, timeout), so its primary can go on alone.
    """

    def __init__(self, address: str, trust: InternalTrust, clock_timeout_s: float = 5.0,
                 max_queued_bytes: int = 1 << 30, queue_timeout_s: float = 5.0, chunk_bytes: int = CHUNK_BYTES,
                 out_of_sync: Optional[Callable[[str, str], None]] = None, traffic: Optional[ReplicaTraffic] = None):
        self.address = address
        self._traffic = traffic
        self._out_of_sync = out_of_sync
        self._clock_timeout_s, self._max_queued, self._queue_timeout_s = clock_timeout_s, max_queued_bytes, queue_timeout_s
        self._chunk_bytes = chunk_bytes
        self._lock = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued_bytes = 0
        self._held: dict[str, HeldVersions] = {}
        self._started: set[str] = set()  # sessions whose standby answered their start (it holds it)
        self._clock_waits: dict[int, Future] = {}
        self._sequences = itertools.count(1)
        self._broken: Optional[Unavailable] = None
        self._channel = trust.channel(address)
        follow = self._channel.stream_stream(f"/{SERVICE}/Follow", request_serializer=replica_pb2.ReplicaFrame.SerializeToString,
                                             response_deserializer=replica_pb2.ReplicaAnswer.FromString)
        self._call = follow(self._frames(), metadata=trust.metadata, wait_for_ready=True)
        self._reader = threading.Thread(target=self._read_answers, name="optserve-replica-answers", daemon=True)
        self._reader.start()

    @property
    def broken(self) -> Optional[Unavailable]:
        """Why the stream ended (None while it serves): every session's standby is out of sync."""
        return self._broken

    def port(self, session: str) -> "SessionReplicaPort":
        """The port of ``session`` (one per session; its :meth:`~SessionReplicaPort.start` first)."""
        return SessionReplicaPort(self, session)

    def forget(self, session: str) -> None:
        """``session`` closed: its waiters fail, its port takes nothing more."""
        with self._lock:
            held = self._held.pop(session, None)
            self._started.discard(session)
        if held is not None:
            held.fail(Unavailable(f"session {session!r} was closed"))

    def close(self) -> None:
        """Ends the stream once what is queued was sent; every later held future fails."""
        self._queue.put(_END)
        self._reader.join(timeout=10)
        self._break(Unavailable(f"the stream to the standby at {self.address} was closed"))
        self._channel.close()

    # what the ports call
    def _start(self, session: str, start: ReplicaStart) -> None:
        with self._lock:
            if self._broken is not None:
                raise self._broken
            if session in self._held:
                raise ValueError(f"session {session!r}: its standby was started already")
            self._held[session] = HeldVersions(start.progress.version)
            self._started.discard(session)
        self._queue.put(lambda: start_frames(session, start, self._chunk_bytes))  # serialized by the sender

    def _ship(self, session: str, record: StepRecord, grads: Sequence[np.ndarray],
              roots: Sequence[RootInstall] = (), digest: Optional[int] = None) -> None:
        size = sum(np.asarray(g).nbytes for g in grads) + sum(r.roots.nbytes + r.errors.nbytes for r in roots)
        with self._lock:
            held = self._held.get(session)
            if held is None:
                return
            roomy = self._lock.wait_for(lambda: self._queued_bytes + size <= self._max_queued or not self._queued_bytes
                                        or self._broken is not None, self._queue_timeout_s)
            if self._broken is not None:
                return  # its held futures failed already
            if not roomy:
                self._fail_session(session, Unavailable(
                    f"session {session!r}: the standby at {self.address} fell {self._queued_bytes} bytes behind"))
                return
            self._queued_bytes += size
        frames = list(step_frames(session, record, grads, self._chunk_bytes, roots, digest))  # copied: the caller reuses grads
        self._queue.put((frames, size))

    def _clock_entry(self, session: str, entry: Any) -> None:
        with self._lock:
            if self._broken is not None or session not in self._held:
                raise OSError(f"session {session!r}: no standby at {self.address} takes the clock's entries "
                              f"({self._broken or 'not started'})")
            sequence = next(self._sequences)
            waiter = self._clock_waits[sequence] = Future()
        self._queue.put(lambda: iter([clock_frame(session, [entry], sequence)]))
        try:
            waiter.result(self._clock_timeout_s)
        except Exception as exc:  # noqa: BLE001 - refused, timed out or the stream broke: nothing is handed out
            self._fail_session(session, Unavailable(f"session {session!r}: the standby at {self.address} did not "
                                                    f"book a clock entry: {exc or type(exc).__name__}"))
            raise OSError(f"session {session!r}: the standby did not book the clock's entry: "
                          f"{exc or type(exc).__name__}") from None
        finally:
            with self._lock:
                self._clock_waits.pop(sequence, None)

    def _held_future(self, session: str, version: int) -> Future:
        with self._lock:
            held = self._held.get(session)
            broken = self._broken
        if held is None:
            failed = Future()
            failed.set_exception(broken or Unavailable(f"session {session!r}: its standby was never started"))
            return failed
        return held.future(version)

    # the stream
    def _frames(self) -> Iterator[replica_pb2.ReplicaFrame]:
        frames = self._queued_frames()
        if self._traffic is None:
            yield from frames
            return
        for frame in frames:
            self._traffic.sent(frame.ByteSize())
            yield frame

    def _queued_frames(self) -> Iterator[replica_pb2.ReplicaFrame]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if callable(item):
                yield from item()
                continue
            frames, size = item
            yield from frames
            with self._lock:
                self._queued_bytes -= size
                self._lock.notify_all()

    def _read_answers(self) -> None:
        try:
            for answer in self._call:
                if self._traffic is not None:
                    self._traffic.received(answer.ByteSize())
                self._answered(answer)
            error = Unavailable(f"the stream to the standby at {self.address} ended")
        except grpc.RpcError as exc:
            error = Unavailable(f"the stream to the standby at {self.address} broke: {exc.code().name} "
                                f"{exc.details()}")
        except Exception as exc:  # noqa: BLE001 - a frame the sender could not build ends the stream too
            error = Unavailable(f"the stream to the standby at {self.address} failed: {exc!r}")
        self._break(error)

    def _is_started(self, session: str) -> bool:
        with self._lock:
            return session in self._started and session in self._held

    def _answered(self, answer: replica_pb2.ReplicaAnswer) -> None:
        with self._lock:
            held = self._held.get(answer.session)
            if held is not None and not answer.error:  # a session's first answer is its start's (in order)
                self._started.add(answer.session)
            waiter = self._clock_waits.get(answer.clock_sequence) if answer.clock_sequence else None
        if answer.error:
            error = Unavailable(f"session {answer.session!r}: the standby at {self.address} refused: {answer.error}")
            self._fail_session(answer.session, error)
            _settle(waiter, error)
            return
        if held is not None and answer.held_version:
            held.hold(answer.held_version)
        _settle(waiter, None)

    def _fail_session(self, session: str, error: Unavailable) -> None:
        """``session``'s standby holds nothing more: its waiters fail, its port takes nothing."""
        with self._lock:
            held = self._held.pop(session, None)
            self._started.discard(session)
        if held is not None:
            held.fail(error)
            _log.warning("event=standby_out_of_sync session=%s address=%s error=%s", session, self.address, error)
            self._tell_out_of_sync([session], error)

    def _break(self, error: Unavailable) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = error
            sessions, held, self._held = list(self._held), list(self._held.values()), {}
            self._started.clear()
            waiters, self._clock_waits = list(self._clock_waits.values()), {}
            self._lock.notify_all()
        for versions in held:
            versions.fail(error)
        for waiter in waiters:
            _settle(waiter, error)
        self._call.cancel()
        self._tell_out_of_sync(sessions, error)

    def _tell_out_of_sync(self, sessions: list, error: Unavailable) -> None:
        """``out_of_sync`` for each of ``sessions``, off this thread (it may hold a session's or a
        clock's lock, which going on alone takes)."""
        if self._out_of_sync is None or not sessions:
            return
        tell = self._out_of_sync
        threading.Thread(target=lambda: [tell(session, str(error)) for session in sessions],
                         name="optserve-replica-out-of-sync", daemon=True).start()


def _settle(waiter: Optional[Future], error: Optional[BaseException]) -> None:
    """Ends ``waiter`` (a clock entry's) unless it ended already (the stream broke meanwhile)."""
    if waiter is None:
        return
    try:
        if error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)
    except InvalidStateError:
        pass


class SessionReplicaPort:
    """One session's :class:`~optserve.server.domain.shard.replica.ReplicaPort` over a
    :class:`ReplicaChannel` (see its docstring for what blocks and for how long)."""

    def __init__(self, channel: ReplicaChannel, session: str):
        self._channel = channel
        self.session = session

    def start(self, start: ReplicaStart) -> None:
        self._channel._start(self.session, start)

    def ship(self, record: StepRecord, grads: Sequence[np.ndarray], roots: Sequence[RootInstall] = (),
             digest: Optional[int] = None) -> None:
        try:
            self._channel._ship(self.session, record, grads, roots, digest)
        except Exception as exc:  # noqa: BLE001 - never raises: the session's waiters learn it instead
            self._channel._fail_session(self.session, Unavailable(
                f"session {self.session!r}: step {record.version} could not be sent to its standby: {exc!r}"))

    def held_future(self, version: int) -> Future:
        return self._channel._held_future(self.session, version)

    @property
    def started(self) -> bool:
        return self._channel._is_started(self.session)

    def clock_entry(self, entry) -> None:
        self._channel._clock_entry(self.session, entry)
