"""A fuzzing campaign that keeps going: every example is checked, every failure is logged.

``pytest tests/test_fuzz.py`` stops at the first failing example (and shrinks it); a
campaign instead counts how many examples fail and why, so that several bugs show up
in one run. It checks the same invariants (``test_fuzz.check_fuzzed_model``) in strict
mode (known bugs are reported, not tolerated). One JSON line per example goes to the
log: ``ok``, seconds, and for a failure the error, the spec (``repr``, evaluable with
``from fuzz_models import *``) and the built modules.

The campaign is test code (``tests/fuzzing/campaign.py``); this file is its command line.

Example::

    python scripts/fuzz_campaign.py --examples 2000 --minutes 40 --log fuzz.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="examples to draw (default 500)")
    parser.add_argument("--minutes", type=float, default=40.0, help="stop drawing after this long (default 40)")
    parser.add_argument("--log", default="fuzz_campaign.jsonl", help="JSON-lines log (appended to)")
    options = parser.parse_args()

    sys.path.insert(0, str(TESTS))
    from fuzzing import campaign

    print(json.dumps(campaign.run(options.examples, options.minutes, options.log)))


if __name__ == "__main__":
    main()
