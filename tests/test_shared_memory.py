"""The same-host fast path (client/_shm.py, server/wire/shared_memory.py, protos/shared_memory.py):
tensor bytes through per-client POSIX shared memory proven by a nonce, gRPC for every step.

Real server on loopback (the session-scoped `server` fixture: 2 shards), real client processes
for the faults; a client in another mount namespace (`unshare -m` with its own /dev/shm) for the
"cannot open the region" case.
"""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest

from _service_helpers import InProcess, make_grads, make_params
from test_overlap_and_compression import _bytes_for_steps, byte_counter  # noqa: F401 - a fixture
from optserve.client import Client
from optserve.client.errors import FailedPreconditionError
from optserve.protos.optserve.v1 import data_pb2


ADAFACTOR = {"name": "adafactor_hf", "args": {"lr": 1e-2, "relative_step": False, "scale_parameter": False}}
SHAMPOO = {"name": "shampoo", "args": {"learning_rate": 0.01, "block_size": 8, "preconditioning_compute_steps": 5}}
SGD = {"name": "sgd", "args": {"learning_rate": 0.1}}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _our_names(server) -> list[str]:
    """The region names in /dev/shm that ``server``'s shards or this process created (a name
    carries its creator's pid; another server on the machine makes names of its own)."""
    creators = {str(pid) for pid in server.fleet.pids()} | {str(os.getpid())}
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("optserve-") and n.split("-")[1] in creators)


def _mapped_regions(pid: int) -> int:
    """How many optserve regions process ``pid`` maps (its data regions, names unlinked or not)."""
    with open(f"/proc/{pid}/maps") as maps:
        return len({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                    for line in maps if "/dev/shm/optserve-" in line})


def _shard_regions(server) -> int:
    return sum(_mapped_regions(pid) for pid in server.fleet.pids())


