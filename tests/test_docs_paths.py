"""Docs that cannot go stale: every module, file and test that docs/ and the README name exists,
and the code map of docs/design.md names every module of the package."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "onnx_modular"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
#: `files/convert/tool.py`, `onnx_modular/files/convert/tool.py`, `storage/save.write_checked`, `tests/test_cli.py`,
#: `tests/catalogue/jobs.py`
_IN_TREE = re.compile(
    r"`(?:onnx_modular/)?((?:" + "|".join(FOLDERS) + r")/[A-Za-z0-9_]+)(\.py|\.[A-Za-z_][A-Za-z0-9_]*)?"
    r"|`((?:tests|scripts|bench)/(?:[A-Za-z0-9_]+/)*[A-Za-z0-9_]+\.(?:py|sh))"
)
#: a test file named on its own (`test_cli.py`)
_TEST_FILE = re.compile(r"`(test_[A-Za-z0-9_]+\.py)")
#: `onnx_modular.files.split.tool` and `onnx_modular.files.split.tool.run_stages`
_DOTTED = re.compile(r"`(onnx_modular(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


@functools.cache
def _top_level_names(path: pathlib.Path) -> frozenset[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id in ("__all__", "_LAZY") for t in targets):
                # what a package exports lazily (``onnx_modular.profile``) is a name of it too
                values = node.value.keys if isinstance(node.value, ast.Dict) else getattr(node.value, "elts", [])
                names.update(v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return frozenset(names)


def _module_file(parts: list[str]) -> pathlib.Path | None:
    path = ROOT.joinpath(*parts)
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _in_tree_problems(text: str) -> list[str]:
    problems = []
    for match in _IN_TREE.finditer(text):
        module, suffix, other = match.groups()
        if other:
            if not (ROOT / other).is_file():
                problems.append(other)
            continue
        path = _module_file(["onnx_modular", *module.split("/")])
        if path is None:
            problems.append(module + (suffix or ""))
        elif suffix and suffix != ".py" and suffix[1:] not in _top_level_names(path):
            problems.append(module + suffix)
    return problems


def _dotted_problems(text: str) -> list[str]:
    problems = []
    for match in _DOTTED.finditer(text):
        parts = match.group(1).split(".")
        for i in range(len(parts), 0, -1):
            path = _module_file(parts[:i])
            if path is not None:
                rest = parts[i:]
                if rest and rest[0] not in _top_level_names(path) and _module_file(parts[: i + 1]) is None:
                    problems.append(match.group(1))
                break
        else:
            problems.append(match.group(1))
    return problems


def test_every_module_file_and_test_the_docs_name_exists():
    tests = {p.name for p in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        found = _in_tree_problems(text) + _dotted_problems(text)
        found += [name for name in _TEST_FILE.findall(text) if name not in tests]
        missing += [f"{doc.relative_to(ROOT)}: {name}" for name in sorted(set(found))]
    assert not missing, "\n".join(missing)


def test_the_checks_find_a_missing_module_and_a_missing_name():
    assert _in_tree_problems("`files/nothing_here.py` and `storage/save.no_such_function`") == [
        "files/nothing_here.py",
        "storage/save.no_such_function",
    ]
    assert _in_tree_problems("`files/convert/tool.py`, `storage/save.py`, `tests/test_layout.py`") == []
    assert _in_tree_problems("`tests/catalogue/jobs.py` `tests/catalogue/gone.py`") == ["tests/catalogue/gone.py"]
    assert _dotted_problems("`onnx_modular.files.gone` `onnx_modular.files.split.tool.run_stages`") == ["onnx_modular.files.gone"]


def test_the_code_map_names_every_module():
    text = (ROOT / "docs" / "design.md").read_text()
    code_map = text[text.index("Code map") :]
    code_map = code_map[: code_map.index("\n\n", code_map.index("| --- |"))]
    rows = {}
    for line in code_map.splitlines():
        cells = line.split("|")
        if len(cells) > 2:
            rows[cells[1].strip()] = cells[2]
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name == "__init__.py" or path.name.startswith("_"):
            continue
        if len(relative.parts) == 1:
            if not any(f"`{path.name}`" in key for key in rows):
                unnamed.append(str(relative))
            continue
        folder = relative.parts[0]
        row = next((job for key, job in rows.items() if f"`{folder}/`" in key), "")
        stem = "/".join(relative.with_suffix("").parts[1:])
        if f"`{stem}.py`" not in row and f"`{stem}.py` " not in row and f"`{stem}." not in row:
            unnamed.append(str(relative))
    assert not unnamed, f"modules the code map of docs/design.md does not name: {unnamed}"
