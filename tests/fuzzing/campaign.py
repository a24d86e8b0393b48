"""The model fuzzer's campaign (``scripts/fuzz_campaign.py`` is its command line): every example
``fuzz_models.model_specs()`` draws is checked by ``test_fuzz.check_fuzzed_model`` in strict mode
(known bugs are reported, not tolerated), and every failure is logged instead of stopping the run.

One JSON line per example goes to the log: ``ok``, seconds, and for a failure the error, the spec
(``repr``, evaluable with ``from fuzz_models import *``) and the built modules.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
import traceback
import warnings


def run(examples: int, minutes: float, log: str) -> dict:
    """Draw up to ``examples`` examples for up to ``minutes``; returns the counts
    (``cases``, ``failures``, ``seconds``). Needs ``tests/`` on ``sys.path``."""
    os.environ["ONNX_MODULAR_FUZZ_STRICT"] = "1"
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import fuzz_models
    import test_fuzz
    from hypothesis import HealthCheck, given, settings

    deadline = time.monotonic() + minutes * 60
    start = time.monotonic()
    counts: collections.Counter[str] = collections.Counter()

    @settings(
        max_examples=examples,
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
        with open(log, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    campaign()
    return {"cases": counts["cases"], "failures": counts["failures"], "seconds": round(time.monotonic() - start)}
