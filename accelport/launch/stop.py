"""What a stop request (SIGTERM, a spot or preemptible machine going away) means between a worker and the launcher.

A worker whose :class:`accelport.Checkpointer` saved at the step boundary after the
request exits with :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL`` of sysexits.h: "try
again later"); one that could not save within the deadline
(``ACCELPORT_STOP_DEADLINE_S``, default :data:`DEADLINE_S`) exits as the signal would
have ended it, 128 + its number (143 for SIGTERM). Under ``accelport launch`` each
worker that saved also leaves ``stopped-rank<N>.json`` in the launch directory, and the
launcher exits with :data:`EXIT_PREEMPTED` only when every worker of its host did. A
request can also come too late to matter: the ranks act on it at the step they agree on
(every few steps), and a script that ends first has nothing left to save; when every
worker of the host finished its script (``done-rank<N>.json``) and none saved, the launch
exits 0, as the job did.

Torch-free: the launcher, the worker wrapper and the checkpointer all read it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

from accelport.errors import AccelportError, UsageError

__all__ = ["EXIT_PREEMPTED", "DEADLINE_ENV", "DEADLINE_S", "LAUNCHER_MARGIN_S", "STOPPED_PREFIX", "LaunchStopped",
           "deadline_s", "unsaved_status", "record_stop", "read_stops", "stopped_launch"]

#: Exit status of a process stopped on request after its checkpoint was saved: run it again to resume.
EXIT_PREEMPTED = 75
#: The variable that bounds the time from a stop request to the exit, in seconds.
DEADLINE_ENV = "ACCELPORT_STOP_DEADLINE_S"
DEADLINE_S = 30.0
#: Seconds the launcher waits past the deadline before it kills the workers that are left: the
#: workers' own deadline comes first, and their exit with it.
LAUNCHER_MARGIN_S = 15.0
#: Records are ``$ACCELPORT_LAUNCH_DIR/<STOPPED_PREFIX><rank>.json``.
STOPPED_PREFIX = "stopped-rank"


def deadline_s(environ: Mapping[str, str]) -> float:
    """``ACCELPORT_STOP_DEADLINE_S`` in seconds (default :data:`DEADLINE_S`); a UsageError if it is not a
    positive number."""
    raw = (environ.get(DEADLINE_ENV) or "").strip()
    if not raw:
        return DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < 7 * 86400:
        from accelport.redact import redact

        raise UsageError(f"{DEADLINE_ENV} must be a number of seconds above 0 (the time from a stop request such as "
                         f"SIGTERM to the exit), not {redact(DEADLINE_ENV, raw)[:40]!r}; unset it for "
                         f"{DEADLINE_S:.0f}")
    return value


#: torchrun's grace period for its workers after a stop signal where TORCH_ELASTIC_SHUTDOWN_TIMEOUT is not read.
TORCHRUN_FIXED_GRACE_S = 30.0


def torchrun_grace_note(deadline: float, takes_setting: bool | None) -> str | None:
    """What to say where torchrun would kill the workers before the stop deadline: a torch whose torchrun has
    its grace period fixed at 30 s (``takes_setting`` False), with a deadline above it; else None."""
    if takes_setting is not False or deadline <= TORCHRUN_FIXED_GRACE_S:
        return None
    return (f"this torch's torchrun kills the workers {TORCHRUN_FIXED_GRACE_S:.0f} s after a stop signal (it does not "
            f"read TORCH_ELASTIC_SHUTDOWN_TIMEOUT), before the {deadline:g} s of {DEADLINE_ENV}: a save still "
            f"running then is cut short and the run resumes from the checkpoint before it. Install a torch whose "
            f"torchrun takes --shutdown-timeout, or set {DEADLINE_ENV} to at most "
            f"{TORCHRUN_FIXED_GRACE_S:.0f}")


def unsaved_status(signum: int) -> int:
    """The exit status of a process the signal ended before it saved: what the signal's default would give."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def record_stop(directory: str | None, rank: int, record: Mapping[str, Any]) -> None:
    """Tell the launcher that ``rank`` saved and exits on a stop request (nothing outside ``accelport launch``)."""
    if not directory:
        return
    from accelport.launch.heartbeat import write_json

    write_json(os.path.join(directory, f"{STOPPED_PREFIX}{rank}.json"), {"rank": rank, **record})


