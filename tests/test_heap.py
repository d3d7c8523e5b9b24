"""The malloc settings (optserve.client._heap, optserve.server.compute.heap): freed message-sized
allocations are reused instead of page-faulting anew.

Each case runs in a fresh interpreter: malloc settings are process-wide and cannot be undone.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from optserve.client import _heap as heap

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Rounds of 32 live 4 MiB messages (as gRPC holds a pushed model's chunks), then all freed.
_ROUNDS = """
import resource, sys
from optserve.client import _heap as heap
if sys.argv[1] == "retain":
    assert heap.retain_freed_memory()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    chunks = [b"x" * (4 << 20) for _ in range(32)]
    del chunks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


def _faults_after_first_round(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@glibc_only
def test_retained_memory_serves_later_rounds_without_page_faults():
    pages_per_round = 32 * (4 << 20) // 4096
    default = _faults_after_first_round("default")
    retained = _faults_after_first_round("retain")
    assert retained < pages_per_round // 10, (retained, default)
    assert retained * 10 < default, f"default malloc faulted {default} times, retained {retained}"


# Rounds of tensor-sized buffers (above any mmap threshold), as an update's outputs and temporaries.
_LARGE_ROUNDS = """
import resource, sys
import numpy as np
from optserve.client import _heap as heap
from optserve.server.compute import heap as server_heap
if sys.argv[1] == "large":
    assert server_heap.keep_large_buffers_on_heap()
elif sys.argv[1] == "retain":
    assert heap.retain_freed_memory()
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [np.ones(16 << 20, np.float32) for _ in range(3)]  # 3 x 64 MiB
    del buffers
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


@glibc_only
def test_buffers_above_the_mmap_threshold_are_reused_only_when_kept_on_the_heap():
    def faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", _LARGE_ROUNDS, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip())

    retained, large = faults("retain"), faults("large")
    assert retained > 3 * 3 * (64 << 20) // (2 << 20), retained  # mmap'd afresh: faults again (huge pages at best)
    assert large * 10 < retained, (large, retained)


@glibc_only
def test_retain_freed_memory_is_idempotent():
    assert heap.retain_freed_memory()
    assert heap.retain_freed_memory()


@pytest.mark.parametrize("keep_bytes", [1 << 20, 1 << 31])
def test_retain_freed_memory_refuses_keep_bytes_outside_what_mallopt_takes(keep_bytes):
    with pytest.raises(ValueError, match="keep_bytes"):
        heap.retain_freed_memory(keep_bytes)
