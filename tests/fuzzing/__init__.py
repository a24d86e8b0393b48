"""The fuzzers' test code: the malformed-file fuzzer of the file tools and the model fuzzer's
campaign, which the tests import and ``scripts/fuzz_files.py`` and ``scripts/fuzz_campaign.py``
run at scale (their command lines).

The modules, bottom up: :mod:`fuzzing.runner` (the fork server, one command in a limited child, its
outcome, failure classes), :mod:`fuzzing.builders` (seeds, case helpers, models built with
``onnx.helper``), the generators by theme (:mod:`fuzzing.generators_bytes`,
:mod:`fuzzing.generators_graphs`, :mod:`fuzzing.generators_export`, :mod:`fuzzing.generators_tools`,
:mod:`fuzzing.generators_folders`, :mod:`fuzzing.surfaces`), :mod:`fuzzing.cases` (every case kind
and the campaign), :mod:`fuzzing.campaign` (the model fuzzer's campaign over ``tests/fuzz_models.py``).
"""
