"""The open PushPull calls of a shard, bounded (``--max-open-streams``): memory and descriptors, not threads.

:class:`OpenStreams` is the table the PushPull handler (:mod:`optserve.server.wire.push_pull`)
registers each call in; past its limit it ends idle calls (the client reopens and retries the
step, which never started) and asks busy ones to end after their step (``StepDone.stream_closing``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from optserve.server.domain.errors import ResourceExhausted
from optserve.server.domain.shard import ShardSession

_log = logging.getLogger(__name__)


class OpenStream:
    """One open PushPull call: ``idle_since`` (monotonic) while it waits for a step's first
    message, None while a step runs; ``served``: a step ran on it; ``evicted`` once
    :class:`OpenStreams` ended it."""

    __slots__ = ("context", "tenant", "idle_since", "served", "evicted", "pushers", "goodbye", "noted")

    def __init__(self, context, tenant: str = ""):
        self.context = context
        self.tenant = tenant
        self.pushers: dict[tuple[int, str], ShardSession] = {}  # elastic sessions' pushers on this call
        self.goodbye = False  # the client ended the call on purpose (see PushPullRequest.goodbye)
        self.noted: Optional[tuple[str, str]] = None  # (session, client_id) of the last step looked at
        self.idle_since: Optional[float] = time.monotonic()
        self.served = False
        self.evicted = False


class OpenStreams:
    """The open PushPull calls. A call waits for its next step, and its step for its vote and
    its turn, on the event loop, holding no thread; calls are bounded all the same (memory,
    descriptors).

    Past ``limit`` open calls the table is *crowded*: a call ends after its current step
    (``StepDone.stream_closing``), and calls that wait idle for their next step are ended at once,
    the longest idle first, down to ``limit`` (the client reopens: a call that ended before its
    step started, reused or new, is retried). A sweeper thread (while any call is open) does this every
    ``period_s``, so a crowd of idle calls cannot hold the threads a new client needs. A call
    idle for less than ``min_idle_s`` is left alone (its step's first message is on its way), and
    a new call that has not served a step yet for less than ``new_idle_s`` (the SDK opens a call
    with its step's messages, so only a call that sends nothing waits that long).
    """

    def __init__(self, limit: int, min_idle_s: float = 0.5, new_idle_s: float = 3.0, period_s: float = 0.25,
                 max_per_tenant: Optional[int] = None):
        self.limit = limit
        self._max_per_tenant = max_per_tenant
        self._min_idle_s = min_idle_s
        self._new_idle_s = new_idle_s
        self._period_s = period_s
        self._open: set[OpenStream] = set()
        self._lock = threading.Lock()
        self._sweeping = False

    def open(self, context, tenant: str = "") -> OpenStream:
        """Registers a new call of ``tenant``.

        Raises:
          ResourceExhausted: the tenant already holds ``max_per_tenant`` open calls here.
        """
        stream = OpenStream(context, tenant)
        with self._lock:
            held = sum(1 for s in self._open if s.tenant == tenant)
            if self._max_per_tenant is not None and held >= self._max_per_tenant:
                raise ResourceExhausted(f"tenant {tenant!r}: {held + 1} open PushPull calls on this shard: over the "
                                        f"limit max_streams_per_tenant={self._max_per_tenant} "
                                        f"(server flag --max-streams-per-tenant)")
            self._open.add(stream)
            start = not self._sweeping
            self._sweeping = True
        if start:
            threading.Thread(target=self._sweep, name="optserve-stream-sweeper", daemon=True).start()
        return stream

    def close(self, stream: OpenStream) -> None:
        """The call ended."""
        with self._lock:
            self._open.discard(stream)

    def idle(self, stream: OpenStream) -> None:
        """The call waits for its next step's first message."""
        with self._lock:
            stream.idle_since = time.monotonic()

    def busy(self, stream: OpenStream) -> bool:
        """A step's first message arrived; False if the call was ended meanwhile (drop the step:
        the client hears CANCELLED before any answer, and retries it on a new call)."""
        with self._lock:
            stream.idle_since = None
            stream.served = True
            return not stream.evicted

    def crowded(self) -> bool:
        """More calls are open than ``limit``: a step's ``done`` asks its client to reopen."""
        return len(self._open) > self.limit

    def _sweep(self) -> None:
        """Every ``period_s`` while any call is open: ends the longest idle calls past ``limit``."""
        while True:
            time.sleep(self._period_s)
            with self._lock:
                if not self._open:
                    self._sweeping = False
                    return
                if len(self._open) <= self.limit:  # not crowded: nothing to end (and nothing to sort)
                    continue
                now = time.monotonic()
                idle = sorted((s for s in self._open if s.idle_since is not None and not s.evicted
                               and now - s.idle_since >= (self._min_idle_s if s.served else self._new_idle_s)),
                              key=lambda s: s.idle_since)
                excess = len(self._open) - sum(s.evicted for s in self._open) - self.limit
                ended = [(stream, now - stream.idle_since) for stream in idle[:max(0, excess)]]
                for stream, _ in ended:
                    stream.evicted = True
                count = len(self._open)
            for stream, idle_s in ended:
                _log.info("event=stream_ended reason=idle_while_crowded peer=%s idle_s=%.1f open=%d limit=%d",
                          stream.context.peer(), idle_s, count, self.limit)
                stream.context.cancel()
