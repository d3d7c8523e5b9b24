"""One session's state on one shard: parameters + optimizer state, staged pushes, the step.

The shard's tensors form ONE pytree (a dict name -> array) on the shard's JAX device; each step
is one jitted, donated call over the whole pytree, plus one jitted partial-statistic call when
the optimizer needs a cross-shard sum (summed by the clock actor). Tickets from the clock are
applied strictly in ordinal order (see :mod:`optserve.server.clock`).

Shampoo sessions: ``ShardSession.preconditioners`` (:mod:`optserve.server.root_offload`) is
called right before and right after each update; it installs inverse roots computed by the
preconditioner workers and sends them new statistics (or only keeps status, in process).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import numpy as np

from optserve.server.assembly import TensorAssembler
from optserve.server.clock import Ticket
from optserve.server.config import Mode, SessionConfig, TensorSpec
from optserve.server.root_offload import shard_preconditioners
from optserve.server.errors import FailedPrecondition, NotFound, PeerRefused, Stale, Timeout

_GAP_POLL_S = 0.25


_XLA_CPU_ALIGNMENT = 64  # bytes: host arrays aligned to this are used by XLA:CPU in place


def aligned_empty(shape: tuple[int, ...], dtype=np.float32, alignment: int = _XLA_CPU_ALIGNMENT) -> np.ndarray:
    """An uninitialized array whose data starts at a multiple of ``alignment`` bytes.

    ``jax.device_put(x, may_alias=True)`` on a CPU device aliases a 64-byte aligned NumPy array
    instead of copying it; ``np.empty`` gives large arrays 16-byte alignment only (malloc), which
    costs a full copy per gradient per step (~30 ms for a 4096 x 4096 float32 matrix here).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


class _BufferPool:
    """Reusable float32 gradient buffers (fresh allocations page-fault on every push), aligned
    so that the jitted step reads them in place (:func:`aligned_empty`)."""

    def __init__(self, specs: list[TensorSpec], keep: int = 4):
        self._specs = specs
        self._free: list[dict[str, np.ndarray]] = []
        self._keep = keep
        self._lock = threading.Lock()

    def acquire(self) -> dict[str, np.ndarray]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return {s.name: aligned_empty(s.shape, np.float32) for s in self._specs}

    def release(self, buffers: dict[str, np.ndarray]) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buffers)


class _Staged:
    def __init__(self, base_version: int, grads: dict[str, np.ndarray]):
        self.base_version = base_version
        self.grads = grads


