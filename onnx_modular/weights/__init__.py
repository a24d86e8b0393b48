"""Weights read one tensor at a time: sources and plans (:mod:`.sources`), streaming an export (:mod:`.streaming`).

``from onnx_modular.weights import WeightSource`` keeps working: the public names of
:mod:`onnx_modular.weights.sources` are re-exported here.
"""

from onnx_modular.weights.sources import *  # noqa: F403
from onnx_modular.weights.sources import __all__  # noqa: F401
