"""The file fuzzer's campaign: every case kind (:data:`GENERATORS`, with the newest surfaces of
:mod:`fuzzing.surfaces`), the commands a case runs (:func:`commands_for`), the promises checked
after them (:func:`check_promises`), and :func:`run_campaign`. ``scripts/fuzz_files.py`` is its
command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import shutil
import stat
import tempfile
from collections.abc import Callable

import onnx

from fuzzing.builders import CHECKS_FILE, Generator, _fingerprint, make_seeds
from fuzzing.generators_bytes import (
    gen_bad_callee,
    gen_bad_utf8,
    gen_bitflips,
    gen_byte_overwrite,
    gen_external,
    gen_huge_dim,
    gen_huge_varint,
    gen_metadata,
    gen_shuffled_functions,
    gen_special_file,
    gen_splice,
    gen_truncate,
)
from fuzzing.generators_export import gen_checkpoint, gen_output_folder
from fuzzing.generators_folders import (
    gen_diff_trailing,
    gen_generation_guard,
    gen_guard_outputs,
    gen_long_dims,
    gen_manifest,
    gen_small_external,
    gen_tool_bounds,
)
from fuzzing.generators_graphs import (
    gen_bomb,
    gen_constant_bomb,
    gen_deep_chain,
    gen_destination,
    gen_hidden_external,
    gen_many_inputs,
    gen_npz_inputs,
    gen_recursion,
    gen_symbolic_dims,
    gen_terminal_names,
)
from fuzzing.generators_tools import (
    gen_long_names,
    gen_loop_trips,
    gen_many_calls,
    gen_odd_numbers,
    gen_own_data_name,
    gen_replace_lies,
    gen_report_destination,
    gen_report_neighbour,
    gen_sparse_external,
    gen_surface_bomb,
    gen_tool_escapes,
)
from fuzzing.runner import ForkServer, run_command
from fuzzing.surfaces import GENERATORS as _SURFACES

GENERATORS: dict[str, tuple[Generator, float]] = {
    # name: (generator, weight)
    "bitflips": (gen_bitflips, 20),
    "byte_overwrite": (gen_byte_overwrite, 12),
    "truncate": (gen_truncate, 8),
    "splice": (gen_splice, 8),
    "huge_varint": (gen_huge_varint, 6),
    "huge_dim": (gen_huge_dim, 5),
    "bad_callee": (gen_bad_callee, 6),
    "shuffled_functions": (gen_shuffled_functions, 4),
    "metadata": (gen_metadata, 5),
    "bad_utf8": (gen_bad_utf8, 4),
    "external": (gen_external, 6),
    "special_file": (gen_special_file, 2),
    "bomb": (gen_bomb, 3),
    "recursion": (gen_recursion, 3),
    "deep_chain": (gen_deep_chain, 2),
    "many_inputs": (gen_many_inputs, 2),
    "symbolic_dims": (gen_symbolic_dims, 3),
    "hidden_external": (gen_hidden_external, 4),
    "terminal_names": (gen_terminal_names, 3),
    "npz_inputs": (gen_npz_inputs, 2),
    "destination": (gen_destination, 3),
    "constant_bomb": (gen_constant_bomb, 2),
    # issue 38: the new surfaces
    "report_neighbour": (gen_report_neighbour, 2),
    "own_data_name": (gen_own_data_name, 2),
    "surface_bomb": (gen_surface_bomb, 2),
    "loop_trips": (gen_loop_trips, 2),
    "long_names": (gen_long_names, 2),
    "replace_lies": (gen_replace_lies, 2),
    "tool_escapes": (gen_tool_escapes, 2),
    "odd_numbers": (gen_odd_numbers, 2),
    "sparse_external": (gen_sparse_external, 2),
    "report_destination": (gen_report_destination, 2),
    "many_calls": (gen_many_calls, 1),
    # issue 53: convert, diff, split / run_stages, modularize, generation folders
    "guard_outputs": (gen_guard_outputs, 3),
    "generation_guard": (gen_generation_guard, 2),
    "manifest": (gen_manifest, 3),
    "long_dims": (gen_long_dims, 2),
    "tool_bounds": (gen_tool_bounds, 2),
    "diff_trailing": (gen_diff_trailing, 2),
    "small_external": (gen_small_external, 2),
    # Run ``export`` (torch and transformers in the children): only with ``--only checkpoint output_folder``.
    "checkpoint": (gen_checkpoint, 0),
    "output_folder": (gen_output_folder, 0),
}

# issue 65: the newest surfaces (the path guard, generate, optimize's options, modularize's bounds, --in-place)
GENERATORS.update(_SURFACES)

_VERIFY_EXTRAS = [[], [], [], ["--seed", "-1"], ["--rtol", "nan"], ["--atol", "-1"], ["--dim", "batch=0"]]


def commands_for(rng: random.Random, name: str, checks: dict | None = None) -> list[list[str]]:
    checks = checks or {}
    if "commands" in checks:  # a case with commands of its own (checkpoint folders: export)
        return checks["commands"]
    verify = ["--inputs", checks["inputs"]] if "inputs" in checks else rng.choice(_VERIFY_EXTRAS)
    return [
        ["tree", name],
        ["inline", name, "out.onnx", *(["--optimize"] if checks.get("optimize") else [])],
        ["verify", name, *verify],
    ]


def check_promises(case: pathlib.Path, checks: dict, results: list[dict]) -> None:
    """Files a case's generator said must survive (``keep``) or must not appear (``outside``,
    next to the case folder): a difference marks the last command ``data-loss``."""
    changed = [path for path, before in checks.get("keep", {}).items() if _fingerprint(case / path) != before]
    changed += [path for path in checks.get("absent", []) if os.path.lexists(case / path)]
    for path, mode in checks.get("modes", {}).items():
        if os.path.isfile(case / path) and stat.S_IMODE(os.stat(case / path).st_mode) != mode:
            changed.append(f"{path} mode {oct(stat.S_IMODE(os.stat(case / path).st_mode))}, was {oct(mode)}")
    for path, (before, mode_before) in checks.get("private_copies", {}).items():
        if os.path.isfile(case / path):
            mode = stat.S_IMODE(os.stat(case / path).st_mode)
            untouched = _fingerprint(case / path) == before
            if (untouched and mode != mode_before) or (not untouched and mode & 0o077):
                changed.append(f"{path} mode {oct(mode)} ({'untouched, was ' + oct(mode_before) if untouched else 'a copy of a 0600 file'})")
    for index in checks.get("must_succeed", []):
        if index < len(results) and results[index]["outcome"] == "ok" and results[index]["exitcode"] != 0:
            results[index].update(outcome="data-loss", exception="a file the command needs was lost or damaged")
    outside = checks.get("outside")
    if outside and os.path.lexists(case.parent / outside):
        changed.append("../" + outside)
        os.unlink(case.parent / outside)
    if changed and results:
        results[-1].update(outcome="data-loss", exception="changed: " + ", ".join(changed))
    for written in checks.get("no_outside_refs", []):
        leaks = _outside_references(case, case / written)
        if leaks and results:  # the inline that wrote it
            results[1].update(outcome="outside-ref", exception=f"{written} refers to {leaks[0]!r}")


def _outside_references(case: pathlib.Path, path: pathlib.Path) -> list[str]:
    """External-data locations of a written file that leave its folder (a read or a later
    write through them would too), or name something other than a regular file."""
    if not path.is_file():
        return []
    model = onnx.load(str(path), load_external_data=False)
    protos = [model.graph, *model.functions]
    found = []
    while protos:
        proto = protos.pop()
        tensors = list(getattr(proto, "initializer", []))
        for sparse in getattr(proto, "sparse_initializer", []):
            tensors += [sparse.values, sparse.indices]
        for node in proto.node:
            for attribute in node.attribute:
                tensors += [attribute.t, *attribute.tensors]
                for sparse in [attribute.sparse_tensor, *attribute.sparse_tensors]:
                    tensors += [sparse.values, sparse.indices]
                protos += [attribute.g, *attribute.graphs]
        for tensor in tensors:
            for entry in tensor.external_data:
                if entry.key == "location":
                    target = os.path.realpath(case / entry.value)
                    if os.path.dirname(target) != os.path.realpath(case) or not os.path.isfile(target):
                        found.append(entry.value)
    return found


# -- the campaign -------------------------------------------------------------------------


def run_campaign(
    cases: int,
    *,
    seed: int = 0,
    first: int = 0,
    timeout: float = 20.0,
    memory_mb: int = 2048,
    only: list[str] | None = None,
    log: pathlib.Path | None = None,
    workdir: pathlib.Path | None = None,
    progress: Callable[[int, dict], None] | None = None,
    server: ForkServer | None = None,
) -> list[dict]:
    """Run ``cases`` cases (3 commands each); returns one record per case."""
    names = only or [name for name, (_, weight) in GENERATORS.items() if weight]
    weights = [GENERATORS[name][1] or 1 for name in names]
    records = []
    with contextlib.ExitStack() as stack:
        if server is None:
            server = ForkServer(torch=bool({"checkpoint", "output_folder"} & set(names)))
            stack.callback(server.close)
        root = workdir or pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fuzz_files-")))
        seeds = make_seeds(root / "seeds")
        log_file = stack.enter_context(open(log, "a")) if log else None
        for index in range(first, first + cases):
            rng = random.Random(f"{seed}:{index}")
            kind = rng.choices(names, weights)[0]
            case = root / f"case{index}"
            case.mkdir()
            try:
                file_name = GENERATORS[kind][0](rng, case, seeds)
            except Exception as e:
                record = {"case": index, "kind": kind, "generator_error": repr(e)}
            else:
                checks = json.loads((case / CHECKS_FILE).read_text()) if (case / CHECKS_FILE).exists() else {}
                results = [
                    run_command(server, argv, case, timeout, memory_mb << 20)
                    for argv in commands_for(rng, file_name, checks)
                ]
                check_promises(case, checks, results)
                record = {"case": index, "kind": kind, "seed": seed, "results": results}
            records.append(record)
            if log_file:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            if progress:
                progress(index, record)
            shutil.rmtree(case, ignore_errors=True)
    return records
