"""Diagnosis of slow or wrong training: :mod:`.rules` (what each kind of finding looks for),
:mod:`.tracer` (where host reads happen, opt-in), :mod:`.metrics_log` (one JSON line per step)
and :mod:`.report` (the page ``accelport report`` makes from that file)."""
