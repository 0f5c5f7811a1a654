"""Run a launch plan to its end: start the workers, watch them, name the first that failed.

The plan (:mod:`accelport.launch.plan`) says what to start; this module starts
it on the engine the backend trusts (torchrun, or torch_xla's own launcher)
and turns a worker's failure into one :class:`WorkerFailedError`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from accelport.errors import AccelportError
from accelport.launch.heartbeat import (
    ATTEMPT_ENV,
    DONE_PREFIX,
    HEARTBEAT_PREFIX,
    PROBE_FILE,
    WHERE_PREFIX,
    attempt_of,
    read,
    read_ranked,
    write_json,
)
from accelport.launch.plan import LaunchError, LaunchPlan, check_resolves
from accelport.launch.stop import (
    EXIT_PREEMPTED,
    LAUNCHER_MARGIN_S,
    LaunchStopped,
    deadline_s,
    stopped_launch,
    torchrun_grace_note,
)

__all__ = ["WorkerFailure", "WorkerFailedError", "parent_launch_env", "run_plan"]


@dataclass
class WorkerFailure:
    """One worker that ended badly, as the launcher saw it."""

    rank: int
    exitcode: int | None
    error: str
    traceback: str = ""
    host: str = ""
    pid: int | None = None
    time: float | None = None
    #: raised, exit, signal, stopped (by the launcher), stalled (no progress within --timeout or
    #: --startup-timeout), ended-early (its script returned while the others still needed it).
    cause: str = ""

    @property
    def headline(self) -> str:
        """How this worker ended, after "rank N": the launch's one-line summary when it is the first."""
        verb = {"stalled": "stopped making progress", "ended-early": "ended early"}.get(self.cause, "failed first")
        return f"{verb}: {self.error}"


class WorkerFailedError(AccelportError):
    """A worker failed; the others were stopped. ``first`` is the one that failed first."""

    #: The job's goodput account up to the failure (:func:`run_plan`), where one was kept.
    goodput: dict[str, Any] | None = None

    def __init__(self, first: WorkerFailure, failures: list[WorkerFailure]) -> None:
        self.first = first
        self.failures = failures
        others = [f for f in failures if f is not first]
        tail = ""
        if others:
            tail = "; then " + ", ".join(f"rank {f.rank} ({_short(f.error)})" for f in others)
        super().__init__(f"rank {first.rank} {first.headline}{tail}")

    @property
    def exit_status(self) -> int:
        code = self.first.exitcode
        return code if code is not None and 0 < code < 256 else 1

    def to_dict(self) -> dict[str, Any]:
        return {"first": asdict(self.first), "failures": [asdict(f) for f in self.failures]}


def _short(text: str, limit: int = 80) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[: limit - 3] + "..."


_PARENT_ENV_CODE = """
import importlib, json, os, sys
module, function, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for name in filter(None, sys.argv[4].split(",")):
    importlib.import_module(name)  # the vendor package that registers the function's module
before = dict(os.environ)
getattr(importlib.import_module(module), function)(**kwargs)
changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
print("ACCELPORT_LAUNCH_ENV=" + json.dumps(changed), flush=True)
"""