def _wait_for(predicate, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.fixture(scope="module")
def fast(server):
    client = Client(server.address, timeout=60)  # shared_memory="auto", the default
    yield client
    client.close()


@pytest.fixture(scope="module")
def plain(server):
    client = Client(server.address, timeout=60, shared_memory=False)
    yield client
    client.close()


# Shared memory == gRPC path bit for bit; == the in-process kernel bit for bit for Adafactor, and
# within 1e-5 for Shampoo (its roots run in the shard's own compilation, as on the gRPC path:
# tests/test_service_preconditioners.py).
# the paths agree bit for bit; the in-process kernel runs the whole tree in one compiled step, and
# with hyperparameters as values of the step a shard's part can round its last bit differently
@pytest.mark.parametrize("optimizer, tolerance", [(ADAFACTOR, 1e-6), (SHAMPOO, 1e-5)], ids=["adafactor_hf", "shampoo"])
def test_shared_memory_path_equals_grpc_path_and_in_process_kernel(fast, plain, unique_name, optimizer, tolerance):
    params = make_params()
    via_shm = fast.create_session(unique_name + "-shm", params, optimizer=optimizer)
    via_grpc = plain.create_session(unique_name + "-grpc", params, optimizer=optimizer)
    reference = InProcess(optimizer["name"], optimizer["args"], params)
    try:
        assert via_shm.data_paths() == {0: "shared_memory", 1: "shared_memory"}
        assert via_grpc.data_paths() == {0: "grpc", 1: "grpc"}
        for step in range(20):
            grads = make_grads(params, step)
            expected = reference.step(grads)
            got_shm, got_grpc = via_shm.push_pull(grads), via_grpc.push_pull(grads)
            for name in params:
                assert np.array_equal(got_shm[name], got_grpc[name]), (step, name)
                assert np.max(np.abs(got_shm[name] - expected[name]), initial=0.0) <= tolerance, (step, name)
        assert [s.data_path for s in via_shm.status().shards] == ["shared_memory", "shared_memory"]
        assert [s.data_path for s in via_grpc.status().shards] == ["grpc", "grpc"]
    finally:
        via_shm.close()
        via_grpc.close()


def test_gradient_buffers_live_in_the_region_and_views_are_read_only(fast, plain, unique_name):
    params = make_params()
    session = fast.create_session(unique_name, params, optimizer=SGD, mode="async")
    twin = plain.create_session(unique_name + "-grpc", params, optimizer=SGD, mode="async")
    try:
        buffers = session.gradient_buffers()
        for array in buffers.values():
            root = array
            while getattr(root, "base", None) is not None:
                root = root.base
            root = getattr(root, "obj", root)  # NumPy keeps a memoryview of the mapping
            assert type(root).__name__ == "mmap"  # in the shared region, not a private array
        for step in range(3):
            grads = make_grads(params, step)
            for name, buffer in buffers.items():
                buffer[...] = grads[name]
            got = session.push_pull(buffers, views=True)
            expected = twin.push_pull(grads)
            for name in params:
                assert np.array_equal(got[name], expected[name])
                assert not got[name].flags.writeable
        assert session.push(make_grads(params, 9)) == 4 and twin.push(make_grads(params, 9)) == 4
        pulled = session.pull()
        assert all(np.array_equal(pulled[n], twin.pull()[n]) for n in params)
    finally:
        session.close()
        twin.close()


def test_overlapped_steps_write_the_next_gradient_into_the_other_buffer_of_a_double_buffered_pair(
        fast, plain, unique_name):
    """Overlap mode with gradient_buffers(): a step in flight reads its gradients where they lie,
    so the next gradient goes into a second region's buffers (the two alternate); every step
    applies the gradient it was sent with, exactly as the gRPC path does."""
    from optserve.client.overlap import DelayedStepper

    params = make_params()
    session = fast.create_session(unique_name, params, optimizer=SGD)
    twin = plain.create_session(unique_name + "-grpc", params, optimizer=SGD)
    stepper, twin_stepper = DelayedStepper(session), DelayedStepper(twin)
    try:
        used = []
        buffers = session.gradient_buffers()
        for step in range(6):
            used.append(buffers["dense/w"].__array_interface__["data"][0])
            grads = make_grads(params, step)
            for name, buffer in buffers.items():
                buffer[...] = grads[name]
            got = stepper.step(buffers)
            # at once, while the step just sent is surely in flight (waiting for the twin's first
            # would let it finish, and a call with no step in flight returns the first set again)
            buffers = session.gradient_buffers()
            expected = twin_stepper.step(grads)
            if step:
                assert all(np.array_equal(got[n], expected[n]) for n in params), step
        got, expected = stepper.wait(), twin_stepper.wait()
        assert all(np.array_equal(got[n], expected[n]) for n in params)
        assert len(set(used)) == 2 and used[0::2] == [used[0]] * 3 and used[1::2] == [used[1]] * 3  # alternating
        assert session.gradient_buffers()["dense/w"].__array_interface__["data"][0] == used[0]  # no step in flight
    finally:
        session.close()
        twin.close()


def test_shared_memory_steps_send_only_step_messages_over_grpc(server, unique_name, byte_counter):
    sent, received = _bytes_for_steps(byte_counter, server.address, unique_name, 3, shared_memory=True)
    payload = 3 * (256 * 256 + 4096) * 4  # float32 gradient bytes of three pushes (and as many back)
    assert sent < 0.01 * payload and received < 0.01 * payload, (sent, received, payload)


def test_several_clients_on_one_sync_session_through_shared_memory(fast, server, unique_name):
    params = make_params()
    creator = fast.create_session(unique_name, params, optimizer=SGD, num_workers=2)
    other_client = Client(server.address, timeout=60)
    other = other_client.session(unique_name)
    try:
        import concurrent.futures

        a, b = make_grads(params, 0), make_grads(params, 1)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first, second = pool.submit(creator.push_pull, a), pool.submit(other.push_pull, b)
            got, got_other = first.result(timeout=60), second.result(timeout=60)
        expected = {k: params[k] - np.float32(0.1) * ((a[k] + b[k]) / np.float32(2)) for k in params}
        for name in params:
            np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6)
            assert np.array_equal(got[name], got_other[name])
        assert set(creator.data_paths().values()) == set(other.data_paths().values()) == {"shared_memory"}
    finally:
        creator.close()
        other_client.close()


