"""A shard's part of a session, built in the shard's process: its optimizer (once), updater,
clock (the home shard) or clock handle (the others), step log and checkpoints (durable servers),
or how far its files restore it (:class:`ShardParts`, what :class:`~optserve.server.shard_actor.ShardActor`
delegates to; it registers and serves what is built)."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from optserve.server.compute.buffers import aligned_empty
from optserve.server.compute.updater import Updater
from optserve.server.domain.clock import HomeClock
from optserve.server.domain.config import ServerConfig
from optserve.server.domain.errors import InvalidArgument, SessionLost
from optserve.server.domain.sessions import ShardOpening
from optserve.server.domain.shard import ShardSession, StepObserver, log_value
from optserve.server.storage import CorruptCheckpoint, ShardStore, StepLogReader
from optserve.server.storage.ownership import ShardFence
from optserve.server.wire.clock_service import PeerClock

log = logging.getLogger(__name__)


class ShardParts:
    """Builds shard ``index``'s parts of sessions.

    Args:
      index: the shard's index.
      config: the server's configuration.
      internal: the server's internal trust (a part's clock handle dials its home shard with it).
      precond_pool: this shard's preconditioner workers (None: none).
      fence: durable servers: this shard's fence on its files (None: not fenced).
      observer: ``session -> StepObserver`` (its metrics).
    """

    def __init__(self, index: int, config: ServerConfig, internal, precond_pool, fence: Optional[ShardFence],
                 observer: Callable[[str], StepObserver]):
        self._index = index
        self._config = config
        self._internal = internal
        self._precond_pool = precond_pool
        self._fence = fence
        self._observer = observer

    def reachable(self, opening: ShardOpening) -> tuple[int, int, str, int, int]:
        """Durable servers: how far this shard's part of a session can be restored, read from disk
        without loading it: ``(checkpoint version, last logged version, checkpoint path, fallback
        version, fallback reach)`` (``LogReach``).

        Raises:
          SessionLost: a damaged manifest or log record (the message names the file).
        """

        config = opening.config
        by_name = config.spec_by_name
        durability = self._config.durability
        store = ShardStore(durability.checkpoint_dir, config.name, opening.shard_index, durability, False)
        try:
            reach = store.reachable(lambda: {n: aligned_empty(by_name[n].shape, np.float32)
                                             for n in opening.tensor_names})
        except CorruptCheckpoint as exc:
            raise SessionLost(f"session {config.name!r} cannot be restored on shard {opening.shard_index}: "
                              f"{exc}") from None
        finally:
            store.close()
        return tuple(reach)

    @property
    def fence(self) -> Optional[ShardFence]:
        """This shard's fence on its files (None: it writes none, e.g. a standby not promoted yet)."""
        return self._fence

    @fence.setter
    def fence(self, fence: ShardFence) -> None:
        self._fence = fence

    def build(self, opening: ShardOpening, restore: bool = False, upto: Optional[int] = None,
              files: bool = True) -> ShardSession:
        """The part of a session holding ``opening.tensor_names``: its optimizer (once), updater,
        clock (home shard: ``session.clock``) or clock handle (others).

        Durable servers keep the session's step log and checkpoints (but a standby's part,
        ``files`` False, which writes nothing until it is promoted: :meth:`take_files`); with
        ``restore`` the shard first loads its latest checkpoint and replays its log (a restarted
        shard or server), up to version ``upto`` (None: all of it).

        A new session's optimizer is checked first: its per-tensor options (``{tensor name: value}``
        maps such as adamw's ``mask``) are restricted to this shard's tensors, and its ``init`` is
        traced abstractly over them (``Updater.init_problem``), so a state the kernel cannot build
        is refused before this shard holds anything of the session.

        Raises:
          SessionLost: ``restore`` found a damaged checkpoint or log (the message names the file).
          InvalidArgument: a per-tensor option that does not name exactly the session's tensors, or
            an optimizer that cannot build its state for this shard's tensors (the message names
            the session, the optimizer, the tensors and the kernel's error, on one line).
        """
        from optserve.optim_kernels import args_for_tensors
        from optserve.server.compute.root_offload import build_shard_optimizer

        config = opening.config
        by_name = config.spec_by_name
        durability = self._config.durability
        home = opening.home_clock is None
        try:  # per-tensor options ({tensor name: value}, e.g. adamw's mask) restricted to this shard's tensors
            args = args_for_tensors(config.optimizer_name, config.optimizer_args, [t.name for t in config.tensors],
                                    opening.tensor_names)
        except ValueError as exc:
            raise InvalidArgument(f"session {config.name!r}: {exc}") from None
        optimizer, preconditioners = build_shard_optimizer(
            config.optimizer_name, args, {n: by_name[n].shape for n in opening.tensor_names},
            self._precond_pool, in_process=config.preconditioners.in_process,
            max_age=config.preconditioners.max_age)
        specs = {n: (by_name[n].shape, by_name[n].dtype.numpy) for n in opening.tensor_names}
        updater = Updater(optimizer, preconditioners, specs)
        if not restore:  # a state the kernel cannot build is refused before this shard holds anything
            problem = updater.init_problem()
            if problem is not None:
                log.info("event=session_refused session=%s shard=%d reason=%s", log_value(config.name),
                         opening.shard_index, log_value(problem))
                raise InvalidArgument(f"session {config.name!r}: {problem}")
            admit_working_memory(opening, updater, self._config)
        store = None
        if durability is not None and files:
            store = ShardStore(durability.checkpoint_dir, config.name, opening.shard_index, durability, home,
                               self._fence)
        if home:
            clock = HomeClock(config, opening.participants, reduce_timeout_s=self._config.step_timeout_s,
                              checkpoints=durability.policy(config.gradient_bytes) if durability else None,
                              journal=store.log.journal_entry if store else None)
        else:
            clock = PeerClock(opening.home_clock, config.name, self._internal,
                              reduce_timeout_s=self._config.step_timeout_s)
        session = ShardSession(config, list(opening.tensor_names), opening.shard_index, clock,
                               updater, self._config.step_timeout_s,
                               self._config.vote_timeout_s, owner=opening.owner, creator=opening.creator,
                               observer=self._observer(config.name),
                               staged_push_ttl_s=self._config.staged_push_ttl_s, limits=self._config.limits)
        if store is not None:
            try:
                if restore:
                    session.durability.restore(store, StepLogReader, store.log.journal, upto=upto)
                else:
                    store.start_logs(None)
                    session.durability.attach_store(store)
            except CorruptCheckpoint as exc:
                store.close()
                raise SessionLost(f"session {config.name!r} cannot be restored on shard {opening.shard_index}: "
                                  f"{exc}") from None
        return session

    def take_files(self, session: ShardSession) -> None:
        """A promoted standby's part of a durable session: its step log and checkpoints are
        this shard's from now on (this process must own the shard's files: :attr:`fence` set to
        the epoch claimed for it). The log goes on after the part's version, and where the old
        files lack what the part holds, a checkpoint of its state is committed before this
        returns (see ``SessionDurability.take_files``).

        Raises:
          OSError: that checkpoint could not be committed (the part must not serve: nothing on
            disk holds its state).
        """
        durability = self._config.durability
        store = ShardStore(durability.checkpoint_dir, session.config.name, session.shard_index, durability,
                           session.clock.is_home, self._fence)
        arrays = lambda: {n: aligned_empty(spec.shape, np.float32) for n, spec in session.specs.items()}  # noqa: E731
        try:
            session.durability.take_files(store, arrays, store.log.journal_entry if session.clock.is_home else None)
        except BaseException:
            store.close()
            raise


def admit_working_memory(opening: ShardOpening, updater: Updater, config: ServerConfig) -> None:
    """Compiles a new part's step (its first step reuses it) and refuses the part if the step's
    working memory (XLA temporaries) does not fit what the budget leaves beyond the estimates
    (``opening.memory_left``; None: unchecked), naming both figures.

    Raises:
      ResourceExhausted: it does not fit (``shard_memory_bytes``, ``--shard-memory-bytes``).
    """
    if opening.memory_left is None:
        return
    working = updater.step_working_bytes()
    if working is None or working <= opening.memory_left:
        return
    name, limits = opening.config.name, config.limits
    log.info("event=session_refused session=%s shard=%d reason=working_memory working_bytes=%d left_bytes=%d",
             log_value(name), opening.shard_index, working, opening.memory_left)
    raise limits.exceeded(
        "shard_memory_bytes", f"session {name!r}: its step needs {working} bytes of working memory (XLA "
        f"temporaries) on shard {opening.shard_index}, where the shard's budget leaves {opening.memory_left} "
        f"bytes beyond the session's estimate", limits.shard_budget(config.shards))