def parent_launch_env(spec: str, kwargs: Mapping[str, int], environ: Mapping[str, str],
                      *, python: str | None = None, timeout: float = 900,
                      preload: str | None = None) -> dict[str, str]:
    """Call ``module:function(**kwargs)`` in a child process; return the variables it set.

    ``preload`` names a module to import first: ``torch.tpu`` exists only once
    ``torch_tpu`` is imported, which autoload does not do when
    ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.

    A child, not this process: the function imports a vendor runtime (TorchTPU
    reads the devices, and may kill the process when libtpu is missing), and the
    launcher must stay able to report any failure.
    """
    module, sep, function = spec.partition(":")
    if not sep or not module or not function:
        raise LaunchError(f"launch_env_function must be 'module:function', not {spec!r}")
    call = f"{spec}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    try:
        out = subprocess.run([python or sys.executable, "-c", _PARENT_ENV_CODE, module, function,
                              json.dumps(dict(kwargs)), preload or ""], env=dict(environ), capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{call} did not finish within {timeout:.0f} s on this host") from None
    for line in reversed(out.stdout.splitlines()):
        if out.returncode == 0 and line.startswith("ACCELPORT_LAUNCH_ENV="):
            return {str(k): str(v) for k, v in json.loads(line.split("=", 1)[1]).items()}
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit status {out.returncode}, no output"
    raise LaunchError(f"{call} failed on this host before any worker started: {last}")


def run_plan(plan: LaunchPlan, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Run ``plan`` to the end. Raises :class:`WorkerFailedError` naming the first failed rank.

    Returns the job's goodput account (:mod:`accelport.goodput`) where a worker kept one with
    ``ap.Checkpointer`` (rank 0, on this host), else None; a raised failure or stop carries it as
    ``exc.goodput``."""
    started = time.time()
    base = dict(os.environ if environ is None else environ)
    if not plan.available:
        from accelport.errors import BackendUnavailableError

        raise BackendUnavailableError(plan.backend, plan.reason, "--backend")
    check_resolves(plan.rendezvous)
    env = {**base, **plan.env}
    if plan.parent_env_function:
        env.update(parent_launch_env(plan.parent_env_function, plan.parent_env_kwargs, env,
                                     python=plan.command[0], preload=plan.parent_env_preload))
    # A stop request (SIGTERM) reaches every worker; they get the deadline to save before torchrun kills them.
    stop_wait = deadline_s(env) + LAUNCHER_MARGIN_S
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(stop_wait + 0.999)))
    if plan.engine == "torchrun" and plan.command[:1] == [sys.executable]:  # the torch found here is torchrun's
        from accelport._packages import torchrun_takes_shutdown_timeout
        from accelport.errors import CompatibilityWarning, warn_user

        note = torchrun_grace_note(deadline_s(env), torchrun_takes_shutdown_timeout())
        if note:
            warn_user(note, CompatibilityWarning)
    if plan.max_restarts and plan.engine == "torchrun":
        # torchrun's agent shares its rendezvous store with the workers, with no prefix per attempt: restarted
        # workers read the dead ones' addresses and fail to connect (pytorch/pytorch#135712, #167288).
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    launch_dir = tempfile.mkdtemp(prefix="accelport-launch-")
    env["ACCELPORT_LAUNCH_DIR"] = launch_dir
    env["ACCELPORT_LAUNCHER_PID"] = str(os.getpid())  # each worker dies with this process (worker.py)
    try:
        try:
            _run_engine(plan, env, launch_dir, stop_wait)
        except (WorkerFailedError, LaunchStopped) as exc:
            exc.goodput = _goodput(launch_dir, started)
            raise
        return _goodput(launch_dir, started)
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


def _goodput(launch_dir: str, started: float) -> dict[str, Any] | None:
    """The account of this launch's runs, from the journal rank 0's checkpointer named in ``launch_dir``."""
    from accelport.goodput import POINTER, account_of_directory

    pointer = read(os.path.join(launch_dir, POINTER))
    directory = pointer.get("directory") if isinstance(pointer, Mapping) else None
    if not isinstance(directory, str):
        return None
    return account_of_directory(directory, launch=launch_dir, started=started, ended=time.time())


def _run_engine(plan: LaunchPlan, env: dict[str, str], launch_dir: str, stop_wait: float) -> None:
    if plan.engine == "torchrun":
        _run_torchrun(plan, env, launch_dir)
        return
    for attempt in range(plan.max_restarts + 1):  # torch_xla's launcher has no restarts: start it again
        env[ATTEMPT_ENV] = str(attempt)
        _forget(launch_dir)  # what the failed attempt's workers said is not about the next one
        try:
            _run_subprocess(plan, env, launch_dir, stop_wait, attempt)
            break
        except WorkerFailedError:
            if attempt == plan.max_restarts:
                raise


# -- the monitor: a rank that stops making progress, a rank that ends early --------------------

#: Seconds between SIGTERM and SIGKILL for a worker the launcher stops.
STOP_GRACE_S = 10.0


def _forget(launch_dir: str) -> None:
    """Remove every file the workers and the monitor wrote in ``launch_dir`` (none of them runs now)."""
    try:
        names = os.listdir(launch_dir)
    except OSError:
        return
    from accelport.goodput import POINTER

    for name in names:
        if name == POINTER:  # where the job's goodput account is: every attempt adds to it
            continue
        try:
            os.unlink(os.path.join(launch_dir, name))
        except OSError:
            pass


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc); [] where that cannot be read."""
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry))
    return found


