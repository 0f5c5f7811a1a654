"""The engine that runs the registered rules over a run's step records: each kind is found once.

Rules are plugins (:class:`accelport.diagnose.rule.Rule`, registered through
``accelport_register_rules``); the engine is what the runtime (``ap.*``) and
``accelport diagnose`` hand their records and signals to. For each finding it makes the
:class:`~accelport.diagnose.rule.Diagnosis`, gives it once as a warning of the rule's
category, and returns it, so the step observers (the metrics file) get it with the record
it was made on. Replaying a metrics file (``accelport report``) runs the same rules on the
records alone.

A warning filter of the script's set to "error" turns nothing here into an exception: the
finding is kept (``ap.diagnostics()``, ``accelport diagnose``'s summary), the warning is
not raised into the training loop. A rule that raises (``SystemExit`` and any other
``BaseException`` too), or does not return within ``ACCELPORT_PLUGIN_TIMEOUT`` seconds, is
disabled for the rest of the run with a PluginWarning naming its plugin, and
:attr:`Diagnostics.failures` says what it missed; a real Ctrl-C still ends the run.

Every finding goes through one pass as it is made (:meth:`Diagnostics.shown`): credentials
redacted, control characters escaped (no message can forge a line or run a terminal escape),
each text cut at :data:`FINDING_CHARACTERS`. The warning, ``ap.diagnostics()``, the metrics
file, the JSON, the summary and the report page all get the finding as it left that pass.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from accelport.diagnose.rule import KIND_PATTERN, SEVERITIES, BatchShapes, Diagnosis, Rule, RunView
from accelport.errors import DiagnosticWarning, PluginWarning, user_stacklevel
from accelport.redact import Redactor
from accelport.settings import plugin_timeout

if TYPE_CHECKING:
    from accelport.contract import StepRecord
    from accelport.plugins.host import PluginHost

__all__ = ["Diagnostics", "SENSORS", "FINDING_CHARACTERS", "rules_from", "usable_rules", "rule_problem"]

#: The live sensors a rule may ask for in ``Rule.needs``.
SENSORS = frozenset({"numerics", "shapes", "nan-search", "memory"})
#: The most characters a finding's message, its fix, or a string of its evidence keeps: a longer
#: one is cut there and says how long it was (a rule that quotes a 5 MB value does not print it).
FINDING_CHARACTERS = 4000
_NOTHING: tuple[Diagnosis, ...] = ()
_get_ident = threading.get_ident


def rule_problem(rule: Any) -> str | None:
    """What makes ``rule`` unusable as a rule class, or None."""
    if not (isinstance(rule, type) and issubclass(rule, Rule)):
        return f"{rule!r} is not a subclass of accelport.Rule"
    kind = getattr(rule, "kind", None)
    if not isinstance(kind, str) or not KIND_PATTERN.match(kind):
        return (f"{rule.__name__}.kind is {kind!r}; a kind is lower-case words joined by '-' "
                "(for example 'slow-step')")
    if rule.severity not in SEVERITIES:
        return f"{rule.__name__}.severity is {rule.severity!r}; expected one of {', '.join(SEVERITIES)}"
    if not (isinstance(rule.warning, type) and issubclass(rule.warning, DiagnosticWarning)):
        return f"{rule.__name__}.warning is {rule.warning!r}; expected a subclass of accelport.DiagnosticWarning"
    needs = rule.needs
    if isinstance(needs, str) or not all(isinstance(n, str) for n in needs) or not set(needs) <= SENSORS:
        return (f"{rule.__name__}.needs is {needs!r}; expected a set of sensor names among "
                f"{', '.join(sorted(SENSORS))}")
    return None


def usable_rules(registered: Sequence[tuple[str, Any]],
                 refuse: Callable[..., None]) -> list[tuple[str, type[Rule]]]:
    """The (plugin, rule class) pairs that can run, in registration order; ``refuse(plugin, why, where)`` for
    the rest, ``where`` being the refused class's (file, line) where it has one.

    A kind that is already registered keeps its first rule (to replace a built-in kind,
    disable the plugin that registers it).
    """
    out: list[tuple[str, type[Rule]]] = []
    kinds: dict[str, str] = {}
    for plugin, rule in registered:
        try:
            problem = rule_problem(rule)
        except Exception as exc:  # a raising property on the class
            problem = f"reading its class attributes raised {type(exc).__name__}: {exc}"
        if problem is None and rule.kind in kinds:
            problem = (f"kind {rule.kind!r} is already registered by plugin {kinds[rule.kind]!r}; disable that "
                       "plugin to replace it")
        if problem:
            refuse(plugin, f"rule skipped: {problem}", rule_site(rule))
            continue
        kinds[rule.kind] = plugin
        out.append((plugin, rule))
    return out


def rules_from(host: PluginHost) -> list[tuple[str, type[Rule]]]:
    """The rules ``host``'s plugins registered that can run; each refused one said once (a PluginWarning)."""
    return usable_rules(host.registered_rules(), host.refuse)


