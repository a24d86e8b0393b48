"""The package layout's rules (docs/design.md, "Code map"): no import circles, torch and
transformers only where they belong. Static (every import statement, lazy ones included) and
dynamic (what importing the torch-free packages actually loads)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "onnx_modular"
TORCH_FREE = ("format", "passes", "files")


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(path: pathlib.Path) -> set[str]:
    """Every module an import statement in ``path`` names (module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # ``from package import submodule`` names the submodule
                full = f"{node.module}.{alias.name}"
                names.add(full if full in MODULES else node.module)
    return names


def _internal(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        targets = {_internal(name) for name in _imports(path) if name.startswith("onnx_modular")}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = _graph()
    assert "onnx_modular.passes.pipeline" in graph["onnx_modular.export"]
    assert "onnx_modular.format.metadata" in graph["onnx_modular.passes.modularize"]


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_cycle_detection_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_packages_import_no_torch(package):
    offenders = [
        module
        for module, path in MODULES.items()
        if module.startswith(f"onnx_modular.{package}")
        and any(name == "torch" or name.startswith("torch.") for name in _imports(path))
    ]
    assert offenders == []


def test_only_hf_imports_transformers():
    offenders = [
        module
        for module, path in MODULES.items()
        if not module.startswith("onnx_modular.hf")
        and any(name == "transformers" or name.startswith("transformers.") for name in _imports(path))
    ]
    assert offenders == []


def test_importing_the_torch_free_packages_loads_no_torch():
    modules = [m for m in MODULES if m == "onnx_modular" or m.split(".")[1] in TORCH_FREE]
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)[:5]\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)
