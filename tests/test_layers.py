"""The layers import one way: read every source file and fail on an import that crosses the wrong way.

wire -> domain -> storage / compute -> kernels; operator parts (ops/) above them; the process hosts
(app.py, cli.py, shard_actor.py, shard_fleet.py, preflight.py) on top;
client and kernels independent of the server; applications (the demo) on top of everything.
Lazy imports inside functions count: they cross a layer all the same.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
HOSTS = ("optserve.server.app", "optserve.server.cli", "optserve.server.shard_actor", "optserve.server.shard_fleet",
         "optserve.server.preflight")

# folder -> (forbidden module prefixes anywhere in a file, forbidden at import time only)
_SERVER = "optserve.server"
_APPS = ("optserve.demo", "optserve.client") + HOSTS
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # wire talks to the domain only (never compute or storage directly)
    "server/wire": (("ray", f"{_SERVER}.compute", f"{_SERVER}.storage", f"{_SERVER}.ops") + _APPS, ()),
    # the domain names kernels but never builds them (the compute layer does)
    "server/domain": (("grpc", "ray", "optserve.optim_kernels", f"{_SERVER}.wire", f"{_SERVER}.ops") + _APPS, ()),
    "server/storage": (("grpc", "ray", "optserve.optim_kernels", f"{_SERVER}.wire", f"{_SERVER}.domain",
                        f"{_SERVER}.compute", f"{_SERVER}.ops") + _APPS, ()),
    "server/compute": (("grpc", f"{_SERVER}.wire", f"{_SERVER}.domain", f"{_SERVER}.storage", f"{_SERVER}.ops")
                       + _APPS, ()),
    "server/ops": (_APPS, ()),
    "server": (("optserve.demo", "optserve.client"), ()),
    "optim_kernels": (("optserve.server", "optserve.client", "optserve.protos", "optserve.demo", "grpc", "ray"), ()),
    "protos": (("optserve.server", "optserve.client", "optserve.optim_kernels", "optserve.demo", "jax", "ray"), ()),
    "client": (("optserve.server", "optserve.optim_kernels", "optserve.demo", "ray"), ("jax",)),
}
# The client's JAX and torch adapters exist to import their framework.
ADAPTERS = {"client/jax.py": ("jax",)}


def _imports(tree: ast.AST) -> list[tuple[str, int, bool]]:
    """(module, line, at import time) for every import in a module's syntax tree."""
    top_level = {id(node) for node in getattr(tree, "body", [])}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.module, node.lineno, id(node) in top_level)]
            found += [(f"{node.module}.{alias.name}", node.lineno, id(node) in top_level) for alias in node.names]
    return found


def _crosses(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(root: pathlib.Path = REPO) -> list[str]:
    """Every import that crosses a layer the wrong way, as 'path:line imports module'."""
    found = []
    for folder, (anywhere, at_import) in RULES.items():
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if "_pb2" in path.name:
                continue
            allowed = ADAPTERS.get(relative, ())
            for module, line, top in _imports(ast.parse(path.read_text(), relative)):
                if _crosses(module, allowed):
                    continue
                if _crosses(module, anywhere) or (top and _crosses(module, at_import)):
                    found.append(f"{relative}:{line} imports {module}")
    return sorted(set(found))


def test_no_import_crosses_a_layer_the_wrong_way():
    assert violations() == []


@pytest.mark.parametrize("folder, source, module", [
    ("server/domain", "import grpc\n", "grpc"),
    ("server/domain", "def f():\n    import ray\n", "ray"),
    ("server/compute", "from optserve.server.wire import errors\n", "optserve.server.wire"),
    ("server/wire", "from optserve.server.compute.root_offload import RootStatus\n", "optserve.server.compute"),
    ("server/domain", "def f():\n    from optserve.optim_kernels import build_optimizer\n", "optserve.optim_kernels"),
    ("server/storage", "import grpc\n", "grpc"),
    ("server/storage", "from optserve.server.domain import durability\n", "optserve.server.domain"),
    ("server/compute", "from optserve.server.storage import ShardStore\n", "optserve.server.storage"),
    ("server/domain", "from optserve.server.ops import metrics\n", "optserve.server.ops"),
    ("optim_kernels", "from optserve.protos import contract\n", "optserve.protos"),
    ("client", "import jax\n", "jax"),
    ("server", "from optserve import demo\n", "optserve.demo"),
])
def test_the_check_catches_a_crossing(tmp_path, folder, source, module):
    for name in RULES:
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / folder / "bad.py").write_text(source)
    assert any(module in v and "bad.py" in v for v in violations(tmp_path))


