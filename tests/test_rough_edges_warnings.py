"""The suite's warning filters: Ray's fork-then-exec in a process that used JAX is quiet, while a
bare ``os.fork()`` (the one that can deadlock JAX's threads) still warns."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest


def _use_jax() -> None:
    import jax.numpy as jnp

    (jnp.ones(4) * 2).block_until_ready()  # starts JAX's backend and its threads in this process


def test_a_fork_that_execs_after_jax_ran_is_not_reported_as_a_deadlock():
    _use_jax()
    with warnings.catch_warnings(record=True) as caught:  # the suite's filters (pyproject) still apply
        # what ray.init() does for each of its daemons: a fork running a Python hook, then exec
        subprocess.run([sys.executable, "-c", "pass"], preexec_fn=lambda: None, check=True, timeout=60)
    assert not [w for w in caught if "os.fork()" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_a_bare_fork_after_jax_ran_still_warns():
    _use_jax()
    with pytest.warns(RuntimeWarning, match=r"os\.fork\(\) was called"):
        pid = os.fork()
        if pid == 0:  # the child leaves at once, touching nothing
            os._exit(0)
    os.waitpid(pid, 0)
