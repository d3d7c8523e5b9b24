"""Recovery of a durable session's part on one shard: its latest checkpoint, then the steps its
log holds after it, applied again exactly as they were (each with the cross-shard statistic it
was logged with: no peer is asked)."""

from __future__ import annotations

import dataclasses
import json
from typing import Mapping, Optional, Sequence

import numpy as np

from optserve.server.compute.buffers import aligned_empty
from optserve.server.compute.updater import Updater
from optserve.server.domain.clock import Ticket
from optserve.server.domain.config import TensorSpec
from optserve.server.domain.durability import CheckpointPort, ShardProgress, StepRecord
from optserve.server.domain.errors import SessionLost


def step_tickets(record: StepRecord) -> list[Ticket]:
    """The tickets of a logged step, as its clock decided them (their staleness is not logged:
    0); the last one closes the step."""
    last = len(record.tickets) - 1
    return [Ticket(ordinal, client, sequence, 0, record.scale, i == last, record.version, False)
            for i, (ordinal, client, sequence) in enumerate(record.tickets)]


def replayed_tickets(records: Sequence[StepRecord], start: Mapping[str, Mapping[str, float]]) -> list[Ticket]:
    """The tickets of logged steps (:func:`step_tickets`), the first of a step that ran with other
    hyperparameters than the step before it carrying the ones that changed (``start``: those of
    the step before the first record), as the clock's tickets carried them."""
    tickets, previous = [], {g: dict(values) for g, values in start.items()}
    for record in records:
        step = step_tickets(record)
        changed = {g: {o: v for o, v in values.items() if previous.get(g, {}).get(o) != v}
                   for g, values in record.hyper.items()}
        changed = {g: values for g, values in changed.items() if values}
        if changed and step:
            step[0] = dataclasses.replace(step[0], hyperparams=json.dumps(changed, sort_keys=True))
        previous = record.hyper or previous
        tickets.extend(step)
    return tickets


def replay(store: CheckpointPort, manifest: dict, updater: Updater, specs: Mapping[str, TensorSpec], read_log,
           upto: Optional[int] = None) -> tuple[ShardProgress, list[StepRecord]]:
    """Recovery: loads checkpoint ``manifest`` of ``store`` into ``updater``, then applies the
    steps its log holds past the checkpoint (up to version ``upto``; None: all); returns the
    progress reached and the records applied.

    ``read_log``: ``(segment_path, fresh_buffers) -> reader``, iterating ``(record_json, grads)``
    with each step's gradient read into buffers from ``fresh_buffers()``; the reader tells the
    byte offset of the record it gave last (``last_at``) and of a torn tail (``torn_at``). Each
    step reuses the cross-shard statistic logged with it (no peer is asked). A torn tail is cut
    off its segment; with ``upto``, the log is cut before the first step after it (those steps
    are rolled back, on every shard alike). A segment a later one was sealed after
    (``store.log.stray_after``) is read up to the sealed version only.

    Raises:
      SessionLost: the log skips a version (nothing holds the steps between).
    """
    def fresh_buffers() -> dict[str, np.ndarray]:
        return {name: aligned_empty(spec.shape, np.float32) for name, spec in specs.items()}

    progress = ShardProgress.from_json(manifest["progress"])
    updater.use_chunks(progress.state_chunks)
    restored = store.restore_arrays(manifest, updater.abstract_state())
    updater.restore(restored["params"], restored["opt_state"])
    updater.set_hyper(progress.hyper)
    applied: list[StepRecord] = []
    for segment in store.log.segments(manifest):
        reader = read_log(segment, fresh_buffers)
        stray_after = store.log.stray_after(segment)
        for header, grads in reader:
            record = StepRecord.from_json(header)
            if stray_after is not None and record.version > stray_after:
                break  # a replaced owner's late write: the log goes on in a later segment
            if record.version > progress.version:
                if upto is not None and record.version > upto:
                    store.log.cut(segment, reader.last_at, drop_later=True)
                    return progress, applied
                if record.version != progress.version + 1:  # never applied out of order
                    raise SessionLost(f"the step log {segment} goes from version {progress.version} to "
                                      f"{record.version}: the steps between are in no file")
                updater.set_hyper(record.hyper)
                updater.apply(grads, record.scale, lambda _partial, s=record.global_stat: s, absent=record.absent)
                progress = progress.after(record)
                applied.append(record)
            if record.version == stray_after:
                break  # what follows is a replaced owner's, maybe half written: never read, never cut
        else:
            if reader.torn_at is not None:
                store.log.cut(segment, reader.torn_at, drop_later=False)
    return progress, applied
