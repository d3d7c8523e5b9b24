"""Prometheus metrics: their names, the shard actors' collectors, and the coordinator's endpoint.

Each shard actor keeps its own metrics (:class:`ShardMetrics`): event metrics its sessions report
through a :class:`~optserve.server.domain.shard.shard_session.StepObserver` (one per session, label
children bound once), and gauges read from its sessions when scraped. The coordinator serves
``/metrics`` (``--metrics-port``): at each scrape it asks every shard for its families over Ray
and merges them (:class:`FleetCollector`). :data:`METRICS` is the contract dashboards rely on.

A shard's families cross Ray packed (:func:`pack_families`): a busy shard's run to hundreds of
kilobytes pickled, over Ray's limit for values passed inline (100 KiB), and each scrape would
otherwise go through the node's object store.
"""

from __future__ import annotations

import os
import pickle
import threading
import zlib
from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from optserve.protos.malloc_settings import heap_usage
from optserve.server.domain.errors import RejectReason
from optserve.server.domain.shard import StepObserver


# name -> (type, labels, help)
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "optserve_push_seconds": ("histogram", ("session", "shard"), "Time a shard spent on one push: receive, stage, vote, update."),
    "optserve_pull_seconds": ("histogram", ("session", "shard"), "Time a shard spent answering a pull (or a step's parameters)."),
    "optserve_step_seconds": ("histogram", ("session", "shard"), "Time of one applied update on a shard."),
    "optserve_received_bytes_total": ("counter", ("session", "shard"), "Tensor bytes received by a shard."),
    "optserve_sent_bytes_total": ("counter", ("session", "shard"), "Tensor bytes sent by a shard."),
    "optserve_steps_applied_total": ("counter", ("session", "shard"), "Updates applied by a shard."),
    "optserve_replica_sent_bytes_total": ("counter", ("shard",),
                                          "Bytes a primary shard streamed to its hot standbys (starts, steps, clock "
                                          "entries)."),
    "optserve_replica_received_bytes_total": ("counter", ("shard",),
                                              "Bytes of its hot standbys' answers a primary shard received."),
    "optserve_pushes_rejected_total": ("counter", ("session", "shard", "reason"), "Pushes a shard refused, by reason."),
    "optserve_staleness": ("histogram", ("session",), "Staleness of accepted pushes, in versions."),
    "optserve_session_version": ("gauge", ("session",), "A session's version (steps decided)."),
    "optserve_param_bytes": ("gauge", ("session", "shard"), "Parameter bytes a shard holds for a session."),
    "optserve_optimizer_state_bytes": ("gauge", ("session", "shard"), "Optimizer-state bytes a shard holds for a session."),
    "optserve_process_resident_bytes": ("gauge", ("process",), "Resident memory of an optserve process."),
    "optserve_process_heap_bytes": ("gauge", ("process", "state"),
                                    "malloc's heap of an optserve process: in_use (allocated) or free (kept for reuse)."),
    "optserve_root_age_steps": ("gauge", ("session", "shard"), "Oldest preconditioner root in use, in steps."),
    "optserve_root_error": ("gauge", ("session", "shard"), "Largest error of the latest roots offered."),
    "optserve_root_fallback_steps_total": ("counter", ("session", "shard"), "Block-updates run without a root."),
    "optserve_root_failures_total": ("counter", ("session", "shard"), "Roots rejected (error too large or NaN)."),
    "optserve_sessions": ("gauge", (), "Open sessions."),
    "optserve_loss": ("gauge", ("session",), "The latest loss a client attached to an accepted push."),
    "optserve_storage_degraded": ("gauge", ("session", "shard"),
                                  "1 while a durable session's step log on a shard has no room (steps refused, "
                                  "UNAVAILABLE), else 0."),
    "optserve_elastic_members": ("gauge", ("session",), "Members of an elastic sync session."),
    "optserve_elastic_stragglers": ("gauge", ("session",), "Members of an elastic session not waited for (straggling)."),
    "optserve_elastic_departures_total": ("counter", ("session", "cause"),
                                          "Members that left an elastic session by a lapsed lease or a dropped "
                                          "connection."),
    "optserve_elastic_rounds_short_total": ("counter", ("session",),
                                            "Elastic rounds committed with fewer than num_workers pushes."),
    "optserve_elastic_late_dropped_total": ("counter", ("session",), "Late gradients an elastic session dropped."),
    "optserve_elastic_round_seconds": ("gauge", ("session",),
                                       "Median elastic round duration (first push to commit), recent rounds."),
}


LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)


def _help(name: str) -> str:
    return METRICS[name][2]


