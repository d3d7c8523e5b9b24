"""How ``make test``'s parallel pass hands tests to its pytest-xdist workers.

Two rules, both about the machine's time:

- A module with a module-scoped fixture (a server of its own, files it prepared with servers it
  started) goes whole to one worker: handed out test by test, each worker that ran one of its tests
  would set the fixture up again. Every other test is a unit of its own.
- Units go out longest first (the longest-processing-time rule), by the seconds each test took in a
  recorded run (``tests/durations.json``; a test not in it counts ``UNKNOWN_S``). Long units started
  last would leave one worker running them alone at the end.

Refresh the record from a run's JUnit file (``pytest ... --junitxml=FILE``):

    python -m tests._scheduling FILE
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Optional

TESTS = os.path.dirname(os.path.abspath(__file__))
DURATIONS = os.path.join(TESTS, "durations.json")
RECORDED_FROM_S = 0.5  # shorter tests are not recorded
UNKNOWN_S = 0.5  # what a test not in the record counts (a short one, or a new one)
_MODULE_FIXTURE = re.compile(r"@pytest\.fixture\(\s*scope\s*=\s*[\"']module[\"']")


def modules_kept_whole(tests_dir: str = TESTS) -> frozenset[str]:
    """Paths (as pytest's node ids start, ``tests/test_x.py``) of the modules defining a
    module-scoped fixture."""
    whole = set()
    for name in os.listdir(tests_dir):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(tests_dir, name), encoding="utf-8") as fh:
                if _MODULE_FIXTURE.search(fh.read()):
                    whole.add(f"{os.path.basename(tests_dir)}/{name}")
    return frozenset(whole)


def recorded_seconds(path: str = DURATIONS) -> dict[str, float]:
    """Node id -> seconds from the record; empty when there is none."""
    try:
        with open(path, encoding="utf-8") as fh:
            return {str(k): float(v) for k, v in json.load(fh).items()}
    except FileNotFoundError:
        return {}


def record(junit_path: str, out: str = DURATIONS) -> int:
    """Writes ``out`` from a JUnit file: each test's seconds (setup, call and teardown) that took at
    least ``RECORDED_FROM_S``; returns how many."""
    import xml.etree.ElementTree as ET

    seconds = {}
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        took = float(case.get("time") or 0.0)
        if took >= RECORDED_FROM_S:
            seconds[f"{module}::{case.get('name')}"] = round(took, 1)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(dict(sorted(seconds.items())), fh, indent=0)
        fh.write("\n")
    return len(seconds)


def make_scheduler(config, log):
    """The xdist scheduler of the rules above (``pytest_xdist_make_scheduler``)."""
    from xdist.scheduler import LoadScopeScheduling

    class WholeModulesLongestFirst(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            self._whole = modules_kept_whole()
            self._seconds = recorded_seconds()
            self._ordered = False

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in self._whole else nodeid

        def _unit_seconds(self, unit: dict) -> float:
            return sum(self._seconds.get(nodeid, UNKNOWN_S) for nodeid in unit)

        def _assign_work_unit(self, node) -> None:
            if not self._ordered:  # the queue is complete from the first assignment on
                ordered = sorted(self.workqueue.items(), key=lambda item: -self._unit_seconds(item[1]))
                self.workqueue.clear()
                self.workqueue.update(ordered)
                self._ordered = True
            super()._assign_work_unit(node)

    return WholeModulesLongestFirst(config, log)


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tests._scheduling JUNIT_XML", file=sys.stderr)
        return 2
    print(f"{record(args[0])} tests recorded in {DURATIONS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
