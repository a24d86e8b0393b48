"""Precision rewrites of ``convert`` and ``optimize --quantize``: float casts (:mod:`.casts`)
and weight quantization (:mod:`.quantize_weights`)."""
