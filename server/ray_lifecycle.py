"""The Ray instance a server joins or starts, and how a started one is stopped.

A server started without ``--ray-address`` starts Ray itself (its GCS, raylet, the raylet's
agents, and the worker processes that host the shard and preconditioner actors) as its children.
A stop that signals every process of the server's process group or service (a shell's kill of the
job, systemd's default ``KillMode=control-group``) must reach only the server, which then drains
and stops its shards before Ray: those children therefore inherit SIGTERM blocked, as Ray's own
launcher blocks SIGINT for them, and the server kills them itself when it has no more use for them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal

from optserve.server.preflight import probe_ray_address

log = logging.getLogger(__name__)

REAP_TIMEOUT_S = 5.0
TASK_EVENTS_SETTING = "RAY_task_events_report_interval_ms"  # 0: no task events reported to the GCS


def join_or_start_ray(address: str, log_to_driver: bool = False) -> bool:
    """Connects to (or starts) Ray; returns True if this call started a local instance (stopped
    with :func:`stop_started_ray`). ``log_to_driver``: the actors' stderr (their log lines) is
    printed on this process's stderr.

    Raises:
      StartError: the cluster to join does not answer (:func:`probe_ray_address`).
    """
    import ray

    if ray.is_initialized():
        return False
    probe_ray_address(address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's GCS keeps an entry (about 1.5 kB) for every thread that ever called Ray from this
    # process, up to its cap of 100,000 tasks: the gRPC pools give idle threads back and start new
    # ones under the next burst, the metrics endpoint starts a thread per scrape, so a server that
    # runs for weeks would grow the GCS by that much. Turned off before Ray reads its configuration
    # (a Ray started here passes it on to its processes); an operator's own setting is kept.
    os.environ.setdefault(TASK_EVENTS_SETTING, "0")
    if log_to_driver:
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every log line as it is, not folded across shards
    if address == "local":
        with sigterm_held_back_from_children():
            ray.init(include_dashboard=False, log_to_driver=log_to_driver, configure_logging=False)
        return True
    # one namespace for optserve's drivers on a cluster: a restarted durable coordinator finds the
    # detached placement group (named in the driver's namespace) that its predecessor left
    from optserve.server.shard_fleet import DETACHED_NAMESPACE

    ray.init(address=address, namespace=DETACHED_NAMESPACE, include_dashboard=False, log_to_driver=log_to_driver,
             configure_logging=False)
    return False


@contextlib.contextmanager
def sigterm_held_back_from_children():
    """Processes started inside inherit SIGTERM blocked (the embedded Ray's processes and, through
    the raylet, every worker it starts later). The calling thread's mask is restored on exit: a
    SIGTERM sent to this process meanwhile is delivered then. No-op where signals cannot be masked.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_started_ray() -> None:
    """``ray.shutdown()`` for the Ray instance this process started, its processes killed at once.

    They hold SIGTERM blocked, so Ray's graceful stop (SIGTERM, a second's wait, SIGKILL, process
    after process) would only wait, and the raylet's agents, left without their raylet, would wait
    for a GCS that is gone. By now the shards and workers have stopped and the GCS keeps nothing on
    disk: the driver disconnects first, then every process of Ray's tree is killed and reaped.
    Falls back to Ray's own stop where its node handle is not where Ray 2.x keeps it.
    """
    import ray

    ray_worker = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(ray_worker, "_global_node", None)
    if node is None or not hasattr(node, "all_processes") or not hasattr(node, "kill_all_processes"):
        ray.shutdown()
        return
    tree = _process_tree([info.process.pid for infos in node.all_processes.values() for info in infos])
    ray_worker._global_node = None  # ray.shutdown() disconnects the driver and leaves the processes to us
    try:
        ray.shutdown()
    finally:
        if node.is_head():
            node.destroy_external_storage()
        _kill(tree)
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)  # reaps its own children


def _process_tree(pids: list[int]) -> list:
    """The processes ``pids`` and all their descendants (psutil handles; those gone are left out)."""
    import psutil

    tree = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return tree


def _kill(processes: list) -> None:
    """SIGKILL to each process, then waits up to :data:`REAP_TIMEOUT_S` for them to be gone."""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    _, alive = psutil.wait_procs(processes, timeout=REAP_TIMEOUT_S)
    for process in alive:
        log.warning("a Ray process did not exit %.0f s after SIGKILL: pid %d", REAP_TIMEOUT_S, process.pid)
