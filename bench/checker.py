"""The chaos checker: from the clients' own records and each session's ``history()``, proves (or
refutes) that a run under faults kept every promise the service makes.

    report = check(sessions, calls, faults)      # a :class:`CheckReport`
    print_report(report)                         # faults, steps, lost, duplicated, unavailability
    report.clean                                 # nothing lost, duplicated, wrong or undocumented

What it proves, per session (:class:`SessionRun`):

- every acknowledged push (a call whose outcome is ``ok``) appears in exactly one version of the
  history (``(client_id, sequence)`` names a push; a sync push in the version it acknowledged, an
  async one at or before it: an async answer may include later pushes);
- no version is applied twice or skipped: the history's versions are exactly ``1..version``;
- no push was applied that its client was told was refused (a definitive refusal: INVALID_ARGUMENT,
  ABORTED, ...; UNAVAILABLE, DEADLINE_EXCEEDED and a killed client's call may go either way), and
  none that no client of the run sent (a rogue's push, or an SDK numbering pushes differently);
- the final parameters equal an in-process replay of the history (:func:`replay`) within the
  rounding allowance of :func:`replay_tolerance`: each push's gradient is rebuilt from its name
  alone (:func:`push_gradient`), a sync round's update runs on ``sum(scales[i] * g_i) /
  len(participants)`` summed in the record's (ticket) order, an async push's on its gradient with
  the step scaled by ``scales[0]``, with the registry's kernel as the session's shards run it (one
  jitted step per shard over the tensors it holds, :attr:`SessionRun.shards`);

and, over all calls (:class:`CallRecord`): every call ended with a documented status (no INTERNAL,
no UNKNOWN, no exception of another kind), a rogue's garbage was refused with the status the docs
promise for it, and no call outlived its deadline (a call without an outcome counts as a hang
unless its process was killed by the nemesis, :attr:`FaultRecord.victims`).

It measures, per fault kind (:class:`FaultRecord`), the longest unavailability: the time from a
fault's injection to the next acknowledged step of each session (:mod:`bench.outages`).

The history's fields are mapped to pushes in one place, :func:`pushes_of`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import sys
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from bench.outages import unavailability
from optserve.protos.status_records import HyperparamChange, RoundRecord

# A call's outcome: "ok", "late" (an elastic push dropped as late), a gRPC status code name, or
# "exception:<type>". These are the statuses docs/api.md documents for a data-plane call.
DOCUMENTED = frozenset({"ok", "late", "CANCELLED", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                        "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                        "ABORTED", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"})
# Outcomes after which the push may or may not have been applied (the answer was lost, or never came);
# every other documented refusal says the push was applied nowhere (docs/api.md).
AMBIGUOUS = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "DATA_LOSS", ""})
REFUSED = DOCUMENTED - AMBIGUOUS - {"ok"}
DEFAULT_TOLERANCE = 1e-6  # the replay's absolute allowance: the floor of replay_tolerance
ROUNDING_ULPS = 1.0  # replay_tolerance: float32 spacings of the parameters' magnitude per sqrt(version)


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One call a client made, as its own process logged it.

    Attributes:
      session: the session it addressed.
      worker: the caller's worker id (``Session.worker_id``; a rogue's name for itself).
      client_id: the push identity (``Session.client_id``); "" for calls that are no push.
      sequence: the push's sequence number as the SDK numbers it (0: no push).
      seed: the gradient's seed, :func:`gradient_seed` of ``(client_id, sequence)`` (0: none).
      kind: "push" (a worker's training step) or "rogue:<what>" (garbage sent on purpose).
      started / ended: unix seconds; ``ended`` None: no outcome was logged (its process died).
      outcome: "ok", "late", a gRPC status code name or "exception:<type>" ("" while unended).
      version: the version the server acknowledged (outcome "ok").
      deadline_s: the longest the call may take by the SDK's rules (its retries included).
      expected: rogue calls: the statuses the docs promise for this garbage.
      detail: the error's message (shortened), for the report.
    """

    session: str
    worker: str
    client_id: str
    sequence: int
    seed: int
    kind: str
    started: float
    ended: Optional[float]
    outcome: str
    version: Optional[int]
    deadline_s: float
    expected: tuple[str, ...] = ()
    detail: str = ""

    @property
    def push_name(self) -> tuple[str, int]:
        return self.client_id, self.sequence


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """One fault the nemesis injected: its kind, what it hit, when (unix seconds), the worker ids
    whose processes it killed (``victims``: their unfinished calls are no hang) and those it
    stopped from ``injected`` to ``ended`` (``stopped``: that time is not their calls' own)."""

    kind: str
    target: str
    injected: float
    ended: Optional[float] = None
    victims: tuple[str, ...] = ()
    note: str = ""
    stopped: tuple[str, ...] = ()


