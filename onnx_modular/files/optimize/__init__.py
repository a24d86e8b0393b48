"""``optimize``: fused kernels chosen by class, and ``--quantize``.

:mod:`.tool` is the command; :mod:`.quantize` quantizes the fused file's weights and
:mod:`.accuracy_guard` keeps the calls whose int8 compute changes the outputs.
"""
