"""``optserve serve`` asking for more GPUs than the embedded Ray has (on this machine without GPUs,
any): one line, exit 2, from the check of the cluster's resources before any actor is placed (Ray
would otherwise wait for the resources without end: the run's 240 s limit would end it). A real
server process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# 64 GPUs per actor: more than any test machine has, GPUs or not.
GPUS = "64"


@pytest.mark.parametrize("flags, expected", [
    (["--gpus-per-shard", "0.5"], "--gpus-per-shard 0.5 x 2 shards needs 1"),
    (["--shards", "2", "--gpus-per-shard", GPUS], "--gpus-per-shard 64 x 2 shards needs 128"),
    (["--shards", "1", "--precond-workers", "2", "--gpus-per-precond-worker", GPUS],
     "--gpus-per-precond-worker 64 x 2 preconditioner workers needs 128"),
])
def test_serve_asking_for_gpus_the_local_ray_lacks_fails_fast_in_one_line(flags, expected):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    result = subprocess.run([sys.executable, "-c", "import sys; from optserve.server.cli import main; sys.exit(main())",
                             "serve", "--port", "0", *flags], capture_output=True, text=True, timeout=240, env=env)
    lines = [line for line in result.stderr.splitlines() if line.startswith("optserve serve")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and "could not start" in lines[0] and "the Ray cluster has" in lines[0], result.stderr[-3000:]
    assert expected in lines[0]
    assert "Traceback" not in result.stderr
