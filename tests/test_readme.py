"""The README as a newcomer walks it.

Every ```python block of the README is run here, as written (only the address is the test
server's), by the README's own recipe: the server is the README's ``optserve serve`` line run as a
process of its own (terminal 1), and each snippet is saved as ``train.py`` and run with
``python train.py`` (terminal 2), twice (a rerun works: the snippet closed its session). What it
prints must be the ```text block the README shows after it (numbers within a tolerance). The
README opens with ``make demo`` and ``make test``, which the Makefile defines; its demo output is
what the demo prints; its links and the docs' links resolve.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tests._server_process import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_ADDRESS = "127.0.0.1:50051"

# the README line each ```python block follows (the first block after it), by snippet
SNIPPETS = {"numpy": "Terminal 2: save this as `train.py`",
            "torch": "From PyTorch, swap the optimizer and keep the loop:",
            "jax": "From JAX, pytrees in and out",
            "torch_scheduler": "## PyTorch: a learning-rate scheduler and parameter groups"}
TERMINAL_1 = "Terminal 1 starts a server"


def readme() -> str:
    return README.read_text()


def blocks(text: str) -> list[tuple[str, str, int]]:
    """Every fenced block of ``text``: (language, body, offset of the opening fence)."""
    return [(m.group(1), m.group(2), m.start()) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def block_after(after: str, language: str) -> tuple[str, int]:
    """The first ```language block after the README line ``after``: (body, offset)."""
    text = readme()
    start = text.index(after)
    for lang, body, offset in blocks(text):
        if offset > start and lang == language:
            return body, offset
    raise AssertionError(f"no ```{language} block after {after!r}")


def snippet(name: str) -> tuple[str, str]:
    """The README's python snippet ``name`` and the output it shows for it (the ```text block
    right after the snippet)."""
    code, offset = block_after(SNIPPETS[name], "python")
    following = [(lang, body) for lang, body, at in blocks(readme()) if at > offset]
    assert following and following[0][0] == "text", f"the README shows no output after the {name} snippet"
    return code, following[0][1]


_NUMBER = re.compile(r"(-?\d+\.\d+(?:e[-+]?\d+)?)")


def assert_output_matches(printed: str, expected: str, rel: float = 0.1, abs_: float = 2e-3) -> None:
    """``printed`` is ``expected`` line for line: the same words, decimal numbers within ``rel``
    (or ``abs_``): the server's float32 math may differ in the last digits between machines."""
    got, want = printed.strip().splitlines(), expected.strip().splitlines()
    assert len(got) == len(want), f"printed:\n{printed}\nREADME shows:\n{expected}"
    for line, shown in zip(got, want):
        parts, shown_parts = _NUMBER.split(line.strip()), _NUMBER.split(shown.strip())
        assert parts[0::2] == shown_parts[0::2], f"printed {line!r}, the README shows {shown!r}"
        for value, shown_value in zip(parts[1::2], shown_parts[1::2]):
            assert float(value) == pytest.approx(float(shown_value), rel=rel, abs=abs_), \
                f"printed {line!r}, the README shows {shown!r}"


# --- terminal 1: the README's server -------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    return env


def serve_command() -> list[str]:
    """The README's ``optserve serve`` line (terminal 1), as argv."""
    body, _ = block_after(TERMINAL_1, "bash")
    lines = [line.split("#")[0].strip() for line in body.splitlines()]
    serve = [line for line in lines if line.startswith("optserve serve")]
    assert len(serve) == 1, body
    return shlex.split(serve[0])


def readme_server_process() -> ServerProcess:
    """The README's ``optserve serve`` line run as a process, on a free port (``--port 0``)."""
    argv = serve_command()
    argv[argv.index("--port") + 1] = "0"  # the only change: the port (the server picks a free one)
    script = pathlib.Path(sys.executable).parent / "optserve"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "optserve.server.cli"]
    return ServerProcess(command=command + argv[1:])


@pytest.fixture(scope="module")
def readme_server():
    server = readme_server_process()
    try:
        yield server.wait_listening()
    finally:
        server.stop()


def run_as_train_py(name: str, address: str, tmp_path: pathlib.Path, times: int = 2) -> list[str]:
    """Saves the README's snippet ``name`` as ``train.py`` (the address replaced by ``address``)
    and runs ``python train.py`` ``times`` times; returns what each run printed."""
    code, _ = snippet(name)
    assert code.count(f'"{README_ADDRESS}"') == 1, f"the {name} snippet dials {README_ADDRESS} once"
    script = tmp_path / "train.py"
    script.write_text(code.replace(f'"{README_ADDRESS}"', repr(address)))
    printed = []
    for _ in range(times):
        run = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300, env=_env())
        assert run.returncode == 0, f"python train.py ({name}) failed:\n{run.stdout[-3000:]}{run.stderr[-5000:]}"
        printed.append(run.stdout)
    return printed


