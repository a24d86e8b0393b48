"""``convert``: precision (float16, bfloat16) and int4/int8 weights chosen per module call.

:mod:`.tool` is the command (``convert_file``); :mod:`.select` picks the calls, :mod:`.ranges`
measures the values, :mod:`.build` writes the converted copy, :mod:`.flat` the flat variant,
:mod:`.verify` runs it against the input file and :mod:`.report` says what was done.
"""
