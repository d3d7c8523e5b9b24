"""An elastic sync session's membership, as one worker holds it: join, a lease kept alive in the
background, leave.

The session's home shard (the first of its shard map) keeps the members. A worker is a member
from its first push or :meth:`Membership.join` until it leaves (:meth:`Membership.leave`, which
``Session.close`` / ``detach`` call), its connection to the home shard drops, or its lease lapses.
While a member, a daemon thread renews the lease every third of ``lease_s``, so a worker whose
user code computes for longer than the lease stays in; a worker that stops (SIGSTOP, a hung
process) stops renewing and is dropped after ``lease_s``.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from optserve.client import _retry
from optserve.client.errors import OptservError, from_rpc_error
from optserve.protos.optserve.v1 import data_pb2

_log = logging.getLogger(__name__)


class Membership:
    """One worker's membership of an elastic session.

    Args:
      client: the ``Client`` (the home shard's ``ShardData`` stub, timeout, retry policy).
      session: the session's name.
      worker_id: this worker's id.
      home_address: ``() -> "host:port"`` of the session's home shard now (the shard map may move it).
      lease_s: the session's lease.
    """

    def __init__(self, client, session: str, worker_id: str, home_address: Callable[[], str], lease_s: float):
        self._client = client
        self._session = session
        self._worker_id = worker_id
        self._home_address = home_address
        self._lease_s = lease_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.members: tuple[str, ...] = ()

    def _call(self, action: int, timeout: float | None) -> data_pb2.MembershipResponse:
        home = self._client.shard_data(self._home_address())
        request = data_pb2.MembershipRequest(session=self._session, worker_id=self._worker_id, action=action)
        try:
            response = home.Membership(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        self.members = tuple(response.members)
        return response

    def join(self) -> tuple[str, ...]:
        """Joins now (retrying a restarting shard) and keeps the lease alive; returns the members.

        Raises:
          ResourceExhaustedError: ``max_workers`` workers are members already.
        """
        _retry.call(lambda: self._call(data_pb2.MEMBERSHIP_JOIN, self._client.timeout), self._client.retry)
        self.keep_alive()
        return self.members

    def keep_alive(self) -> None:
        """Starts renewing the lease in the background (once; a push joins implicitly)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew, name=f"optserve-lease-{self._worker_id}", daemon=True)
            self._thread.start()

    def _renew(self) -> None:
        period = self._lease_s / 3.0
        complained = False
        while not self._stop.is_set():
            try:
                self._call(data_pb2.MEMBERSHIP_RENEW, timeout=period)
                complained = False
            except OptservError as exc:
                if not complained:  # once per episode: the next renewal may well succeed
                    _log.warning("optserve: worker %s could not renew its lease in session %r (%s: %s); retrying",
                                 self._worker_id, self._session, exc.code, exc.details)
                    complained = True
            self._stop.wait(period)

    def leave(self) -> None:
        """Stops renewing and leaves now (best effort: a server gone already forgets the member)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        try:
            self._call(data_pb2.MEMBERSHIP_LEAVE, timeout=min(self._client.timeout or 5.0, 5.0))
        except OptservError:
            pass
