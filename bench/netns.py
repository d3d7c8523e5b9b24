"""Separate hosts on one Linux machine: network namespaces on a bridge (the test bed of
:mod:`bench.netbed`).

Each host is a network namespace of its own (its own address in a private /24 the bed picks, its
own loopback) plugged into one bridge, which lives in a namespace of its own too: nothing is added
to the machine's own network. Namespaces share ``/dev/shm``, so each host is also a mount namespace
with a private tmpfs on ``/dev/shm``: a client's same-host shared-memory proof succeeds only where
client and shard really share a host. A host is one long-lived holder process (``sleep`` in the
host's namespaces); every process of the host is started with ``nsenter`` into the holder's
namespaces, in its own process group, its output in ``DIR/NAME.log``.

:class:`NetBed` makes the hosts (root and iproute2 needed: :func:`unavailable_reason` says why not),
:meth:`NetBed.lose_host` (link down, then SIGKILL of every process of the host: a machine whose
power failed), :meth:`NetBed.partition` / :meth:`NetBed.heal` (the host's link down / up: packets
vanish, nothing is reset).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

from bench.process_session import kill_until_gone, titled
from bench.ray_cluster import ray_env

PREFIX = "osnb"  # every namespace of a bed is "osnb-TAG-HOST"; its folder /tmp/osnb-TAG
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # processes of a host work from here


def unavailable_reason() -> Optional[str]:
    """Why hosts cannot be made here (one line), or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2 / util-linux)"
    return None


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _netns_inode(ns: str) -> Optional[int]:
    try:
        return os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return None


def pids_in_netns(ns: str) -> list[int]:
    """Pids of the processes whose network namespace is ``ns``."""
    inode, pids = _netns_inode(ns), []
    if inode is None:
        return pids
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def kill_netns(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL to every process of ``ns`` until none is left (or ``timeout_s``)."""
    kill_until_gone(lambda: pids_in_netns(ns), timeout_s)


def sweep() -> list[str]:
    """Deletes the namespaces (and their processes, links and folder) of beds whose owner process
    is gone; returns the namespaces deleted."""
    swept = []
    for line in _ip("netns", "list").splitlines():
        ns = line.split()[0] if line.strip() else ""
        if not ns.startswith(PREFIX + "-"):
            continue
        folder = os.path.join("/tmp", "-".join(ns.split("-")[:2]))
        try:
            with open(os.path.join(folder, "owner")) as f:
                os.kill(int(f.read()), 0)
            continue  # its owner runs
        except (OSError, ValueError):
            pass
        kill_netns(ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
        swept.append(ns)
    return swept


class Proc:
    """A process of a host, in its own process group; its output in ``log_path``."""

    def __init__(self, name: str, argv: list[str], log_path: str, env: dict):
        self.name, self.log_path = name, log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, start_new_session=True, text=True)

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_for(self, text: str, timeout_s: float = 180.0) -> str:
        """The first output line containing ``text``; RuntimeError if the process ends or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = next((line for line in self.output().splitlines() if text in line), None)
            if line is not None:
                return line
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not print {text!r} (exit {self.process.poll()}):\n{self.output()[-3000:]}")


@dataclasses.dataclass
class Host:
    """One host: its namespace, address and holder process (whose namespaces its processes enter)."""

    name: str
    ns: str
    address: str
    port: str  # its link's end on the bridge
    holder: subprocess.Popen
    folder: str

    def shard_pids(self) -> list[int]:
        """The shard actor processes running on this host."""
        return titled(pids_in_netns(self.ns), b"ray::ShardActor")

    def spawn(self, name: str, argv: list[str], env: Optional[dict] = None) -> Proc:
        """``argv`` run on this host (its network, its /dev/shm), output in FOLDER/NAME.log."""
        # entering a mount namespace moves to its root: work from the checkout, as the caller does
        enter = ["nsenter", f"--target={self.holder.pid}", "--mount", "--net", f"--wd={REPO}", "--"]
        return Proc(name, enter + list(argv), os.path.join(self.folder, f"{name}.log"),
                    dict(env if env is not None else ray_env(), OSNB_HOST=self.name))


class NetBed:
    """Hosts ``names`` on one bridge (a context manager: closing removes everything it made).

    Attributes:
      hosts: name -> :class:`Host`; addresses ``10.213.N.1``, ``.2``, ... in host order.
      folder: the bed's folder (logs, Ray temp dirs, the checkpoint folder every host sees).
    """

    def __init__(self, names=("h1", "h2", "h3", "h4")):
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        sweep()
        self.folder = tempfile.mkdtemp(prefix=PREFIX + "-", dir="/tmp")  # short: Ray's socket paths live under it
        with open(os.path.join(self.folder, "owner"), "w") as f:
            f.write(str(os.getpid()))
        self.tag = os.path.basename(self.folder).split("-", 1)[1]
        self.switch = f"{PREFIX}-{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        try:
            self._make(names)
        except BaseException:
            self.close()
            raise

    def _make(self, names) -> None:
        subnet = _free_subnet()
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(names, start=1):
            ns = f"{PREFIX}-{self.tag}-{name}"
            self._add_namespace(ns)
            port = f"p{name}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            address = f"{subnet}.{i}"
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            folder = os.path.join(self.folder, name)
            os.mkdir(folder)
            script = "mount -t tmpfs -o size=2g osnb-shm /dev/shm && echo ready && exec sleep 2147483647"
            holder = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private",
                                       "sh", "-c", script], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                      start_new_session=True, text=True)
            if holder.stdout.readline().strip() != "ready":
                raise RuntimeError(f"host {name}: could not mount a private /dev/shm")
            self.hosts[name] = Host(name, ns, address, port, holder, folder)

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)

    def partition(self, name: str) -> None:
        """Cuts host ``name`` off: its link on the bridge goes down (packets vanish both ways)."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        """Plugs host ``name`` back in."""
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

    def lose_host(self, name: str) -> None:
        """Host ``name`` fails as a machine does: its link goes down first (its peers get no reset,
        no FIN), then every process of it is SIGKILLed."""
        self.partition(name)
        kill_netns(self.hosts[name].ns)

    def close(self) -> None:
        """Kills every process of every host, deletes the namespaces (links and bridge with them)
        and the folder."""
        for ns in reversed(self._namespaces):
            kill_netns(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for host in self.hosts.values():
            host.holder.wait(timeout=10)
            host.holder.stdout.close()
        self._namespaces.clear()
        if os.environ.get("OSNB_KEEP"):  # a closer look at the logs: the folder stays (and says so)
            print(f"netbed: kept {self.folder}", file=sys.stderr)
            os.remove(os.path.join(self.folder, "owner"))
        else:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "NetBed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _free_subnet() -> str:
    """``10.213.N`` for the first N whose /24 no route of this machine covers (the bed's hosts are
    reachable only from each other: two beds never meet, whatever their subnets)."""
    routed = _ip("route", "show", "table", "all")
    for n in range(1, 255):
        if f"10.213.{n}." not in routed and "10.213.0.0/16" not in routed and "10.0.0.0/8" not in routed:
            return f"10.213.{n}"
    raise RuntimeError("no free 10.213.N.0/24 on this machine")


# ----------------------------------------------------------------------------- the deployment
