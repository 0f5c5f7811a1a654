"""A profile of chosen steps, with the backend's own profiler: ``ap.profile``, ``ACCELPORT_PROFILE``,
``accelport diagnose --profile``.

A window ``FIRST:STOP`` is the steps FIRST to STOP-1 (``range(FIRST, STOP)``; steps count
from 1, as ``StepRecord.step`` does). The profiler starts when step FIRST-1 ends (at the run's
start for FIRST=1) and stops when step STOP-1 ends, nowhere else:

- eager backends: ``torch.profiler`` with the activities the device offers (CPU; CUDA on
  ``cuda``; PrivateUse1 where TorchTPU or TorchNeuron register it), one Chrome trace written by
  ``torch.profiler.tensorboard_trace_handler`` (TensorBoard and Perfetto open it), whose
  ``ProfilerStep#N`` markers carry the run's own step numbers;
- lazy XLA backends: ``torch_xla.debug.profiler.start_trace`` / ``stop_trace``, which write
  ``plugins/profile/<time>/*.xplane.pb`` (and a ``.trace.json.gz``) where TensorBoard's profile
  plugin and xprof read them.

Then :attr:`StepProfile.result` says what the window held: its steps' time breakdown, the ten
operators with the most self time (``key_averages()`` of torch.profiler) and the share of the
window the device had no work. Profiling never breaks training: a window the run never
reaches, a directory that cannot be written, a profiler that fails to start or to write are
each said once (``on_message``) and the run goes on unprofiled.

The script's own profiler wins over the window: two torch profilers at once crash the process
(SIGSEGV) or leave one profile empty, so accelport never starts one while the script's records
(or is prepared to), and when the script starts its own while the window records, accelport
stops its own first (no trace written) and says which steps it did not profile and why
(:class:`_TorchGuard`).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from accelport.contract import Backend
from accelport.observe.steptime import add_into, breakdown_line

__all__ = ["Window", "StepProfile", "parse_window", "window_of", "directory_problem", "describe", "DEFAULT_DIR"]

#: Where the traces go when no directory is given (relative to the working directory).
DEFAULT_DIR = "accelport-profile"
_WINDOW = re.compile(r"^\s*(-?\d+)\s*:\s*(-?\d+)\s*$")
_EXAMPLE = "e.g. 100:110 for steps 100 to 109"
#: Why the script's own profiler wins over a window (said when it does).
_TWO = "two torch profilers at once crash the process or leave one profile empty"


@dataclass(frozen=True)
class Window:
    """Steps ``first`` to ``stop - 1`` (``range(first, stop)``)."""

    first: int
    stop: int

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and self.first <= step < self.stop

    @property
    def last(self) -> int:
        return self.stop - 1

    def __str__(self) -> str:
        return f"{self.first}:{self.stop}"

    def describe(self) -> str:
        return f"step {self.first}" if self.stop == self.first + 1 else f"steps {self.first} to {self.last}"


def _checked(first: int, stop: int, typed: str) -> Window:
    if first < 1:
        raise ValueError(f"{typed}: steps count from 1 (the first optimizer step is step 1); give FIRST:STOP "
                         f"with FIRST >= 1, {_EXAMPLE}")
    if stop <= first:
        hint = f" (did you mean {stop}:{first}?)" if stop < first and stop >= 1 else ""
        raise ValueError(f"{typed}: the window holds no step: it stops at {stop}, not after its first step {first}"
                         f"{hint}; give FIRST:STOP with FIRST < STOP, {_EXAMPLE}")
    return Window(first, stop)


def parse_window(text: str, what: str) -> Window:
    """The window ``FIRST:STOP`` in ``text`` (as typed for ``what``: ``--profile``, ``ACCELPORT_PROFILE``);
    ValueError saying what is wrong and what to give."""
    m = _WINDOW.match(text)
    if not m:
        raise ValueError(f"{what} {text!r} is not a window of steps: give FIRST:STOP, two whole numbers for steps "
                         f"FIRST to STOP-1 (as range(FIRST, STOP)), {_EXAMPLE}")
    return _checked(int(m.group(1)), int(m.group(2)), f"{what} {text.strip()}")


def window_of(steps: Any) -> Window:
    """``ap.profile(steps=...)``: a ``range`` of consecutive steps, or a (first, stop) pair of ints."""
    if isinstance(steps, range):
        if steps.step != 1:
            raise ValueError(f"ap.profile(steps={steps!r}): the steps must be consecutive (a range with step 1): "
                             f"a profile covers every step from its first to its last, {_EXAMPLE}")
        return _checked(steps.start, steps.stop, f"ap.profile(steps={steps!r})")
    if isinstance(steps, tuple) and len(steps) == 2 and all(
            isinstance(n, int) and not isinstance(n, bool) for n in steps):
        return _checked(steps[0], steps[1], f"ap.profile(steps={steps!r})")
    raise TypeError(f"ap.profile(steps=...) takes range(FIRST, STOP) or a (FIRST, STOP) pair of ints, not "
                    f"{type(steps).__name__}; e.g. ap.profile(steps=range(100, 110)) for steps 100 to 109")


def directory_problem(path: str) -> str | None:
    """Why traces cannot be written under ``path`` (created if missing), or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"it cannot be created ({exc.strerror or exc})"
    if not os.path.isdir(path):
        return "it is not a directory"
    try:  # the one sure test (access() says yes to root, and nothing of a read-only mount)
        fd, probe = tempfile.mkstemp(prefix=".accelport-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"nothing can be written in it ({exc.strerror or exc})"
    return None


def _files_under(path: str) -> set[str]:
    found = set()
    for root, _dirs, names in os.walk(path):
        for name in names:
            found.add(os.path.join(root, name))
    return found


#: The calls of ``torch.autograd.profiler`` (its module globals, looked up at each call) through which every torch
#: profiler (torch.profiler.profile, torch.autograd.profiler.profile, emit_nvtx, emit_itt) prepares, starts and
#: stops the one profiler state a process has.
_PREPARES = ("_prepare_profiler", "_enable_profiler")
_STOPS = "_disable_profiler"


class _TorchGuard:
    """The script's own torch profiler against accelport's window, process-wide.

    Once installed it sees every torch profiler prepare, start and stop that is not accelport's own
    (those run inside :meth:`own`): it knows the script's profiler is prepared or recording (a
    schedule's warmup, which torch's own flags do not show), and it lets a window that is recording
    yield before the script's profiler touches the state (:meth:`StepProfile._yield_to_script`).
    On a torch without those calls it installs nothing: the check before a window starts is then
    torch's own flags.
    """

    def __init__(self) -> None:
        self.installed = False
        #: The script's profiler is prepared or recording (a prepare or start of its own, no stop since).
        self.script_holds = False
        #: The window whose torch.profiler records now.
        self.running: StepProfile | None = None
        self._own: int | None = None  # the thread of accelport's own profiler call in progress

    def install(self) -> None:
        """Wrap the calls (once, where torch is imported; a no-op before)."""
        module = sys.modules.get("torch.autograd.profiler")
        if self.installed or module is None:
            return
        self.installed = True
        names = (*_PREPARES, _STOPS)
        originals = {name: call for name in names if callable(call := getattr(module, name, None))}
        if len(originals) < len(names):  # another torch: the check before a window starts is its flags
            return
        for name, original in originals.items():
            if not getattr(original, "_accelport_guard", False):
                setattr(module, name, self._wrapped(original, starts=name != _STOPS))

    def _wrapped(self, original: Callable[..., Any], starts: bool) -> Callable[..., Any]:
        guard = self

        def call(*args: Any, **kwargs: Any) -> Any:
            if guard._own == threading.get_ident():
                return original(*args, **kwargs)
            if starts:
                window = guard.running
                if window is not None:  # accelport's stops first: two at once crash or leave one empty
                    window._yield_to_script()
                out = original(*args, **kwargs)
                guard.script_holds = True
                return out
            guard.script_holds = False
            return original(*args, **kwargs)

        call.__name__ = getattr(original, "__name__", "call")
        call.__doc__ = original.__doc__
        call.__wrapped__ = original  # type: ignore[attr-defined]
        call._accelport_guard = True  # type: ignore[attr-defined]
        return call

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        """accelport's own profiler calls (its window's start, steps and stop) run inside."""
        before, self._own = self._own, threading.get_ident()
        try:
            yield
        finally:
            self._own = before

    def script_profiling(self) -> bool:
        """Whether a profiler of the script's is prepared or recording now."""
        if self.script_holds:
            return True
        if getattr(sys.modules.get("torch.autograd.profiler"), "_is_profiler_enabled", False):
            return True
        enabled = getattr(getattr(getattr(sys.modules.get("torch"), "_C", None), "_autograd", None),
                          "_profiler_enabled", None)
        try:
            return bool(enabled()) if callable(enabled) else False
        except Exception:  # noqa: BLE001 - a torch that cannot say: its flags above said no
            return False


_GUARD = _TorchGuard()


class _TorchSession:
    """torch.profiler over the window, with the run's step numbers on its ProfilerStep markers."""

    profiler = "torch.profiler"

    def __init__(self, backend: Backend, directory: str, first: int) -> None:
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity, profile, tensorboard_trace_handler

        supported = torch.profiler.supported_activities()
        activities = [ProfilerActivity.CPU]
        device_type = getattr(backend, "device_type", "cpu")
        if device_type == "cuda" and ProfilerActivity.CUDA in supported:
            activities.append(ProfilerActivity.CUDA)
        elif device_type not in ("cpu", "cuda") and ProfilerActivity.PrivateUse1 in supported:
            activities.append(ProfilerActivity.PrivateUse1)  # TorchTPU, TorchNeuron
        self.device_activity = len(activities) > 1
        self.error: str | None = None
        self._directory = directory
        self._before = _files_under(directory)
        handler = tensorboard_trace_handler(directory)

        def ready(prof: Any) -> None:
            # Its own errors (a directory gone since the start) would be raised from stop(): kept instead.
            try:
                handler(prof)
            except Exception as exc:  # noqa: BLE001
                self.error = f"{type(exc).__name__}: {exc}"

        # A schedule that always records: torch then marks each step (ProfilerStep#N), numbered from first.
        self._prof = profile(activities=activities, schedule=lambda _step: ProfilerAction.RECORD, on_trace_ready=ready)
        self._prof.step_num = first
        with _GUARD.own():
            self._prof.start()

    def step(self) -> None:
        with _GUARD.own():
            self._prof.step()

    def stop(self) -> list[str]:
        with _GUARD.own():
            self._prof.stop()
        if self.error:
            raise RuntimeError(f"writing the trace failed ({self.error})")
        return sorted(_files_under(self._directory) - self._before)

    def discard(self) -> None:
        """Stop recording, writing nothing (the script's own profiler is about to start)."""
        self._prof.on_trace_ready = None
        with _GUARD.own():
            self._prof.stop()

    def top_ops(self, n: int = 10) -> tuple[list[dict[str, Any]], str | None]:
        rows = [e for e in self._prof.key_averages() if not str(e.key).startswith("ProfilerStep")]
        rows.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        out = [{"name": str(e.key), "calls": int(e.count), "self_seconds": float(e.self_cpu_time_total) / 1e6,
                "self_device_seconds": float(getattr(e, "self_device_time_total", 0.0) or 0.0) / 1e6}
               for e in rows[:n]]
        return out, None

    def device_seconds(self) -> float | None:
        """The device's own busy time in the window, from the profile's device events (None: it holds none)."""
        if not self.device_activity:
            return None
        total = sum(float(getattr(e, "self_device_time_total", 0.0) or 0.0) for e in self._prof.key_averages())
        return total / 1e6 if total > 0 else None


class _XlaSession:
    """torch_xla's profiler (``xp.start_trace`` / ``xp.stop_trace``) over the window."""

    profiler = "torch_xla.debug.profiler"
    device_activity = True

    def __init__(self, backend: Backend, directory: str, first: int) -> None:
        import torch_xla.debug.profiler as xp

        self._xp = xp
        self._backend = backend
        self._directory = directory
        self._before = _files_under(directory)
        self._executed = self._execute_seconds()
        xp.start_trace(directory)

    def _execute_seconds(self) -> float | None:
        value = self._backend.counters().get("execute_seconds")
        return float(value) if isinstance(value, (int, float)) else None

    def step(self) -> None:
        pass

    def stop(self) -> list[str]:
        self._xp.stop_trace()
        self._executed_after = self._execute_seconds()
        return sorted(_files_under(self._directory) - self._before)

    def top_ops(self, n: int = 10) -> tuple[list[dict[str, Any]], str | None]:
        return [], ("torch_xla's profiler has no key_averages(): the operators are in the trace, under TensorBoard's "
                    "profile plugin or xprof (its op profile and trace viewer)")

    def device_seconds(self) -> float | None:
        before, after = self._executed, getattr(self, "_executed_after", None)
        if before is None or after is None:
            return None
        return max(after - before, 0.0)


class StepProfile:
    """One window of steps to profile on a run; the step tracker drives it (see the module's docstring).

    ``on_message`` is told, once each, why the window was not (or only partly) profiled and,
    once it is and ``say_result`` is true, the summary (:func:`describe`); by default nothing is said.
    """

    def __init__(self, window: Window, directory: str, source: str,
                 on_message: Callable[[str], None] | None = None, say_result: bool = True) -> None:
        self.window = window
        self.directory = os.path.abspath(directory)
        #: Where the window was asked for, as the messages name it ("--profile 5:8").
        self.source = source
        #: "waiting" (for its first step), "running", "stopped" (waiting for its steps' breakdowns),
        #: "done", or "off" (not profiled: ``problem`` says why).
        self.state = "waiting"
        self.problem: str | None = None
        self.files: list[str] = []
        #: What the window held (:func:`describe` says it in words); None until it is done.
        self.result: dict[str, Any] | None = None
        #: The step whose end the tracker tells the profile of next (0: the run's start).
        self.next_step = window.first - 1
        self.on_message: Callable[[str], None] = on_message or (lambda text: None)
        self.say_result = say_result
        self._backend: Backend | None = None
        self._session: _TorchSession | _XlaSession | None = None
        self._parts: dict[str, float] = {}
        self._added = 0
        self._last = window.first - 1  # the last step profiled
        self._started_at = 0.0

    # -- what the step tracker calls ----------------------------------------------------------
    def arm(self, backend: Backend, steps_done: int) -> None:
        """The run is on ``backend``, ``steps_done`` steps in: check the directory; start now for a window from 1."""
        if self.state != "waiting":
            return
        self._backend = backend
        if not backend.lazy:
            _GUARD.install()  # from now on a profiler the script prepares is known, before it records
        if steps_done >= self.window.first:
            self._off(f"{self.source}: the run is already past the window's first step ({steps_done} steps done); "
                      f"give a window that starts later")
            return
        problem = directory_problem(self.directory)
        if problem is not None:
            self._off(f"{self.source}: traces cannot be written to {self.directory}: {problem}; give a directory "
                      "that can be written (--profile-dir DIR, ACCELPORT_PROFILE_DIR, ap.profile(dir=...)). "
                      "The run goes on unprofiled")
            return
        if steps_done == self.window.first - 1:
            self._start()

    def step_ended(self, step: int) -> None:
        """Step ``step`` ended (called for ``step >= next_step``)."""
        state = self.state
        if state == "waiting":
            if step == self.window.first - 1:
                self._start()
            elif step >= self.window.first:  # (steps skipped: armed late)
                self._off(f"{self.source}: the window's first step {self.window.first} had passed when profiling "
                          "could start")
        elif state == "running":
            self._last = step
            if step >= self.window.last:
                self._stop()
            else:
                self.next_step = step + 1
                self._guarded("step", self._session.step if self._session is not None else (lambda: None))

    def add(self, step: int, breakdown: Mapping[str, float]) -> None:
        """A window step's time breakdown, final (handed over by the tracker)."""
        if step in self.window:
            add_into(self._parts, breakdown)
            self._added += 1

    def settle(self) -> dict[str, Any] | None:
        """After the tracker handed steps over: the result, once every profiled step's breakdown is in."""
        if self.state == "stopped" and self._added >= self._last - self.window.first + 1:
            return self._finish()
        return None

    def run_ended(self, steps: int) -> None:
        """The run ended after ``steps`` steps (their breakdowns handed over): say what became of the window."""
        if self.state == "waiting":
            self._off(f"{self.source}: the run ended after step {steps}, before the window's first step "
                      f"{self.window.first}: nothing was profiled; give a window of steps the run reaches "
                      f"(it took {steps})")
        elif self.state == "running":
            self._stop()
            self._finish()
        elif self.state == "stopped":
            self._finish()

    # -- inside -----------------------------------------------------------------------------
    def _off(self, why: str) -> None:
        self.state, self.problem = "off", why
        self.next_step = 1 << 62
        self.on_message(f"accelport: {why}.")

    def _guarded(self, what: str, call: Callable[[], Any], name: str | None = None) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - profiling never breaks training
            name = name or (self._session.profiler if self._session is not None else "the profiler")
            session, self._session = self._session, None
            if _GUARD.running is self:
                _GUARD.running = None
            if what != "start" and session is not None:
                try:
                    session.stop()
                except Exception:  # noqa: BLE001
                    pass
            self._off(f"{self.source}: {name} failed to {what} at step {self._last}: {type(exc).__name__}: {exc}; "
                      "the run goes on unprofiled")
            return None

    def _start(self) -> None:
        backend = self._backend
        if backend is None:
            return
        kind = _XlaSession if backend.lazy else _TorchSession
        if kind is _TorchSession:
            _GUARD.install()
            if _GUARD.script_profiling():
                self._off(f"{self.source}: the script's own torch profiler was recording (or about to) when "
                          f"step {self.window.first} began; {_TWO}, so accelport did not start its own: "
                          f"{self.window.describe()} not profiled by accelport, the script's profile left "
                          "to record alone")
                return

        def start() -> Any:
            return kind(backend, self.directory, self.window.first)

        self._last = self.window.first - 1
        self._session = self._guarded("start", start, kind.profiler)
        if self._session is not None:
            if kind is _TorchSession:
                _GUARD.running = self
            self.state = "running"
            self.next_step = self.window.first
            self._started_at = time.perf_counter()

    def _stop(self) -> None:
        session = self._session
        self.next_step = 1 << 62
        if _GUARD.running is self:
            _GUARD.running = None
        if session is None:
            return
        files = self._guarded("stop", session.stop)
        if self.state == "off":
            return
        self.files = list(files or [])
        self.state = "stopped"

    def _yield_to_script(self) -> None:
        """The script starts a torch profiler of its own while this window records: stop ours first, writing
        nothing, and say which steps were not profiled (never raises: it runs inside the script's call)."""
        session, self._session = self._session, None
        if _GUARD.running is self:
            _GUARD.running = None
        if isinstance(session, _TorchSession):
            try:
                session.discard()
            except Exception:  # noqa: BLE001 - the script's profiler must start whatever became of ours
                pass
        try:
            self._off(f"{self.source}: the script started its own torch profiler during step {self._last + 1}, "
                      f"while accelport's profile of {self.window.describe()} was recording; {_TWO}, so accelport "
                      f"stopped its own (no trace written) and let the script's profile record: "
                      f"{self.window.describe()} not profiled by accelport")
        except Exception:  # noqa: BLE001
            pass

    def _finish(self) -> dict[str, Any] | None:
        session, backend = self._session, self._backend
        if session is None or backend is None:
            return None
        window_steps = self._last - self.window.first + 1
        seconds = sum(self._parts.values())
        try:
            top, top_note = session.top_ops()
        except Exception as exc:  # noqa: BLE001
            top, top_note = [], f"the operators could not be read: {type(exc).__name__}: {exc}"
        idle, idle_note = _idle(backend, session, self._parts, seconds)
        self.result = {
            "steps": [self.window.first, self._last], "asked": str(self.window),
            "complete": self._last >= self.window.last,
            "backend": backend.name, "profiler": session.profiler, "directory": self.directory, "files": self.files,
            "seconds": seconds, "breakdown": dict(self._parts), "top_ops": top, "top_ops_note": top_note,
            "device_idle_share": idle, "device_idle_note": idle_note, "window_steps": window_steps,
        }
        self.state = "done"
        self._session = None
        if self.say_result:
            self.on_message("\n".join(describe(self.result)))
        return self.result


def _idle(backend: Backend, session: Any, parts: Mapping[str, float], seconds: float) -> tuple[float | None, str]:
    """The share of the window the device had no work, and how it was measured."""
    if seconds <= 0:
        return None, "the window took no time"
    if backend.time_phases().get("body") == "device":  # the host is the device
        busy = parts.get("device", 0.0)
        return max(0.0, 1.0 - busy / seconds), ("the host is the device: the share of the window outside the "
                                                "forward, backward and optimizer")
    try:
        measured = session.device_seconds()
    except Exception:  # noqa: BLE001
        measured = None
    if measured is None:
        return None, "not measured: the profile holds no device time on this backend"
    how = ("torch_xla's ExecuteTime of the graphs that finished in the window" if backend.lazy
           else "the device's own events in the profile")
    return max(0.0, 1.0 - min(measured / seconds, 1.0)), how


def describe(result: Mapping[str, Any]) -> list[str]:
    """The profile's result in words: where it went, the window's breakdown, top operators, device idle time."""
    first, last = result["steps"]
    which = f"step {first}" if first == last else f"steps {first} to {last}"
    partly = "" if result.get("complete", True) else f" (of {result.get('asked')}: the run ended there)"
    files = result.get("files") or []
    where = f"{len(files)} file(s) under {result['directory']}" if files else \
        f"nothing written under {result['directory']}"
    lines = [f"profile of {which}{partly} on {result['backend']} ({result['profiler']}): {where}"]
    seconds = float(result.get("seconds") or 0.0)
    steps = max(int(result.get("window_steps") or 1), 1)
    if seconds > 0:
        lines.append("  " + breakdown_line(result.get("breakdown") or {}, seconds / steps, steps))
    top = result.get("top_ops") or []
    if top:
        lines.append("  top operators by self time:")
        for op in top:
            lines.append(f"    {op['self_seconds'] * 1e3:10.2f} ms  {op['calls']:6d} calls  {op['name']}")
    elif result.get("top_ops_note"):
        lines.append(f"  top operators: {result['top_ops_note']}")
    idle = result.get("device_idle_share")
    if idle is None:
        lines.append(f"  device idle: {result.get('device_idle_note') or 'not measured'}")
    else:
        lines.append(f"  device idle {idle:.0%} of the window ({result.get('device_idle_note')})")
    return lines