def test_a_retried_shared_memory_step_applies_once(fast, unique_name):
    params = make_params()
    session = fast.create_session(unique_name, params, optimizer=SGD)
    try:
        grads = make_grads(params, 0)
        header = session._header()  # what a retry after UNAVAILABLE resends: same client_id + sequence
        first = session._push_pull_once(header, grads, None)
        again = session._push_pull_once(header, grads, None)
        expected = {k: params[k] - np.float32(0.1) * grads[k] for k in params}
        for name in params:
            np.testing.assert_allclose(first[name], expected[name], rtol=0, atol=1e-6)
            assert np.array_equal(again[name], first[name])
        status = session.status()
        assert (status.version, status.pushes_accepted) == (1, 1)
        assert status.shards[0].data_path == "shared_memory"
    finally:
        session.close()


def test_a_wrong_nonce_never_uses_the_region(fast, unique_name):
    params = make_params()
    session = fast.create_session(unique_name, params, optimizer=SGD)
    try:
        session.push_pull(make_grads(params, 0))
        region = session._shm.acquire(session._shards)[0]
        session._shm.release({0: region})
        shard = session._shards[0]
        channel = fast.channel(shard.address)
        # 1. the handshake: a nonce that was not read from the probe region is refused
        offer = channel.unary_unary("/optserve.v1.ShardData/OfferSharedMemory",
                                    request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=data_pb2.OfferSharedMemoryResponse.FromString)(
            data_pb2.OfferSharedMemoryRequest(session=unique_name, client_id="intruder"), timeout=10)
        open_region = channel.unary_unary("/optserve.v1.ShardData/OpenSharedMemory",
                                          request_serializer=lambda m: m.SerializeToString(),
                                          response_deserializer=data_pb2.OpenSharedMemoryResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            open_region(data_pb2.OpenSharedMemoryRequest(session=unique_name, client_id="intruder", offer=offer.offer,
                                                         nonce=b"\0" * 32), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # 2. a step naming a real region with a wrong nonce: refused before anything is read
        poison = {name: np.full(shape, 1e3, np.float32) for name, shape in
                  ((n, session.specs[n][1]) for n in shard.names)}
        region.write(poison)
        step = region.step(True)
        step.nonce = bytes(32)
        header = session._header()
        request = data_pb2.PushPullRequest(step=data_pb2.PushPullStep(header=header, shared_memory=step))
        with pytest.raises(grpc.RpcError) as wrong:
            list(session._shards[0].calls.push_pull(iter([request]), timeout=10))
        assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED
        status = session.status()
        assert status.version == 1 and status.pushes_accepted == 1
        before = session.pull()
        assert all(np.abs(before[n]).max() < 100 for n in params)
    finally:
        session.close()


_CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from optserve.client import Client
    address, name, mode, action = sys.argv[1:5]
    client = Client(address, timeout=30, shared_memory={"auto": "auto", "true": True}[mode])
    try:
        session = client.session(name)
        buffers = session.gradient_buffers()
        print("paths", sorted(set(session.data_paths().values())), flush=True)
        if action == "kill-mid-push":
            for buffer in buffers.values():   # half of the gradients written, then killed: no step message
                buffer.reshape(-1)[: buffer.size // 2] = 1e6
            os.kill(os.getpid(), signal.SIGKILL)
        params = session.push_pull({n: np.zeros(s, np.float32) for n, (_, s) in session.specs.items()})
        print("version", session.version, flush=True)
    except Exception as exc:
        print("error", type(exc).__name__, exc, flush=True)
""")


def _child(server, name: str, action: str, mode: str = "auto", isolate: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", _CHILD, server.address, name, mode, action]
    if isolate:  # another mount namespace with a /dev/shm of its own: the shard's regions are out of reach
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"] + command
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)


def _can_isolate() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_isolate(), reason="needs unshare -m (root) for another mount namespace")
def test_a_client_that_cannot_open_the_region_falls_back_to_grpc_without_error(fast, server, unique_name):
    params = make_params()
    session = fast.create_session(unique_name, params, optimizer=SGD, mode="async")
    try:
        auto = _child(server, unique_name, "step", isolate=True)
        assert "paths ['grpc']" in auto.stdout and "version 1" in auto.stdout, auto.stdout + auto.stderr
        required = _child(server, unique_name, "step", mode="true", isolate=True)
        assert f"error {FailedPreconditionError.__name__}" in required.stdout, required.stdout + required.stderr
        assert "probe" in required.stdout
        assert session.status().version == 1
    finally:
        session.close()


def test_a_client_killed_mid_push_applies_nothing_and_leaves_no_region(fast, server, unique_name):
    params = make_params()
    empty = _shard_regions(server)
    session = fast.create_session(unique_name, params, optimizer=SGD, mode="async")
    try:
        session.push_pull(make_grads(params, 0))
        before = session.pull()
        baseline = _shard_regions(server)
        killed = _child(server, unique_name, "kill-mid-push")
        assert killed.returncode == -signal.SIGKILL and "paths ['shared_memory']" in killed.stdout, killed.stdout
        # the dead client's regions are reaped by the shards (it no longer holds its lock on them)
        assert _wait_for(lambda: _shard_regions(server) <= baseline), (_shard_regions(server), baseline)
        assert session.status().version == 1
        assert all(np.array_equal(session.pull()[n], before[n]) for n in params)
        grads = make_grads(params, 1)  # the session serves the next client
        after = session.push_pull(grads)
        for name in params:
            np.testing.assert_allclose(after[name], before[name] - np.float32(0.1) * grads[name], rtol=0, atol=1e-6)
    finally:
        session.close()
    assert _wait_for(lambda: _shard_regions(server) <= empty), (_shard_regions(server), empty)
    # names live only for a handshake (an offer nobody answered, e.g. the isolated client's, at
    # most OFFER_TTL_S): none stays behind
    assert _wait_for(lambda: _our_names(server) == [], timeout_s=20), _our_names(server)


def test_a_session_is_created_through_shared_memory_exactly_in_every_dtype(server, unique_name, byte_counter):
    """The initial values go through the region's push part: gRPC carries only the messages
    (a 256 KiB model sent less than 3% of its bytes), and every dtype arrives exactly."""
    import ml_dtypes

    rng = np.random.default_rng(5)
    params = {"w": rng.standard_normal((256, 256), np.float32), "h": rng.standard_normal((64,)).astype(np.float16),
              "b": rng.standard_normal((128,)).astype(ml_dtypes.bfloat16)}
    client = Client(server.address, timeout=60)  # after byte_counter: its channels are counted
    try:
        sent = counter_sent = byte_counter.sent
        session = client.create_session(unique_name, params, optimizer=SGD)
        sent = byte_counter.sent - counter_sent
        assert sent < 0.03 * sum(v.nbytes for v in params.values()), sent
        assert set(session.data_paths().values()) == {"shared_memory"}
        pulled = session.pull()
        for name, value in params.items():
            np.testing.assert_array_equal(pulled[name].astype(np.float32), value.astype(np.float32), err_msg=name)
        session.close()
    finally:
        client.close()


def test_a_region_closed_while_its_step_uses_it_refuses_as_an_unknown_region_not_a_fault():
    # a client killed mid-step: its region is closed while the step's thread writes the parameters
    # (logged as a refusal nobody hears, in one line; it was a traceback of "mmap closed or invalid")
    from optserve.protos import contract, shared_memory as shm
    from optserve.server.domain.errors import NotFound
    from optserve.server.wire.shared_memory import Region

    layout = shm.layout([("w", contract.FLOAT32, (4, 4))])
    name, mapping, fd = shm.create(layout.size, keep_fd=True)
    region = Region(None, "client", b"nonce", name, mapping, fd, layout)
    params = {"w": np.ones((4, 4), np.float32)}
    assert region.write_params(params) == 64
    region.close()
    with pytest.raises(NotFound, match=shm.REGION_UNKNOWN):
        region.write_params(params)
    for read in (region.gradient_chunks, region.parameter_chunks):  # a push or an init read after it closed
        with pytest.raises(NotFound, match=shm.REGION_UNKNOWN):
            list(read())


def test_a_cpu_shard_reads_and_writes_its_regions_in_place_without_a_host_link():
    import jax

    from optserve.protos.shared_memory import page_span
    from optserve.server.compute.host_link import host_link

    assert host_link(jax.devices("cpu")[0]) is None  # no mapping for DMA: the CPU reads the region where it lies
    page = mmap.PAGESIZE
    assert [page_span(n) for n in (1, page, page + 1)] == [page, page, 2 * page]
