"""scripts/cpu_by_process.py: the suite's CPU by kind of process."""

from __future__ import annotations

import sys

from scripts.cpu_by_process import kind_of, main


def test_processes_are_told_apart_by_their_command_lines():
    assert kind_of("python -u -c import sys;exec(eval(sys.stdin.readline()))") == "pytest worker"
    assert kind_of("ray::ShardActor") == "shard actor"
    assert kind_of("ray::IDLE") == "ray idle worker"
    assert kind_of("/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/s") == "ray daemons"
    assert kind_of("/v/bin/python /v/bin/optserve serve --port 0") == "optserve serve"
    assert kind_of("/v/bin/python /v/bin/optserve demo --quick") == "optserve demo"
    # a command started by a test carries pytest's tmp_path: it is still what it is
    assert kind_of("/v/bin/python /v/bin/optserve demo --out /tmp/pytest-of-root/pytest-1/popen-gw0/x") == "optserve demo"
    assert kind_of("/v/bin/optserve serve --checkpoint-dir /tmp/pytest-of-root/pytest-1/t0/ckpt") == "optserve serve"
    assert kind_of("/v/bin/python -m pytest -q -m serial") == "pytest worker"
    assert kind_of("sleep 5") == "other"


def test_a_commands_cpu_is_attributed_to_its_kind_and_its_exit_status_returned(capsys):
    busy = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\nraise SystemExit(3)"
    assert main(["--interval-s", "0.2", "--", sys.executable, "-c", busy]) == 3
    out = capsys.readouterr().out
    assert "cores busy on average" in out and "  other python" in out, out
    assert float(out.split("other python")[1].split()[0]) >= 0.5, out  # the busy second (less the last reading's gap)
