"""Rough edges a new user hits on the ``optserve`` command line: each is one line on stderr and
exit status 2, never a traceback or argparse's usage block. Real subprocesses, nothing mocked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_MAIN = "import sys; from optserve.server.cli import main; sys.exit(main())"

# Makes importing the server's dependencies fail, as on a client-only install, then runs `optserve`.
_CLIENT_ONLY_MAIN = """
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "jax", "jaxlib", "optax"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
from optserve.server.cli import main
sys.exit(main())
"""


def _optserve(*argv: str, main: str = _MAIN, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", COLUMNS="80")
    return subprocess.run([sys.executable, "-c", main, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _assert_one_line_exit_2(result: subprocess.CompletedProcess, prefix: str, *named: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(prefix), lines[0]
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr
    for word in named:
        assert word in lines[0], lines[0]
    return lines[0]


def test_serve_on_a_client_only_install_says_the_server_is_not_installed_in_one_line():
    result = _optserve("serve", "--port", "0", "--shards", "1", main=_CLIENT_ONLY_MAIN)
    _assert_one_line_exit_2(result, "optserve serve: the server is not installed", "pip install -e",
                            "No module named")


@pytest.mark.parametrize("argv, named", [
    (["demo", "--steps", "many"], "--steps"),
    (["demo", "--optimizer", "lion"], "--optimizer"),
    (["demo", "--no-such-flag"], "--no-such-flag"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--lr", "-1"], "--lr"),
    (["status", "--timeout", "soon"], "--timeout"),
    (["status", "--no-such-flag"], "--no-such-flag"),
    (["report"], "session"),
    (["report", "s", "--timeout", "soon"], "--timeout"),
])
def test_a_bad_flag_of_demo_status_or_report_is_one_line_naming_it_and_exit_2(argv, named):
    _assert_one_line_exit_2(_optserve(*argv), f"optserve {argv[0]}: ", named)


def test_demo_on_a_client_only_install_names_what_is_missing_in_one_line():
    _assert_one_line_exit_2(_optserve("demo", "--quick", main=_CLIENT_ONLY_MAIN),
                            "optserve demo: the demo is not installed (pip install -e",
                            "missing", "jax", "ray")
