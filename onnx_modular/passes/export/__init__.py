"""The export pipeline's passes, one per file; :mod:`.pipeline` runs them in order."""
