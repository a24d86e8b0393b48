"""The catalogue of models the tests and the sweep scripts share: every architecture transformers
ships, built tiny with random weights and valid inputs, exported both ways in bounded children,
each file tool run on the result, and the report (``docs/coverage.md``).

The modules, bottom up: :mod:`catalogue.overrides` (sizes, the sample, per-architecture settings),
:mod:`catalogue.shrinking` (config rules), :mod:`catalogue.media_inputs` and
:mod:`catalogue.model_inputs` (inputs), :mod:`catalogue.reference_outputs` (PyTorch's reference),
:mod:`catalogue.building` (a model with its inputs), :mod:`catalogue.tools_phase` (every file tool
on a row's files), :mod:`catalogue.coverage` (rows and the report), :mod:`catalogue.jobs` (a row
in bounded child processes). ``scripts/sweep_transformers.py`` is the command line over them.
"""
