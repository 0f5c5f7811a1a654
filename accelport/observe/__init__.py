"""What a run measures, never what it concludes: the sensors the backend families and the step
tracker read, and the rules judge through what they report.

:mod:`.dynamo` (torch.compile's own records, process-wide), :mod:`.tracer` (host reads of device
tensors: counted on eager accelerators, located in trace mode, timed for the step clock),
:mod:`.numerics` (the step checks: non-finite gradients and their source, low-precision updates
that round away), :mod:`.frames` (which frame is the user's line), :mod:`.steptime` (where each
step's time goes: the step clock) and :mod:`.profile` (a profile of chosen steps with the
backend's own profiler)."""
