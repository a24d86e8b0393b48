"""The one home of the bounds on work a file or an option can ask for.

Each limit is checked before the work it bounds, and its error names the limit and, where a
genuine model could need more, the environment variable that lifts it. The bounds on a model's
structure (expanded nodes and calls, nesting, ``Loop`` trips and the run time of a ``Loop`` decided
at run time, dimensions) are defined in :mod:`~onnx_modular.storage.checks` and re-exported here;
the others (stages, runs, modules, the guard's scan, ``manifest.json``) are defined here.
"""

from __future__ import annotations

import os

from onnx_modular.errors import InvalidInputError, InvalidModelFileError
from onnx_modular.storage.checks import (
    LOOP_RUN_SECONDS,
    MAX_DIMENSION,
    MAX_EXPANDED_CALLS,
    MAX_EXPANDED_NODES,
    MAX_LOOP_TRIPS,
    MAX_NESTING,
)

__all__ = [
    "MAX_DIMENSION",
    "MAX_EXPANDED_CALLS",
    "MAX_EXPANDED_NODES",
    "MAX_LOOP_TRIPS",
    "MAX_NESTING",
    "LOOP_RUN_SECONDS",
    "MAX_NEIGHBOUR_MODELS",
    "MAX_SCANNED_FIELDS",
    "MAX_STAGES",
    "MAX_RUNS",
    "MAX_MODULES",
    "MAX_TEST_DATA_BYTES",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_DEPTH",
    "MAX_NEW_TOKENS",
    "MAX_POSITIONS",
    "MAX_GUARD_TRIALS",
    "limit",
    "check_count",
]

#: ``.onnx`` files of a destination folder whose external-data references the writer's guard
#: reads (:mod:`~onnx_modular.storage.guard`); a folder holds a handful of models.
MAX_NEIGHBOUR_MODELS = 256
#: Protobuf fields the guard walks in one model file before it stops (a real model has a few per tensor).
MAX_SCANNED_FIELDS = 2_000_000
#: Most stages ``split`` writes (a 100-layer model cut between every layer is 100).
#: ``ONNX_MODULAR_MAX_STAGES`` raises it.
MAX_STAGES = 1024
#: Most timed runs of ``profile`` / ``diff --profile`` (``ONNX_MODULAR_MAX_RUNS`` raises it).
MAX_RUNS = 100_000
#: Most module calls ``modularize`` outlines (``ONNX_MODULAR_MAX_MODULES`` raises it): a 48-layer
#: transformer has about 700; each outlined call costs a pass over its nodes.
MAX_MODULES = 10_000
#: Most bytes of the values ``split``'s stages pass each other, written as their test data (a 1 GiB
#: activation crossing a cut took 15 times its size in memory): ``split --no-data`` skips them,
#: ``ONNX_MODULAR_MAX_TEST_DATA_BYTES`` raises the limit.
MAX_TEST_DATA_BYTES = 256 << 20
#: Largest ``manifest.json`` ``run_stages`` reads, and its deepest nesting of lists and objects.
MAX_MANIFEST_BYTES = 16 << 20
MAX_MANIFEST_DEPTH = 8
#: Most tokens ``generate`` adds in one run when the file does not say the positions it was exported
#: for (``max_position_embeddings`` bounds it first): ``ONNX_MODULAR_MAX_NEW_TOKENS`` raises it.
MAX_NEW_TOKENS = 32_768
#: Most rows of the rotary caches ``optimize --max-positions`` builds (1M rows of a 128-wide head are
#: 512 MB per cache): ``ONNX_MODULAR_MAX_POSITIONS`` raises it.
MAX_POSITIONS = 1 << 20
#: Most calls the accuracy guard of ``optimize --quantize`` tries one by one at float compute
#: (each trial runs the file); ``ONNX_MODULAR_MAX_GUARD_TRIALS`` raises it.
MAX_GUARD_TRIALS = 256

_VARIABLES = {
    "MAX_STAGES": "ONNX_MODULAR_MAX_STAGES",
    "MAX_RUNS": "ONNX_MODULAR_MAX_RUNS",
    "MAX_MODULES": "ONNX_MODULAR_MAX_MODULES",
    "MAX_TEST_DATA_BYTES": "ONNX_MODULAR_MAX_TEST_DATA_BYTES",
    "MAX_LOOP_TRIPS": "ONNX_MODULAR_MAX_LOOP_TRIPS",
    "MAX_EXPANDED_CALLS": "ONNX_MODULAR_MAX_EXPANDED_CALLS",
    "MAX_EXPANDED_NODES": "ONNX_MODULAR_MAX_EXPANDED_NODES",
    "MAX_NEW_TOKENS": "ONNX_MODULAR_MAX_NEW_TOKENS",
    "MAX_POSITIONS": "ONNX_MODULAR_MAX_POSITIONS",
    "MAX_GUARD_TRIALS": "ONNX_MODULAR_MAX_GUARD_TRIALS",
}


def limit(name: str) -> int:
    """The limit ``name`` (``"MAX_STAGES"``), or its environment variable's value when set."""
    default = globals()[name]
    text = os.environ.get(_VARIABLES.get(name, ""), "").strip()
    return int(text) if text.isdigit() else default


def check_count(name: str, count: float, what: str, *, from_file: str | None = None) -> None:
    """Refuse ``count`` above the limit ``name``: an :class:`InvalidModelFileError` when the number
    comes from the file ``from_file``, else an :class:`InvalidInputError` (an option)."""
    bound = limit(name)
    if count <= bound:
        return
    variable = _VARIABLES.get(name)
    lift = f" If this is genuine, raise the limit with the environment variable {variable}={int(count)}." if variable else ""
    if from_file is not None:
        raise InvalidModelFileError(f"{from_file}: {what} ({count:,}) is more than the limit of {bound:,}.{lift}")
    raise InvalidInputError(f"{what} ({count:,}) is more than the limit of {bound:,}.", hint=(lift.strip() or None))
