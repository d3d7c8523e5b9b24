"""Where a shard session keeps the pushes it received and has not applied yet.

A push is staged under its identity ``(client_id, sequence)`` in pooled gradient buffers until its
ticket applies it, a refusal drops it, or (the two-phase path only) it expires: a push staged
without ``auto_commit`` that no Commit reached within ``staged_push_ttl_s`` is dropped the next
time :meth:`StagingArea.expire` runs (lazily: the session calls it when it receives a push or a
commit, or reports its status), and its identity is remembered for a while so that a late Commit
can say it expired. The staged pushes of one session on one shard fit ``max_staged_bytes``.

One lock (:attr:`StagingArea.lock`) guards the staged pushes and the expired identities. It is
never held while calling out (buffer pool, refusals). The session may take it while holding its
own condition (applying a ticket), never the other way round.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Iterable, Mapping, Optional

import numpy as np

from optserve.server.compute.buffers import BufferPool
from optserve.server.compute.heap import release_free_memory
from optserve.server.domain.config import Limits, TensorSpec
from optserve.server.domain.errors import Cancelled, InvalidArgument, NonFinite, NotFound, RejectReason
from optserve.server.domain.shard.assembly import TensorAssembler
from optserve.server.domain.shard.refusals import Refusals
from optserve.server.domain.shard.shard_records import PushHeader
from optserve.server.domain.telemetry import Telemetry
from optserve.server.domain.waits import Steps, Wait

PushKey = tuple[str, int]  # a push's identity: (client_id, sequence)

KEEP_EXPIRED = 1024  # expired staged pushes remembered (for a later Commit's message)
_RETURN_PAGES_BYTES = 64 << 20  # expiries freeing this much (in all) give the heap's free pages back to the kernel


@dataclasses.dataclass(slots=True, eq=False)
class StagedPush:
    """A push received in full on this shard and not applied yet.

    Attributes:
      base_version: the session version its gradients were computed from (the clock's vote).
      grads: tensor name -> gradient, in buffers from the session's pool (returned to it once
        the push is applied or dropped).
      telemetry: what its client attached (the home shard's series records it when applied).
      expires_at: monotonic time after which an uncommitted two-phase push is dropped (None:
        auto-commit, bounded by its vote instead).
      committing: a Commit reached this shard, so the push waits for its ticket and no longer
        expires.
      without_gradient: this shard's tensors the push has no gradient for (zeros in ``grads``):
        its step leaves them and their optimizer state alone.
    """

    base_version: int
    grads: dict[str, np.ndarray]
    telemetry: Telemetry
    expires_at: Optional[float] = None
    committing: bool = False
    without_gradient: frozenset = frozenset()


class StagingArea:
    """The staged pushes of one session on one shard (thread-safe).

    Args:
      session: the session's name (in error messages).
      shard_index: this shard's index (in error messages).
      specs: the tensors this shard holds, by name, in order (a push covers each exactly once).
      ttl_s: ``staged_push_ttl_s``: how long a two-phase push may wait for its Commit.
      limits: the server's limits (``max_staged_bytes``).
      refusals: where dropped and refused pushes are counted and logged.

    Attributes:
      lock: guards the staged pushes and the remembered expired identities.
      ttl_s: as given.
    """

    def __init__(self, session: str, shard_index: int, specs: Mapping[str, TensorSpec], ttl_s: float,
                 limits: Limits, refusals: Refusals):
        self.lock = threading.Lock()
        self.ttl_s = ttl_s
        self._session = session
        self._shard_index = shard_index
        self._specs = specs
        self._pool = BufferPool([(s.name, s.shape) for s in specs.values()])
        self.push_bytes = sum(spec.size * 4 for spec in specs.values())  # one push's float32 buffers
        self._limits = limits
        self._refusals = refusals
        self._entries: dict[PushKey, StagedPush] = {}  # guarded by lock
        self._assembling = 0  # pushes being received (their buffers taken, not staged yet); guarded by lock
        self._sweep: Optional[threading.Timer] = None  # expires two-phase pushes nobody asks about; guarded by lock
        self._freed_since_trim = 0  # bytes of expired pushes freed since the heap last gave pages back; guarded by lock
        self._expired: dict[PushKey, float] = {}  # identity -> when it expired (time.time()); guarded by lock

    # ----------------------------------------------------------------- receiving
    def assemble(self, header: PushHeader, chunks: Iterable, complete: Callable[[], bool], check_finite: bool,
                 in_place: bool, upload: Optional[Callable] = None) -> Steps[tuple[dict[str, np.ndarray], int]]:
        """Validates ``header`` and receives its push's ``chunks`` into a set of pooled buffers
        (``in_place``: whole float32 tensors are read where they lie, and ``upload`` takes those to
        an accelerator, see :class:`TensorAssembler`).
        Returns the gradients (the caller stages or releases them) and the bytes received. A bad
        header, chunk or value, or a call that ended early (``complete()`` is False), is refused
        (INVALID, NONFINITE, else ABORTED) and raised, its buffers released.

        A generator of waits (:mod:`~optserve.server.domain.waits`): ``chunks`` may give a
        :class:`~optserve.server.domain.waits.Wait` while its next chunk is on its way; it is
        yielded, so that a push arriving over a slow link holds no thread between its chunks."""
        with self.lock:  # counted against max_staged_bytes while it arrives (see check_room)
            self._assembling += 1
        try:
            buffers = self._pool.acquire()
            assembler = TensorAssembler(self._specs, buffers, check_finite=check_finite, in_place=in_place,
                                        upload=upload)
            try:
                header.validate()
                for chunk in chunks:
                    if isinstance(chunk, Wait):
                        yield chunk
                        continue
                    assembler.add(chunk)
                grads = assembler.finish()
                if not complete():
                    raise Cancelled(f"push {header.sequence} from client {header.client_id!r}: the call ended early")
            except BaseException as exc:
                self._pool.release(buffers)
                self._refusals.refuse(RejectReason.NONFINITE if isinstance(exc, NonFinite) else
                                      RejectReason.INVALID if isinstance(exc, InvalidArgument) else
                                      RejectReason.ABORTED, header.client_id, header.sequence)
                raise
        finally:
            with self.lock:
                self._assembling -= 1
        return grads, assembler.received_bytes

    def release(self, grads: dict[str, np.ndarray]) -> None:
        """Returns a push's buffers to the pool (nothing reads them any more)."""
        self._pool.release(grads)

    # ----------------------------------------------------------------- admission and expiry
    @property
    def count(self) -> int:
        """Pushes staged now."""
        with self.lock:
            return len(self._entries)

    def check_room(self, client_id: str, sequence: int) -> None:
        """Refuses (counted ABORTED, then raises ResourceExhausted) a push that would take this
        session's staged pushes, and those still arriving (their buffers taken; a push waiting
        for its next chunk holds no thread, so threads do not bound them), past
        ``max_staged_bytes``; checked before any buffer is taken."""
        with self.lock:
            staged = len(self._entries) + self._assembling
        if (staged + 1) * self.push_bytes > self._limits.max_staged_bytes:
            self._refusals.refuse(RejectReason.ABORTED, client_id, sequence, cause="max_staged_bytes")
            raise self._limits.exceeded("max_staged_bytes", f"session {self._session!r} on shard "
                                        f"{self._shard_index}: {staged} pushes staged or arriving and not yet "
                                        f"applied, {self.push_bytes} bytes each")

    def expire(self) -> None:
        """Drops two-phase pushes staged longer than ``ttl_s`` without a Commit or Abort: their
        buffers return to the pool, each counts as an ABORTED refusal."""
        now = time.monotonic()
        with self.lock:
            keys = [key for key, entry in self._entries.items()
                    if entry.expires_at is not None and not entry.committing and entry.expires_at <= now]
            expired = [(key, self._entries.pop(key)) for key in keys]
            for key, _ in expired:
                self._expired[key] = time.time()
            while len(self._expired) > KEEP_EXPIRED:
                del self._expired[next(iter(self._expired))]
        freed = len(expired) * self.push_bytes
        while expired:
            (client_id, sequence), entry = expired.pop()
            self._pool.release(entry.grads)
            self._refusals.refuse(RejectReason.ABORTED, client_id, sequence,
                                  cause=f"not committed within staged_push_ttl_s={self.ttl_s:g}")
        entry = None  # the last one's buffers are free too
        with self.lock:
            self._freed_since_trim += freed
            # enough freed, or the last staged push gone: what is left to free stays put until a
            # push comes, which may be never (expiries of pushes staged apart come sweep by sweep)
            trim = self._freed_since_trim >= _RETURN_PAGES_BYTES or (self._freed_since_trim > 0 and not self._entries)
            if trim:
                self._freed_since_trim = 0
        if trim:  # the heap would keep their pages (up to 1 GiB)
            release_free_memory()

    def _arm_sweep(self) -> None:
        """Makes sure expired two-phase pushes go (and their memory with them) even when no call
        comes to run :meth:`expire` (lock held)."""
        if self._sweep is not None:
            return
        deadlines = [e.expires_at for e in self._entries.values() if e.expires_at is not None and not e.committing]
        if not deadlines:
            return
        self._sweep = threading.Timer(max(0.0, min(deadlines) - time.monotonic()) + 0.05, self._swept)
        self._sweep.daemon = True
        self._sweep.start()

    def _swept(self) -> None:
        with self.lock:
            self._sweep = None
        self.expire()
        with self.lock:
            self._arm_sweep()

    # ----------------------------------------------------------------- the staged pushes
    def stage(self, key: PushKey, base_version: int, grads: dict[str, np.ndarray], telemetry: Telemetry,
              auto_commit: bool, without_gradient: frozenset = frozenset()) -> None:
        """Stages a received push; a retry replaces what an earlier attempt staged (whose buffers
        go back to the pool) and is no longer remembered as expired. ``without_gradient``: the
        push's gradient-less tensors (those of this shard are kept)."""
        expires_at = None if auto_commit else time.monotonic() + self.ttl_s
        with self.lock:
            old = self._entries.pop(key, None)
            self._entries[key] = StagedPush(base_version, grads, telemetry, expires_at,
                                            without_gradient=frozenset(without_gradient) & frozenset(grads))
            self._expired.pop(key, None)
            if expires_at is not None:
                self._arm_sweep()
        if old is not None:
            self._pool.release(old.grads)

    def claim(self, key: PushKey) -> tuple[Optional[StagedPush], Optional[float]]:
        """Two-phase Commit: marks the staged push as committing (it never expires from now on).
        Returns it (None if nothing is staged under ``key``) and when it expired (None if it did
        not, or is no longer remembered)."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.committing = True
            return entry, self._expired.get(key)

    def missing(self, key: PushKey, expired_at: Optional[float]) -> NotFound:
        """The error for a Commit of ``key`` that finds nothing staged and nothing applied."""
        client_id, sequence = key
        if expired_at is not None:
            return NotFound(f"session {self._session!r}: staged push {sequence} from client {client_id!r} "
                            f"expired on shard {self._shard_index}: not committed within "
                            f"staged_push_ttl_s={self.ttl_s:g} s, so it was dropped")
        return NotFound(f"session {self._session!r}: no staged push {sequence} from client {client_id!r}")

    def base_version(self, key: PushKey) -> int:
        """The staged push's base version (-1: nothing staged under ``key``, e.g. a retry of an
        applied push)."""
        with self.lock:
            entry = self._entries.get(key)
        return entry.base_version if entry is not None else -1

    def holds(self, key: PushKey) -> bool:
        """Whether a push is staged under ``key``."""
        with self.lock:
            return key in self._entries

    def take(self, key: PushKey) -> Optional[StagedPush]:
        """Removes and returns the push staged under ``key`` (None: none is); its buffers are the
        taker's to release."""
        with self.lock:
            return self._entries.pop(key, None)

    def drop(self, key: PushKey, reason: RejectReason) -> bool:
        """Drops the push staged under ``key`` as a refusal for ``reason``; returns whether one was
        staged (dropping twice is harmless)."""
        with self.lock:
            staged = self._entries.pop(key, None)
        if staged is None:
            return False
        self._refusals.refuse(reason, *key)
        self._pool.release(staged.grads)
        return True
