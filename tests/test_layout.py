"""The package layout's rules (docs/design.md, "Code map"): no import circles, torch and
transformers only where they belong. Static (every import statement, lazy ones included) and
dynamic (what importing the torch-free packages actually loads)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

from onnx_modular.format import metadata

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "onnx_modular"
#: Folders whose every module is torch-free, and the torch-free modules of mixed folders
#: (``check/``'s onnxruntime half). Listed by module, not folder, so a new module of ``check/``
#: that imports torch needs no exception here.
TORCH_FREE_FOLDERS = ("format", "passes", "storage", "runtime", "calls", "files", "profiling")
TORCH_FREE_MODULES = (
    "onnx_modular",
    "onnx_modular._version",
    "onnx_modular.errors",
    "onnx_modular.check",
    "onnx_modular.check.parity",
    "onnx_modular.check.drift",
    "onnx_modular.runtime.sessions",
    "onnx_modular.runtime.inputs",
)


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
    assert "onnx_modular.passes.export.pipeline" in graph["onnx_modular.export"]
    assert "onnx_modular.format.metadata" in graph["onnx_modular.passes.export.outline_calls"]


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_cycle_detection_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _torch_free() -> list[str]:
    return sorted(
        m for m in MODULES if m in TORCH_FREE_MODULES or (m.count(".") >= 1 and m.split(".")[1] in TORCH_FREE_FOLDERS)
    )


def test_torch_free_modules_import_no_torch():
    assert "onnx_modular.files.extract" in _torch_free() and "onnx_modular.runtime.sessions" in _torch_free()
    offenders = [
        module
        for module in _torch_free()
        if any(name == "torch" or name.startswith("torch.") for name in _imports(MODULES[module]))
    ]
    assert offenders == []


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and MODULES[module].name == "__init__.py") else "(root)"


def test_no_two_folders_import_each_other():
    """Folders form layers: if ``check/`` imports ``capture/``, nothing in ``capture/`` imports ``check/``."""
    edges = {}
    for module, targets in _graph().items():
        for target in targets:
            a, b = _folder(module), _folder(target)
            if a != b and "(root)" not in (a, b):
                edges.setdefault((a, b), (module, target))
    assert ("check", "capture") in edges  # the rule sees the folder-level edges
    mutual = sorted((edges[(a, b)], edges[(b, a)]) for a, b in edges if (b, a) in edges and a < b)
    assert mutual == []
    folders = {}
    for a, b in edges:
        folders.setdefault(a, set()).add(b)
    for folder in {f for pair in edges for f in pair}:
        folders.setdefault(folder, set())
    assert _cycles(folders) == []


def test_nothing_below_cli_and_hf_imports_the_package_root():
    """The root re-exports the public API; modules below it import its parts (``_version`` for the version)."""
    offenders = [
        module
        for module, path in MODULES.items()
        if module.count(".") >= 1
        and module.split(".")[1] not in ("cli", "hf", "__main__")
        and "onnx_modular" in {_internal(name) for name in _imports(path) if name.startswith("onnx_modular")}
    ]
    assert offenders == []


def test_no_folder_holds_more_than_a_quarter_of_the_package():
    lines: dict[str, int] = {}
    for module, path in MODULES.items():
        lines[_folder(module)] = lines.get(_folder(module), 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    assert {folder: n for folder, n in lines.items() if n > total / 4} == {}


def test_only_hf_imports_transformers():
    offenders = [
        module
        for module, path in MODULES.items()
        if not module.startswith("onnx_modular.hf")
        and any(name == "transformers" or name.startswith("transformers.") for name in _imports(path))
    ]
    assert offenders == []


def test_importing_the_torch_free_packages_loads_no_torch():
    modules = _torch_free()
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)[:5]\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


#: torch internals that change between releases, and the only modules allowed to import them:
#: the ONNX translator's private API in ``torch_compat``, torch.export's (fake tensors,
#: higher-order ops) in ``torch_export`` (docs/design.md, "Code map").
PRIVATE_TORCH = {
    "torch.onnx._internal": {"onnx_modular.capture.torch_compat"},
    "torch._subclasses": {"onnx_modular.capture.torch_export"},
    "torch._higher_order_ops": {"onnx_modular.capture.torch_export"},
}


def test_private_torch_api_has_one_home_each():
    misplaced = sorted(
        f"{module} imports {name}"
        for module, path in MODULES.items()
        for name in _imports(path)
        for private, homes in PRIVATE_TORCH.items()
        if (name == private or name.startswith(private + ".")) and module not in homes
    )
    assert not misplaced, misplaced
    # and the homes do use what they are the home of (a rule about nothing would pass forever)
    used = {private for private, homes in PRIVATE_TORCH.items() for home in homes
            if any(n == private or n.startswith(private + ".") for n in _imports(MODULES[home]))}
    assert used == set(PRIVATE_TORCH)


def test_families_are_packages_not_prefixes():
    """No module's name is another module's name of the same folder plus ``_...`` (``convert`` and
    ``convert_build``): a family of modules is a package (``files/convert/``)."""
    offenders = []
    for folder in {path.parent for path in MODULES.values()}:
        stems = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
        offenders += [f"{folder.name}/{a} + {b}" for a in stems for b in stems if b.startswith(a + "_")]
    assert offenders == []


def test_the_export_and_its_result_import_no_file_tool():
    for module in ("onnx_modular.export", "onnx_modular.result"):
        assert not [t for t in _graph()[module] if t.startswith("onnx_modular.files")], module


def _private_imports(modules: dict[str, pathlib.Path]) -> list[str]:
    """``from x import _name`` where ``x`` is another module of the package and ``_name`` is not a
    module itself (a package-private module, ``calls/_proto.py``, is imported by name)."""
    found = []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = base + ("." + node.module if node.module else "")
            else:
                target = node.module or ""
            if not target.startswith("onnx_modular") or target == module:
                continue
            found += [
                f"{module}: from {target} import {alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__") and f"{target}.{alias.name}" not in modules
            ]
    return sorted(found)


#: Private names still shared between modules (none left: every shared name is public where it is defined).
PRIVATE_IMPORTS_PENDING: set[str] = set()


def test_no_module_imports_another_modules_private_name():
    """A name another module needs is public where it is defined (or the function moves to where it
    belongs); ``_name`` is for its own module."""
    found = set(_private_imports(MODULES))
    assert sorted(found - PRIVATE_IMPORTS_PENDING) == []
    assert sorted(PRIVATE_IMPORTS_PENDING - found) == []  # a name made public leaves the list


def test_the_private_import_rule_sees_relative_and_absolute_imports(tmp_path):
    package = tmp_path / "onnx_modular"
    (package / "a").mkdir(parents=True)
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "_inner.py").write_text("")
    (package / "a" / "x.py").write_text("def _hidden(): pass\n")
    (package / "a" / "y.py").write_text("from .x import _hidden\nfrom onnx_modular.a import _inner\n")
    (package / "b.py").write_text("from onnx_modular.a.x import _hidden as h\n")
    modules = {"onnx_modular.a": package / "a" / "__init__.py", "onnx_modular.a._inner": package / "a" / "_inner.py",
               "onnx_modular.a.x": package / "a" / "x.py", "onnx_modular.a.y": package / "a" / "y.py",
               "onnx_modular.b": package / "b.py"}
    assert _private_imports(modules) == [
        "onnx_modular.a.y: from onnx_modular.a.x import _hidden",
        "onnx_modular.b: from onnx_modular.a.x import _hidden",
    ]


TESTS = pathlib.Path(__file__).resolve().parent
#: Test files that still spell a key (none left).
KEYS_SPELLED_PENDING: set[str] = set()


def _spelled_keys(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` whose code (docstrings and comments aside) spells a ``pkg.onnx_modular.`` key."""
    tree = ast.parse(path.read_text())
    docs = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and metadata.PREFIX in node.value
        and id(node) not in docs
    )


def test_metadata_keys_are_spelled_in_format_only():
    """Every ``pkg.onnx_modular.*`` key has one home, ``format/metadata.py``: the package and the
    tests use its constants."""
    assert _spelled_keys(PACKAGE / "format" / "metadata.py")  # the rule sees the home's spelling
    paths = [p for p in PACKAGE.rglob("*.py") if "format" not in p.relative_to(PACKAGE).parts[:1]]
    paths += [p for p in TESTS.rglob("*.py") if p.name not in KEYS_SPELLED_PENDING]
    spelled = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in paths for line in _spelled_keys(path)]
    assert spelled == []