def _attempt_of_process(pid: int) -> int | None:
    """The attempt the engine started ``pid`` for (its ``TORCHELASTIC_RESTART_COUNT``, Linux /proc); None where
    that cannot be read or it has none."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    key = ATTEMPT_ENV.encode() + b"="
    for entry in entries:
        if entry.startswith(key):
            value = entry[len(key):].strip()
            return int(value) if value.isdigit() else None
    return None


def _signal_group(pid: int, sig: int) -> None:
    """``sig`` to ``pid``'s process group where it leads one (torchrun's workers do), else to ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except OSError:
        pass  # it ended already


def _stop(pids: list[int]) -> None:
    """SIGTERM ``pids`` (their groups), then SIGKILL whatever is left after :data:`STOP_GRACE_S`."""
    for pid in pids:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            _signal_group(pid, signal.SIGKILL)


def _still_worker(pid: int, workers: Sequence[int]) -> bool:
    """Whether ``pid`` still runs as one of ``workers`` (the processes the engine started) or a child of
    one. A rank that has exited may have left its pid to an unrelated process, which must not be
    stopped; where /proc cannot be read, whether it runs at all."""
    if not _alive(pid):
        return False
    if not os.path.isdir("/proc/self"):
        return True
    if pid in workers:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return False
    return parent in workers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


#: Seconds between two probes while a rank that finished waits at its exit for the others.
PROBE_GAP_S = 2.0
#: How long the launcher waits for the workers' answers before it judges a stall without them.
PROBE_WAIT_S = 5.0


def _place(answer: Mapping[str, Any] | None) -> str:
    """Where a rank's script is, from its answer to a probe, as a clause of an error."""
    if answer is None:
        return (f"where its script is is not known (no answer to the launcher's probe within {PROBE_WAIT_S:.0f} s: "
                "busy in code that holds Python's interpreter lock?)")
    line = answer.get("where")
    at = f" at {line}" + (f" ({answer['code']})" if answer.get("code") else "") if line else ""
    steps = f" after {answer['steps']} step(s)" if isinstance(answer.get("steps"), int) else ""
    if answer.get("waiting"):
        return f"its script waits in {answer['waiting']}{at}{steps}, a collective"
    if answer.get("script_running") is False:
        return (f"its script is not running{steps}: accelport's own code is, before the script started or after it "
                "ended (meeting the other ranks to end the process group, or under --diagnose gathering their runs)")
    return f"its script is{at or ' somewhere not known'}{steps}, outside any collective"


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _ended_early_error(ended: Mapping[str, Any], others: Sequence[int], detail: str) -> str:
    """Why a rank whose script returned while the others still needed it is the cause."""
    steps = f" after {ended['steps']} step(s)" if isinstance(ended.get("steps"), int) else ""
    return (f"its script returned{steps} while {_ranks(others) if others else 'the others'} still ran and waited "
            f"for it in a collective it never joined ({detail}). Every rank must run the same steps and "
            "collectives: give each the same number of batches (ap.loader(..., shard=True) does) and keep "
            "collectives out of branches that depend on the rank")