def resident_bytes(pid: Optional[int] = None) -> int:
    """Resident memory of a process on this machine (0 if it cannot be read)."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def process_memory(process: str) -> list[GaugeMetricFamily]:
    """This process's resident memory and malloc heap (in use / free; none where glibc cannot
    tell), labelled ``process``."""
    rss = GaugeMetricFamily("optserve_process_resident_bytes", _help("optserve_process_resident_bytes"),
                            labels=("process",))
    rss.add_metric([process], resident_bytes())
    heap = GaugeMetricFamily("optserve_process_heap_bytes", _help("optserve_process_heap_bytes"),
                             labels=("process", "state"))
    usage = heap_usage()
    if usage is not None:
        heap.add_metric([process, "in_use"], usage[0])
        heap.add_metric([process, "free"], usage[1])
    return [rss, heap]


class _SessionObserver(StepObserver):
    """A session's metric children on one shard (label lookups done once, not per step)."""

    def __init__(self, metrics: "ShardMetrics", session: str):
        labels = (session, metrics.shard)
        self._push = metrics.push_seconds.labels(*labels)
        self._pull = metrics.pull_seconds.labels(*labels)
        self._step = metrics.step_seconds.labels(*labels)
        self._received = metrics.received_bytes.labels(*labels)
        self._sent = metrics.sent_bytes.labels(*labels)
        self._steps = metrics.steps_applied.labels(*labels)
        self._rejected = {reason: metrics.rejected.labels(session, metrics.shard, reason.name.lower())
                          for reason in RejectReason}
        self._staleness_metric, self._session = metrics.staleness, session
        self._staleness = None  # made on the first accepted push: only the home shard reports them

    def received(self, nbytes: int) -> None:
        self._received.inc(nbytes)

    def rejected(self, reason: RejectReason) -> None:
        self._rejected[reason].inc()

    def accepted(self, staleness: int) -> None:
        if self._staleness is None:
            self._staleness = self._staleness_metric.labels(self._session)
        self._staleness.observe(staleness)

    def applied(self, seconds: float) -> None:
        self._steps.inc()
        self._step.observe(seconds)

    def pushed(self, seconds: float) -> None:
        self._push.observe(seconds)

    def sent(self, seconds: float, nbytes: int) -> None:
        self._pull.observe(seconds)
        self._sent.inc(nbytes)