@dataclasses.dataclass
class SessionRun:
    """What a session is checked against: its optimizer and initial parameters, its version and
    parameters at the end (pulled once every client stopped), its history (every version, as
    followed during the run: see :class:`HistoryFollower`) and its shard map at the end
    (``shards``, :func:`shard_map`: the replay steps each shard's tensors together, as it does)."""

    name: str
    mode: str  # "sync" (plain or elastic) or "async"
    optimizer: Mapping
    initial: Mapping[str, np.ndarray]
    final: Mapping[str, np.ndarray]
    version: int
    history: Sequence
    history_conflicts: tuple[str, ...] = ()
    rollbacks: tuple[str, ...] = ()  # versions decided afresh after a restore (HistoryFollower.rollbacks)
    shards: tuple[tuple[str, ...], ...] = ()  # the tensors each shard holds, in shard order (): one shard


def shard_map(status) -> tuple[tuple[str, ...], ...]:
    """:attr:`SessionRun.shards` from a ``SessionStatus`` (``Client.session_status``): the tensors of
    each shard that holds some, in shard-index order."""
    return tuple(tuple(s.tensors) for s in sorted(status.shards, key=lambda s: s.index) if s.tensors)


@dataclasses.dataclass(frozen=True)
class AppliedPush:
    """One push of a history record (see :func:`pushes_of`)."""

    version: int
    client: str
    sequence: int
    worker: str
    scale: float
    staleness: int

    @property
    def name(self) -> tuple[str, int]:
        return self.client, self.sequence


def pushes_of(record: RoundRecord) -> tuple[AppliedPush, ...]:
    """The pushes a :class:`RoundRecord` says its update applied. The one place that reads the
    record's per-push fields: push ``i`` is ``(clients[i], sequences[i])`` from worker
    ``participants[i]``, weighted ``scales[i]``, ``staleness[i]`` versions old.

    Raises:
      ValueError: the per-push fields do not line up (a record that names no push cannot be checked).
    """
    n = len(record.participants)
    if not (len(record.clients) == len(record.sequences) == len(record.scales) == n) or (
            record.staleness and len(record.staleness) != n):
        raise ValueError(f"version {record.version}: {n} participants but {len(record.clients)} clients, "
                         f"{len(record.sequences)} sequences, {len(record.scales)} scales, "
                         f"{len(record.staleness)} staleness entries")
    staleness = record.staleness or (0,) * n
    return tuple(AppliedPush(record.version, c, int(s), w, float(x), int(t))
                 for c, s, w, x, t in zip(record.clients, record.sequences, record.participants, record.scales,
                                          staleness))


