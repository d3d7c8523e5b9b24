"""The server's process reports no task events to Ray's GCS: without that, every thread that
ever calls Ray leaves an entry there (the gRPC pools start new threads after idle ones leave, the
metrics endpoint one per scrape), and a server that runs for weeks grows the GCS by each. Real Ray,
started in a fresh process by :func:`join_or_start_ray` as ``optserve serve`` starts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

THREADS = 40

_SCRIPT = textwrap.dedent(f"""
    import json, threading, time
    import grpc, ray
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    from optserve.server.ray_lifecycle import join_or_start_ray, stop_started_ray

    join_or_start_ray("local")
    try:
        class Echo:
            def ping(self):
                return 1
        echo = ray.remote(Echo).options(num_cpus=0).remote()
        ray.get(echo.ping.remote())
        for _ in range({THREADS}):  # one short-lived thread per call, as a pool's new thread makes
            thread = threading.Thread(target=lambda: ray.get(echo.ping.remote()))
            thread.start()
            thread.join()
        time.sleep(2.5)  # a process reports its task events every second
        gcs = ray._private.worker._global_node.gcs_address
        stub = gcs_service_pb2_grpc.TaskInfoGcsServiceStub(grpc.insecure_channel(gcs))
        reply = stub.GetTaskEvents(gcs_service_pb2.GetTaskEventsRequest(limit=100000), timeout=30)
        print(json.dumps({{"stored": reply.num_total_stored}}))
    finally:
        stop_started_ray()
""")


def test_threads_calling_ray_from_the_servers_process_leave_no_entries_in_the_gcs():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_task_events")}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    stored = json.loads(done.stdout.strip().splitlines()[-1])["stored"]
    # with task events on: one entry per thread (THREADS and more)
    assert stored < THREADS // 4, f"{stored} task entries in the GCS after {THREADS} threads called Ray"