def _verdict(now: float, stalled: Mapping[int, str], beats: Mapping[int, Mapping[str, Any]],
             done: Mapping[int, Mapping[str, Any]], answers: Mapping[int, Mapping[str, Any] | None],
             why: str, ended: Mapping[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """The failure record of every rank this host knows, once the job cannot end well.

    ``stalled``: rank -> how it stopped making progress (an error's first part);
    ``answers``: each running rank's answer to the probe (None: no answer); ``why``:
    what stopped the job; ``ended``: the done record of a rank that ended early, if
    that is the verdict already. A stalled rank outside any collective (or that did not
    answer) hangs: it is the cause, and the ranks waiting in a collective wait for it.
    If every stalled rank waits in one and a rank had finished its script, that rank
    ended early; if none had, a running rank outside any collective, at no more steps
    than they took, hangs: heartbeats are handed over late (StepRecord), so the rank
    waiting for it may pass the limit first.
    """
    running = sorted(r for r in beats if r not in done)
    stalled = dict(stalled)
    hung = sorted(r for r in stalled if not (answers.get(r) or {}).get("waiting"))
    if ended is None and stalled and not hung:
        unmet = [d for d in done.values() if d.get("peers_met") is not True and isinstance(d.get("rank"), int)]
        ended = min(unmet, key=lambda d: float(d.get("time") or 0)) if unmet else None
    if ended is None and stalled and not hung:
        taken = [steps for r in stalled if isinstance(steps := (answers.get(r) or {}).get("steps"), int)]
        if len(taken) == len(stalled):
            waiters = sorted(stalled)
            for rank in running:
                answer = answers.get(rank)
                if rank not in stalled and answer is not None and not answer.get("waiting") and \
                        isinstance(answer.get("steps"), int) and answer["steps"] <= min(taken):
                    hung.append(rank)
                    stalled[rank] = (f"{_ranks(waiters)} waited for it in a collective "
                                     f"({stalled[waiters[0]]})")
    records: dict[int, dict[str, Any]] = {}

    def record(rank: int, cause: str, error: str, at: float | None = None) -> None:
        source = beats.get(rank) or done.get(rank) or {}
        records[rank] = {"rank": rank, "pid": source.get("pid"), "host": os.uname().nodename,
                         "time": now if at is None else at, "cause": cause, "error": error}

    if hung:
        culprit = _ranks(hung)
        for rank in hung:
            record(rank, "stalled", f"{stalled[rank]}; {_place(answers.get(rank))}; stopped by the launcher")
        for rank in running:
            if rank not in hung:
                record(rank, "stopped", f"{_place(answers.get(rank))}, for {culprit}, which stopped making "
                                        f"progress; stopped by the launcher ({why})")
    elif ended is not None:
        waits = ", ".join(f"rank {r} in {a['waiting']}" + (f" at {a['where']}" if a.get("where") else "")
                          for r in running if (a := answers.get(r) or {}).get("waiting"))
        record(ended["rank"], "ended-early", _ended_early_error(ended, running, waits or "as the launcher saw"),
               float(ended.get("time") or now))
        for rank in running:
            record(rank, "stopped", f"{_place(answers.get(rank))}, for rank {ended['rank']}, whose script had "
                                    f"returned; stopped by the launcher ({why})")
    elif stalled:
        for rank in running:
            if rank in stalled:
                record(rank, "stalled", f"{stalled[rank]}; {_place(answers.get(rank))}, as every rank of this host "
                                        "does: the ranks called different collectives (or a different number of "
                                        "them), or a rank on another host stopped; stopped by the launcher")
            else:
                record(rank, "stopped", f"{_place(answers.get(rank))}; stopped by the launcher ({why}) when "
                                        f"{_ranks(sorted(stalled))} stopped making progress")
    else:  # only ranks that never started (they have no heartbeat, and get their error from the engine's report)
        for rank in running:
            record(rank, "stopped", f"{_place(answers.get(rank))}; stopped by the launcher ({why}) when a rank "
                                    "had not started its script")
    for rank, d in done.items():
        if rank not in records:
            steps = f" after {d['steps']} step(s)" if isinstance(d.get("steps"), int) else ""
            record(rank, "stopped", f"had finished its script{steps} and waited at its exit for the others; "
                                    f"stopped by the launcher ({why})")
    return records


class _Monitor(threading.Thread):
    """Watches a launch's workers and stops the job when it can no longer end well.

    - **A rank stopped making progress**: it ended a training step and then went
      ``timeout`` seconds without another (``--timeout``), or did not end its first step
      within ``startup`` seconds of the launch, or of the restart for a later attempt
      (``--startup-timeout``: starting Python, imports, data and a first compilation are
      not steps, and a busy host takes its time).
    - **A rank ended early**: its script returned while another rank waits for it in one
      of accelport's world collectives, on two probes :data:`PROBE_GAP_S` apart, at the
      same step (not fewer steps than it took). That collective can never complete; the
      job is stopped then, not after the finished rank's exit barrier.

    Before a verdict the workers are asked where their scripts are (launch.heartbeat): a
    stalled rank outside any collective is the one that hangs, and the ranks that wait in
    one wait for it. The verdict is written as the ranks' failure records, then every
    worker is stopped and the engine reports them as failed, so the launch ends like any
    other failure. A monitor without ``timeout`` or ``startup`` judges only early ends.

    One monitor watches every attempt of a launch that restarts (torchrun's agent restarts
    the workers inside one run): it follows the attempt of the engine's workers (each one's
    ``TORCHELASTIC_RESTART_COUNT``, and each record's ``attempt``), judges only the records
    of the attempt that runs now, and measures that attempt's start-up from when it saw it
    begin. After a verdict it waits for the next attempt, if the engine starts one.
    """

    def __init__(self, launch_dir: str, *, timeout: int | None, startup: int | None, expected: int | None,
                 workers: Callable[[], list[int]], attempt: int = 0) -> None:
        super().__init__(name="accelport-launch-monitor", daemon=True)
        self.launch_dir, self.timeout, self.startup = launch_dir, timeout, startup
        self.expected, self.workers = expected, workers
        #: The attempt watched now (0 until a restart), when it began, and whether the monitor stopped it.
        self.attempt = attempt
        self.started_at = time.time()
        self.fired = False
        self._done = threading.Event()
        self._seq = 0
        self._asked_at = float("-inf")
        self._answers: dict[int, list[dict[str, Any]]] = {}  # each rank's answers, the latest last

    def close(self) -> None:
        self._done.set()

    def finish(self) -> None:
        """Stop watching, once a verdict under way is written and its workers stopped (they have ended already
        when the engine reports them)."""
        self.close()
        if self.is_alive():
            self.join(STOP_GRACE_S + PROBE_WAIT_S)

    def run(self) -> None:
        poll = min(1.0, self.timeout / 5) if self.timeout else 1.0
        while not self._done.wait(poll):
            self.check(time.time())  # after a verdict too: the engine may start another attempt

    def follow(self, now: float, workers: Sequence[int] | None = None) -> bool:
        """Start watching a newer attempt, if the engine's workers (or their heartbeats) belong to one; True
        when it did."""
        running = [p for p in (self.workers() if workers is None else workers) if _alive(p)]
        newest = max([self.attempt, *(a for p in running if (a := _attempt_of_process(p)) is not None),
                      *(attempt_of(b) for b in read_ranked(self.launch_dir, HEARTBEAT_PREFIX).values())])
        if newest <= self.attempt:
            return False
        self.attempt, self.started_at, self.fired = newest, now, False
        self._asked_at, self._answers = float("-inf"), {}
        return True

    def _since(self) -> str:
        return "the launch" if self.attempt == 0 else f"restart {self.attempt}"

    def check(self, now: float) -> bool:
        """Stop the job if it cannot end well at ``now``; True when it did (once an attempt)."""
        workers = self.workers()
        self.follow(now, workers)
        if self.fired:
            return False  # this attempt is being stopped already
        beats = read_ranked(self.launch_dir, HEARTBEAT_PREFIX, attempt=self.attempt)
        done = read_ranked(self.launch_dir, DONE_PREFIX, ".json", attempt=self.attempt)
        self._read_answers()
        running = sorted(r for r in beats if r not in done)
        stalled = self._stalled(now, beats, done, workers)
        missing = (self.expected or 0) - len(beats)
        # (Only while workers run: between two attempts, or before the first, there is nobody to stop.)
        late = missing > 0 and self.startup is not None and now - self.started_at > self.startup and \
            any(_alive(p) for p in workers)
        if stalled or late:
            stepped = any(int(beats[r].get("step") or 0) for r in stalled)
            why = f"--timeout {self.timeout}" if stepped else f"--startup-timeout {self.startup}"
            records = _verdict(now, stalled, beats, done, self._ask_and_wait(running), why)
        else:
            records = self._ended_early(now, beats, done, running)
            if not records:
                return False
        if self.follow(time.time()):
            return False  # the attempt ended while its workers were asked, and the engine started another
        self.fired = True
        from accelport.launch.worker import FAILURE_PREFIX

        for rank, rec in records.items():
            write_json(os.path.join(self.launch_dir, f"{FAILURE_PREFIX}{rank}.json"), {**rec, "attempt": self.attempt},
                       replace=False)
        # The ranks that caused it last: the others are gone before they can see it go and
        # fail with a lost connection of their own.
        causes = {r for r, rec in records.items() if rec["cause"] in ("stalled", "ended-early")}
        # Again (the probe took seconds), and only the judged attempt's: never a newer one's.
        workers = [p for p in self.workers() if _attempt_of_process(p) in (None, self.attempt)]
        pids = {r: p for r, b in {**done, **beats}.items()
                if isinstance(p := b.get("pid"), int) and _still_worker(p, workers)}
        first = [p for r, p in pids.items() if r not in causes]
        first += sorted(p for p in set(workers) - set(pids.values()) if _alive(p))
        _stop(first + [p for r, p in pids.items() if r in causes])
        return True

    def _stalled(self, now: float, beats: Mapping[int, Mapping[str, Any]],
                 done: Mapping[int, Mapping[str, Any]], workers: Sequence[int]) -> dict[int, str]:
        """Rank -> how it stopped making progress, for each running rank past its limit.

        A rank whose process has ended is not judged: the engine reports how it ended.
        """
        out: dict[int, str] = {}
        for rank, beat in beats.items():
            pid = beat.get("pid")
            if rank in done or (isinstance(pid, int) and pid > 0 and not _still_worker(pid, workers)):
                continue
            step = int(beat.get("step") or 0)
            if step:
                since = now - float(beat.get("time") or now)
                if self.timeout is not None and since > self.timeout:
                    out[rank] = (f"no training step ended for {since:.0f} s (last heartbeat at step {step}), "
                                 f"more than --timeout {self.timeout}")
            elif self.startup is not None and now - self.started_at > self.startup:
                out[rank] = (f"did not end its first training step within {self.startup} s of {self._since()} "
                             f"(--startup-timeout {self.startup})")
        return out

    def _ask(self, now: float) -> None:
        self._seq += 1
        self._asked_at = now
        write_json(os.path.join(self.launch_dir, PROBE_FILE), {"seq": self._seq, "time": now})

    def _read_answers(self) -> None:
        for rank, answer in read_ranked(self.launch_dir, WHERE_PREFIX, ".json", attempt=self.attempt).items():
            history = self._answers.setdefault(rank, [])
            if not history or history[-1].get("seq") != answer.get("seq"):
                history.append(answer)
                del history[:-3]

    def _ask_and_wait(self, ranks: Sequence[int]) -> dict[int, dict[str, Any] | None]:
        """Every rank's answer to a new probe; None for a rank that gave none within :data:`PROBE_WAIT_S`."""
        self._ask(time.time())
        deadline = time.monotonic() + PROBE_WAIT_S
        while True:
            self._read_answers()
            got = {r: next((a for a in self._answers.get(r, ()) if a.get("seq") == self._seq), None) for r in ranks}
            if all(got.values()) or time.monotonic() > deadline or self._done.is_set():
                return got
            time.sleep(0.1)

    def _ended_early(self, now: float, beats: Mapping[int, Mapping[str, Any]],
                     done: Mapping[int, Mapping[str, Any]], running: Sequence[int]) -> dict[int, dict[str, Any]]:
        """The failure records when a finished rank leaves another waiting in a world collective; else {}."""
        unmet = sorted((d for d in done.values() if d.get("peers_met") is not True and isinstance(d.get("rank"), int)),
                       key=lambda d: float(d.get("time") or 0))
        if not unmet or not running:
            return {}
        if now - self._asked_at >= PROBE_GAP_S:
            self._ask(now)
        for rank in running:
            pair = self._answers.get(rank, [])[-2:]
            if len(pair) < 2 or not all(a.get("world") for a in pair):
                continue
            first, last = pair
            if any(first.get(k) != last.get(k) for k in ("waiting", "steps", "where", "pid")):
                continue  # it moved between the two probes
            for ended in unmet:
                if float(ended.get("time") or 0) > float(first.get("time") or 0):
                    continue  # seen waiting before that rank finished: perhaps for a collective it took part in
                steps, taken = last.get("steps"), ended.get("steps")
                if isinstance(steps, int) and isinstance(taken, int) and steps < taken:
                    continue  # still finishing a step the other took part in
                answers = {r: history[-1] if (history := self._answers.get(r)) else None for r in running}
                return _verdict(now, {}, beats, done, answers, "a rank ended early", ended)
        return {}


def _monitor(plan: LaunchPlan, launch_dir: str, workers: Callable[[], list[int]], attempt: int = 0) -> _Monitor:
    monitor = _Monitor(launch_dir, timeout=plan.timeout, startup=plan.startup_timeout,
                       expected=plan.nprocs if plan.engine == "torchrun" else None, workers=workers, attempt=attempt)
    monitor.start()
    return monitor


#: Errors of a worker whose peer went away (it waited for it in a collective).
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|DistNetworkError|DistBackendError|"
                        r"gloo|NCCL|timed out|Timeout", re.IGNORECASE)


def _explain(failures: list[WorkerFailure], launch_dir: str, monitor: _Monitor | None,
             attempt: int = 0) -> tuple[WorkerFailure, list[WorkerFailure]]:
    """The first failure and all of them, with a rank that finished early named as the cause.

    ``attempt`` is the attempt that failed: only its records count. The monitor's verdict,
    when it stopped that attempt, is in the failure records already. A
    rank whose script returned (exit status 0) while the others still ran leaves them
    waiting for it in a collective it never joins; once it is gone they fail with a lost
    connection, and the one torchrun reports first is a victim, not the cause.
    """
    if monitor is not None and monitor.fired and monitor.attempt == attempt:
        beats = read_ranked(launch_dir, HEARTBEAT_PREFIX, attempt=attempt)
        since = "the launch" if attempt == 0 else f"restart {attempt}"
        for i, f in enumerate(failures):
            if f.cause == "stopped" and f.rank not in beats:  # (a rank with a heartbeat has its verdict)
                failures[i] = WorkerFailure(
                    f.rank, f.exitcode, f"never started its script within --startup-timeout {monitor.startup} s "
                    f"of {since} (stuck starting Python or importing?); stopped by the launcher", "", f.host,
                    f.pid, f.time, "stalled")
        # A rank the monitor found to have ended early may have left its exit barrier (status 0,
        # so not among the engine's failures) before it was stopped.
        seen = {f.rank for f in failures}
        for rank, rec in sorted(_records(launch_dir, attempt).items()):
            if rank not in seen and rec.get("cause") == "ended-early":
                failures.append(_failure_from(rank, 0, rec))
    first = _first(failures)
    if first.cause == "ended-early":
        return first, [first, *(f for f in failures if f is not first)]
    early = [d for d in read_ranked(launch_dir, DONE_PREFIX, ".json", attempt=attempt).values()
             if d.get("peers_met") is not True and isinstance(d.get("rank"), int)
             and float(d.get("time") or 0) <= (first.time or float("inf"))]
    if first.cause == "stalled" or not early or not _LOST_PEER.search(first.error):
        return first, failures
    ended = min(early, key=lambda d: float(d.get("time") or 0))
    others = sorted(f.rank for f in failures if f.rank != ended["rank"])
    error = _ended_early_error(ended, others, f"then rank {first.rank}: {_short(first.error)}")
    cause = WorkerFailure(ended["rank"], 0, error, "", os.uname().nodename, ended.get("pid"),
                          float(ended.get("time") or 0), "ended-early")
    rest = [f for f in failures if f.rank != ended["rank"]]
    return cause, [cause, *rest]


def _records(launch_dir: str, attempt: int | None = None) -> dict[int, dict[str, Any]]:
    """Rank -> its failure record (its own, or the monitor's verdict); only ``attempt``'s, when it is given."""
    from accelport.launch.worker import FAILURE_PREFIX

    out: dict[int, dict[str, Any]] = {}
    for name in os.listdir(launch_dir):
        if name.startswith(FAILURE_PREFIX) and name.endswith(".json"):
            try:
                with open(os.path.join(launch_dir, name)) as f:
                    record = json.load(f)
                if attempt is None or attempt_of(record) == attempt:
                    out[int(record["rank"])] = record
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
    return out


def _signal_name(exitcode: int | None) -> str | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _first(failures: list[WorkerFailure]) -> WorkerFailure:
    """The root cause, as far as the launcher can tell.

    A worker killed by a signal other than the launcher's own SIGTERM (out of
    memory, a crash) had no chance to record anything and is nearly always the
    cause; otherwise the earliest recorded error. Peers that lost their
    connection, or that the launcher stopped, come later.
    """
    def key(f: WorkerFailure) -> tuple[int, float]:
        sig = _signal_name(f.exitcode)
        if f.cause in ("stalled", "ended-early"):  # the launcher's own verdict, stopped by it
            return (2, f.time or 0.0)
        if f.cause == "stopped":  # (SIGKILL too, where SIGTERM did not end it in time)
            return (5, f.time or 0.0)
        if sig is not None and sig not in ("SIGTERM", "SIGINT"):
            return (0, f.time or 0.0)
        if f.traceback:
            return (1, f.time or 0.0)
        return (3 if sig is None else 4, f.time or 0.0)

    return min(failures, key=key)


def _failure_from(rank: int, exitcode: int | None, record: dict[str, Any] | None,
                  pid: int | None = None, observed: float | None = None) -> WorkerFailure:
    if record is not None:
        cause = str(record.get("cause") or "raised")  # the launcher's verdicts say theirs
        return WorkerFailure(rank, exitcode, record.get("error", ""), record.get("traceback", ""),
                             record.get("host", ""), record.get("pid", pid), record.get("time"), cause)
    sig = _signal_name(exitcode)
    if sig == "SIGTERM":
        error, cause = "stopped by the launcher after another worker failed (SIGTERM)", "stopped"
    elif sig is not None:
        hint = " (out of memory?)" if sig == "SIGKILL" else ""
        error, cause = f"killed by {sig}{hint}", "signal"
    else:
        error, cause = f"exited with status {exitcode} without raising a Python exception", "exit"
    return WorkerFailure(rank, exitcode, error, "", os.uname().nodename, pid, observed, cause)


def _run_torchrun(plan: LaunchPlan, env: dict[str, str], launch_dir: str) -> None:
    # torchrun reads the workers' environment from os.environ: set it for the run only.
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        from torch.distributed import DistError
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousError

        args = torchrun.parse_args(plan.command[3:])
        launcher = os.getpid()  # torchrun runs here: its workers are this process's children
        monitor = _monitor(plan, launch_dir, lambda: _children(launcher))
        try:
            torchrun.run(args)
        except ChildFailedError as exc:
            if all(pf.exitcode == EXIT_PREEMPTED for pf in exc.failures.values()):
                raise _stopped_workers(launch_dir, plan.nprocs) from None  # they got the stop request themselves
            # The attempt that failed last: the monitor's, or a later one it had no time to see.
            monitor.finish()
            monitor.follow(time.time(), [])
            records = _records(launch_dir, monitor.attempt)
            failures = [
                _failure_from(int(rank), pf.exitcode, _own(records.get(int(rank)), pf.pid), pf.pid,
                              float(pf.timestamp))
                for rank, pf in sorted(exc.failures.items())
            ]
            raise WorkerFailedError(*_explain(failures, launch_dir, monitor, monitor.attempt)) from None
        except (RendezvousError, DistError) as exc:
            # A static rendezvous (--master-addr) fails with the store's DistError (a client that
            # cannot connect, a master whose clients never came); c10d with a RendezvousError.
            where = plan.rendezvous
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no details"
            waited = f" within {where['timeout_s']} s" if where.get("timeout_s") else ""
            raise LaunchError(
                f"the {plan.nnodes} hosts did not meet{waited} ({type(exc).__name__}: {detail}); check "
                "that every host runs the same command with the same --nnodes and --rdzv-endpoint (or "
                "--master-addr), that the address is reachable from all of them, and --rdzv-timeout "
                "if the hosts start far apart") from None
        except SignalException as exc:
            # torchrun passed the signal to every worker and waited for them (its shutdown timeout).
            raise stopped_launch(launch_dir, exc.sigval, plan.nprocs) from None
        finally:
            monitor.close()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _own(record: dict[str, Any] | None, pid: int) -> dict[str, Any] | None:
    """``record`` where it is about the process ``pid`` (torchrun's worker writes its own), else None."""
    if record is None or record.get("pid") in (None, pid):
        return record
    return None


def _stopped_workers(launch_dir: str, expected: int | None) -> Exception:
    from accelport.launch.stop import read_stops

    names = {str(r.get("signal")) for r in read_stops(launch_dir).values()}
    sig = getattr(signal, names.pop(), signal.SIGTERM) if len(names) == 1 else signal.SIGTERM
    return stopped_launch(launch_dir, sig, expected)


def _run_subprocess(plan: LaunchPlan, env: dict[str, str], launch_dir: str, stop_wait: float,
                    attempt: int = 0) -> None:
    # A session of its own: the monitor (and an interrupt) stop torch_xla's replicas with it.
    proc = subprocess.Popen(plan.command, env=env, start_new_session=True)
    monitor = _monitor(plan, launch_dir, lambda: [proc.pid], attempt)
    stops: list[int] = []
    forwarded = _forward_stops(proc.pid, stops)
    try:
        code = _wait(proc, stops, stop_wait)
    except BaseException:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    finally:
        monitor.finish()
        for sig, handler in forwarded.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if stops:
        raise stopped_launch(launch_dir, stops[0], plan.nprocs or 1)
    if code == EXIT_PREEMPTED:
        raise _stopped_workers(launch_dir, plan.nprocs or 1)
    if code == 0:
        return
    records = _records(launch_dir, attempt)
    failures = [_failure_from(rank, code, rec) for rank, rec in sorted(records.items())]
    if not failures:
        failures = [_failure_from(0, code, None)]
    raise WorkerFailedError(*_explain(failures, launch_dir, monitor, attempt))


def _forward_stops(pid: int, stops: list[int]) -> dict[int, Any]:
    """SIGTERM and SIGINT to the launcher go to the workers' group (they save and exit); the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum: int, frame: Any) -> None:
        stops.append(signum)
        _signal_group(pid, signum)

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}


def _wait(proc: subprocess.Popen[Any], stops: list[int], stop_wait: float) -> int:
    """The worker's exit status; once a stop was forwarded, killed if it has not ended ``stop_wait`` s later."""
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        if stops:
            try:
                return proc.wait(timeout=stop_wait)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                return proc.wait()
