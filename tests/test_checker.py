"""The chaos checker (bench/checker.py) on hand-made runs: no server. Each run is a history built
from RoundRecord objects, the clients' call records, and final parameters computed by hand (SGD:
``p - lr * update``, so the expected values need no kernel); a correct run passes, and a lost
step, a duplicate, a skipped or repeated version, a wrong parameter, a refused push that was
applied, an undocumented status and a hang are each caught. The replay's own arithmetic is pinned
against a shard's apply queue and updater run in this process (bit for bit), and its rounding
allowance against long Adam histories: rounding passes, a push applied wrongly does not."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

from bench.checker import (DEFAULT_TOLERANCE, CallRecord, FaultRecord, HistoryFollower, RoundRecord, SessionRun,
                           check, gradient_seed, print_report, push_gradient, replay, replay_tolerance,
                           unavailability)
from tests._service_helpers import InProcess, max_abs_diff

LR = 0.1
SGD = {"name": "sgd", "args": {"learning_rate": LR}}
SHAPES = {"w": (3, 2), "b": (2,)}
A, B = "a/0001", "b/0002"  # client ids: worker "a", worker "b"


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def g(client: str, sequence: int) -> dict[str, np.ndarray]:
    return push_gradient(SHAPES, client, sequence)


def sync_record(version: int, pushes, scales=None) -> RoundRecord:
    """A sync round applying ``pushes`` ((client, sequence) pairs)."""
    n = len(pushes)
    return RoundRecord(version, tuple(c.split("/")[0] for c, _ in pushes), tuple(scales or (1.0,) * n), (), 0.01,
                       "num_workers", tuple(c for c, _ in pushes), tuple(s for _, s in pushes), (0,) * n)


def async_record(version: int, push, staleness: int = 0) -> RoundRecord:
    client, sequence = push
    return RoundRecord(version, (client.split("/")[0],), (1.0 / (1 + staleness),), (), 0.0, "push", (client,),
                       (sequence,), (staleness,))


def sgd_by_hand(records, mode: str) -> dict[str, np.ndarray]:
    """SGD's parameters after ``records``, by hand (float32, as the kernel computes them)."""
    params = {n: v.copy() for n, v in initial().items()}
    for r in records:
        grads = [g(c, s) for c, s in zip(r.clients, r.sequences)]
        for n in params:
            if mode == "async":
                params[n] = params[n] + np.float32(-LR) * grads[0][n] * np.float32(r.scales[0])
            else:
                mean = sum(np.float32(x) * gr[n] for x, gr in zip(r.scales, grads)) / np.float32(len(grads))
                params[n] = params[n] + np.float32(-LR) * mean
    return params


def push_call(client: str, sequence: int, outcome: str = "ok", version=None, session: str = "s",
              ended: float = None, started: float = 100.0) -> CallRecord:
    return CallRecord(session, client.split("/")[0], client, sequence, gradient_seed(client, sequence), "push",
                      started, started + 0.05 if ended is None else ended, outcome,
                      version if outcome == "ok" else None, 30.0)


def run_of(records, mode: str, final=None, version=None, name: str = "s") -> SessionRun:
    return SessionRun(name, mode, SGD, initial(), final if final is not None else sgd_by_hand(records, mode),
                      version if version is not None else max((r.version for r in records), default=0), records)


SYNC = [sync_record(v, [(A, v), (B, v)]) for v in (1, 2, 3)]
SYNC_CALLS = [push_call(c, v, version=v) for v in (1, 2, 3) for c in (A, B)]
ASYNC = [async_record(1, (A, 1)), async_record(2, (B, 1), 1), async_record(3, (A, 2)), async_record(4, (B, 2), 2)]
ASYNC_CALLS = [push_call(A, 1, version=1), push_call(B, 1, version=4),  # async: acknowledged at or after its version
               push_call(A, 2, version=3), push_call(B, 2, version=4)]


