"""Goodput: how much of a job's wall time went into training steps it kept, and where the rest went.

``ap.Checkpointer`` keeps the account on rank 0, in its own directory, so that every
run of a job (each restart, each requeue) adds to it:

    goodput.jsonl           one line per event: a run began (when its process started,
                            when its restore ended, the step it resumed from), a save
                            (its step, how long the loop waited for it), a run ended
    goodput-progress.bin    the running run's last step, stored at every step through a
                            memory map of the file (no system call, no new file): what a
                            run killed with SIGKILL had reached

The account (:func:`account`) splits the wall time into

    productive      the steps whose result the job kept
    recomputed      steps done and lost: past the checkpoint the next run resumed from
    start-up        each run's process start to the end of its restore (imports,
                    building the model, loading the checkpoint), and the launcher's
                    start before the first run
    restarts        a run's last step to the next run's process start (the failure,
                    its detection, the new processes); a step cut short counts here
    saves           the time the loop waited for checkpoints to be written
    other           what is left (the end of the last run, the launcher's exit)

and gives the checkpoint interval that would maximise goodput from the measured save
cost C and the mean time between the failures that lost work M: about sqrt(2 C M)
(Young, 1974; Daly, 2006). A stop request (SIGTERM) saves before stopping and loses
no steps: it is not such a failure.

Nothing here imports torch: ``accelport doctor`` and ``accelport launch`` read the account.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import struct
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ATTEMPT_ENV", "JOURNAL", "PROGRESS", "POINTER", "Journal", "attempt", "process_start_time", "read_runs",
           "account", "account_of_directory", "render"]

#: Which attempt of the job a process belongs to: 0, then 1 after the first restart (torchrun's agent sets it,
#: and accelport launch's own loop on XLA backends).
ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"

JOURNAL = "goodput.jsonl"
PROGRESS = "goodput-progress.bin"
#: What rank 0's checkpointer leaves in ``$ACCELPORT_LAUNCH_DIR``: where its journal is.
POINTER = "goodput-journal.json"
#: The progress file: the run's id (16 bytes of ASCII), then two slots written in turn (step parity) through a
#: shared memory map, each the step, the time, the busy and blocked seconds and a check of the step stored last:
#: a plain store into the page cache per step, no system call, no formatting; a kill in the middle of one slot's
#: store leaves that slot's check wrong and the other slot whole.
_HEAD = 16
_SLOT_FORMAT = struct.Struct("<qdddq")
_CHECK = 0x5A5A_A5A5_5A5A_A5A5


def process_start_time(pid: int | None = None) -> float | None:
    """When this process (or ``pid``) started, in seconds since 1970; None where /proc cannot say.

    From its start in clock ticks since boot and the seconds since boot now (``/proc/uptime``, to
    the hundredth), not from boot time, which is rounded to the second."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            stat = f.read()
        started_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counting from pid and comm
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        return now - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _append(path: str, event: Mapping[str, Any]) -> None:
    """One line, in one write with O_APPEND: a line is never split by a kill, only missing."""
    line = (json.dumps(dict(event), allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Journal:
    """Rank 0's account of one run, in the checkpointer's directory. Every write is best effort: an account
    that cannot be written never stops training (it is then said to be missing, not wrong)."""

    def __init__(self, directory: str, run: str, *, resumed_from: int, restore_began: float, restored: float,
                 environ: Mapping[str, str], settings: Mapping[str, Any]) -> None:
        self.directory = directory
        self.run = run
        self.path = os.path.join(directory, JOURNAL)
        self.progress_path = os.path.join(directory, PROGRESS)
        self.ended = False
        self.broken = False
        self._map: Any = None
        #: The last step said, with its busy and blocked seconds: what an exit without close() says.
        self.last: tuple[int, float, float] | None = None
        runs = read_runs(directory)
        try:
            self._fold_progress()
            if resumed_from == 0 and (not runs or runs[-1].get("end") == "finished"):
                # No checkpoint, and no run of this job was cut short: a new job's account begins.
                for name in (JOURNAL, PROGRESS):
                    try:
                        os.unlink(os.path.join(directory, name))
                    except FileNotFoundError:
                        pass
            start = process_start_time()
            _append(self.path, {"event": "start", "run": run, "pid": os.getpid(),
                                "process_start": start if start is not None else restore_began,
                                "process_start_known": start is not None, "restore_began": restore_began,
                                "time": restored, "resumed_from": resumed_from,
                                "launch": environ.get("ACCELPORT_LAUNCH_DIR") or None,
                                "attempt": attempt(environ), **settings})
        except OSError:
            self.broken = True
            return
        try:
            self._map = _mapped(self.progress_path, run)
        except (OSError, ValueError):  # a filesystem that cannot map files: the events are kept, the step is not
            self._map = None
        # A process that ends without close() still says so (a kill says nothing: its progress stands).
        atexit.register(_end_at_exit, weakref.ref(self))

    def _fold_progress(self) -> None:
        """The last run's progress becomes a line of the journal before this run's lines follow."""
        record = _read_progress(self.progress_path)
        if record is not None:
            _append(self.path, {"event": "progress", **record})

    def step(self, step: int, busy_s: float, blocked_s: float) -> None:
        """The step reached, stored in its slot of the mapped progress file (a few hundred nanoseconds)."""
        self.last = (step, busy_s, blocked_s)
        if self._map is not None:
            _SLOT_FORMAT.pack_into(self._map, _HEAD + (step & 1) * _SLOT_FORMAT.size, step, time.time(), busy_s,
                                   blocked_s, step ^ _CHECK)

    def saved(self, step: int, blocked_s: float, busy_s: float, *, background: bool) -> None:
        self._event({"event": "save", "step": step, "blocked_s": round(blocked_s, 6), "busy_s": round(busy_s, 6),
                     "background": background})

    def waited(self, blocked_s: float) -> None:
        """The loop waited for a background save to finish writing."""
        self._event({"event": "wait", "blocked_s": round(blocked_s, 6)})

    def end(self, how: str, step: int, busy_s: float, blocked_s: float) -> None:
        """How the run ended: "finished" (close()), "stopped" (saved on a stop request and exited), "failed" (an
        exception left the checkpointer's ``with`` block), "exited" (the process ended without close()). A run
        killed says nothing: its progress stands."""
        if self.ended:
            return
        self.ended = True
        self.step(step, busy_s, blocked_s)
        self._event({"event": "end", "how": how, "step": step, "busy_s": round(busy_s, 6),
                     "blocked_s": round(blocked_s, 6)})
        if self._map is not None:
            try:
                self._map.close()
            except (OSError, ValueError):
                pass
            self._map = None

    def _event(self, event: dict[str, Any]) -> None:
        if self.broken:
            return
        try:
            _append(self.path, {**event, "run": self.run, "time": time.time()})
        except OSError:
            self.broken = True


def _mapped(path: str, run: str) -> Any:
    """``path`` made the run's id and two empty slots, mapped shared for writing (what is stored reaches the file)."""
    import mmap

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, run.encode()[:_HEAD].ljust(_HEAD) + b"\0" * (2 * _SLOT_FORMAT.size))
        return mmap.mmap(fd, _HEAD + 2 * _SLOT_FORMAT.size, mmap.MAP_SHARED, mmap.PROT_WRITE | mmap.PROT_READ)
    finally:
        os.close(fd)  # the map keeps the file


def _read_progress(path: str) -> dict[str, Any] | None:
    """The newest whole slot of a progress file, as a progress event's fields; None if there is none."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) < _HEAD + 2 * _SLOT_FORMAT.size:
        return None
    run = data[:_HEAD].decode("ascii", "replace").strip()
    best = None
    for slot in (0, 1):
        step, at, busy, blocked, check = _SLOT_FORMAT.unpack_from(data, _HEAD + slot * _SLOT_FORMAT.size)
        if check == step ^ _CHECK and step >= 0 and (best is None or step > best["step"]) \
                and all(math.isfinite(v) for v in (at, busy, blocked)):
            best = {"run": run, "step": step, "time": at, "busy_s": busy, "blocked_s": blocked}
    return best if run else None


def _end_at_exit(ref: Any) -> None:
    journal = ref()
    if journal is not None and not journal.ended and journal.last is not None:
        journal.end("exited", *journal.last)


def attempt(environ: Mapping[str, str]) -> int:
    """The attempt a process with this environment belongs to (0 where it is unset or not a number)."""
    try:
        return max(0, int((environ.get(ATTEMPT_ENV) or "0").strip()))
    except ValueError:
        return 0


# -- reading the account ---------------------------------------------------------------------------


def read_runs(directory: str) -> list[dict[str, Any]]:
    """Each run the journal in ``directory`` holds, oldest first, its events gathered: ``start`` (the start
    event), ``saves``, ``waits``, ``end`` (how it ended, or None), ``step``/``time``/``busy_s``/``blocked_s``
    (the last it said). A line that is not JSON (cut by a full disk) is skipped."""
    runs: dict[str, dict[str, Any]] = {}
    try:
        with open(os.path.join(directory, JOURNAL), "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    events = []
    for raw in lines:
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("run"), str):
            events.append(event)
    live = _read_progress(os.path.join(directory, PROGRESS))
    if live is not None:
        events.append({"event": "progress", **live})
    for event in events:
        kind, run = event.get("event"), event["run"]
        if kind == "start":
            runs[run] = {"run": run, "start": event, "saves": [], "waits": [], "end": None,
                         "step": event.get("resumed_from", 0), "time": event.get("time"), "busy_s": 0.0,
                         "blocked_s": 0.0}
            continue
        row = runs.get(run)
        if row is None:
            continue
        if kind == "save":
            row["saves"].append(event)
        elif kind == "wait":
            row["waits"].append(event)
        elif kind == "end":
            row["end"] = event.get("how")
        if kind in ("progress", "end", "save") and _number(event.get("step")) is not None \
                and event["step"] >= row["step"]:
            for key in ("step", "time", "busy_s", "blocked_s"):
                if _number(event.get(key)) is not None:
                    row[key] = event[key]
    return list(runs.values())


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _busy_at(run: Mapping[str, Any], step: int) -> float | None:
    """The run's busy seconds when it reached ``step``: known at its saves and at its last step."""
    if step <= run["start"].get("resumed_from", 0):
        return 0.0
    if step == run["step"]:
        return float(run["busy_s"])
    for save in run["saves"]:
        if save.get("step") == step and _number(save.get("busy_s")) is not None:
            return float(save["busy_s"])
    return None


def account(runs: Sequence[Mapping[str, Any]], *, started: float | None = None,
            ended: float | None = None) -> dict[str, Any] | None:
    """The job's account over ``runs`` (:func:`read_runs`), in seconds; None without a run.

    ``started``/``ended``: the job's own wall-clock bounds (the launcher's); by default the first
    run's process start and the last thing the last run said."""
    if not runs:
        return None
    first, last = runs[0], runs[-1]
    started = float(first["start"]["process_start"]) if started is None else started
    ended = float(last["time"]) if ended is None else ended
    wall = max(0.0, ended - started)
    productive = recomputed = startup = restart = blocked = 0.0
    kept_steps = lost_steps = saves = 0
    failures = stops = 0
    estimated = False
    rows = []
    for i, run in enumerate(runs):
        start = run["start"]
        resumed = int(start.get("resumed_from", 0))
        reached = int(run["step"])
        following = runs[i + 1] if i + 1 < len(runs) else None
        if following is not None:
            kept_to = int(following["start"].get("resumed_from", 0))
        elif run["end"] in ("finished", "stopped", "exited"):
            kept_to = reached
        else:  # the job ended with this run cut short: what it had not saved is lost
            kept_to = max([resumed] + [int(s["step"]) for s in run["saves"] if isinstance(s.get("step"), int)])
        kept_to = min(kept_to, reached)
        busy = float(run["busy_s"])
        kept_busy = _busy_at(run, kept_to)
        if kept_busy is None:  # resumed from a step this run did not save (another rank's timing): in proportion
            estimated = True
            kept_busy = busy * (kept_to - resumed) / max(1, reached - resumed)
        kept = max(0, kept_to - resumed)
        lost = max(0, reached - max(kept_to, resumed))
        productive += kept_busy
        recomputed += busy - kept_busy
        kept_steps += kept
        lost_steps += lost
        blocked += float(run["blocked_s"])
        saves += len(run["saves"])
        up = max(0.0, float(start["time"]) - float(start["process_start"]))
        startup += up
        gap = None
        if following is not None:
            gap = max(0.0, float(following["start"]["process_start"]) - float(run["time"]))
            restart += gap
            if run["end"] == "stopped":
                stops += 1
            elif run["end"] != "finished":
                failures += 1
        rows.append({"run": run["run"], "attempt": start.get("attempt"), "resumed_from": resumed,
                     "reached": reached, "kept_steps": kept, "lost_steps": lost, "ended": run["end"] or "killed",
                     "start_up_s": up, "busy_s": busy, "save_blocked_s": float(run["blocked_s"]),
                     "saves": len(run["saves"]), "restart_s": gap})
    # Before the first process: the launcher starting it (torchrun's agent, the rendezvous) is start-up too.
    startup += max(0.0, float(first["start"]["process_start"]) - started)
    counted = productive + recomputed + startup + restart + blocked
    save_seconds = [float(s["blocked_s"]) for r in runs for s in r["saves"] if _number(s.get("blocked_s")) is not None]
    save_cost = sum(save_seconds) / len(save_seconds) if save_seconds else None
    between = wall / failures if failures else None
    step_s = productive / kept_steps if kept_steps else None
    every_steps = first["start"].get("every_steps")
    interval_now = (step_s * every_steps if step_s is not None and isinstance(every_steps, int) else None)
    best = math.sqrt(2 * save_cost * between) if save_cost is not None and between is not None else None
    if best is None:
        why = ("no save was measured" if save_cost is None else
               "no failure lost work in this job (a stop request saves first)")
    else:
        why = None
    return {
        "goodput": productive / wall if wall > 0 else None,
        "wall_s": wall, "productive_s": productive, "productive_steps": kept_steps,
        "recomputed_s": recomputed, "recomputed_steps": lost_steps, "start_up_s": startup, "restart_s": restart,
        "save_blocked_s": blocked, "saves": saves, "save_cost_s": save_cost, "other_s": max(0.0, wall - counted),
        "runs": len(runs), "restarts": len(runs) - 1, "failures": failures, "stops": stops,
        "mean_time_between_failures_s": between, "step_s": step_s,
        "every_steps": every_steps, "every_seconds": first["start"].get("every_seconds"),
        "interval_s": interval_now, "best_interval_s": best,
        "best_every_steps": max(1, round(best / step_s)) if best is not None and step_s else None,
        "best_interval_unknown": why, "estimated": estimated, "per_run": rows,
    }


def account_of_directory(directory: str, *, launch: str | None = None, started: float | None = None,
                         ended: float | None = None) -> dict[str, Any] | None:
    """:func:`account` of the journal in ``directory``; ``launch``: only the runs of that launch."""
    runs = read_runs(directory)
    if launch is not None:
        runs = [r for r in runs if r["start"].get("launch") == launch]
    result = account(runs, started=started, ended=ended)
    if result is not None:
        result["journal"] = os.path.join(directory, JOURNAL)
    return result


def _s(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 100:
        return f"{seconds / 60:.1f} min"
    if seconds < 1:
        return f"{seconds * 1000:.1f} ms" if seconds < 0.01 else f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


def render(result: Mapping[str, Any]) -> list[str]:
    """The account in two or three lines of plain words."""
    if result.get("goodput") is None:
        return [f"goodput: the job's wall time was not measured ({result.get('runs', 0)} run(s))"]
    restarts = result["restarts"]
    parts = [f"productive {_s(result['productive_s'])} ({result['productive_steps']} steps)"]
    if result["recomputed_steps"] or result["recomputed_s"] > 0:
        parts.append(f"recomputed {result['recomputed_steps']} step(s) lost past the last checkpoint "
                     f"({_s(result['recomputed_s'])})")
    parts.append(f"start-up and restore {_s(result['start_up_s'])}")
    if restarts:
        parts.append(f"restarts {_s(result['restart_s'])}")
    if result["saves"]:
        parts.append(f"saves blocked the loop {_s(result['save_blocked_s'])} ({result['saves']} saves, "
                     f"{_s(result['save_cost_s'])} each)")
    if result["other_s"] >= 0.0005:
        parts.append(f"other {_s(result['other_s'])}")
    lines = [f"goodput {100 * result['goodput']:.1f}% of {_s(result['wall_s'])}"
             f"{f' over {restarts + 1} runs ({restarts} restart(s))' if restarts else ''}: " + "; ".join(parts)]
    now = ""
    if result.get("every_steps"):
        now = f"every {result['every_steps']} steps"
        if result.get("interval_s") is not None:
            now += f" ({_s(result['interval_s'])})"
        now += " now; "
    if result["best_interval_s"] is not None:
        steps = f", {result['best_every_steps']} steps" if result.get("best_every_steps") else ""
        lines.append(f"checkpoint interval: {now}about {_s(result['best_interval_s'])}{steps} would maximise goodput "
                     f"(sqrt(2 x {_s(result['save_cost_s'])} per save x {_s(result['mean_time_between_failures_s'])} "
                     "between failures; Young/Daly)")
    elif result.get("best_interval_unknown"):
        lines.append(f"checkpoint interval: {now}the best one cannot be told from this job: "
                     f"{result['best_interval_unknown']}")
    if result.get("estimated"):
        lines.append("(some steps' time is estimated in proportion: a run resumed from a step it did not save)")
    return lines
