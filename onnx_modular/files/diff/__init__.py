"""``diff``: two files compared module call by module call.

:mod:`.tool` is the command; :mod:`.numerics` runs both files on the same inputs,
:mod:`.result` holds the comparison and :mod:`.views` prints it.
"""
