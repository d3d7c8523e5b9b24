"""The README's quick-start snippets (NumPy, PyTorch, JAX) run as written against a real server
(only the address is the test server's), and train: the loss each prints falls well below the
loss it starts from; each can be run again (it closed its session)."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"

# the README line each snippet follows
SNIPPETS = {"numpy": "Train through it from NumPy:",
            "torch": "From PyTorch, swap the optimizer and keep the loop:",
            "jax": "From JAX, pytrees in and out"}


def quick_start_snippet(after: str) -> str:
    """The first ```python block after the README line ``after``."""
    text = README.read_text()
    section = text[text.index(after):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_twice(code: str, namespace: dict) -> list[float]:
    printed = io.StringIO()
    for _ in range(2):  # a rerun of the script works too: it closed its session
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), namespace)
    return [float(line.split()[1]) for line in printed.getvalue().splitlines() if line.startswith("loss ")]


def test_the_readme_numpy_quick_start_runs_as_written_and_trains(server):
    code = quick_start_snippet(SNIPPETS["numpy"]).replace('"127.0.0.1:50051"', repr(server.address))
    namespace: dict = {}
    losses = _run_twice(code, namespace)
    start = float((namespace["y"] ** 2).mean())  # zeros: the loss before any step
    assert len(losses) == 2 and all(loss < 0.5 * start for loss in losses), (losses, start)


def test_the_readme_torch_quick_start_runs_as_written_and_trains(server):
    torch = pytest.importorskip("torch")
    code = quick_start_snippet(SNIPPETS["torch"]).replace('"127.0.0.1:50051"', repr(server.address))
    torch.manual_seed(0)  # the snippet's own model and data, to know the loss before any step
    model = torch.nn.Linear(64, 10)
    x, y = torch.randn(256, 64), torch.randn(256, 10)
    start = torch.nn.functional.mse_loss(model(x), y).item()
    losses = _run_twice(code, {})
    assert len(losses) == 2 and all(loss < 0.9 * start for loss in losses), (losses, start)


def test_the_readme_jax_quick_start_runs_as_written_and_trains(server):
    pytest.importorskip("jax")
    code = quick_start_snippet(SNIPPETS["jax"]).replace('"127.0.0.1:50051"', repr(server.address))
    namespace: dict = {}
    losses = _run_twice(code, namespace)
    start = float((namespace["y"] ** 2).mean())  # zeros: the loss before any step
    assert len(losses) == 2 and all(loss < 0.5 * start for loss in losses), (losses, start)