class ShardMetrics:
    """One shard actor's metrics: event metrics its sessions report through observers, and
    gauges read from its sessions at collection time (``gauges`` returns them).

    Args:
      shard: the shard's index (the ``shard`` label).
      gauges: ``() -> iterable of GaugeMetricFamily`` read at collection (versions, bytes, roots).
    """

    def __init__(self, shard: int, gauges: Callable[[], Iterable[Metric]]):
        self.shard = str(shard)
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        session_shard = ("session", "shard")
        self.push_seconds = Histogram("optserve_push_seconds", _help("optserve_push_seconds"), session_shard,
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.pull_seconds = Histogram("optserve_pull_seconds", _help("optserve_pull_seconds"), session_shard,
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.step_seconds = Histogram("optserve_step_seconds", _help("optserve_step_seconds"), session_shard,
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.received_bytes = Counter("optserve_received_bytes", _help("optserve_received_bytes_total"), session_shard,
                                      registry=r)
        self.sent_bytes = Counter("optserve_sent_bytes", _help("optserve_sent_bytes_total"), session_shard, registry=r)
        self.steps_applied = Counter("optserve_steps_applied", _help("optserve_steps_applied_total"), session_shard,
                                     registry=r)
        self.rejected = Counter("optserve_pushes_rejected", _help("optserve_pushes_rejected_total"),
                                ("session", "shard", "reason"), registry=r)
        self.staleness = Histogram("optserve_staleness", _help("optserve_staleness"), ("session",),
                                   buckets=STALENESS_BUCKETS, registry=r)
        self.replica_sent_bytes = Counter("optserve_replica_sent_bytes", _help("optserve_replica_sent_bytes_total"),
                                          ("shard",), registry=r).labels(self.shard)
        self.replica_received_bytes = Counter("optserve_replica_received_bytes",
                                              _help("optserve_replica_received_bytes_total"), ("shard",),
                                              registry=r).labels(self.shard)
        self._gauges = gauges
        self._lock = threading.Lock()

    def observer(self, session: str) -> StepObserver:
        return _SessionObserver(self, session)

    def forget(self, session: str) -> None:
        """Drops a closed session's series."""
        with self._lock:
            for metric in (self.push_seconds, self.pull_seconds, self.step_seconds, self.received_bytes,
                           self.sent_bytes, self.steps_applied):
                _remove(metric, session, self.shard)
            for reason in RejectReason:
                _remove(self.rejected, session, self.shard, reason.name.lower())
            _remove(self.staleness, session)

    def collect(self) -> list[Metric]:
        """Every family of this shard, gauges included (picklable: sent to the coordinator)."""
        families = list(self.registry.collect())
        families.extend(self._gauges())
        families.extend(process_memory(f"shard-{self.shard}"))
        return families


def _remove(metric, *labels) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def pack_families(families: Iterable[Metric]) -> bytes:
    """``families`` as compressed bytes (their samples' label names and values repeat, a dozen
    times smaller than pickled alone); :func:`unpack_families` gives them back."""
    return zlib.compress(pickle.dumps(list(families), protocol=pickle.HIGHEST_PROTOCOL), 1)


def unpack_families(packed: bytes) -> list[Metric]:
    """The families :func:`pack_families` packed (from a shard process of this server)."""
    return pickle.loads(zlib.decompress(packed))


def merge(families: Iterable[Metric]) -> list[Metric]:
    """Families of the same name (from several processes) as one family with all their samples."""
    merged: dict[str, Metric] = {}
    for family in families:
        into = merged.get(family.name)
        if into is None:
            into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
        into.samples.extend(family.samples)
    return list(merged.values())


class FleetCollector:
    """The coordinator's collector: every shard's families (over Ray, at scrape time), merged,
    plus the coordinator's own gauges.

    Args:
      shard_families: ``() -> list of each shard's packed families`` (:func:`pack_families`; a
        shard that does not answer is left out).
      sessions: ``() -> number of open sessions``.
    """

    def __init__(self, shard_families: Callable[[], list], sessions: Callable[[], int]):
        self._shard_families = shard_families
        self._sessions = sessions

    def collect(self):
        families = [f for packed in self._shard_families() for f in unpack_families(packed)]
        families.extend(process_memory("coordinator"))
        sessions = GaugeMetricFamily("optserve_sessions", _help("optserve_sessions"))
        sessions.add_metric([], self._sessions())
        families.append(sessions)
        yield from merge(families)


def serve_metrics(host: str, port: int, collector: FleetCollector):
    """Serves Prometheus text at ``http://host:port/metrics``; returns (server, port)."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server, server.server_address[1]


def session_gauges(sessions: Iterable, shard: str) -> list[Metric]:
    """Gauges of a shard's sessions (``ShardSession`` objects), read now."""
    version = GaugeMetricFamily("optserve_session_version", _help("optserve_session_version"), labels=("session",))
    params = GaugeMetricFamily("optserve_param_bytes", _help("optserve_param_bytes"), labels=("session", "shard"))
    state = GaugeMetricFamily("optserve_optimizer_state_bytes", _help("optserve_optimizer_state_bytes"),
                              labels=("session", "shard"))
    age = GaugeMetricFamily("optserve_root_age_steps", _help("optserve_root_age_steps"), labels=("session", "shard"))
    error = GaugeMetricFamily("optserve_root_error", _help("optserve_root_error"), labels=("session", "shard"))
    fallbacks = CounterMetricFamily("optserve_root_fallback_steps", _help("optserve_root_fallback_steps_total"),
                                    labels=("session", "shard"))
    failures = CounterMetricFamily("optserve_root_failures", _help("optserve_root_failures_total"),
                                   labels=("session", "shard"))
    loss = GaugeMetricFamily("optserve_loss", _help("optserve_loss"), labels=("session",))
    degraded = GaugeMetricFamily("optserve_storage_degraded", _help("optserve_storage_degraded"),
                                 labels=("session", "shard"))
    elastic = _ElasticFamilies()
    for session in sessions:
        name = session.config.name
        status = session.status()
        if status.clock is not None:
            version.add_metric([name], status.clock.version)
            if status.clock.elastic is not None:
                elastic.add(name, status.clock.elastic)
        if session.series is not None and session.series.last_loss is not None:
            loss.add_metric([name], session.series.last_loss)
        params.add_metric([name, shard], session.updater.param_bytes())
        state.add_metric([name, shard], status.state_bytes)
        degraded.add_metric([name, shard], float(status.durability is not None and bool(status.durability.degraded)))
        roots = status.preconditioners
        if roots is not None and roots.blocks:
            age.add_metric([name, shard], max(b.age for b in roots.blocks))
            error.add_metric([name, shard], max(b.error for b in roots.blocks))
            fallbacks.add_metric([name, shard], sum(b.fallback_steps for b in roots.blocks))
            failures.add_metric([name, shard], sum(b.failures for b in roots.blocks))
    return [version, params, state, age, error, fallbacks, failures, loss, degraded, *elastic.families]


class _ElasticFamilies:
    """The elastic sessions' gauges and counters (reported by each session's home shard)."""

    def __init__(self):
        def family(kind, name, labels=("session",)):
            exposed = name[:-len("_total")] if name.endswith("_total") else name  # the client adds _total back
            return kind(exposed, _help(name), labels=labels)

        self.members = family(GaugeMetricFamily, "optserve_elastic_members")
        self.stragglers = family(GaugeMetricFamily, "optserve_elastic_stragglers")
        self.departures = family(CounterMetricFamily, "optserve_elastic_departures_total", ("session", "cause"))
        self.short = family(CounterMetricFamily, "optserve_elastic_rounds_short_total")
        self.late = family(CounterMetricFamily, "optserve_elastic_late_dropped_total")
        self.round_seconds = family(GaugeMetricFamily, "optserve_elastic_round_seconds")
        self.families = [self.members, self.stragglers, self.departures, self.short, self.late, self.round_seconds]

    def add(self, name: str, status) -> None:
        self.members.add_metric([name], len(status.members))
        self.stragglers.add_metric([name], len(status.stragglers))
        self.departures.add_metric([name, "lease"], status.lease_expiries)
        self.departures.add_metric([name, "disconnect"], status.disconnects)
        self.short.add_metric([name], status.rounds_short)
        self.late.add_metric([name], status.late_dropped)
        self.round_seconds.add_metric([name], status.round_p50_s)