@pytest.mark.parametrize("mode,records,calls", [("sync", SYNC, SYNC_CALLS), ("async", ASYNC, ASYNC_CALLS)])
def test_a_correct_run_is_clean_and_its_replay_matches_the_parameters_computed_by_hand(mode, records, calls):
    report = check([run_of(records, mode)], calls)
    assert report.clean, report.problems()
    (session,) = report.sessions
    assert session.replay_max_diff <= 1e-6 and session.acked == len(calls) and session.applied_unacked == 0
    assert report.lost == 0 and report.duplicated == 0


def test_the_replay_uses_the_registrys_kernel_as_optax_runs_it():
    import optax

    from bench.checker import replay

    adam = {"name": "adam", "args": {"learning_rate": 0.01}}
    reference = InProcess("adam", adam["args"], initial(), transformation=optax.adam(0.01))
    for r in SYNC:
        mean = {n: (g(A, r.version)[n] + g(B, r.version)[n]) / np.float32(2) for n in SHAPES}
        expected = reference.step(mean)
    assert max_abs_diff(replay(adam, initial(), SYNC, "sync"), expected) <= 1e-6


def test_an_acknowledged_push_missing_from_the_history_is_caught_as_lost():
    records = SYNC[:2] + [sync_record(3, [(A, 3)])]  # round 3 lists only a's push; b was told version 3
    report = check([run_of(records, "sync")], SYNC_CALLS)
    (session,) = report.sessions
    assert session.lost == ((B, 3),) and report.lost == 1
    assert session.replay_ok  # the parameters are what the history says: only the accounting is wrong
    assert not report.clean and any("lost" in p for p in report.problems())


def test_a_push_applied_in_two_versions_is_caught_as_duplicated():
    records = ASYNC[:3] + [async_record(4, (A, 2), 1), async_record(5, (B, 2), 3)]  # (A, 2) applied twice
    calls = ASYNC_CALLS[:3] + [push_call(B, 2, version=5)]
    report = check([run_of(records, "async")], calls)
    (session,) = report.sessions
    assert session.duplicated == ((A, 2),) and report.duplicated == 1 and session.replay_ok
    assert not report.clean


def test_a_version_applied_twice_skipped_or_past_the_sessions_version_is_caught():
    repeated = SYNC + [sync_record(3, [(A, 4), (B, 4)])]
    calls = SYNC_CALLS + [push_call(A, 4, "UNAVAILABLE"), push_call(B, 4, "UNAVAILABLE")]
    report = check([run_of(repeated, "sync", version=3)], calls)
    assert report.sessions[0].repeated_versions == (3,) and not report.clean

    ahead = check([run_of(SYNC, "sync", version=2)], SYNC_CALLS)  # a version recorded that the session lacks
    assert ahead.sessions[0].beyond_version == (3,) and not ahead.clean

    skipped = [SYNC[0], SYNC[2]]  # version 2 never listed
    report = check([run_of(skipped, "sync")], [c for c in SYNC_CALLS if c.sequence != 2])
    assert report.sessions[0].skipped_versions == (2,) and not report.clean


def test_a_wrong_parameter_is_caught_by_the_replay():
    final = sgd_by_hand(SYNC, "sync")
    final["w"][1, 0] += 1e-4
    report = check([run_of(SYNC, "sync", final=final)], SYNC_CALLS)
    (session,) = report.sessions
    assert not session.replay_ok and 9e-5 < session.replay_max_diff < 2e-4
    assert session.lost == () and session.duplicated == ()
    assert any("replay differs" in p for p in report.problems())


ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}  # the soak's sync session
SOAK_SHAPES = {"w": (16, 12), "b": (12,), "v": (40,)}  # bench.nemesis.SHAPES
SOAK_SHARDS = (("w",), ("b", "v"))  # how its two shards hold them


def soak_initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SOAK_SHAPES.items()}