class ShardSession:
    """A session's tensors on one shard.

    Args:
      config: the session.
      tensor_names: the tensors this shard holds (a subset of ``config.tensors``, in order).
      shard_index: this shard's index (for cross-shard sums).
      participants: number of shards holding tensors of this session.
      clock: the session's clock (:class:`~optserve.server.clock.LocalClock` in its home shard,
        :class:`~optserve.server.clock_endpoint.PeerClock` elsewhere).
      step_timeout_s: longest wait for a sync barrier, a missing ticket or a reduction.
      vote_timeout_s: auto-commit: longest wait for the peer shards to stage a push.
      precond_pool: the server's Shampoo preconditioner workers (``None``: none); whether this
        session uses them is decided by :func:`~optserve.server.root_offload.shard_preconditioners`.
    """

    def __init__(self, config: SessionConfig, tensor_names: list[str], shard_index: int, participants: int,
                 clock, step_timeout_s: float = 300.0, vote_timeout_s: float = 30.0, precond_pool=None):
        import jax

        by_name = config.spec_by_name
        self.config = config
        self.specs: dict[str, TensorSpec] = {name: by_name[name] for name in tensor_names}
        self.shard_index = shard_index
        self.participants = participants
        self._clock = clock
        self._timeout = step_timeout_s
        self._vote_timeout = vote_timeout_s
        self.optimizer = config.validate_optimizer()
        self.preconditioners = shard_preconditioners(
            config.optimizer_name, self.optimizer, {n: s.shape for n, s in self.specs.items()}, precond_pool,
            config.preconditioners.in_process, config.preconditioners.max_age)
        if self.preconditioners is not None:  # offloaded Shampoo runs without in-line roots
            self.optimizer = self.preconditioners.optimizer
        self.device = jax.devices()[0]
        self.params: Optional[dict[str, Any]] = None
        self.opt_state: Any = None
        self.version = 0
        self.rejected = {"invalid": 0, "nonfinite": 0, "stale": 0, "aborted": 0}
        self._pool = _BufferPool(list(self.specs.values()))
        self._staged: dict[tuple[str, int], _Staged] = {}
        self._staged_lock = threading.Lock()
        self._applied_sequence: dict[str, int] = {}
        self._cond = threading.Condition()
        self._next_ordinal = 0
        self._arrived: dict[int, Ticket] = {}
        self._sum: Optional[dict[str, np.ndarray]] = None
        self._summed = 0
        self._step_fn, self._partial_fn = self._compile()

    # ----------------------------------------------------------------- compute
    def _compile(self):
        import jax
        import optax

        tx = self.optimizer.transformation
        partial = self.optimizer.partial_statistic

        def step(params, state, grads, scale, global_stat):
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            if partial is None:
                updates, state = tx.update(grads, state, params)
            else:
                updates, state = tx.update(grads, state, params, global_grad_sq_norm=global_stat)
            updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
            return optax.apply_updates(params, updates), state

        step_fn = jax.jit(step, donate_argnums=(0, 1))
        partial_fn = None
        if partial is not None:
            partial_fn = jax.jit(lambda grads, state, params: partial(
                jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), state, params))
        return step_fn, partial_fn

    def assembler_for_init(self) -> TensorAssembler:
        buffers = {s.name: np.empty(s.shape, s.dtype.numpy) for s in self.specs.values()}
        return TensorAssembler(self.specs, buffers, check_finite=False)

    def initialize(self, values: dict[str, np.ndarray]) -> int:
        """Installs initial parameters and the optimizer's initial state (once)."""
        import jax

        with self._cond:
            if self.params is not None:
                raise FailedPrecondition(f"session {self.config.name!r}: parameters are already initialized")
            params = {name: jax.device_put(values[name], self.device) for name in self.specs}
            self.opt_state = jax.jit(self.optimizer.transformation.init)(params)
            self.params = params
            self._cond.notify_all()  # pulls and pushes that arrived first (see _require_initialized)
            return self.version

    @property
    def initialized(self) -> bool:
        return self.params is not None

    def _require_initialized(self):
        """Waits up to ``vote_timeout_s`` for the initial values: a client that attaches right after
        the session was created may pull before its creator has sent them."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.params is not None, timeout=self._vote_timeout):
                raise FailedPrecondition(
                    f"session {self.config.name!r}: initial values were not sent to shard {self.shard_index} "
                    f"(waited {self._vote_timeout:g} s for the creating client)")

    # ----------------------------------------------------------------- staging
    def assembler_for_push(self) -> tuple[TensorAssembler, dict[str, np.ndarray]]:
        self._require_initialized()
        buffers = self._pool.acquire()
        return TensorAssembler(self.specs, buffers, check_finite=not self.config.allow_nonfinite), buffers

    def already_applied(self, client_id: str, sequence: int) -> bool:
        return self._applied_sequence.get(client_id, -1) >= sequence

    def stage(self, client_id: str, sequence: int, base_version: int, grads: dict[str, np.ndarray]) -> None:
        """Holds a validated push until the client commits or aborts it (a retry replaces it)."""
        with self._staged_lock:
            old = self._staged.pop((client_id, sequence), None)
            self._staged[(client_id, sequence)] = _Staged(base_version, grads)
        if old is not None:
            self._pool.release(old.grads)

    def release_buffers(self, grads: dict[str, np.ndarray]) -> None:
        self._pool.release(grads)

    def abort(self, client_id: str, sequence: int) -> bool:
        with self._staged_lock:
            staged = self._staged.pop((client_id, sequence), None)
        if staged is None:
            return False
        self.rejected["aborted"] += 1
        self._pool.release(staged.grads)
        return True

    def count_rejection(self, reason: str) -> None:
        self.rejected[reason] += 1

    # ----------------------------------------------------------------- commit
    def commit(self, client_id: str, sequence: int) -> Ticket:
        """Gets the push's ticket from the clock and returns once its step is applied here.

        Raises:
          Stale: the clock refused the push (its staged gradients are dropped).
          NotFound: nothing staged under (client_id, sequence) and it was never applied.
        """
        with self._staged_lock:
            staged = self._staged.get((client_id, sequence))
        if staged is None and not self.already_applied(client_id, sequence):
            raise NotFound(f"session {self.config.name!r}: no staged push {sequence} from client {client_id!r}")
        base = staged.base_version if staged is not None else -1
        try:
            ticket = self._clock.commit(client_id, sequence, base)
        except Stale:
            self.rejected["stale"] += 1
            with self._staged_lock:
                dropped = self._staged.pop((client_id, sequence), None)
            if dropped is not None:
                self._pool.release(dropped.grads)
            raise
        self._run_through(ticket)
        return ticket

    def commit_with_peers(self, client_id: str, sequence: int, staged: bool) -> Optional[Ticket]:
        """Auto-commit: votes this shard's stage outcome; if every shard staged, applies the push.

        With ``staged=False`` (this shard refused its part, or the stream broke) the vote tells
        the peers to drop theirs and returns None at once; the caller raises its own error.

        Raises:
          PeerRefused: another shard refused its part (the staged gradients here are dropped).
          Stale: the clock refused the push.
        """
        if not staged:
            self._clock.vote(client_id, sequence, -1, self.shard_index, False, self._vote_timeout)
            return None
        with self._staged_lock:
            entry = self._staged.get((client_id, sequence))
        base = entry.base_version if entry is not None else -1
        try:
            ticket = self._clock.vote(client_id, sequence, base, self.shard_index, True, self._vote_timeout)
        except (Stale, PeerRefused) as exc:
            self.rejected["stale" if isinstance(exc, Stale) else "aborted"] += 1
            with self._staged_lock:
                dropped = self._staged.pop((client_id, sequence), None)
            if dropped is not None:
                self._pool.release(dropped.grads)
            raise
        self._run_through(ticket)
        return ticket

    def _run_through(self, ticket: Ticket) -> None:
        """Applies tickets in ordinal order up to ``ticket``, then waits for its step."""
        deadline = time.monotonic() + self._timeout
        with self._cond:
            if ticket.ordinal >= self._next_ordinal:  # else: a retry of a push applied already
                self._arrived[ticket.ordinal] = ticket
                self._cond.notify_all()
            while self._next_ordinal <= ticket.ordinal:
                pending = self._arrived.pop(self._next_ordinal, None)
                if pending is not None:
                    self._apply_ticket(pending)
                    self._cond.notify_all()
                    continue
                if not self._cond.wait(timeout=_GAP_POLL_S):
                    missing = self._clock.ticket(self._next_ordinal)
                    if missing is not None:
                        self._arrived.setdefault(missing.ordinal, missing)
                if time.monotonic() > deadline:
                    raise Timeout(f"session {self.config.name!r}: ticket {self._next_ordinal} never arrived on shard {self.shard_index}")
            while self.version < ticket.target_version:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise Timeout(
                        f"session {self.config.name!r}: step {ticket.target_version} did not complete within "
                        f"{self._timeout:.0f} s (sync mode waits for num_workers={self.config.num_workers} pushes)"
                    )

    def _apply_ticket(self, ticket: Ticket) -> None:
        with self._staged_lock:
            staged = self._staged.pop((ticket.client_id, ticket.sequence), None)
        self._next_ordinal = ticket.ordinal + 1
        if staged is None:
            raise Timeout(
                f"session {self.config.name!r}: push {ticket.sequence} of client {ticket.client_id!r} was "
                f"committed but never staged on shard {self.shard_index}"
            )
        self._applied_sequence[ticket.client_id] = ticket.sequence
        grads = staged.grads
        if self.config.mode is Mode.SYNC and self.config.num_workers > 1:
            if self._sum is None:
                self._sum = {name: aligned_empty(g.shape, g.dtype) for name, g in grads.items()}
                for name, g in grads.items():
                    np.copyto(self._sum[name], g)
            else:
                for name, g in grads.items():
                    self._sum[name] += g
            self._pool.release(grads)
            self._summed += 1
            if not ticket.closes_step:
                return
            grads = {name: np.divide(s, np.float32(self._summed), out=s) for name, s in self._sum.items()}
            self._sum, self._summed = None, 0
            self._update(grads, ticket)
            return
        self._update(grads, ticket)
        self._pool.release(grads)

    def _update(self, grads: dict[str, np.ndarray], ticket: Ticket) -> None:
        import jax

        # may_alias: on CPU the jitted step reads the pooled host buffers directly (no copy); they
        # return to the pool only after the step completed (block_until_ready below).
        grads = {name: jax.device_put(g, self.device, may_alias=True) for name, g in grads.items()}
        global_stat = np.float32(0.0)
        if self._partial_fn is not None:
            partial = float(self._partial_fn(grads, self.opt_state, self.params))
            total = self._clock.reduce_sum(ticket.target_version, self.shard_index, partial)
            global_stat = np.float32(total)
        if self.preconditioners is not None:  # installs roots that arrived; waits past the age bound
            self.opt_state = self.preconditioners.before_update(self.opt_state, grads, self.params)
        self.params, self.opt_state = self._step_fn(self.params, self.opt_state, grads, np.float32(ticket.scale), global_stat)
        jax.block_until_ready(self.params)
        if self.preconditioners is not None:  # sends the statistics for new roots, without waiting
            self.opt_state = self.preconditioners.after_update(self.opt_state)
        self.version = ticket.target_version

    # ----------------------------------------------------------------- reading
    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """The current version and host views of the parameters (consistent with each other)."""
        with self._cond:
            self._require_initialized()
            return self.version, {name: np.asarray(p) for name, p in self.params.items()}

    def status(self) -> dict:
        return {
            "version": self.version,
            "initialized": self.initialized,
            "rejected": dict(self.rejected),
            "device": str(self.device),
            "clock": self._clock.status(),
            "preconditioners": self.preconditioners.status() if self.preconditioners is not None else None,
        }
