"""The same-host fast path's shared contract: region names, the data region's layout, and the
POSIX shared-memory calls both sides make.

A client and a shard on one host move tensor bytes through a per-client *data region* instead
of gRPC chunks; gRPC still carries every step's message (identity, version, status), so
idempotency, atomicity, authentication and errors are those of the gRPC path. The handshake
(data.proto ``OfferSharedMemory`` / ``OpenSharedMemory``) proves, instead of assuming, that the
client sees the shard's shared memory: the shard writes a random nonce of :data:`NONCE_BYTES`
into a *probe region* and the client must send it back.

Regions are files under ``/dev/shm`` created ``O_CREAT | O_EXCL`` with mode 0600 (only the
shard's user can open them), named ``optserve-<creator pid>-<32 random hex digits>``. A name
lives only for the handshake: the client unlinks it as soon as it has mapped the region, and
the shard unlinks every name it made within :data:`NAME_TTL_S` anyway; the memory itself is
freed when both processes have unmapped it (or died). :func:`sweep_stale` removes names left by
a creator that died within those seconds (run at shard and client start).

Layout of a data region (:func:`layout`): the push part, one float32 slot per tensor, then the
reply part, one slot per tensor in the tensor's own dtype; every slot starts at a multiple of
:data:`ALIGN` bytes (64: XLA:CPU and NumPy use such host memory in place), and a push slot of
:data:`PAGE_SLOT_BYTES` or more at a multiple of :data:`PAGE_ALIGN` (a durable shard's step log
can then write it to the disk with direct I/O, straight from the region).
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import re
import secrets
from typing import Optional, Sequence

from optserve.protos import contract

ALIGN = 64
PAGE_ALIGN = 4096
PAGE_SLOT_BYTES = 64 << 10
NONCE_BYTES = 32
SHM_DIR = "/dev/shm"
PREFIX = "optserve-"
NAME_TTL_S = 10.0  # a region's name is unlinked by its creator at the latest this long after creation
_NAME = re.compile(r"^optserve-(\d+)-[0-9a-f]{32}$")
# The one message prefix of a step naming a region the shard no longer holds (it expired or the
# shard restarted): the client drops the region and retries the step (negotiating again).
REGION_UNKNOWN = "shared memory region unknown"


def available() -> bool:
    """Whether this host has POSIX shared memory where this module looks for it."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def new_name() -> str:
    """An unguessable region name that also says which process created it."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"


def valid_name(name: str) -> bool:
    """A name this contract makes (no path separators, nothing else under /dev/shm)."""
    return bool(_NAME.match(name))


def _path(name: str) -> str:
    if not valid_name(name):
        raise ValueError(f"not an optserve shared-memory region name: {name!r}")
    return os.path.join(SHM_DIR, name)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor's bytes in a data region: ``nbytes`` from byte ``offset``, elements of wire
    dtype ``dtype`` (an ``optserve.v1.DType`` value), C order, in ``shape``."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """A data region: ``push`` (float32 gradients) and ``reply`` (parameters) slots, ``size`` bytes."""

    push: tuple[Slot, ...]
    reply: tuple[Slot, ...]
    size: int


def _aligned(offset: int, alignment: int = ALIGN) -> int:
    return -(-offset // alignment) * alignment


def layout(tensors: Sequence[tuple[str, int, Sequence[int]]]) -> Layout:
    """The data region of ``tensors`` (``(name, spec dtype value, shape)``, in the session's order)."""
    offset = 0
    push, reply = [], []
    for part, slots in (("push", push), ("reply", reply)):
        for name, dtype, shape in tensors:
            wire = contract.FLOAT32 if part == "push" else int(dtype)
            count = 1
            for dim in shape:
                count *= int(dim)
            nbytes = count * contract.ITEMSIZE[wire]
            offset = _aligned(offset, PAGE_ALIGN if part == "push" and nbytes >= PAGE_SLOT_BYTES else ALIGN)
            slots.append(Slot(name, wire, tuple(int(d) for d in shape), offset, nbytes))
            offset += slots[-1].nbytes
    return Layout(tuple(push), tuple(reply), max(ALIGN, _aligned(offset)))


def page_span(size: int) -> int:
    """The bytes a mapping of ``size`` bytes covers (whole pages)."""
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def create(size: int, keep_fd: bool = False):
    """Creates a region of ``size`` bytes (mode 0600, never an existing file); returns its name
    and a read-write mapping (and its open descriptor with ``keep_fd``: see :func:`peer_alive`).
    Raises OSError."""
    name = new_name()
    fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    if keep_fd:
        return name, mapping, fd
    os.close(fd)
    return name, mapping


def open_existing(name: str, size: int, writable: bool = True, hold: bool = False):
    """Maps region ``name``, which must hold exactly ``size`` bytes. With ``hold``, also takes
    a shared lock on it and returns ``(mapping, fd)``: the lock says "this process still uses the
    region" until the descriptor is closed or the process dies (:func:`peer_alive`).
    Raises OSError (no such region, no permission) or ValueError (another size, a foreign name)."""
    fd = os.open(_path(name), (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_NOFOLLOW", 0))
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(f"shared memory region {name!r} holds {actual} bytes, expected {size}")
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        if hold:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return mapping, fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return mapping


def peer_alive(fd: int) -> bool:
    """Whether another process holds the region open with :func:`open_existing` ``hold`` (its
    shared lock); False once that process closed it or died, SIGKILL included. Works across PID
    namespaces: the lock belongs to the file, not to a process id."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def unlink(name: str) -> bool:
    """Removes region ``name``'s name (its memory lives on while mapped); False if it was gone."""
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


def close_quietly(mapping: Optional[mmap.mmap]) -> None:
    """Unmaps ``mapping``; when NumPy views of it are still alive, leaves it to them (it is
    unmapped when the last view goes)."""
    if mapping is None:
        return
    try:
        mapping.close()
    except BufferError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlinks regions whose creating process is gone (a shard or client SIGKILLed during a
    handshake); returns their names. Names of live processes are left alone."""
    removed = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for entry in entries:
        match = _NAME.match(entry)
        if match and not _alive(int(match.group(1))) and unlink(entry):
            removed.append(entry)
    return removed
