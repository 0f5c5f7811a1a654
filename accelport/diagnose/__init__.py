"""Diagnosis of slow or wrong training: :mod:`.rule` (what a rule is and sees), :mod:`.engine` (the rules
run over a run's records, each kind found once), :mod:`.rules` (the built-in kinds, one module each),
:mod:`.metrics_log` (one JSON line per step), :mod:`.report` (the page ``accelport report`` makes from
that file) and :mod:`.timing` (where a run's step time goes, in one line, and the verdict)."""
