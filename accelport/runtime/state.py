"""The state behind the public API: the plugin host, the matrix, the selected backend, step tracking, the rules.

A :class:`Runtime` owns them and hands them to whoever needs them (selection,
the step tracker, the loader); ``RUNTIME`` is the process's one, which the
``ap.*`` functions use. Nothing below this module reads it: the rules see a
:class:`~accelport.diagnose.rule.RunView` it builds for each run, and the step
records the tracker hands them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from accelport.contract import COUNTER_FIELDS, LEVEL_FIELDS, Backend, Metrics
from accelport.runtime.tracker import StepTracker
from accelport.settings import is_off

if TYPE_CHECKING:
    from accelport.compat.load import Matrix
    from accelport.diagnose.engine import Diagnostics
    from accelport.diagnose.rule import Diagnosis
    from accelport.observe.dynamo import CompileEvents
    from accelport.observe.memory import MemoryWatch
    from accelport.observe.nan_search import NanSearch
    from accelport.plugins.host import PluginHost

__all__ = ["Runtime", "RUNTIME", "profile_warning"]


class Runtime:
    """Holds the plugin host, the matrix, the selected backend and the rules' engine, built once and passed on.

    ``environ`` is the environment it reads (default: the process's, read when used).
    ``tracker`` is a step tracker that has already seen this run's first batches (``accelport
    diagnose`` selects the backend at the script's first step); ``compile_events`` the point
    torch.compile's records count from (default: when the rules are first set up);
    ``from_process_start``: the counters (``ap.metrics()``) count from the process's start, not
    from the backend's selection (``accelport diagnose``: the script compiled before its first step);
    ``command``: how ``accelport diagnose`` ran the script (its arguments), which the rules may say.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, plugin_timeout: float | None = None, *,
                 tracker: StepTracker | None = None, compile_events: CompileEvents | None = None,
                 from_process_start: bool = False, command: tuple[str, ...] | None = None) -> None:
        self._lock = threading.RLock()
        self._environ = environ
        self._plugin_timeout = plugin_timeout
        self._host: PluginHost | None = None
        self._matrix: Matrix | None = None
        self._backend: Backend | None = None
        self.reason = ""
        self.explicit: str | None = None
        self.tracker = StepTracker()
        self._first_tracker = tracker
        self._compile_events = compile_events
        self._from_process_start = from_process_start
        self._style = "accelport"
        self._engine: Diagnostics | None = None
        self._engine_built = False
        self._command = command
        self._baseline: dict[str, Any] = {}
        #: Keys of the warnings already given in this process (each is given once).
        self._warned: set[str] = set()

    @property
    def environ(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    def host(self) -> PluginHost:
        if self._host is None:
            with self._lock:
                if self._host is None:
                    from accelport.plugins.host import create_manager

                    self._host = create_manager(self.environ, timeout=self._plugin_timeout)
        return self._host

    def limit_plugin_calls(self, seconds: float) -> None:
        """Bound every plugin call of the host built from now on (the CLI does; a training run does not)."""
        with self._lock:
            self._plugin_timeout = seconds

    def matrix(self) -> Matrix:
        """The matrix in effect for this runtime: shipped, its plugins' rows, ``ACCELPORT_COMPAT_MATRIX``."""
        if self._matrix is None:
            with self._lock:
                if self._matrix is None:
                    from accelport.compat.load import build

                    self._matrix = build(self.host(), self.environ)
        return self._matrix

    @property
    def baseline(self) -> Mapping[str, Any]:
        """The backend's counters as they were when it was selected (``since_selected`` counts from them)."""
        return self._baseline

    @property
    def selected(self) -> Backend | None:
        """The backend in use, or None before the first ``ap.*`` call selects one (selects nothing)."""
        return self._backend

    def backend(self) -> Backend:
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    from accelport.compat.deprecations import warn_deprecations
                    from accelport.platform import detect
                    from accelport.runtime.selection import resolve

                    env, found = self.environ, detect(environ=self.environ)
                    backend, reason = resolve(self.host(), self.explicit, env, matrix=self.matrix(), found=found)
                    # Vendor deprecations are announced where the backend is first chosen.
                    warn_deprecations(backend, env, matrix=self.matrix(), found=found)
                    self._warn_unmet_pjrt(backend)
                    backend.prepare()
                    # Exit hooks run last registered first: one the backend's library registered as it was
                    # imported (torch_xla's tears its runtime down) must run after accelport's last read. So it
                    # is registered again, not moved (a backend chosen inside another exit hook would lose it:
                    # a hook registered while they run never runs), and runs once.
                    atexit.register(_flush_at_exit)
                    backend.reason = reason
                    # The backends' counters are process-wide: from its start, every one is 0.
                    self._baseline = {} if self._from_process_start else backend.counters()
                    if not self._from_process_start:
                        # Per-step changes count from here; from the process start, the first step's record
                        # holds what came before it (a torch.compile'd forward), as ap.metrics() does.
                        backend.step_delta()
                    tracker, self._first_tracker = self._first_tracker or StepTracker(), None
                    self._start_run(backend, tracker)
                    self.tracker = tracker
                    self._backend, self.reason = backend, reason
        return self._backend

    def _start_run(self, backend: Backend, tracker: StepTracker) -> None:
        """Set up the rules for a run on ``backend``, and the sensors they read, and bind the tracker to them."""
        engine = self.diagnostics()
        numerics = shapes = None
        # Memory is watched in every run: ap.metrics() reports it whether or not a rule reads it.
        memory = self._memory_watch(backend)
        from accelport.observe.flops import FlopWatch

        tracker.flops = FlopWatch(backend.lazy)  # (counted in every run: ap.metrics() reports the MFU)
        if engine is not None and "memory" in engine.needs:
            from accelport.observe.memory import watch_uncaught

            watch_uncaught(self._uncaught)  # an out-of-memory error in the script's own code
        if engine is not None:
            from accelport.diagnose.rule import RunView

            if "numerics" in engine.needs:
                from accelport.observe.numerics import NumericsWatch

                numerics = NumericsWatch(backend)
            if "shapes" in engine.needs and backend.lazy:
                # (On eager devices torch.compile's own records say which tensor changed, and a function mode
                # would change what dynamo compiles.)
                from accelport.observe.shapes import ShapeTrace

                shapes = ShapeTrace()
            search = self._nan_search(tracker, backend) if "nan-search" in engine.needs else None
            dynamic = getattr(backend, "compile_dynamic", None)
            engine.start(RunView(
                backend=backend.name, lazy=backend.lazy, environ=self.environ,
                device_type=getattr(backend, "device_type", None), world_size=backend.world_size(),
                compile_dynamic=dynamic if isinstance(dynamic, bool) else None, style=self._style,
                numerics=numerics, shape_trace=shapes, compile_events=self._compile_events,
                counters=self.since_selected, nan_search=search, command=self._command, memory=memory))
        tracker.bind(backend, self.host(), engine, numerics, shapes, memory)
        self._profile_from_environ(tracker)

    def trains_as(self, style: str) -> None:
        """How the script trains (``RunView.style``: "torch", "torch_xla", "transformers", ...), so the rules
        spell their fixes in its terms; before the backend is selected. A ported script is "accelport"."""
        with self._lock:
            self._style = style

    def _nan_search(self, tracker: StepTracker, backend: Backend) -> NanSearch | None:
        """The search for the op that made the first NaN, where the run asks for it: the one ``accelport
        diagnose`` started with the script, else one ``ACCELPORT_FIND_NAN`` asks for (started here)."""
        search = tracker.nan_search
        before = self.tracker.nan_search
        if before is not None and before is not search:
            before.finish()  # the run before this one (ap.use): its steps are counted no more
        if search is None:
            from accelport.observe.nan_search import ENV, ENV_DIR, NanSearch, parse_first_step

            value = self.environ.get(ENV)
            try:
                first = parse_first_step(value)
            except ValueError as exc:
                from accelport.errors import DiagnosticWarning, warn_user
                from accelport.redact import Redactor

                warn_user(Redactor(self.environ).text(f"accelport: {ENV}={value}: {exc}; no operation is searched "
                                                      "for a NaN in this run."), DiagnosticWarning)
                return None
            if first is None:
                return None
            metrics = self.environ.get("ACCELPORT_METRICS_FILE")
            directory = self.environ.get(ENV_DIR) or (os.path.dirname(os.path.abspath(metrics)) if metrics
                                                      else os.getcwd())
            search = NanSearch(first, os.path.abspath(directory), option=ENV_DIR, steps_before=tracker.steps)
            tracker.nan_search = search
        search.bind(backend)
        search.attach()
        return search

    def _memory_watch(self, backend: Backend) -> MemoryWatch:
        """The run's memory sensor; on TPU and Trainium with the HBM per device of the machine's chip
        (compatibility matrix) for where the device's own reading has no capacity."""
        from accelport.observe.memory import MemoryWatch

        capacity, source = None, None
        if backend.platform in ("gcp-tpu", "aws-neuron"):
            try:
                from accelport.diagnose.memory import chip_capacity
                from accelport.platform import detect

                found = chip_capacity(self.matrix(), detect(environ=self.environ).chip)
            except Exception:  # noqa: BLE001 - a capacity is a nicety: never in the way of a run
                found = None
            if found is not None:
                capacity, source = found
        return MemoryWatch(backend, capacity, source)

    def efficiency(self) -> dict[str, Any]:
        """How much of the chip a step uses: FLOPs per step, achieved FLOP/s, and with the chip's peak from the
        compatibility matrix the MFU and why it is low (``accelport.observe.flops.efficiency``)."""
        from accelport.observe.flops import device_seconds, efficiency

        t = self.tracker
        watch = t.flops
        count = watch.summary(t.steps_by_signature()) if watch is not None else None
        seconds = device_seconds(t.time_total, t.time_steps, t.first_breakdown)
        peak, chip, devices = None, None, 1
        backend = self._backend
        if count is not None and backend is not None and backend.platform != "cpu":
            try:
                from accelport.platform import detect

                plat = detect(environ=self.environ)
                if plat.name == backend.platform and plat.chip:
                    matrix = self.matrix()
                    chip, peak = plat.chip, matrix.peak_for(plat.chip)
                    fact = matrix.chips.get(peak.name) if peak is not None else None
                    devices = fact.devices if fact is not None else 1
            except Exception:  # noqa: BLE001 - a peak is a nicety: never in the way of a run
                peak = None
        return efficiency(count, seconds, peak, chip=chip, devices=devices)

    def _metrics_efficiency(self) -> dict[str, Any]:
        found = self.efficiency()
        return {"flops_per_step": found["flops_per_step"], "achieved_flops": found["achieved_flops"],
                "mfu": found["mfu"]}

    def _uncaught(self, exc: BaseException) -> None:
        self.tracker.failed(exc)

    def _profile_from_environ(self, tracker: StepTracker) -> None:
        """``ACCELPORT_PROFILE=FIRST:STOP`` (``ACCELPORT_PROFILE_DIR``): profile those steps of this run."""
        text = self.environ.get("ACCELPORT_PROFILE")
        if text is None or not text.strip() or tracker.profile is not None:
            return
        from accelport.observe.profile import DEFAULT_DIR, StepProfile, parse_window

        say = profile_warning(self.environ)
        try:
            window = parse_window(text, "ACCELPORT_PROFILE")
        except ValueError as exc:
            say(f"accelport: {exc}. The run goes on unprofiled.")
            return
        directory = (self.environ.get("ACCELPORT_PROFILE_DIR") or "").strip() or DEFAULT_DIR
        tracker.profile_steps(StepProfile(window, directory, f"ACCELPORT_PROFILE={window}", say))

    def profile(self, steps: Any, directory: Any = None) -> Any:
        """``ap.profile``: profile ``steps`` of this run into ``directory``; a StepProfile (state "off" and a
        ProfileWarning where it cannot be)."""
        from accelport.observe.profile import DEFAULT_DIR, StepProfile, Window, window_of

        say = profile_warning(self.environ)
        self.backend()  # the run's tracker is the one made when the backend is selected
        tracker = self.tracker
        where = "ap.profile(dir=...)"
        try:
            window = window_of(steps)
            if directory is not None and not isinstance(directory, (str, os.PathLike)):
                raise TypeError(f"{where} takes a directory path (str or os.PathLike), not {type(directory).__name__}")
        except (TypeError, ValueError) as exc:
            off = StepProfile(Window(1, 2), os.fspath(directory) if isinstance(directory, (str, os.PathLike))
                              else DEFAULT_DIR, "ap.profile")
            off.state, off.problem = "off", str(exc)
            say(f"accelport: {exc}. The run goes on unprofiled.")
            return off
        current = tracker.profile
        if current is not None and current.state in ("running", "stopped"):
            off = StepProfile(window, os.fspath(directory or DEFAULT_DIR), f"ap.profile(steps={steps!r})")
            off.state = "off"
            off.problem = (f"ap.profile(steps={steps!r}): {current.source} is being profiled now; one window at a "
                           "time: ask for this one after it ends")
            say(f"accelport: {off.problem}. This window is not profiled.")
            return off
        profile = StepProfile(window, os.fspath(directory or DEFAULT_DIR), f"ap.profile(steps={steps!r})", say)
        if current is not None and current.state == "waiting":
            # One window at a time, and the latest call says what the script wants now: it replaces the
            # window that has not started, and says so (the replaced one says why it is off).
            current.state = "off"
            current.problem = (f"{profile.source} replaced it before its first step {current.window.first}: one "
                               "window at a time")
            say(f"accelport: {profile.source} replaces {current.source}, which had not started: one window at a "
                f"time, so {current.window.describe()} will not be profiled; to profile both, call ap.profile for "
                "the later window once the earlier one has ended, or give one window that covers both.")
        tracker.profile_steps(profile)
        return profile

    def diagnostics(self) -> Diagnostics | None:
        """The engine that runs the registered rules (None: ``ACCELPORT_DIAGNOSTICS=0``, or no rule registered)."""
        if not self._engine_built:
            with self._lock:
                if not self._engine_built:
                    self._engine = self._build_engine()
                    self._engine_built = True
        return self._engine

    def _build_engine(self) -> Diagnostics | None:
        value = self.environ.get("ACCELPORT_DIAGNOSTICS")
        if value is not None and value.strip() and is_off(value):
            return None
        from accelport.diagnose.engine import Diagnostics, rules_from

        rules = rules_from(self.host())
        if not rules:
            return None
        if self._compile_events is None:
            from accelport.observe.dynamo import CompileEvents

            self._compile_events = CompileEvents()
        return Diagnostics(rules)

    def findings(self) -> list[Diagnosis]:
        """What the rules found so far in this run (every finished step judged first)."""
        # Asked while an error is handled (a handler that logs the findings before it re-raises), the error may
        # have left a step midway (see StepTracker.flush).
        self.tracker.flush(pass_ended=False, interrupted=sys.exc_info()[1] is not None)
        engine = self._engine
        return engine.current() if engine is not None else []

    def first_time(self, key: str) -> bool:
        """True the first time ``key`` is asked in this runtime: a warning keyed so is given once."""
        with self._lock:
            if key in self._warned:
                return False
            self._warned.add(key)
            return True

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` on the backend and end the step: the hot path of ``ap.optimizer_step``."""
        backend = self._backend or self.backend()  # (a call less per step once selected)
        tracker = self.tracker
        tracker.optimizer_started()
        try:
            result = backend.optimizer_step(optimizer, **kwargs)
        except BaseException as exc:  # out of memory: the finding first; the error goes on unchanged
            tracker.failed(exc)
            raise
        tracker.step_end(optimizer)
        return result

    def _warn_unmet_pjrt(self, backend: Backend) -> None:
        from accelport.errors import CompatibilityWarning, warn_user
        from accelport.runtime.selection import pjrt_unmet

        if self.explicit is None and not (self.environ.get("ACCELPORT_BACKEND") or "").strip():
            unmet = pjrt_unmet(self.host().backends, self.environ, backend)
            if unmet:
                warn_user(f"accelport: {unmet}.", CompatibilityWarning)

    def sync(self) -> None:
        """``ap.sync()``: run or wait for the queued work; on a lazy backend, look at the graph that ran."""
        backend = self._backend or self.backend()
        try:
            backend.sync()
        except BaseException as exc:  # on XLA an out-of-memory error surfaces at a sync
            self.tracker.failed(exc)
            raise
        self.tracker.user_synced()

    def use(self, name: str) -> Backend:
        self.tracker.end_run()  # the steps so far belong to the backend in use until now (and its profile)
        with self._lock:
            from accelport.runtime.selection import resolve

            backend, reason = resolve(self.host(), name, self.environ)
            self.explicit = name
            self._backend = None
            self.reason = reason
        return self.backend()

    def reset(self) -> None:
        """Forget plugins, selection and counters (tests; a fresh start after env changes)."""
        if self.tracker.nan_search is not None:
            self.tracker.nan_search.finish()  # its hooks come out with the run
        self.tracker.end_run()  # the observers get every step of the run that ends here; a profile is closed
        with self._lock:
            self.__init__(self._environ, self._plugin_timeout)  # type: ignore[misc]

    @contextlib.contextmanager
    def scoped(self) -> Iterator[Runtime]:
        """Run a block whose backend choice and counters are its own; the state before comes back after.

        The pytest plugin runs each test on its backend inside one, so a test's
        ``ap.use`` (or ``reset``) never leaks into the next test.
        """
        with self._lock:
            saved = {key: value for key, value in vars(self).items() if key != "_lock"}
        try:
            yield self
        finally:
            search = self.tracker.nan_search
            if search is not None and search is not saved["tracker"].nan_search:
                search.finish()  # the block's own search ends with it
            self.tracker.flush(pass_ended=False)  # (its tracker goes: what its checks keep is read now)
            with self._lock:
                vars(self).update(saved)

    def since_selected(self) -> dict[str, Any]:
        """Every counter field, counted since the backend was selected (None: not measured).

        torch_xla's counters are process-wide: a second run in the same process
        (another ``ap.use``, a test) must not see the first one's compilations or fallbacks.
        """
        now = self.backend().counters()
        values: dict[str, Any] = {}
        for key in COUNTER_FIELDS:
            if key not in now:
                values[key] = None
                continue
            value, base = now[key], self._baseline.get(key)
            if key in LEVEL_FIELDS or base is None:
                values[key] = value
            elif isinstance(value, dict):
                diff = {op: n - base.get(op, 0) for op, n in value.items()}
                values[key] = {op: n for op, n in diff.items() if n}
            else:
                values[key] = value - base
        return values

    def metrics(self) -> Metrics:
        backend = self.backend()
        t = self.tracker
        t.hand_over_finished()  # every finished step's breakdown final (a step waiting for its sync stays)
        values = self.since_selected()
        if t.memory is not None:  # the sensor's figures; a backend's own counters where it has none
            values.update({k: v for k, v in t.memory.metrics().items() if v is not None or k not in values})
        total, steps = dict(t.time_total), t.time_steps
        said = [*self.time_summary(), "", "", ""]
        return Metrics(
            backend=backend.name,
            steps=t.steps,
            data_wait_seconds=t.data_wait,
            step_seconds=t.step_seconds,
            batch_signatures=len(t.signatures) if t.signatures else None,
            compile_cache_dir=backend.compile_cache_dir(),
            **values,
            time_breakdown=total,
            time_breakdown_per_step={k: v / steps for k, v in total.items()} if steps else {},
            time_summary=said[0],
            time_verdict=said[1],
            time_fix=said[2],
            **self._metrics_efficiency(),
        )

    def time_summary(self) -> list[str]:
        """Where a step's time goes in one line, the verdict and its fix (none before the first step); a
        device-bound verdict says how much of the chip the step uses, and why it is low."""
        from accelport.diagnose.timing import with_efficiency

        said = self._time_summary()
        return with_efficiency(said, self.efficiency()) if said else said

    def _time_summary(self) -> list[str]:
        t = self.tracker
        if not t.time_steps:
            return []
        from accelport.diagnose.timing import explain

        engine = self._engine
        return explain(t.time_total, t.time_steps, first=t.first_breakdown, loader=t.loader_info,
                       # (the findings as the whole run has them: the fix the summary says for the same kind)
                       findings=engine.current() if engine is not None else (),
                       lazy=bool(self._backend is not None and self._backend.lazy), style=self._style,
                       shapes=len(t.signatures) or None)


RUNTIME = Runtime()


def profile_warning(environ: Mapping[str, str]) -> Any:
    """What a profile of a ported script says goes out as a ProfileWarning at the user's line, redacted."""
    from accelport.errors import ProfileWarning, warn_user
    from accelport.redact import Redactor

    redactor = Redactor(environ, limit=2000)

    def say(text: str) -> None:
        try:  # (line by line: the pass escapes a newline, which would forge a line)
            warn_user("\n".join(redactor.text(line) for line in text.split("\n")), ProfileWarning)
        except Warning:  # the script's filters make warnings errors: profiling never breaks training
            pass

    return say


_exit_flushed = threading.Event()


@atexit.register
def _flush_at_exit() -> None:
    # Steps a loop without ap.loader left unread (ap.loader hands them over as it ends), and a
    # profile window still open. (Registered once more as each backend is chosen: the first call does it.)
    if _exit_flushed.is_set():
        return
    _exit_flushed.set()
    try:
        from accelport.errors import ending_with_error

        search = RUNTIME.tracker.nan_search
        if search is not None:
            search.finish()  # an op found in a step whose update never came: the rules see it now
        RUNTIME.tracker.end_run(failed=ending_with_error())
        if search is not None:
            from accelport.errors import DiagnosticWarning
            from accelport.observe.nan_search import ENV

            # What was checked: a ported script has no summary to say it in. (Shown at the script, whose
            # run it is; there is no line of it to point at any more.)
            script = getattr(sys.modules.get("__main__"), "__file__", None) or "accelport"
            for note in search.notes():
                warnings.warn_explicit(f"accelport {ENV}: {note}", DiagnosticWarning, script, 0)
    except Exception:  # noqa: BLE001 - the interpreter is going away; never fail there
        pass