def _file_of(cls: type) -> str:
    module = sys.modules.get(cls.__module__)
    return str(getattr(module, "__file__", "") or "")


def rule_site(rule: Any) -> tuple[str, int, str] | None:
    """The file, line and module where the class ``rule`` is defined (a warning about it points there), or None."""
    import inspect

    if not isinstance(rule, type):
        return None
    try:
        filename = inspect.getsourcefile(rule) or _file_of(rule)
        line = getattr(rule, "__firstlineno__", None)  # Python 3.13 keeps it; before, the source says it
        if not isinstance(line, int):
            line = inspect.getsourcelines(rule)[1]
    except Exception:  # noqa: BLE001 - a class made at run time, or one whose source is gone
        filename, line = _file_of(rule), 0
    return (filename, line, rule.__module__) if filename else None


class _Hung(BaseException):
    """Raised by the watchdog in the thread of a rule call that ran past the time limit; the engine catches it.

    A BaseException, so a rule's own ``except Exception`` does not swallow it.
    """


def _async_raise(thread_id: int, exc: type[BaseException] | None) -> bool:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None: take back one not yet raised)."""
    import ctypes

    try:
        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    except AttributeError:  # an interpreter without the C API: calls are not bounded
        return False
    return bool(set_async_exc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None))


class _Watchdog:
    """One daemon thread per process that bounds the rule calls of every engine (see :meth:`Diagnostics._poll`).

    The rules run in the thread that hands the records over (the training loop's): a thread per
    call, as doctor isolates its plugins, would cost more than the rules do on every step. The
    watchdog instead looks at each engine's current call every ``period`` seconds, and raises
    :class:`_Hung` in the thread of a call it has seen running for the engine's whole time limit.
    That stops a rule busy in Python; one blocked inside a C call (a sleep, a lock) is stopped
    when that call returns. The limit counts the watchdog's own looks, not the clock: a process
    stopped (Ctrl-Z) and resumed has not let a rule run long.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards every engine's _call, _calling, _injected against the watchdog
        self.period = 1.0
        self._engines: weakref.WeakSet[Diagnostics] = weakref.WeakSet()
        self._pid: int | None = None
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forked)

    def watch(self, engine: Diagnostics) -> None:
        """Bound ``engine``'s rule calls (again: after a fork, the thread is started anew)."""
        with self.lock:
            self._engines.add(engine)
            self.period = min(self.period, max(0.05, engine.timeout / 10))
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="accelport-rule-watchdog", daemon=True).start()

    def _forked(self) -> None:
        # The thread is not in the child, and the lock may have been held by it when the process forked.
        self.lock = threading.Lock()
        self._pid = None

    def _run(self) -> None:
        import ctypes  # noqa: F401 - imported now: never while the thread it stops holds an import lock

        pid = os.getpid()
        while self._pid == pid:
            time.sleep(self.period)
            with self.lock:
                for engine in list(self._engines):
                    engine._poll(max(2, math.ceil(engine.timeout / self.period)))


_WATCHDOG = _Watchdog()