def test_the_replay_reproduces_the_shards_arithmetic_bit_for_bit():
    """Three pushes a round (their sum's order matters), one of them scaled as a late gradient is,
    summed by each shard's apply queue and stepped by its updater: the replay over the same shard
    map gives the very same floats."""
    from optserve.optim_kernels import build_optimizer
    from optserve.server.compute.updater import Updater
    from optserve.server.domain.clock import Ticket
    from optserve.server.domain.config import DType, Mode, SessionConfig, TensorSpec
    from optserve.server.domain.shard.apply_queue import ApplyQueue

    init, clients = soak_initial(), ("a/0001", "b/0002", "c/0003")
    config = SessionConfig("soak", tuple(TensorSpec(n, DType.FLOAT32, s) for n, s in SOAK_SHAPES.items()), "adam",
                           ADAM["args"], Mode.SYNC, num_workers=3)
    shards = []
    for names in SOAK_SHARDS:
        updater = Updater(build_optimizer("adam", dict(ADAM["args"])),
                          param_specs={n: (SOAK_SHAPES[n], np.float32) for n in names})
        updater.initialize({n: init[n].copy() for n in names})
        shards.append((names, ApplyQueue(config, len(shards), 30.0), updater))
    records, ordinal = [], 0
    for version in range(1, 151):
        scales = (1.0, 0.5 if version % 3 == 0 else 1.0, 1.0)
        for i, client in enumerate(clients):
            ticket = Ticket(ordinal, client, version, 0, scales[i], i == len(clients) - 1, version)
            ordinal += 1
            grads = push_gradient(SOAK_SHAPES, client, version)
            for names, queue, updater in shards:
                queue.add({n: grads[n] for n in names}, ticket)
                closed = queue.hold_or_close(ticket)
                if closed is not None:
                    updater.apply(closed[0], 1.0, lambda partial: partial)
        records.append(sync_record(version, [(c, version) for c in clients], scales))
    served = {n: np.asarray(updater.host_params()[n]) for names, _, updater in shards for n in names}
    replayed = replay(ADAM, init, records, "sync", SOAK_SHARDS)
    for n in SOAK_SHAPES:
        assert np.array_equal(served[n], replayed[n]), (n, max_abs_diff(served, replayed))


def adam_run(records, final) -> SessionRun:
    return SessionRun("s", "sync", ADAM, soak_initial(), final, len(records), records, shards=SOAK_SHARDS)


LONG = [sync_record(v, [(A, v), (B, v)]) for v in range(1, 1001)]
LONG_CALLS = [push_call(c, v, version=v) for v in range(1, 1001) for c in (A, B)]


@pytest.fixture(scope="module")
def long_replay() -> dict[str, np.ndarray]:
    return replay(ADAM, soak_initial(), LONG, "sync", SOAK_SHARDS)


def test_a_long_history_served_a_few_float32_spacings_off_the_replay_passes(long_replay):
    """1,000 Adam versions, the served parameters ten float32 spacings off the replay each (the
    rounding of another XLA program; over the 1e-6 floor): within the allowance."""
    sign = np.random.default_rng(0)
    rounded = {n: v + (sign.choice([-10, 10], v.shape) * np.spacing(v)).astype(np.float32)
               for n, v in long_replay.items()}
    report = check([adam_run(LONG, rounded)], LONG_CALLS)
    (session,) = report.sessions
    assert DEFAULT_TOLERANCE < session.replay_max_diff <= session.tolerance < 2e-5 and report.clean


@pytest.mark.parametrize("served_round", [
    sync_record(500, [(A, 500), (B, 500)], (1.0, 2.0)),  # B's push applied with the wrong scale
    sync_record(500, [(A, 500)]),  # B's push dropped from the update
    sync_record(500, [(A, 500), (B, 500), (B, 500)]),  # B's push applied twice
], ids=["wrong_scale", "dropped", "applied_twice"])
def test_a_push_applied_wrongly_in_a_long_history_is_flagged_far_past_the_allowance(long_replay, served_round):
    """1,000 Adam versions whose history says version 500 applied A's and B's pushes, while the
    served parameters had B's applied with a wrong scale, dropped or applied twice."""
    served = replay(ADAM, soak_initial(), LONG[:499] + [served_round] + LONG[500:], "sync", SOAK_SHARDS)
    report = check([adam_run(LONG, served)], LONG_CALLS)
    (session,) = report.sessions
    assert not session.replay_ok and session.replay_max_diff > 100 * session.tolerance
    assert any("replay differs" in p for p in report.problems())
    assert max_abs_diff(served, long_replay) == session.replay_max_diff


