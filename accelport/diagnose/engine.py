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
not raised into the training loop. A rule that raises is disabled for the rest of the run
with a PluginWarning naming its plugin, and :attr:`Diagnostics.failures` says what it missed.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from accelport.diagnose.rule import KIND_PATTERN, SEVERITIES, BatchShapes, Diagnosis, Rule, RunView
from accelport.errors import DiagnosticWarning, PluginWarning, user_stacklevel

if TYPE_CHECKING:
    from accelport.contract import StepRecord
    from accelport.plugins.host import PluginHost

__all__ = ["Diagnostics", "SENSORS", "rules_from", "usable_rules", "rule_problem"]

#: The live sensors a rule may ask for in ``Rule.needs``.
SENSORS = frozenset({"numerics", "shapes", "nan-search", "memory"})
_NOTHING: tuple[Diagnosis, ...] = ()


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
                 refuse: Callable[[str, str], None]) -> list[tuple[str, type[Rule]]]:
    """The (plugin, rule class) pairs that can run, in registration order; ``refuse(plugin, why)`` for the rest.

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
            refuse(plugin, f"rule skipped: {problem}")
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


class Diagnostics:
    """Runs the rules of one run (one instance each) and keeps what they found.

    ``rules`` are (plugin, rule class) pairs (see :func:`usable_rules`); ``view`` is what the
    run knows of itself (backend, family, live sensors), None for a replay of records alone.
    A record whose step number does not follow the last one starts a new run: the rules
    start again, the findings and the kinds already found stay.
    """

    def __init__(self, rules: Sequence[tuple[str, type[Rule]]], view: RunView | None = None) -> None:
        self.findings: list[Diagnosis] = []
        #: One line per rule that raised: its kind, its plugin, the step, the error; not judged after it.
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
        self._base = view if view is not None else RunView()
        self._restart()

    def start(self, view: RunView) -> None:
        """A run starts with what ``view`` says of it (a backend was selected)."""
        self._base = view
        self._restart()

    def _restart(self) -> None:
        self.shapes = BatchShapes()
        self.view = dataclasses.replace(self._base, shapes=self.shapes, found=self._reported.__contains__)
        self._step = 0
        self._last: StepRecord | None = None
        self._rules: list[Rule] = []
        for _, cls in self._classes:
            if cls in self._broken:
                continue
            try:
                self._rules.append(cls(self.view, self._report))
            except Exception as exc:
                self._broke(cls, exc, 0)

    # -- the signals --------------------------------------------------------------------------
    def step_end(self, record: StepRecord) -> tuple[Diagnosis, ...]:
        """Judge one step record; the findings made on it (usually none)."""
        if record.step <= self._step:
            self._restart()
        self._step = record.step
        self._last = record
        self.shapes.update(record.signature)
        before = len(self.findings)
        for rule in self._rules:
            try:
                rule.step(record)
            except Exception as exc:
                self._broke(type(rule), exc, record.step)
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
        for rule in list(self._rules):
            try:
                call(rule)
            except Exception as exc:
                self._broke(type(rule), exc, self._step)
        return tuple(self.findings[before:])

    # -- what was judged -------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """The last step judged (0: none)."""
        return self._step

    def unjudged(self) -> dict[str, str]:
        """kind -> why it did not judge this run so far ("needs 10 steps", "failed at step 5"); empty when every
        rule judged every step it could."""
        out = {}
        for rule in list(self._rules):
            try:
                why = rule.unjudged(self._step)
            except Exception as exc:
                self._broke(type(rule), exc, self._step)
                why = None
            if why and rule.kind not in self._reported:
                out[rule.kind] = why
        for cls in self._broken:
            out[getattr(cls, "kind", cls.__name__)] = "its rule failed"
        return out

    # -- findings -------------------------------------------------------------------------------
    def current(self) -> list[Diagnosis]:
        """The findings as of now: each with its kind's totals over the run so far, and its fix as the whole
        run would have it (the findings themselves say the moment each was made)."""
        out = []
        for finding in self.findings:
            rule = self._by_kind.get(finding.kind)
            if rule is None or type(rule) in self._broken:
                out.append(finding)
                continue
            try:
                totals = dict(rule.totals())
                fix = rule.current_fix()
            except Exception as exc:
                self._broke(type(rule), exc, self._step)
                out.append(finding)
                continue
            out.append(dataclasses.replace(finding, totals=totals, fix=fix if fix is not None else finding.fix))
        return out

    def severity_of(self, kind: str, evidence: Mapping[str, Any], default: str = "warning") -> str:
        """A finding's severity by today's rule for its kind; ``default`` for a kind no rule here knows."""
        rule = self.kinds.get(kind)
        return rule.severity_of(evidence) if rule is not None else default

    def _report(self, rule: Rule, message: str, step: int, fix: str, evidence: dict[str, Any]) -> None:
        kind = rule.kind
        if kind in self._reported:
            return
        severity = type(rule).severity_of(evidence)
        if severity not in SEVERITIES:
            severity = rule.severity
        self._reported.add(kind)
        diagnosis = Diagnosis(kind, str(message), int(step), evidence, severity, str(fix or ""))
        self.findings.append(diagnosis)
        self._by_kind[kind] = rule
        text = f"[{kind}] PROBLEM: {diagnosis.text}" if severity == "problem" else f"[{kind}] {diagnosis.text}"
        try:
            warnings.warn(text, rule.warning, stacklevel=user_stacklevel(also=self.rule_files))
        except Warning:
            pass  # the script's filters turn warnings into errors: the finding stays, its loop is not broken

    def _broke(self, cls: type[Rule], exc: Exception, step: int) -> None:
        self._broken.add(cls)
        self._rules = [r for r in self._rules if type(r) is not cls]
        plugin = self._plugins.get(cls, "?")
        kind = getattr(cls, "kind", cls.__name__)
        self.failures.append(f"the {kind} rule of plugin {plugin!r} failed at step {step} "
                             f"({type(exc).__name__}: {exc}), so {kind} was not judged after it")
        try:
            warnings.warn(f"accelport plugin {plugin!r}: its {kind} rule was disabled: it raised "
                          f"{type(exc).__name__}: {exc} at step {step}. The other rules keep working; set "
                          f"ACCELPORT_DISABLED_PLUGINS={plugin} to silence this.", PluginWarning,
                          stacklevel=user_stacklevel(also=self.rule_files))
        except Warning:
            pass