def _check_snippet(name: str, readme_server, tmp_path) -> None:
    _, expected = snippet(name)
    for printed in run_as_train_py(name, readme_server.address, tmp_path):
        assert_output_matches(printed, expected)


# --- the tests -----------------------------------------------------------------------------------


def test_every_python_snippet_in_the_readme_is_run_by_a_test():
    shown = sorted(body for lang, body, _ in blocks(readme()) if lang == "python")
    tested = sorted(snippet(name)[0] for name in SNIPPETS)
    assert shown == tested, "a ```python block of the README that no test runs (add it to SNIPPETS)"


def test_the_readme_opens_with_make_demo_and_make_test_as_the_makefile_defines_them():
    first = blocks(readme())[0]
    commands = [line.split("#")[0].strip() for line in first[1].splitlines()]
    assert first[0] == "bash" and commands == ["make demo", "make test"], first
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\.PHONY:.*\bdemo\b.*\btest\b", makefile, re.M)
    assert re.search(r"^demo: \$\(STAMP\)\n\t\$\(VENV\)/bin/optserve demo$", makefile, re.M)
    # two passes: the suite on two workers, then the modules marked serial alone; either failing fails
    assert re.search(r"^test: \$\(STAMP\)\n\t\$\(PY\) -m pytest -q -n 2 --dist loadscope -m \"not serial\"[^\n]*"
                     r"parallel=\$\$\?; \\\n\t\$\(PY\) -m pytest -q -m serial[^\n]*serial=\$\$\?; \\\n"
                     r"\ttest \$\$parallel -eq 0 && test \$\$serial -eq 0$", makefile, re.M), makefile
    # what the README says both do: a venv, the pinned install, then the demo / the suite
    assert "VENV   := .venv" in makefile and "-c constraints.txt -e '.[dev]'" in makefile
    assert "TORCH  := torch==2.13.0" in makefile
    text = readme()
    assert "`pip install -c constraints.txt -e '.[dev]'`, after `torch==2.13.0`" in text
    assert "`make test` then runs the whole suite (pytest, on two workers, then the few" in text
    assert "`make demo` runs `optserve demo`" in text


def test_the_readme_shows_the_output_the_demo_prints():
    from optserve.demo.config import parse_args
    from optserve.demo.optimizers import describe_learning_rate

    shown, _ = block_after("## What `make demo` and `make test` do", "text")
    cfg = parse_args([])  # `make demo` runs `optserve demo` without flags
    assert f"optimizer: {cfg.optimizer}, {describe_learning_rate(cfg.learning_rate())}\n" in shown
    assert f"; {cfg.workers} workers x {cfg.steps} steps\n" in shown
    assert f"digits MLP, {cfg.optimizer} lr={cfg.lr} (warmup+cosine), batch {cfg.batch_size}" in shown
    assert "optserve async, 2 worker processes" in shown and "in process (Adam)" in shown
    assert "wrote demo_out/loss_curve.png and demo_out/summary.json" in shown


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_links_of_the_readme_and_the_docs_resolve():
    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # links in code are text
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_stays_a_short_path(readme_words=1500):
    words = len(readme().split())
    assert words <= readme_words, f"README.md has {words} words: move reference material into docs/"


def test_the_readme_server_starts_as_the_readme_says(readme_server):
    shown, _ = block_after(TERMINAL_1, "text")
    port = readme_server.address.rsplit(":", 1)[1]
    assert shown.strip().replace("50051", port) in "".join(readme_server.lines)


def test_the_readme_numpy_quick_start_runs_as_train_py_and_prints_what_the_readme_shows(readme_server, tmp_path):
    _check_snippet("numpy", readme_server, tmp_path)


def test_the_readme_torch_quick_start_runs_as_train_py_and_prints_what_the_readme_shows(readme_server, tmp_path):
    pytest.importorskip("torch")
    _check_snippet("torch", readme_server, tmp_path)


def test_the_readme_jax_quick_start_runs_as_train_py_and_prints_what_the_readme_shows(readme_server, tmp_path):
    pytest.importorskip("jax")
    _check_snippet("jax", readme_server, tmp_path)


def test_the_readme_torch_scheduler_with_parameter_groups_runs_and_prints_what_the_readme_shows(
        readme_server, tmp_path):
    pytest.importorskip("torch")
    _check_snippet("torch_scheduler", readme_server, tmp_path)
