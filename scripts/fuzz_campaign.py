"""A fuzzing campaign that keeps going: every example is checked, every failure is logged.

``pytest tests/test_fuzz.py`` stops at the first failing example (and shrinks it); a
campaign instead counts how many examples fail and why, so that several bugs show up
in one run. It checks the same invariants (``test_fuzz.check_fuzzed_model``) in strict
mode (known bugs are reported, not tolerated). One JSON line per example goes to the
log: ``ok``, seconds, and for a failure the error, the spec (``repr``, evaluable with
``from fuzz_models import *``) and the built modules.

Example::

    python scripts/fuzz_campaign.py --examples 2000 --minutes 40 --log fuzz.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import pathlib
import sys
import time
import traceback
import warnings

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="examples to draw (default 500)")
    parser.add_argument("--minutes", type=float, default=40.0, help="stop drawing after this long (default 40)")
    parser.add_argument("--log", default="fuzz_campaign.jsonl", help="JSON-lines log (appended to)")
    options = parser.parse_args()

    os.environ["ONNX_MODULAR_FUZZ_STRICT"] = "1"
    sys.path.insert(0, str(TESTS))
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import fuzz_models
    import test_fuzz
    from hypothesis import HealthCheck, given, settings

    deadline = time.monotonic() + options.minutes * 60
    start = time.monotonic()
    counts: collections.Counter[str] = collections.Counter()

    @settings(
        max_examples=options.examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(spec=fuzz_models.model_specs())
    def campaign(spec):
        if time.monotonic() > deadline:
            return
        counts["cases"] += 1
        began = time.monotonic()
        record: dict = {"case": counts["cases"]}
        try:
            test_fuzz.check_fuzzed_model(spec)
            record["ok"] = True
        except Exception as e:  # every failure is a result here, not a reason to stop
            counts["failures"] += 1
            record.update(
                ok=False,
                error=f"{type(e).__name__}: {str(e)[:1500]}",
                traceback=traceback.format_exc()[-3000:],
                spec=repr(spec),
                model=repr(fuzz_models.build(spec)[0]),
            )
        record["seconds"] = round(time.monotonic() - began, 2)
        with open(options.log, "a") as log:
            log.write(json.dumps(record) + "\n")

    campaign()
    summary = {"cases": counts["cases"], "failures": counts["failures"], "seconds": round(time.monotonic() - start)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