def gradient_seed(client_id: str, sequence: int) -> int:
    """The seed of push ``(client_id, sequence)``'s gradient: a function of its name alone."""
    digest = hashlib.blake2b(f"{client_id}#{int(sequence)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def push_gradient(shapes: Mapping[str, tuple], client_id: str, sequence: int) -> dict[str, np.ndarray]:
    """The gradient a nemesis worker pushes as ``(client_id, sequence)`` (float32, small values),
    so a replay rebuilds every push from the history alone."""
    rng = np.random.default_rng(gradient_seed(client_id, sequence))
    return {n: (rng.standard_normal(shapes[n]) * 0.1).astype(np.float32) for n in sorted(shapes)}


REREAD = 64  # versions a follower asks for again each time (see HistoryFollower.since)


class HistoryFollower:
    """Follows a session's history as a run goes (the home shard keeps only the latest versions):
    :meth:`add` each ``history(since=self.since)`` answer, and :meth:`settle` with a final
    ``history(since=0)``. Records are kept in version order; a version listed twice in one answer
    stays twice (the checker must see it).

    A version answered again differently was rolled back and decided afresh: a restore brings
    every shard to the latest version all of them logged, so a version some shard had applied but
    not logged when it died is decided again from the clients' retries. The held records from that
    version on are dropped for the server's word, and the rollback is noted in ``rollbacks``. That
    is no defect by itself (no acknowledgement covered the version: a push is acknowledged once
    its step is logged on every shard it touches); a rolled-back version that held an acknowledged
    push shows up as that push lost, or acknowledged at another version."""

    def __init__(self):
        self.conflicts: list[str] = []  # disagreements the run itself noticed (e.g. pulled vs status version)
        self.rollbacks: list[str] = []
        self._rounds: dict[int, list[RoundRecord]] = {}  # version -> its record(s), as answered
        self._changes: list = []  # HyperparamChange records

    @property
    def records(self) -> list:
        """Every held record, in version order."""
        held = [r for version in sorted(self._rounds) for r in self._rounds[version]] + self._changes
        return sorted(held, key=lambda r: r.version)

    @property
    def since(self) -> int:
        """The ``since`` to ask with next: the last :data:`REREAD` versions held are asked again,
        so a version a restore rolled back and decided afresh after this follower read it (the
        last one or two, those some shard had not logged) is seen answered differently."""
        return max(0, self.last - REREAD)

    @property
    def last(self) -> int:
        """The latest version held."""
        return max(self._rounds, default=0)

    def add(self, answer: Iterable) -> None:
        listed: dict[int, list[RoundRecord]] = {}
        for record in answer:
            if isinstance(record, RoundRecord):
                listed.setdefault(record.version, []).append(record)
            elif record not in self._changes:
                self._changes.append(record)
        for version in sorted(listed):
            answered, held = listed[version], self._rounds.get(version)
            if held is not None and _identity(held[0]) != _identity(answered[0]):
                self._roll_back(version, f"version {version} was {_identity(held[0])}, "
                                         f"later answered as {_identity(answered[0])}")
                held = None
            if held is None or len(answered) > len(held):  # a version listed twice stays twice
                self._rounds[version] = answered

    def settle(self, answer: Sequence) -> None:
        """Adds a ``history(since=0)`` answer, the server's word on where the history ends now:
        held versions past its last one were rolled back and not decided again."""
        self.add(answer)
        last = max((r.version for r in answer if isinstance(r, RoundRecord)), default=0)
        if self.last > last:
            self._roll_back(last + 1, f"versions {last + 1}-{self.last} rolled back, not decided again")

    def _roll_back(self, version: int, note: str) -> None:
        self.rollbacks.append(note)
        self._rounds = {v: held for v, held in self._rounds.items() if v < version}
        self._changes = [c for c in self._changes if c.version < version]


def _identity(record: RoundRecord) -> tuple:
    """What must never change about a version once answered (its timing may be rounded)."""
    return record.clients, record.sequences, record.scales, record.staleness


@dataclasses.dataclass(frozen=True)
class SessionCheck:
    """What :func:`check` found for one session (``lost`` etc. name pushes as (client id, sequence))."""

    name: str
    mode: str
    version: int
    pushes_applied: int
    acked: int
    applied_unacked: int
    lost: tuple = ()
    duplicated: tuple = ()
    skipped_versions: tuple = ()
    repeated_versions: tuple = ()
    beyond_version: tuple = ()
    version_mismatches: tuple = ()
    refused_but_applied: tuple = ()
    foreign: tuple = ()
    malformed: tuple = ()
    history_conflicts: tuple = ()
    rollbacks: tuple = ()
    replay_max_diff: float = math.inf
    replay_error: str = ""
    tolerance: float = DEFAULT_TOLERANCE  # the allowance the replay was held to (replay_tolerance)

    @property
    def replay_ok(self) -> bool:
        return not self.replay_error and self.replay_max_diff <= self.tolerance

    def problems(self) -> list[str]:
        out = [f"{self.name}: {what}: {list(items)[:5]}" for what, items in (
            ("acknowledged pushes lost", self.lost), ("pushes applied more than once", self.duplicated),
            ("versions skipped", self.skipped_versions), ("versions applied twice", self.repeated_versions),
            (f"versions recorded past the session's version {self.version}", self.beyond_version),
            ("acknowledged at another version", self.version_mismatches),
            ("refused but applied", self.refused_but_applied), ("applied pushes no client sent", self.foreign),
            ("malformed records", self.malformed), ("history rewritten", self.history_conflicts)) if items]
        if not self.replay_ok:
            why = self.replay_error or f"max |diff| {self.replay_max_diff:.3g} > allowance {self.tolerance:.3g}"
            out.append(f"{self.name}: replay differs from the served parameters: {why}")
        return out


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """Everything :func:`check` proved or refuted; :attr:`clean` when nothing was wrong."""

    sessions: tuple[SessionCheck, ...]
    faults: dict  # kind -> count
    skipped_faults: dict  # kind -> why it could not be injected
    statuses: dict  # call kind -> {outcome: count}
    undocumented: tuple[str, ...]
    hangs: tuple[str, ...]
    rogue_unexpected: tuple[str, ...]
    unavailability: dict  # kind -> Unavailability

    @property
    def lost(self) -> int:
        return sum(len(s.lost) for s in self.sessions)

    @property
    def duplicated(self) -> int:
        return sum(len(s.duplicated) for s in self.sessions)

    def problems(self) -> list[str]:
        out = [p for s in self.sessions for p in s.problems()]
        out += [f"undocumented status: {u}" for u in self.undocumented]
        out += [f"hang: {h}" for h in self.hangs]
        out += [f"rogue call not refused as documented: {r}" for r in self.rogue_unexpected]
        return out

    @property
    def clean(self) -> bool:
        return not self.problems()


# ----------------------------------------------------------------------------- the checks

def check(sessions: Sequence[SessionRun], calls: Sequence[CallRecord], faults: Sequence[FaultRecord] = (),
          skipped_faults: Optional[Mapping[str, str]] = None, tolerance: float = DEFAULT_TOLERANCE,
          grace_s: float = 5.0, run_ended: Optional[float] = None) -> CheckReport:
    """Checks ``sessions`` against the ``calls`` the clients logged and the ``faults`` injected.

    ``tolerance``: the replay's absolute allowance, the floor of :func:`replay_tolerance`;
    ``grace_s``: how far past its ``deadline_s`` a call may end before it counts as a hang;
    ``run_ended``: unix seconds the run stopped (unrecovered unavailability is measured to it).
    """
    victims = {v for f in faults for v in f.victims}
    checks = tuple(check_session(s, [c for c in calls if c.session == s.name and c.kind == "push"], tolerance)
                   for s in sessions)
    statuses: dict = collections.defaultdict(collections.Counter)
    undocumented, hangs, rogue = [], [], []
    for c in calls:
        statuses[c.kind.split(":")[0]][c.outcome or "no answer"] += 1
        where = f"{c.session}/{c.worker} {c.kind} seq {c.sequence}"
        if c.ended is None:
            if c.worker not in victims:
                hangs.append(f"{where}: no answer (started {c.started:.1f}, its process was not killed)")
            continue
        took = c.ended - c.started - sum(max(0.0, min(c.ended, f.ended) - max(c.started, f.injected))
                                         for f in faults if c.worker in f.stopped and f.ended is not None)
        if took > c.deadline_s + grace_s:
            hangs.append(f"{where}: {took:.1f} s > deadline {c.deadline_s:.0f} s ({c.outcome})")
        if c.outcome not in DOCUMENTED:
            undocumented.append(f"{where}: {c.outcome} {c.detail[:160]}")
        elif c.kind.startswith("rogue") and c.outcome not in c.expected:
            rogue.append(f"{where}: {c.outcome} (expected {'/'.join(c.expected)}) {c.detail[:160]}")
    return CheckReport(checks, dict(collections.Counter(f.kind for f in faults)), dict(skipped_faults or {}),
                       {k: dict(v) for k, v in statuses.items()}, tuple(undocumented), tuple(hangs), tuple(rogue),
                       unavailability(faults, calls, [s.name for s in sessions], run_ended))


def check_session(run: SessionRun, calls: Sequence[CallRecord], tolerance: float = DEFAULT_TOLERANCE) -> SessionCheck:
    """The checks of one session against its workers' push ``calls`` (see the module docstring);
    ``tolerance``: the floor of the replay's allowance (:func:`replay_tolerance`)."""
    records = [r for r in run.history if isinstance(r, RoundRecord)]
    malformed, applied = [], collections.defaultdict(list)
    for record in records:
        try:
            pushes = pushes_of(record)
        except ValueError as error:
            malformed.append(str(error))
            continue
        if run.mode == "async" and len(pushes) != 1:
            malformed.append(f"version {record.version}: an async record with {len(pushes)} pushes")
        for push in pushes:
            if push.worker != push.client.split("/", 1)[0]:
                malformed.append(f"version {record.version}: worker {push.worker!r} of client {push.client!r}")
            applied[push.name].append(record.version)
    seen = collections.Counter(r.version for r in records)
    skipped = tuple(v for v in range(1, run.version + 1) if v not in seen)
    repeated = tuple(sorted(v for v, n in seen.items() if n > 1))
    beyond = tuple(sorted(v for v in seen if v > run.version or v < 1))
    by_name = {c.push_name: c for c in calls}
    acked = [c for c in calls if c.outcome == "ok"]
    lost = tuple(c.push_name for c in acked if c.push_name not in applied)
    mismatched = tuple((c.push_name, c.version, applied[c.push_name][0]) for c in acked if c.push_name in applied
                       and not _acked_at(run.mode, c.version, applied[c.push_name][0]))
    refused = tuple((name, by_name[name].outcome) for name in applied
                    if name in by_name and by_name[name].ended is not None and by_name[name].outcome in REFUSED)
    foreign = tuple(name for name in applied if name not in by_name)
    diff, error, allowed = replay_difference(run, records, tolerance)
    return SessionCheck(
        name=run.name, mode=run.mode, version=run.version, pushes_applied=sum(len(v) for v in applied.values()),
        acked=len(acked), applied_unacked=sum(1 for name in applied if name not in by_name or
                                              by_name[name].outcome != "ok"),
        lost=lost, duplicated=tuple(name for name, versions in applied.items() if len(versions) > 1),
        skipped_versions=skipped, repeated_versions=repeated, beyond_version=beyond, version_mismatches=mismatched,
        refused_but_applied=refused, foreign=foreign, malformed=tuple(malformed),
        history_conflicts=tuple(run.history_conflicts), rollbacks=tuple(run.rollbacks), replay_max_diff=diff,
        replay_error=error, tolerance=allowed)


def _acked_at(mode: str, acked: Optional[int], applied_at: int) -> bool:
    """A sync push is acknowledged with its round's version; an async one with a version at or
    after its own (the parameters returned may include later pushes)."""
    if acked is None:
        return False
    return acked == applied_at if mode == "sync" else acked >= applied_at


# ----------------------------------------------------------------------------- the replay

def replay_tolerance(floor: float, magnitude: float, versions: int) -> float:
    """The largest ``max |final - replay|`` float32 rounding explains after ``versions`` replayed
    steps of parameters at most ``magnitude`` in absolute value (over the initial, final and
    replayed ones): ``max(floor, ROUNDING_ULPS * spacing(float32(magnitude)) * sqrt(versions))``.

    The rule: :func:`replay` reproduces the server's arithmetic (the same scaled sum in the same
    order and the same division, one jitted step per shard over the tensors it holds, a cross-shard
    statistic summed in shard order in double), and then equals the served parameters bit for
    bit. Where it does not (a shard map that a restore changed mid-run, a shard of more than
    ``CHUNK_TENSORS`` tensors stepped chunk by chunk), XLA compiles the same formulas into other
    programs, which round differently in the last bit now and then: one program over the whole
    tree against the soak's two shards differs in 8 of 192 entries by one spacing after one Adam
    step. A step's update does not depend on the last bits of the parameters, so a difference
    stays as it is until another step rounds differently, which moves it by at most a spacing of
    the parameter's magnitude, either way: a random walk, about ``sqrt(versions)`` spacings (over
    12,120 Adam steps, |p| <= 4.8: 9.5e-7, 2 spacings; the allowance there is 5.2e-5).

    Anything else moves a parameter by about a step's size: a push dropped, applied twice or
    with a wrong scale at version 500 of an Adam history of 1,000 versions (learning rate 0.01)
    leaves the parameters 9e-3 to 3e-2 off, against an allowance of 7.5e-6 there
    (tests/test_checker.py); and a short run is held to ``floor`` (``DEFAULT_TOLERANCE``, 1e-6:
    the allowance for the first 70 versions of parameters below 2 in magnitude, 280 below 1).
    Non-finite parameters get ``floor``.
    """
    if not math.isfinite(magnitude):
        return floor
    rounding = ROUNDING_ULPS * float(np.spacing(np.float32(magnitude))) * math.sqrt(max(versions, 0))
    return max(floor, rounding)


def replay_difference(run: SessionRun, records: Sequence[RoundRecord], tolerance: float) -> tuple[float, str, float]:
    """(max |final - replay|, "", the allowance :func:`replay_tolerance` gives it with floor
    ``tolerance``), or (inf, why the replay could not run, ``tolerance``)."""
    if any(isinstance(r, HyperparamChange) for r in run.history):
        return math.inf, "the history has hyperparameter changes (the replay does not model them)", tolerance
    try:
        replayed = replay(run.optimizer, run.initial, sorted(records, key=lambda r: r.version), run.mode, run.shards)
    except (ValueError, KeyError) as error:
        return math.inf, f"{type(error).__name__}: {error}", tolerance
    if set(replayed) != set(run.final):
        return math.inf, f"tensors differ: {sorted(replayed)} vs {sorted(run.final)}", tolerance
    diff = max((float(np.max(np.abs(np.asarray(run.final[n], np.float64) - replayed[n].astype(np.float64)),
                             initial=0.0)) for n in replayed), default=0.0)
    magnitude = max((float(np.max(np.abs(np.asarray(t, np.float64)), initial=0.0))
                     for tree in (run.initial, run.final, replayed) for t in tree.values()), default=0.0)
    return diff, "", replay_tolerance(tolerance, magnitude, len(records))


def replay(optimizer: Mapping, initial: Mapping[str, np.ndarray], records: Sequence[RoundRecord],
           mode: str, shards: Sequence[Sequence[str]] = ()) -> dict[str, np.ndarray]:
    """The parameters ``records`` make from ``initial``, with the registry's kernel run in this
    process as the session's shards run it: one jitted step per shard over the tensors it holds
    (``shards``: :attr:`SessionRun.shards`; empty: one shard of every tensor), so XLA compiles
    the programs a shard runs; a cross-shard statistic is the shards' parts summed in shard order
    in double precision, then rounded to float32 (as the home clock's sum and the updater take
    it); a sync round's mean is ``sum(scales[i] * g_i)`` in the record's order (the order its
    pushes' tickets applied) divided by the count, in float32 (as a shard's apply queue sums it).

    Raises:
      ValueError: ``shards`` does not name every tensor of ``initial`` exactly once.
    """
    import jax

    from optserve.optim_kernels import build_optimizer
    from optserve.server.compute.updater import step_function

    built = build_optimizer(optimizer["name"], dict(optimizer.get("args", {})))
    groups = _shard_groups(shards, initial)
    params = [{n: jax.numpy.asarray(initial[n]) for n in names} for names in groups]
    states = [built.transformation.init(p) for p in params]
    step = jax.jit(step_function(built))
    partial = jax.jit(built.partial_statistic) if built.partial_statistic is not None else None
    shapes = {n: tuple(np.shape(v)) for n, v in initial.items()}
    for record in records:
        pushes = pushes_of(record)
        grads = [push_gradient(shapes, p.client, p.sequence) for p in pushes]
        if mode == "async":  # one push, the step scaled
            update, scale = grads[0], np.float32(pushes[0].scale)
        else:  # the scaled mean of the round's pushes
            update = {n: sum(np.float32(p.scale) * g[n] for p, g in zip(pushes, grads)) / np.float32(len(grads))
                      for n in shapes}
            scale = np.float32(1.0)
        total = 0.0
        if partial is not None:
            for p, s in zip(params, states):
                total += float(partial({n: update[n] for n in p}, s, p))
        for i, (p, s) in enumerate(zip(params, states)):
            params[i], states[i] = step(p, s, {n: update[n] for n in p}, scale, np.float32(total), built.hyperparams)
    return {n: np.asarray(v) for p in params for n, v in p.items()}


def _shard_groups(shards: Sequence[Sequence[str]], initial: Mapping[str, np.ndarray]) -> list[tuple[str, ...]]:
    """The tensors each shard steps (``shards`` without empty shards; empty: every tensor in one)."""
    if not shards:
        return [tuple(initial)]
    named = [n for group in shards for n in group]
    if sorted(named) != sorted(initial):
        raise ValueError(f"the shard map {[list(g) for g in shards]} does not name each of the tensors "
                         f"{sorted(initial)} exactly once")
    return [tuple(group) for group in shards if group]


# ----------------------------------------------------------------------------- the printer

def print_report(report: CheckReport, out=sys.stdout) -> None:
    """The report as a reader wants it: faults, steps, lost, duplicated, unavailability, verdict."""
    w = out.write
    w("faults injected: " + (", ".join(f"{k} {n}" for k, n in sorted(report.faults.items())) or "none") + "\n")
    for kind, why in sorted(report.skipped_faults.items()):
        w(f"  not injected: {kind}: {why}\n")
    w(f"{'session':<12}{'mode':<7}{'versions':>9}{'pushes':>8}{'acked':>7}{'unacked':>8}{'lost':>6}"
      f"{'dup':>5}{'replay |diff|':>15}\n")
    for s in report.sessions:
        diff = s.replay_error[:30] if s.replay_error else f"{s.replay_max_diff:.2e}"
        w(f"{s.name:<12}{s.mode:<7}{s.version:>9}{s.pushes_applied:>8}{s.acked:>7}{s.applied_unacked:>8}"
          f"{len(s.lost):>6}{len(s.duplicated):>5}{diff:>15}\n")
    w(f"steps acknowledged: {sum(s.acked for s in report.sessions)}, lost: {report.lost}, "
      f"duplicated: {report.duplicated}\n")
    for s in report.sessions:
        for note in s.rollbacks:  # versions no acknowledgement covered, decided again after a restore
            w(f"rolled back ({s.name}): {note[:200]}\n")
    for kind, counts in sorted(report.statuses.items()):
        w(f"calls ({kind}): " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) + "\n")
    w("longest unavailability (fault injected -> next acknowledged step of each session; from the fault's "
      "end; and over the faults no other fault followed before that step):\n")
    for kind, u in sorted(report.unavailability.items()):
        what = f"{u.seconds:.1f} s" if u.recovered else f">= {u.seconds:.1f} s (no step before the end)"
        lifted = f"{u.after_end_s:.1f} s after its end" if u.after_end_s is not None else ""
        alone = f"alone {u.alone_s:.1f} s" if u.alone_s is not None else "alone -"
        w(f"  {kind:<14}{what:<34}{lifted:<22}{alone:<14}({u.session}, fault #{u.fault_index})\n")
    problems = report.problems()
    w("verdict: " + ("clean" if not problems else f"{len(problems)} problem(s)") + "\n")
    for p in problems:
        w(f"  - {p}\n")
