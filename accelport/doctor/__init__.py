"""``accelport doctor``: what will happen on this machine, and what to fix, before a run.

:mod:`.finding` (the types checks use), :mod:`.gather` (the facts and the checks,
never importing a vendor runtime or touching a device), :mod:`.render` (text, markdown).
"""
