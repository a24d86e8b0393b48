"""``manifest.json`` of a ``split`` folder read as untrusted input (``run_stages``).

:func:`read_manifest` checks, before anything runs: the file is a small regular file inside the
folder (no link, no FIFO: opened without blocking); the JSON nests at most
:data:`~onnx_modular.storage.limits.MAX_MANIFEST_DEPTH` levels (a deeply nested file cannot
exhaust Python's stack: the depth is counted on the text before it is parsed); the schema
(``stages``: a list of at most :data:`~onnx_modular.storage.limits.MAX_STAGES` objects, each with a
``file`` string, an ``inputs`` object of string to string and an ``outputs`` list of strings;
``outputs``: an object of string to string); every stage file resolved inside the folder, through
no symbolic link, a regular file, and used by one stage only; every source a model input or an
output of an earlier stage (``stage_<k>/<name>``); every model output an output of some stage.

:func:`check_feeds` refuses feeds that are not a mapping of names, and a model input named like a
stage output (``stage_0/t``), which would otherwise shadow or be shadowed by that stage's value.
:func:`check_stage_file` loads a stage with the bounds every tool applies (the structure checks,
the expanded size of its calls, its ``Loop`` trips).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import stat
from collections.abc import Mapping

from onnx_modular.errors import InvalidInputError
from onnx_modular.format.text import shown
from onnx_modular.storage.limits import MAX_MANIFEST_BYTES, MAX_MANIFEST_DEPTH, check_count
from onnx_modular.storage.load import read_regular_file

__all__ = ["read_manifest", "read_folder_json", "file_in_folder", "check_feeds", "check_stage_file", "STAGE_OUTPUT"]

#: How a manifest names a value one stage computes for a later one: ``stage_<k>/<name>``.
STAGE_OUTPUT = re.compile(r"stage_(\d+)/(.+)", re.DOTALL)


def _invalid(path: pathlib.Path, why: str) -> InvalidInputError:
    return InvalidInputError(
        f"{shown(str(path))!r} is not a valid split manifest: {why}.",
        hint="Write the folder again with `onnx-modular split`; run_stages reads only what split writes.",
    )


def _depth(text: str) -> int:
    """The deepest nesting of ``[`` and ``{`` outside strings, counted on the text (no parsing)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _strings(value, path: pathlib.Path, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _invalid(path, f"{what} must be an object of names (strings) to names")
    return value


def _stage_file(folder: pathlib.Path, name: str, path: pathlib.Path, k: int) -> pathlib.Path:
    """The stage file ``name`` inside ``folder``: relative, through no link, a regular file."""
    problem, current = _inside(folder, name)
    if problem:
        raise _invalid(path, f"the file of stage {k} ({shown(name)!r}) {problem}")
    return current


def _inside(folder: pathlib.Path, name: object) -> tuple[str | None, pathlib.Path]:
    """(what is wrong with ``name`` as a file of ``folder``, or ``None``; its path)."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a file name", folder
    relative = pathlib.PurePosixPath(name)
    if not name or "\x00" in name or relative.is_absolute() or ".." in relative.parts or "\\" in name:
        return "is outside the folder", folder
    if not relative.parts or relative.parts == (".",):
        return "names the folder itself, not a file", folder
    current = folder
    for part in relative.parts:
        current = current / part
        try:
            info = os.lstat(current)
        except OSError as e:
            return f"cannot be read: {e.strerror or e}", current
        if stat.S_ISLNK(info.st_mode):
            return "goes through a symbolic link; links are not followed", current
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file", current
    return None, current


def file_in_folder(folder: str | os.PathLike, name: object, what: str, *, hint: str | None = None) -> pathlib.Path:
    """The file ``name`` a folder's own JSON names (a manifest's stage, ``export.json``'s component):
    relative, inside ``folder``, through no symbolic link, a regular file; else an
    :class:`InvalidInputError` naming ``what`` (never the path outside)."""
    problem, current = _inside(pathlib.Path(folder), name)
    if problem:
        raise InvalidInputError(f"{what} ({shown(str(name))!r}) {problem}.", hint=hint)
    return current


def read_folder_json(path: str | os.PathLike, what: str, *, hint: str | None = None) -> object:
    """A small JSON file of a folder (``export.json``) read as untrusted input: a regular file of at
    most :data:`~onnx_modular.storage.limits.MAX_MANIFEST_BYTES`, nested at most
    :data:`~onnx_modular.storage.limits.MAX_MANIFEST_DEPTH` levels, UTF-8 JSON."""
    path = pathlib.Path(path)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise InvalidInputError(f"{what} {shown(str(path))!r} is not a regular file (a link, a FIFO or a folder).", hint=hint)
        text = bytes(read_regular_file(path, str(path), limit=MAX_MANIFEST_BYTES)).decode("utf-8")
    except InvalidInputError:
        raise
    except Exception as e:  # too large, unreadable, not UTF-8
        raise InvalidInputError(f"{what} {shown(str(path))!r} cannot be read: {shown(str(e).splitlines()[0] if str(e) else type(e).__name__)}.", hint=hint) from None
    if _depth(text) > MAX_MANIFEST_DEPTH:
        raise InvalidInputError(f"{what} {shown(str(path))!r} nests more than {MAX_MANIFEST_DEPTH} levels of lists and objects.", hint=hint)
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidInputError(f"{what} {shown(str(path))!r} is not JSON: {shown(str(e))}.", hint=hint) from None


def _check_stages(manifest: dict, folder: pathlib.Path, path: pathlib.Path) -> list[pathlib.Path]:
    stages = manifest.get("stages")
    if not isinstance(stages, list) or not stages:
        raise _invalid(path, "'stages' must be a non-empty list")
    check_count("MAX_STAGES", len(stages), f"{shown(str(path))!r} lists {len(stages)} stages, the number of stages")
    files, seen, produced = [], set(), set()
    for k, stage in enumerate(stages):
        if not isinstance(stage, dict) or not isinstance(stage.get("file"), str):
            raise _invalid(path, f"stage {k} must be an object with a 'file' string")
        sources = _strings(stage.get("inputs"), path, f"the inputs of stage {k}")
        outputs = stage.get("outputs", [])
        if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
            raise _invalid(path, f"the outputs of stage {k} must be a list of names")
        for source in sources.values():
            match = STAGE_OUTPUT.fullmatch(source)
            if match and source not in produced:
                raise _invalid(path, f"stage {k} reads {shown(source)!r}, which no earlier stage computes")
        file = _stage_file(folder, stage["file"], path, k)
        key = os.path.realpath(file)
        if key in seen:
            raise _invalid(path, f"stage {k} uses the file {shown(stage['file'])!r} of an earlier stage")
        seen.add(key)
        files.append(file)
        produced.update(f"stage_{k}/{name}" for name in outputs)
    for name, source in _strings(manifest.get("outputs"), path, "'outputs'").items():
        if source not in produced:
            raise _invalid(path, f"the model output {shown(name)!r} comes from {shown(source)!r}, which no stage computes")
    return files


def read_manifest(folder: str | os.PathLike, name: str = "manifest.json") -> tuple[dict, list[pathlib.Path]]:
    """The checked manifest of a split folder and the paths of its stage files, in order.

    Raises:
        InvalidInputError: Saying what is wrong (see the module's docstring). Nothing has run.
    """
    folder = pathlib.Path(folder)
    path = folder / name
    if not folder.is_dir():
        raise InvalidInputError(f"{shown(str(folder))!r} is no folder, so it holds no {name}: give a folder written by split.")
    try:
        info = os.lstat(path)
    except OSError:
        raise InvalidInputError(f"{shown(str(folder))!r} holds no {name}: it is not a folder written by split.") from None
    if not stat.S_ISREG(info.st_mode):
        raise _invalid(path, "it is not a regular file (a link, a FIFO or a folder)")
    try:
        text = bytes(read_regular_file(path, str(path), limit=MAX_MANIFEST_BYTES)).decode("utf-8")
    except Exception as e:  # too large, unreadable, not UTF-8
        raise _invalid(path, shown(str(e).splitlines()[0] if str(e) else type(e).__name__)) from None
    if _depth(text) > MAX_MANIFEST_DEPTH:
        raise _invalid(path, f"it nests more than {MAX_MANIFEST_DEPTH} levels of lists and objects")
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise _invalid(path, shown(str(e))) from None
    if not isinstance(manifest, dict):
        raise _invalid(path, "it must be a JSON object")
    return manifest, _check_stages(manifest, folder, path)


def check_feeds(feeds, stages: int) -> Mapping:
    """``feeds`` as run_stages takes them: a mapping of names, none named like a stage output."""
    if not isinstance(feeds, Mapping):
        raise InvalidInputError(
            f"The feeds must be a mapping of input names to arrays, not {type(feeds).__name__}.",
            hint='Pass {"input_ids": ids, ...} (or an .npz file\'s arrays by name).',
        )
    for name in feeds:
        if not isinstance(name, str):
            raise InvalidInputError(f"The feeds' names must be strings, not {type(name).__name__}.")
        match = STAGE_OUTPUT.fullmatch(name)
        if match and int(match.group(1)) < stages:
            raise InvalidInputError(
                f"The input {shown(name)!r} is named like the output of stage {match.group(1)}; run_stages cannot tell them apart.",
                hint="Rename the model input (stage_<k>/<name> names the values split passes between stages).",
            )
    return feeds


def check_stage_file(path: pathlib.Path, k: int) -> None:
    """Load a stage with every tool's bounds before onnxruntime runs it (call bombs, endless loops)."""
    from onnx_modular.storage.checks import check_expanded_size
    from onnx_modular.storage.load import load_model_file

    model = load_model_file(path)  # the values too: a Loop's constant trip count is one
    check_expanded_size(model, name=f"stage {k} ({shown(str(path))!r})")
