"""``modularize``: the module hierarchy of a flat file rebuilt from its scopes (or inferred).

:mod:`.tool` is the command; :mod:`.report` says what was recovered.
"""