def test_importing_the_client_loads_neither_jax_nor_ray_nor_the_server():
    code = ("import sys, optserve.client, optserve.client.torch; "
            "print(sorted(m for m in ('jax', 'ray', 'optserve.server') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# A session's clock is a Clock (server/domain/clock/home_clock.py): the home shard's HomeClock or a
# PeerClock handle; callers tell them apart by ``clock.is_home``, never by probing for methods.
_CLOCK_PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*[\w.]*clock\w*\s*,", re.IGNORECASE)


def clock_probes(root: pathlib.Path = REPO) -> list[str]:
    """Every ``getattr`` / ``hasattr`` on something named ``*clock*`` under server/, as 'path:line'."""
    found = []
    for path in sorted((root / "server").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _CLOCK_PROBE.search(line):
                found.append(f"{path.relative_to(root).as_posix()}:{number}")
    return found


def test_no_server_code_probes_a_clock_for_its_methods():
    assert clock_probes() == []


@pytest.mark.parametrize("source", [
    'abandon = getattr(self._clock, "abandon", None)\n',
    'peer_up = getattr(session.clock, "peer_up", None)\n',
    'if hasattr(home_clock, "restore"):\n    pass\n',
])
def test_the_clock_probe_check_catches_a_probe(tmp_path, source):
    (tmp_path / "server" / "domain").mkdir(parents=True)
    (tmp_path / "server" / "domain" / "bad.py").write_text(source)
    assert clock_probes(tmp_path) == ["server/domain/bad.py:1"]


_METHOD_PATH = re.compile(r"optserve\.v1\.[A-Z]")  # a service or message of package optserve.v1, by name


def method_path_strings(source: str) -> list[int]:
    """Lines of the string literals in ``source`` that name an ``optserve.v1`` service (as a
    hand-written method path like "/optserve.v1.ShardData/Push" does)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _METHOD_PATH.search(node.value)]


def test_the_client_calls_through_the_generated_stubs_with_no_hand_written_method_paths():
    """A method renamed or moved in protos/ must break the client at import, not at the first call
    on a live server: the client reaches the services through the stubs generated from protos/
    (or the method paths in their descriptors), never by naming a path itself."""
    assert method_path_strings('rpc = channel.unary_unary("/optserve.v1.ShardData/History")\n') == [1]
    found = [f"{path.relative_to(REPO).as_posix()}:{line}" for path in sorted((REPO / "client").rglob("*.py"))
             for line in method_path_strings(path.read_text())]
    assert found == []


def _string_constants(tree: ast.AST) -> list[tuple[str, int]]:
    """(value, line) of every string constant in a module that is not a docstring."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.value, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def optimizer_names_in_server(root: pathlib.Path = REPO) -> list[str]:
    """'path:line names NAME' for each optimizer name written in server code (outside docstrings)."""
    from optserve.optim_kernels.registry import optimizer_names

    names = set(optimizer_names())
    found = []
    for path in sorted((root / "server").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        found += [f"{relative}:{line} names {value!r}" for value, line in _string_constants(ast.parse(path.read_text()))
                  if value in names]
    return found


def test_no_server_module_names_an_optimizer():
    """What the server knows of an optimizer comes from its registry entry (costs, seams, rules)."""
    assert optimizer_names_in_server() == []


def test_the_optimizer_name_check_catches_a_table_keyed_by_name(tmp_path):
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "costs.py").write_text('"""Costs: shampoo is named here, in a docstring."""\n'
                                                  'COSTS = {"shampoo": 1}\n')
    assert optimizer_names_in_server(tmp_path) == ["server/costs.py:2 names 'shampoo'"]


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["optserve"] + parts)


def import_graph(root: pathlib.Path = REPO, folders=("server", "client")) -> dict[str, set[str]]:
    """Module -> the modules of ``folders`` it imports anywhere (at the top, in a function, or for
    type checkers only): ``from package import name`` is an edge to the submodule ``name`` when
    there is one, else to the package (its ``__init__``)."""
    paths = {_module_name(root, p): p for folder in folders for p in sorted((root / folder).rglob("*.py"))
             if "_pb2" not in p.name}
    graph = {}
    for name, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in paths}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    edges.add(target if target in paths else node.module)
        graph[name] = {target for target in edges if target in paths and target != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def test_no_import_circle_in_the_server_or_the_client():
    """Type-checking and function-level imports count: a circle is two modules that need each other."""
    assert import_circles(import_graph()) == []


def test_the_circle_check_finds_a_circle_made_for_type_checkers_only(tmp_path):
    (tmp_path / "client").mkdir()
    (tmp_path / "client" / "a.py").write_text("from optserve.client.b import B\n")
    (tmp_path / "client" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from optserve.client.a import A\n")
    assert import_circles(import_graph(tmp_path, ("client",))) == [["optserve.client.a", "optserve.client.b"]]


def test_other_subsystems_import_a_domain_package_only_through_its_exports():
    """server code outside domain/clock, domain/shard and domain/sessions names their modules never,
    only the package (what its __init__ exports)."""
    found = []
    for path in sorted((REPO / "server").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                       [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for module in modules:
                match = re.match(r"optserve\.server\.domain\.(clock|shard|sessions)\.", module)
                if match and not relative.startswith(f"server/domain/{match.group(1)}/"):
                    found.append(f"{relative}:{node.lineno} imports {module}")
    assert found == []
