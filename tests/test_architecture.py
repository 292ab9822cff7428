"""The tree's layering, as code (docs/architecture.md): every import between the project's
files, lazy and ``TYPE_CHECKING`` ones included, must point down a layer, and no file may
reach itself through its imports.

Layers, top to bottom: ``cluster -> actors -> kv_transfer -> scheduler``. Inside ``cluster/``
the subpackages are floors: ``tools -> {serving, sim} -> control -> engine -> observability
-> {config, errors}`` (a floor may use any floor below it, never one above or a sibling).
``scheduler/`` imports only the standard library and pydantic.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("scheduler", "kv_transfer", "actors", "cluster")
LAYER = {name: rank for rank, name in enumerate(PACKAGES)}
# Floors inside cluster/: the first path part below ``cluster`` (a module at the top is its
# own part). Siblings on one floor stay independent of each other.
CLUSTER_FLOORS = {
    "config": 0,
    "errors": 0,
    "proto": 0,
    "observability": 1,
    "engine": 2,
    "control": 3,
    "serving": 4,
    "sim": 4,
    "tools": 5,
}
SCHEDULER_THIRD_PARTY = {"pydantic", "pydantic_core", "typing_extensions"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _files() -> dict[str, Path]:
    """Every project module by dotted name (generated protocol modules excluded)."""
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                files[_module_name(path)] = path
    return files


def _imports(path: Path, module: str) -> Iterator[str]:
    """Dotted names this file imports, anywhere in it (functions and TYPE_CHECKING too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}"  # a submodule, or a name in ``base``


def _resolve(name: str, files: dict[str, Path]) -> str | None:
    """The project module an imported name lives in (the longest matching prefix)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in files:
            return candidate
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's ``__init__`` counts only where it
    is imported by name: ``from scheduler import Request`` is an edge to ``scheduler``)."""
    files = _files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges = set()
        for name in _imports(path, module):
            target = _resolve(name, files)
            if target is not None and target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def _is_facade(module: str) -> bool:
    """A package's ``__init__`` re-exporting its own modules (lazily)."""
    return (ROOT / Path(*module.split(".")) / "__init__.py").exists()


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _floor(module: str) -> tuple[int, int, str]:
    """(layer, floor inside the layer, the floor's name) of a module."""
    parts = module.split(".")
    layer = LAYER[parts[0]]
    if parts[0] != "cluster" or len(parts) == 1:
        return layer, 0, parts[0]
    return layer, CLUSTER_FLOORS[parts[1]], parts[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        if module.split(".")[-1] in PACKAGES or _is_facade(module):
            continue  # a package facade re-exports what lies below it
        layer, floor, name = _floor(module)
        for target in sorted(targets):
            t_layer, t_floor, t_name = _floor(target)
            if t_layer > layer:
                problems.append(f"{module} imports {target}: a higher layer")
            elif t_layer == layer and t_name != name and t_floor >= floor and t_layer == 3:
                where = "a higher floor" if t_floor > floor else "a sibling on its floor"
                problems.append(f"{module} imports {target}: {where} of cluster/")
    return problems


def test_floors_cover_every_cluster_subpackage() -> None:
    names = {p.name for p in (ROOT / "cluster").iterdir() if p.is_dir() and p.name != "__pycache__"}
    names |= {p.stem for p in (ROOT / "cluster").glob("*.py") if p.stem != "__init__"}
    assert names <= set(CLUSTER_FLOORS), (
        f"give these a floor: {sorted(names - set(CLUSTER_FLOORS))}"
    )


def test_no_import_cycle_between_files() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_runs_up_a_layer() -> None:
    problems = upward_imports(import_graph())
    assert not problems, "\n".join(problems)


def test_checker_finds_a_cycle_and_an_upward_import() -> None:
    """The two checks above can fail: a made-up graph with both defects trips them."""
    graph = {
        "scheduler.a": {"scheduler.b"},
        "scheduler.b": {"scheduler.a", "cluster.config"},
        "cluster.config": set(),
        "cluster.engine.llm": {"cluster.control.client"},
        "cluster.control.client": {"cluster.engine.llm"},
    }
    assert find_cycles(graph) == [
        ["cluster.control.client", "cluster.engine.llm"],
        ["scheduler.a", "scheduler.b"],
    ]
    assert upward_imports(graph) == [
        "cluster.engine.llm imports cluster.control.client: a higher floor of cluster/",
        "scheduler.b imports cluster.config: a higher layer",
    ]


def test_scheduler_imports_only_the_standard_library_and_pydantic() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    bad = []
    for module, path in _files().items():
        if not module.startswith("scheduler"):
            continue
        for name in _imports(path, module):
            top = name.split(".")[0]
            if top not in stdlib and top not in SCHEDULER_THIRD_PARTY and top != "scheduler":
                bad.append(f"{module} imports {name}")
    assert not bad, "\n".join(bad)


# A meta path finder that makes the named packages unimportable, as on a machine without them.
_HIDE = """
import importlib.abc, sys
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)")
        return None
sys.meta_path.insert(0, _Hide())
"""


def _run_hidden(hidden: set[str], code: str) -> subprocess.CompletedProcess[str]:
    script = _HIDE.format(hidden=hidden) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_config_scheduler_and_kv_transfer_import_without_torch() -> None:
    result = _run_hidden(
        {"torch", "ray", "opentelemetry"},
        """
        import cluster.config, scheduler, kv_transfer
        from cluster.config import ClusterConfig, TracingConfig
        from kv_transfer import PDConnector
        ClusterConfig.from_yaml("pools: [{name: a, role: both}]")
        assert not {"torch", "ray", "opentelemetry"} & set(sys.modules), sorted(sys.modules)
        print("ok")
        """,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_what_the_api_server_and_the_control_plane_load_needs_no_torch() -> None:
    """The processes that run no model import no torch (a second and a few hundred MB
    each): the Serve ingress (its modules, a GGUF file's tokenizer, grammar checks), the
    central scheduler and engine actors, and the worker's actor class that Ray loads wherever
    a worker's handle is unpickled."""
    from actors.model.loader import builtin_model_path

    result = _run_hidden(
        {"torch"},
        f"""
        import cluster.serving.app, cluster.serving.openai_serving, cluster.serving.grpc_api
        import cluster.control.scheduler_actor, cluster.control.engine_actor
        from kv_transfer.registry import available_transports
        assert "nixl" in available_transports()
        import actors.worker_actor
        from pathlib import Path
        from actors.model.tokenizer import Tokenizer
        from actors.structured_output import compiler_for
        tokenizer = Tokenizer.from_path(Path({str(builtin_model_path())!r}))
        assert tokenizer.encode("Paris")
        from scheduler.request import StructuredOutputsParams
        spec = StructuredOutputsParams.model_validate({{"json": {{"type": "object"}}}})
        compiler_for(tokenizer, tokenizer.vocab_size).compile(spec)
        print("ok")
        """,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("hidden", ["torch", "numpy"])
def test_hiding_a_package_really_hides_it(hidden: str) -> None:
    """The check above can fail: importing what the finder hides raises."""
    result = _run_hidden({hidden}, f"import {hidden}")
    assert result.returncode != 0 and "hidden by the test" in result.stderr