def test_the_rounding_allowance_is_the_floor_for_short_runs_and_grows_with_magnitude_and_versions():
    assert replay_tolerance(1e-6, 3.0, 3) == 1e-6
    assert replay_tolerance(1e-6, 4.8, 12_120) == pytest.approx(float(np.spacing(np.float32(4.8))) * 12_120 ** 0.5)
    assert replay_tolerance(1e-6, 4.8, 12_120) > 1.19e-6  # the soak's sync session, a whole-tree replay
    assert replay_tolerance(1e-6, 1000.0, 1) == pytest.approx(float(np.spacing(np.float32(1000.0))))
    assert replay_tolerance(1e-6, float("inf"), 10) == 1e-6


def test_a_shard_map_that_does_not_name_every_tensor_once_is_a_replay_error():
    records = [sync_record(1, [(A, 1), (B, 1)])]
    final = replay(ADAM, soak_initial(), records, "sync", SOAK_SHARDS)
    run = adam_run(records, final)
    assert check([run], SYNC_CALLS[:2]).clean
    for shards in ((("w",), ("b",)), (("w", "b"), ("b", "v"))):
        (session,) = check([dataclasses.replace(run, shards=shards)], SYNC_CALLS[:2]).sessions
        assert not session.replay_ok and "shard map" in session.replay_error


def test_a_push_applied_after_a_definitive_refusal_or_sent_by_no_client_is_caught():
    calls = SYNC_CALLS[:5] + [push_call(B, 3, "INVALID_ARGUMENT")]  # b was told its push was refused
    report = check([run_of(SYNC, "sync")], calls)
    assert report.sessions[0].refused_but_applied == (((B, 3), "INVALID_ARGUMENT"),)
    ambiguous = SYNC_CALLS[:5] + [push_call(B, 3, "UNAVAILABLE")]  # may have been applied: fine
    assert check([run_of(SYNC, "sync")], ambiguous).clean
    rogue = SYNC[:2] + [sync_record(3, [(A, 3), ("rogue/x", 1)])]  # a push no client of the run logged
    report = check([run_of(rogue, "sync")], SYNC_CALLS[:5])
    assert report.sessions[0].foreign == (("rogue/x", 1),) and not report.clean


def test_internal_unknown_and_exceptions_are_undocumented_and_an_unanswered_call_is_a_hang_unless_killed():
    calls = SYNC_CALLS + [push_call(A, 4, "INTERNAL"), push_call(B, 4, "exception:KeyError"),
                          push_call(A, 5, "DEADLINE_EXCEEDED", started=100.0, ended=200.0),  # 100 s > 30 + 5
                          dataclasses.replace(push_call(B, 5), ended=None, outcome="")]
    report = check([run_of(SYNC, "sync")], calls)
    assert len(report.undocumented) == 2 and len(report.hangs) == 2 and not report.clean
    killed = [FaultRecord("worker_kill", "s/b", 100.0, victims=("b",))]  # b's unanswered call: its process died
    report = check([run_of(SYNC, "sync")], calls, killed)
    assert len(report.hangs) == 1
    stopped = killed + [FaultRecord("worker_stop", "a", 120.0, 190.0, stopped=("a",))]  # a was stopped 70 of its 100 s
    assert check([run_of(SYNC, "sync")], calls, stopped).hangs == ()


def test_rogue_garbage_must_be_refused_with_the_status_the_docs_promise():
    def rogue(outcome):
        return CallRecord("s", "rogue", "", 0, 0, "rogue:nan", 100.0, 100.1, outcome, None, 30.0,
                          ("INVALID_ARGUMENT",))

    assert check([run_of(SYNC, "sync")], SYNC_CALLS + [rogue("INVALID_ARGUMENT")]).clean
    for outcome in ("ok", "UNAVAILABLE"):
        report = check([run_of(SYNC, "sync")], SYNC_CALLS + [rogue(outcome)])
        assert len(report.rogue_unexpected) == 1, outcome