def _raised_by_code(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt was raised by a ``raise`` statement of the code that was running (a rule's),
    not by SIGINT (a Ctrl-C).

    Python raises SIGINT's KeyboardInterrupt where it checks for signals: at a loop's jump, a call, the
    return of a C function (a sleep) or inside SIGINT's own handler; never at a ``raise`` statement of
    the interrupted code. So the innermost frame of the traceback says which it was. A rule that sends
    itself SIGINT (``os.kill``) is taken at its word: that ends the run, as the user's Ctrl-C does.
    """
    import dis

    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code, lasti = tb.tb_frame.f_code, tb.tb_lasti
    raises = {dis.opmap[name] for name in ("RAISE_VARARGS", "RERAISE") if name in dis.opmap}
    if not 0 <= lasti < len(code.co_code) or code.co_code[lasti] not in raises:
        return False
    handler = signal.getsignal(signal.SIGINT)
    return code is not getattr(getattr(handler, "__func__", handler), "__code__", None)


def _class_of(item: Any) -> type[Rule]:
    return item if isinstance(item, type) else type(item)


def _scrub(value: Any, redactor: Redactor) -> Any:
    """``value`` with every string in it through ``redactor``; an object JSON would quote as its ``str()``, too."""
    if isinstance(value, str):
        return redactor.text(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {_scrub(k, redactor) if isinstance(k, str) else k: _scrub(v, redactor) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, redactor) for v in value]
    if isinstance(value, (tuple, set, frozenset)):
        return tuple(_scrub(v, redactor) for v in value)
    return redactor.text(str(value))


def _why(exc: BaseException) -> str:
    """What a rule did that disabled it, in words."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})" if exc.code is not None else "it raised SystemExit"
    if isinstance(exc, KeyboardInterrupt):
        return "its own code raised KeyboardInterrupt (not a Ctrl-C)"
    said = str(exc)
    return f"it raised {type(exc).__name__}: {said}" if said else f"it raised {type(exc).__name__}"


class Diagnostics:
    """Runs the rules of one run (one instance each) and keeps what they found.

    ``rules`` are (plugin, rule class) pairs (see :func:`usable_rules`); ``view`` is what the
    run knows of itself (backend, family, live sensors), None for a replay of records alone.
    A record whose step number does not follow the last one starts a new run: the rules
    start again, the findings and the kinds already found stay.

    Every call into a rule is contained: whatever it raises (``SystemExit``, a KeyboardInterrupt
    of its own, any ``BaseException``) or a call that does not return within :attr:`timeout`
    seconds (``ACCELPORT_PLUGIN_TIMEOUT`` of the run's environment, as for doctor's plugins)
    disables that rule for the rest of the run; a Ctrl-C (SIGINT) goes on and ends the run.
    """

    def __init__(self, rules: Sequence[tuple[str, type[Rule]]], view: RunView | None = None) -> None:
        self.findings: list[Diagnosis] = []
        #: One line per rule that was disabled: its kind, its plugin, the step, why; not judged after it.
        self.failures: list[str] = []
        self._classes = list(rules)
        self._plugins = {cls: plugin for plugin, cls in self._classes}
        self._broken: set[type[Rule]] = set()
        self._reported: set[str] = set()
        self._by_kind: dict[str, Rule] = {}  # the rule instance that made each finding
        #: The live sensors the rules read (see Rule.needs).
        self.needs: frozenset[str] = frozenset().union(*(cls.needs for _, cls in self._classes))
        self.kinds = {cls.kind: cls for _, cls in self._classes}
        #: The files the rules live in: a warning is pointed past them, at the user's line.
        self.rule_files = frozenset(_file_of(cls) for _, cls in self._classes) - {""}
        # The rule call being made, for the watchdog: (thread id,) while rules run, and the rule (or class).
        self._call: tuple[int] | None = None
        self._calling: Any = None
        self._injected = False  # the watchdog raised _Hung in this call, and it was not taken yet
        self._hung: Any = None  # the rule it was raised for
        self._seen: list[Any] | None = None  # the watchdog's: [call, rule, looks]
        self._base = view if view is not None else RunView()
        self._settings()
        self._restart()

    def start(self, view: RunView) -> None:
        """A run starts with what ``view`` says of it (a backend was selected)."""
        self._base = view
        self._settings()
        self._restart()

    def _settings(self) -> None:
        #: Seconds a rule call may take before its rule is disabled.
        self.timeout = plugin_timeout(self._base.environ)
        self._redactor: Redactor | None = None  # made at the first finding, from the run's environment
        _WATCHDOG.watch(self)

    def _restart(self) -> None:
        self.shapes = BatchShapes()
        self.view = dataclasses.replace(self._base, shapes=self.shapes, found=self._reported.__contains__)
        self._step = 0
        self._last: StepRecord | None = None
        self._rules: list[Rule] = []
        live = [cls for _, cls in self._classes if cls not in self._broken]
        made = self._watched(live, lambda cls: cls(self.view, self._report), 0)
        self._rules = [rule for cls, rule in made if cls not in self._broken]

    # -- the signals --------------------------------------------------------------------------
    def step_end(self, record: StepRecord) -> tuple[Diagnosis, ...]:
        """Judge one step record; the findings made on it (usually none)."""
        if record.step <= self._step:
            self._restart()
        self._step = record.step
        self._last = record
        self.shapes.update(record.signature)
        before = len(self.findings)
        # (The hot path: _watched's loop, written out.)
        entered = self._call is None
        if entered:
            self._call = (_get_ident(),)
        try:
            for rule in self._rules:
                self._calling = rule
                try:
                    rule.step(record)
                except BaseException as exc:
                    self._fault(rule, exc, record.step)
        except _Hung:  # raised between two rules' calls
            self._timed_out(record.step)
        finally:
            if entered:
                self._leave()
        return tuple(self.findings[before:]) if len(self.findings) > before else _NOTHING

    def graph_ran(self, nodes: int, where: str) -> tuple[Diagnosis, ...]:
        """A lazy backend ran a graph outside a training step; the findings made on it."""
        return self._each(lambda rule: rule.graph_ran(nodes, where))

    def settle(self) -> tuple[Diagnosis, ...]:
        """Every step so far was judged: what the live sensors found since the last record."""
        if self._last is None:
            return _NOTHING
        return self._each(lambda rule: rule.settle())

    def _each(self, call: Callable[[Rule], None]) -> tuple[Diagnosis, ...]:
        before = len(self.findings)
        self._watched(list(self._rules), call, self._step)
        return tuple(self.findings[before:])

    # -- containment ----------------------------------------------------------------------------
    def _watched(self, items: Sequence[Any], call: Callable[[Any], Any], step: int) -> list[tuple[Any, Any]]:
        """(item, call(item)) for each rule (or rule class) whose call returned; the others are disabled."""
        out = []
        entered = self._call is None  # (a rule's warning whose hook asks for the findings calls in again)
        if entered:
            self._call = (_get_ident(),)
        try:
            for item in items:
                self._calling = item
                try:
                    out.append((item, call(item)))
                except BaseException as exc:
                    self._fault(item, exc, step)
        except _Hung:
            self._timed_out(step)
        finally:
            if entered:
                self._leave()
        return out

    def _fault(self, item: Any, exc: BaseException, step: int) -> None:
        """A rule call raised ``exc``: disable its rule, unless it is a Ctrl-C, which goes on."""
        self._calling = None
        if isinstance(exc, _Hung):
            self._timed_out(step)
        elif isinstance(exc, KeyboardInterrupt) and not _raised_by_code(exc):
            # SIGINT: the user stops the run. (Told apart from a rule's own `raise KeyboardInterrupt`, which
            # must not end a training run any more than its sys.exit() may: see _raised_by_code.)
            raise exc
        else:
            self._broke(_class_of(item), _why(exc), step)

    def _timed_out(self, step: int) -> None:
        """The watchdog's :class:`_Hung` was raised here, and is taken: disable the rule it was raised for."""
        hung, self._hung = self._hung, None
        self._calling = None
        with _WATCHDOG.lock:  # (nothing else is pending: it raises one at a time; the next call is bounded again)
            self._injected = False
        if hung is not None:
            self._broke(_class_of(hung), f"it did not return within {self.timeout:g} s", step)

    def _leave(self) -> None:
        """The rules' calls are over: the watchdog stops looking, and a _Hung it raised too late is taken here."""
        call = self._call
        while True:
            try:
                with _WATCHDOG.lock:
                    self._call = self._calling = None
                    injected, self._injected = self._injected, False
                if injected and call is not None:
                    _async_raise(call[0], None)  # raised as the call returned: taken back, not raised later
                return
            except _Hung:  # raised here, before it could be taken back
                self._timed_out(self._step)

    def _poll(self, looks: int) -> None:
        """The watchdog's look (its lock held): a rule call seen running ``looks`` times in a row is stopped."""
        call, rule = self._call, self._calling
        if call is None or rule is None or self._injected:
            self._seen = None
            return
        seen = self._seen
        if seen is None or seen[0] is not call or seen[1] is not rule:
            self._seen = [call, rule, 1]
            return
        seen[2] += 1
        if seen[2] >= looks:
            self._seen = None
            self._hung = rule
            self._injected = _async_raise(call[0], _Hung)

    # -- what was judged -------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """The last step judged (0: none)."""
        return self._step

    def unjudged(self) -> dict[str, str]:
        """kind -> why it did not judge this run so far ("needs 10 steps", "failed at step 5"); empty when every
        rule judged every step it could."""
        out = {}
        for rule, why in self._watched(list(self._rules), lambda rule: rule.unjudged(self._step), self._step):
            if why and rule.kind not in self._reported and type(rule) not in self._broken:
                out[rule.kind] = str(why)
        for cls in self._broken:
            out[getattr(cls, "kind", cls.__name__)] = "its rule was disabled"
        return out

    # -- findings -------------------------------------------------------------------------------
    def current(self) -> list[Diagnosis]:
        """The findings as of now: each with its kind's totals over the run so far, and its fix as the whole
        run would have it (the findings themselves say the moment each was made)."""
        rules = [rule for rule in {id(r): r for r in self._by_kind.values()}.values()
                 if type(rule) not in self._broken]
        read = self._watched(rules, lambda rule: (dict(rule.totals()), rule.current_fix()), self._step)
        now = {id(rule): value for rule, value in read}  # (by identity: a rule may define __eq__)
        out = []
        for finding in self.findings:
            rule = self._by_kind.get(finding.kind)
            if rule is None or id(rule) not in now or type(rule) in self._broken:
                out.append(finding)
                continue
            totals, fix = now[id(rule)]
            redactor = self._shown()  # (what the finding itself says went through it when it was made)
            out.append(dataclasses.replace(finding, totals=_scrub(totals, redactor),
                                           fix=redactor.text(str(fix)) if fix is not None else finding.fix))
        return out

    def severity_of(self, kind: str, evidence: Mapping[str, Any], default: str = "warning") -> str:
        """A finding's severity by today's rule for its kind; ``default`` for a kind no rule here knows."""
        rule = self.kinds.get(kind)
        if rule is None:
            return default
        try:
            severity = rule.severity_of(evidence)
        except Exception:  # noqa: BLE001 - a rule that cannot say keeps what was said
            return default
        return severity if severity in SEVERITIES else default

    def shown(self, diagnosis: Diagnosis) -> Diagnosis:
        """``diagnosis`` as every output shows it: each of its texts (message, fix, the strings of its evidence
        and totals) redacted, its control characters escaped, cut at :data:`FINDING_CHARACTERS`."""
        redactor = self._shown()
        return dataclasses.replace(diagnosis, message=redactor.text(diagnosis.message),
                                   fix=redactor.text(diagnosis.fix), evidence=_scrub(diagnosis.evidence, redactor),
                                   totals=_scrub(diagnosis.totals, redactor))

    def _shown(self) -> Redactor:
        """The pass of :meth:`shown`: made at the first finding, knowing the secrets of the run's environment."""
        if self._redactor is None:
            self._redactor = Redactor(self._base.environ, limit=FINDING_CHARACTERS)
        return self._redactor

    def _report(self, rule: Rule, message: str, step: int, fix: str, evidence: dict[str, Any]) -> None:
        kind = rule.kind
        if kind in self._reported:
            return
        severity = type(rule).severity_of(evidence)
        if severity not in SEVERITIES:
            severity = rule.severity
        diagnosis = self.shown(Diagnosis(kind, str(message), int(step), evidence, severity, str(fix or "")))
        self._reported.add(kind)
        self.findings.append(diagnosis)
        self._by_kind[kind] = rule
        text = f"[{kind}] PROBLEM: {diagnosis.text}" if severity == "problem" else f"[{kind}] {diagnosis.text}"
        try:
            warnings.warn(text, rule.warning, stacklevel=user_stacklevel(also=self.rule_files))
        except Warning:
            pass  # the script's filters turn warnings into errors: the finding stays, its loop is not broken

    def _broke(self, cls: type[Rule], why: str, step: int) -> None:
        """Disable rule ``cls`` for the rest of the run (once), saying ``why`` in the failures and a PluginWarning."""
        if cls in self._broken:
            return
        self._broken.add(cls)
        self._rules = [r for r in self._rules if type(r) is not cls]
        plugin = self._plugins.get(cls, "?")
        kind = getattr(cls, "kind", cls.__name__)
        why = self._shown().text(why)  # (an exception's text quotes what it likes)
        self.failures.append(f"the {kind} rule of plugin {plugin!r} was disabled at step {step}: {why}; "
                             f"{kind} was not judged after it")
        try:
            warnings.warn(f"accelport plugin {plugin!r}: its {kind} rule was disabled at step {step}: {why}. The "
                          f"other rules keep working; set ACCELPORT_DISABLED_PLUGINS={plugin} to silence this.",
                          PluginWarning, stacklevel=user_stacklevel(also=self.rule_files))
        except Warning:
            pass
