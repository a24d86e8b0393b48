"""``split``: a modular file cut into stages at module-call boundaries.

:mod:`.tool` is the command; :mod:`.plan` chooses the cuts and what crosses them,
:mod:`.stage` writes one stage, :mod:`.stages` runs a folder ``split`` wrote (``run_stages``).
"""
