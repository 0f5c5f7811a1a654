"""What a run measures, never what it concludes: the sensors the backend families and the step
tracker read, and the rules judge through what they report.

:mod:`.dynamo` (torch.compile's own records, process-wide), :mod:`.tracer` (host reads of device
tensors: counted on eager accelerators, located in trace mode), :mod:`.numerics` (the step
checks: non-finite gradients and their source, low-precision updates that round away) and
:mod:`.frames` (which frame is the user's line)."""