def read_stops(directory: str) -> dict[int, dict[str, Any]]:
    """Rank -> its stop record, for the ranks of this host that saved and exited on a stop request. (A
    restarted worker removes its rank's records of the attempt before, so what is here is the last one's.)"""
    from accelport.launch.heartbeat import read_ranked

    return read_ranked(directory, STOPPED_PREFIX, ".json")


class LaunchStopped(AccelportError):
    """The launch was stopped on request (a signal); ``exit_status`` says whether every worker saved."""

    #: The job's goodput account up to the stop (set by the launcher), where one was kept.
    goodput: dict[str, Any] | None = None

    def __init__(self, signum: int, saved: Mapping[int, Mapping[str, Any]], expected: int | None,
                 finished: Mapping[int, Mapping[str, Any]] | None = None) -> None:
        self.signum = signum
        self.saved = dict(saved)
        #: Workers of this host whose script returned (the stop came too late to matter to them).
        self.finished = {r: dict(v) for r, v in (finished or {}).items() if r not in self.saved}
        #: Workers of this host that ended without saving.
        self.not_saved = max(0, (expected or 0) - len(self.saved)) if expected else (0 if self.saved else 1)
        name = signal_name(signum)
        steps = sorted({int(r["step"]) for r in self.saved.values() if isinstance(r.get("step"), int)})
        where = sorted({str(r.get("path")) for r in self.saved.values() if r.get("path")})
        if not self.saved and expected and len(self.finished) >= expected:
            self.exit_status = 0
            self.not_saved = 0
            taken = sorted({int(r["steps"]) for r in self.finished.values() if isinstance(r.get("steps"), int)})
            after = f" after {', '.join(map(str, taken))} steps" if taken and taken != [0] else ""
            message = (f"stopped by {name} as the job ended: every rank had finished its script{after} before the "
                       "ranks reached a step to stop at, so there was nothing left to save (exit status 0)")
        elif self.saved and not self.not_saved:
            self.exit_status = EXIT_PREEMPTED
            message = (f"stopped by {name}: every rank saved its checkpoint (step {', '.join(map(str, steps))}, "
                       f"{', '.join(where)}) and exited; run the same command again to resume from it "
                       f"(exit status {EXIT_PREEMPTED})")
        else:
            self.exit_status = unsaved_status(signum)
            if self.saved:
                lost = (f"{self.not_saved} of {len(self.saved) + self.not_saved} workers ended without saving "
                        f"(ranks {', '.join(map(str, sorted(self.saved)))} saved step "
                        f"{', '.join(map(str, steps))})")
            else:
                lost = "no worker saved a checkpoint"
            message = (f"stopped by {name}: {lost}: no ap.Checkpointer in the script, a step or save longer than "
                       f"{DEADLINE_ENV}, or a rank that was already failing; a rerun resumes from the last "
                       f"complete checkpoint, if there is one (exit status {self.exit_status})")
        super().__init__(message)

    def to_dict(self) -> dict[str, Any]:
        return {"signal": signal_name(self.signum), "exit_status": self.exit_status,
                "saved": {str(k): dict(v) for k, v in sorted(self.saved.items())}, "not_saved": self.not_saved,
                "finished": sorted(self.finished)}


def stopped_launch(directory: str, signum: int, expected: int | None) -> LaunchStopped:
    """The outcome of a launch stopped by ``signum``: which of this host's ``expected`` workers saved, and
    which had finished their script."""
    from accelport.launch.heartbeat import DONE_PREFIX, read_ranked

    return LaunchStopped(signum, read_stops(directory), expected, read_ranked(directory, DONE_PREFIX, ".json"))
