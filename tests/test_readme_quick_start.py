"""The README's NumPy quick start runs as written against a real server (only its address is
the test server's), and trains: the loss it prints falls below the loss at the start."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _numpy_quick_start() -> str:
    text = README.read_text()
    section = text[text.index("Train through it from NumPy:"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_numpy_quick_start_runs_as_written_and_trains(server):
    code = _numpy_quick_start().replace('"127.0.0.1:50051"', repr(server.address))
    printed = io.StringIO()
    namespace: dict = {}
    for _ in range(2):  # a rerun of the script works too: it closed its session
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), namespace)
    losses = [float(line.split()[1]) for line in printed.getvalue().splitlines() if line.startswith("loss ")]
    x, y = namespace["x"], namespace["y"]
    start = float((y ** 2).mean())  # zeros: the loss before any step
    assert len(losses) == 2 and all(loss < 0.5 * start for loss in losses), (losses, start)