def test_unavailability_is_the_time_from_a_fault_to_each_sessions_next_acknowledged_step():
    calls = [push_call(A, 1, version=1, ended=10.0), push_call(A, 2, version=2, ended=14.0),
             push_call(A, 3, version=3, ended=30.0), push_call(A, 1, version=1, ended=12.0, session="t")]
    faults = [FaultRecord("shard_kill", "shard 0", 11.0), FaultRecord("shard_kill", "shard 1", 20.0),
              FaultRecord("disk_full", "ckpt", 29.0)]
    worst = unavailability(faults, calls, ["s", "t"], run_ended=40.0)
    assert worst["shard_kill"].session == "t" and not worst["shard_kill"].recovered  # t never stepped again
    assert worst["shard_kill"].seconds == pytest.approx(20.0)  # from the second kill (20) to the end (40)
    assert worst["disk_full"].seconds == pytest.approx(11.0) and not worst["disk_full"].recovered
    worst = unavailability(faults, calls[:3], ["s"], run_ended=40.0)
    assert worst["shard_kill"].recovered and worst["shard_kill"].seconds == pytest.approx(10.0)  # 20 -> 30
    # the kill at 20 was followed by the disk fault at 29 before its next step: its own outage is the
    # kill at 11's (11 -> 14)
    assert worst["shard_kill"].alone_s == pytest.approx(3.0)
    assert worst["disk_full"].alone_s == pytest.approx(1.0)


def test_the_history_follower_keeps_versions_answered_twice_and_follows_a_rollback():
    follower = HistoryFollower()
    follower.add(SYNC[:2])
    follower.add(SYNC[1:])  # an answer overlapping what is held: the same records, nothing new
    assert [r.version for r in follower.records] == [1, 2, 3] and follower.rollbacks == []
    redone = sync_record(2, [(A, 9), (B, 9)])
    follower.add([redone])  # version 2 decided afresh after a restore: 2 and 3 held are dropped for it
    assert follower.records == [SYNC[0], redone] and len(follower.rollbacks) == 1
    follower.settle([SYNC[0], redone])
    assert follower.records == [SYNC[0], redone] and len(follower.rollbacks) == 1
    follower.add([SYNC[2]])
    follower.settle([SYNC[0]])  # the server now ends at version 1: 2 and 3 were rolled back, not redone
    assert follower.records == [SYNC[0]] and len(follower.rollbacks) == 2 and follower.conflicts == []
    twice = HistoryFollower()
    twice.add([SYNC[0], SYNC[0]])  # one answer listing a version twice is kept as answered
    assert [r.version for r in twice.records] == [1, 1]


def test_a_follower_asking_as_it_goes_sees_its_last_version_decided_afresh():
    """The follower read version 3; a restore rolled 3 back and it was decided again (then 4):
    asking with ``since`` it sees 3's new record, not only 4."""
    follower = HistoryFollower()
    follower.add(SYNC)
    redone = sync_record(3, [(A, 9), (B, 9)])
    server = [SYNC[0], SYNC[1], redone, sync_record(4, [(A, 10), (B, 10)])]
    follower.add([r for r in server if r.version > follower.since])
    assert follower.records == server and len(follower.rollbacks) == 1


def test_a_rolled_back_version_that_held_acknowledged_pushes_shows_them_lost():
    follower = HistoryFollower()
    follower.add(SYNC)
    follower.settle(SYNC[:2])  # version 3, acknowledged to A and B, is gone from the server's history
    run = run_of(follower.records, "sync")
    result = check([run], SYNC_CALLS, [])
    assert sorted(result.sessions[0].lost) == sorted([(A, 3), (B, 3)]) and not result.clean
    unacked = [c if c.sequence != 3 else dataclasses.replace(c, outcome="UNAVAILABLE", version=None)
               for c in SYNC_CALLS]  # never acknowledged: rolling it back loses nothing
    assert check([run], unacked, []).clean


def test_the_printed_report_names_faults_steps_lost_duplicated_unavailability_and_the_verdict():
    faults = [FaultRecord("shard_kill", "shard 0", 99.0)]
    out = io.StringIO()
    print_report(check([run_of(SYNC, "sync")], SYNC_CALLS, faults, {"write_error": "not root"}), out)
    text = out.getvalue()
    for words in ("faults injected: shard_kill 1", "not injected: write_error: not root",
                  "steps acknowledged: 6, lost: 0, duplicated: 0", "longest unavailability", "verdict: clean"):
        assert words in text, text
