"""``accelport compare A.json B.json [...]``: runs side by side, each against the first (the baseline).

A run is the ``--output`` file of ``accelport diagnose`` or a metrics file (``--metrics-file``,
``ACCELPORT_METRICS_FILE``: the last run in it). Both hold the same account of a run on every
backend, so anything compares with anything: before and after a fix, cpu against XLA, two torch
versions. What differs in the setup (script, backend, versions, arguments) is said first; then
per-step time and each time category, compilations, host reads, data wait, the memory peak and
the model FLOPs utilisation, with the ratio to the baseline; then the findings, matched by kind and
location (fixed, new, still there); then one line that says what changed.

Nothing here prints or parses arguments (that is :mod:`accelport.cli.compare`); a file that is not
a run's is a :class:`accelport.errors.UsageError` that says what to pass.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accelport.errors import AccelportError, UsageError
from accelport.safe_io import read_regular_file

__all__ = ["RunSummary", "Finding", "Row", "Comparison", "load_run", "compare", "render_text", "render_page",
           "to_dict", "WHAT_TO_PASS"]

#: What a run's file is, said with every error about one that is not.
WHAT_TO_PASS = ("pass the file `accelport diagnose --output FILE.json -- SCRIPT` wrote, or a metrics file "
                "(`accelport diagnose --metrics-file FILE.jsonl`, ACCELPORT_METRICS_FILE)")
#: The largest run file read (a metrics file of a long run is tens of MB).
_LIMIT = 1 << 30
#: The setup fields, in the order their differences are said.
SETUP_FIELDS = ("script", "backend", "torch", "torch_xla", "python", "accelport", "args")
#: Below this change (either way) a time is "unchanged" in the verdict.
_SAME = 0.05


@dataclass(frozen=True)
class Finding:
    """One finding of a run, as compared: its kind and where (``file:line``, None where not recorded)."""

    kind: str
    where: str | None
    severity: str
    step: int | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "where": self.where, "severity": self.severity, "step": self.step,
                "message": self.message}


@dataclass
class RunSummary:
    """What one run's file says, in the quantities compared (None: not measured, or not in the file)."""

    path: str
    #: "diagnose --output" or "metrics file".
    source: str
    #: SETUP_FIELDS -> what was recorded (None: not recorded; a metrics file has the backend only).
    setup: dict[str, Any]
    steps: int
    exit_status: int | None = None
    #: Seconds per step, and each time category's seconds per step.
    per_step: float | None = None
    categories: dict[str, float] = field(default_factory=dict)
    compilations: int | None = None
    compile_seconds: float | None = None
    host_reads: int | None = None
    data_wait: float | None = None
    memory_peak: int | None = None
    flops_per_step: float | None = None
    achieved_flops: float | None = None
    mfu: float | None = None
    findings: list[Finding] = field(default_factory=list)
    #: What makes this run's numbers partial (nothing measured, a failed run).
    notes: list[str] = field(default_factory=list)

    def value(self, key: str) -> float | None:
        """A row's value: an attribute, ``category:NAME`` for a time category, or ``host_reads_per_step``."""
        if key.startswith("category:"):  # (a run that measured its steps' time spent none in a category it lacks)
            return self.categories.get(key.partition(":")[2], 0.0) if self.categories else None
        if key == "host_reads_per_step":
            return self.host_reads / self.steps if self.host_reads is not None and self.steps else None
        value = getattr(self, key)
        return float(value) if isinstance(value, (int, float)) else None


@dataclass(frozen=True)
class Row:
    """One line of the table: a quantity of every run (None: "-"), and each run's ratio to the baseline."""

    key: str
    label: str
    #: "s" (shown in ms), "s_total" (shown in s), "count", "bytes", "flops", "flop/s", "share".
    unit: str
    values: tuple[float | None, ...]

    def ratio(self, i: int) -> float | None:
        """Run ``i`` over the baseline; None where either is missing or the baseline is 0."""
        base, value = self.values[0], self.values[i]
        if base is None or value is None or base == 0:
            return None
        return value / base


@dataclass
class Comparison:
    """The runs (the first is the baseline), the table, and for each other run: its setup differences,
    its findings against the baseline's, and the verdict."""

    runs: list[RunSummary]
    rows: list[Row]
    #: Per run after the first: [(field, baseline's, this run's)].
    setup_differences: list[list[tuple[str, Any, Any]]]
    #: Per run after the first: {"fixed": [...], "new": [...], "still": [(baseline's, this run's)]}.
    findings: list[dict[str, list[Any]]]
    verdicts: list[str]
    notes: list[list[str]]


# -- reading a run --------------------------------------------------------------------------------


def _refuse(path: str, what: str) -> UsageError:
    return UsageError(f"compare: {path} {what}; {WHAT_TO_PASS}")


def load_run(path: str) -> RunSummary:
    """The run in ``path``; UsageError saying what the file is and what to pass where it is no run's."""
    if not os.path.lexists(path):
        raise _refuse(path, "does not exist")
    if os.path.isdir(path):
        raise _refuse(path, "is a directory, not a run's file")
    try:
        data = read_regular_file(path, what="compare:", limit=_LIMIT)
    except AccelportError as exc:  # a FIFO, a device, unreadable, too large
        raise UsageError(f"{exc}; {WHAT_TO_PASS}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _refuse(path, "is not a text file (a run's file is JSON)") from None
    if not text.strip():
        raise _refuse(path, "is empty")
    try:
        whole: Any = json.loads(text)
    except RecursionError:
        raise _refuse(path, "is JSON nested too deeply to be a run's file") from None
    except ValueError as exc:
        first = text.lstrip().partition("\n")[0]
        if _is_step_line(first):
            return _from_metrics_file(path)
        detail = f" ({exc.msg}, line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise _refuse(path, f"is not JSON{detail}") from None
    if isinstance(whole, dict):
        if {"findings", "metrics"} <= whole.keys():
            return _from_output(path, whole)
        if isinstance(whole.get("step"), int):  # a metrics file of one step
            return _from_metrics_file(path)
    raise _refuse(path, _other_shape(whole))


def _is_step_line(line: str) -> bool:
    try:
        first = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(first, dict) and isinstance(first.get("step"), int)


def _other_shape(value: Any) -> str:
    """What a JSON value that is no run is, in the words of whoever wrote it, where known."""
    if not isinstance(value, dict):
        return f"is JSON ({type(value).__name__ if value is not None else 'null'}), not a run's file"
    keys = set(value)
    if {"system", "platform", "packages", "backends"} <= keys:
        return "is the output of `accelport doctor --json` (this machine's setup, not a run)"
    if {"report", "diagnoses"} <= keys:
        return "is the output of `accelport report --json`; pass the metrics file that report read"
    if {"baseline", "comparisons"} <= keys:
        return "is the output of `accelport compare --json`; pass the runs it compared"
    if {"error", "kind"} <= keys and len(keys) <= 2:
        return "holds an error accelport printed, not a run"
    shown = ", ".join(sorted(str(k) for k in keys)[:8]) + (", ..." if len(keys) > 8 else "")
    return f"is JSON of another shape (keys: {shown or 'none'}), not a run's file"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None else None


def _checked(path: str, obj: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _refuse(path, f"has {key!r} that is not {'an object' if kind is dict else 'a list'} "
                            "(a file written by hand, or changed since)")
    return value


def _from_output(path: str, result: dict[str, Any]) -> RunSummary:
    """A run from ``accelport diagnose --output``: its metrics (``ap.metrics()``), findings, setup and efficiency."""
    metrics = _checked(path, result, "metrics", dict, {})
    findings = _checked(path, result, "findings", list, [])
    setup = _checked(path, result, "setup", dict, {})
    efficiency = _checked(path, result, "efficiency", dict, {})
    steps = _count(metrics.get("steps"))
    if steps is None:
        steps = _count(result.get("steps")) or 0
    run = RunSummary(path=path, source="diagnose --output", setup=_setup(setup, metrics.get("backend")
                                                                         or result.get("backend")),
                     steps=steps, exit_status=_count(result.get("exit_status")))
    per_step = metrics.get("time_breakdown_per_step")
    if isinstance(per_step, dict) and per_step:
        run.categories = {str(k): v for k, v in ((k, _number(v)) for k, v in per_step.items()) if v is not None}
        run.per_step = sum(run.categories.values())
    elif _number(metrics.get("step_seconds")) and steps:
        run.per_step = float(metrics["step_seconds"]) / steps
    run.compilations = _count(metrics.get("compilations"))
    run.compile_seconds = _number(metrics.get("compile_seconds"))
    run.host_reads = _count(metrics.get("device_to_host"))
    wait = _number(metrics.get("data_wait_seconds"))
    run.data_wait = wait / steps if wait is not None and steps else None
    run.memory_peak = _count(metrics.get("peak_memory_bytes"))
    if run.memory_peak is None:
        run.memory_peak = _count(metrics.get("memory_bytes"))
    run.flops_per_step = _number(efficiency.get("flops_per_step"))
    run.achieved_flops = _number(efficiency.get("achieved_flops"))
    run.mfu = _number(efficiency.get("mfu"))
    for item in findings:
        if isinstance(item, dict) and isinstance(item.get("kind"), str):
            evidence = item.get("evidence")
            where = evidence.get("where") if isinstance(evidence, dict) else None
            run.findings.append(Finding(item["kind"], where if isinstance(where, str) else None,
                                        str(item.get("severity") or "warning"), _count(item.get("step")),
                                        str(item.get("message") or "")))
    if not metrics:
        verdict = result.get("verdict")
        said = verdict.get("text") if isinstance(verdict, dict) else None
        run.notes.append(f"nothing was measured{': ' + said if isinstance(said, str) and said else ''}")
    if run.exit_status:
        run.notes.append(f"the script ended with status {run.exit_status}: its numbers cover the steps it ran")
    return run


def _setup(recorded: Mapping[str, Any], backend: Any) -> dict[str, Any]:
    setup: dict[str, Any] = {name: recorded.get(name) for name in SETUP_FIELDS}
    setup["backend"] = backend if isinstance(backend, str) and backend else None
    if setup["args"] is not None and not isinstance(setup["args"], list):
        setup["args"] = None
    return setup


def _from_metrics_file(path: str) -> RunSummary:
    """A run from a metrics file (its last run): the same quantities summed over its step records."""
    from accelport.diagnose.report import ReportError, diagnose, read_runs, skipped_note

    try:
        runs, skipped = read_runs(path)
    except ReportError as exc:
        raise UsageError(f"compare: {exc}") from None
    records = runs[-1].records
    n = len(records)
    run = RunSummary(path=path, source="metrics file", setup=_setup({}, records[-1].get("backend")), steps=n)
    if len(runs) > 1:
        run.notes.append(f"{os.path.basename(path)} holds {len(runs)} runs; the last one is compared "
                         f"(lines {runs[-1].first_line} to {runs[-1].last_line})")
    run.notes += filter(None, [skipped_note(os.path.basename(path), skipped)])

    def total(key: str) -> float | None:
        values = [_number(r.get(key)) for r in records if key in r]
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    seconds = total("seconds")
    run.per_step = seconds / n if seconds is not None else None
    categories: dict[str, float] = {}
    for r in records:
        for key, value in (r.get("breakdown") or {}).items():
            categories[key] = categories.get(key, 0.0) + (_number(value) or 0.0)
    run.categories = {k: v / n for k, v in categories.items()}
    compilations = total("compilations")
    run.compilations = int(compilations) if compilations is not None else None
    run.compile_seconds = total("compile_seconds")
    reads = total("device_to_host")
    run.host_reads = int(reads) if reads is not None else None
    wait = total("data_wait_seconds")
    run.data_wait = wait / n if wait is not None else None
    peaks = [v for r in records if isinstance(r.get("memory"), dict)
             for v in (r["memory"].get("peak_memory_bytes"), r["memory"].get("memory_bytes")) if _count(v) is not None]
    run.memory_peak = int(max(peaks)) if peaks else None
    for d in diagnose(records):
        where = d.evidence.get("where") if isinstance(d.evidence, Mapping) else None
        run.findings.append(Finding(d.kind, where if isinstance(where, str) else None, d.severity, d.step, d.message))
    return run


# -- comparing ------------------------------------------------------------------------------------


def _rows(runs: Sequence[RunSummary]) -> list[Row]:
    from accelport.observe.steptime import ordered

    def row(key: str, label: str, unit: str) -> Row:
        return Row(key, label, unit, tuple(r.value(key) for r in runs))

    seen: dict[str, float] = {}
    for r in runs:
        seen.update(dict.fromkeys(r.categories, 0.0))
    return [
        row("steps", "steps", "count"),
        row("per_step", "time per step", "s"),
        *(row(f"category:{name}", f"  {name}", "s") for name, _ in ordered(seen)),
        row("compilations", "compilations", "count"),
        row("compile_seconds", "compile time", "s_total"),
        row("host_reads_per_step", "host reads per step", "count"),
        row("data_wait", "data wait per step", "s"),
        row("memory_peak", "memory peak", "bytes"),
        row("flops_per_step", "model FLOPs per step", "flops"),
        row("achieved_flops", "achieved FLOP/s", "flop/s"),
        row("mfu", "MFU", "share"),
    ]


def _differences(a: RunSummary, b: RunSummary) -> list[tuple[str, Any, Any]]:
    """The setup fields both runs recorded and that differ, in SETUP_FIELDS order."""
    out = []
    for name in SETUP_FIELDS:
        x, y = a.setup.get(name), b.setup.get(name)
        if x is not None and y is not None and x != y:
            out.append((name, x, y))
    return out


def _basename_where(where: str | None) -> str | None:
    """``train.py:20`` for ``/any/dir/train.py:20``: the same line of the same script run from elsewhere."""
    if where is None:
        return None
    file, sep, line = where.rpartition(":")
    return f"{os.path.basename(file)}:{line}" if sep else os.path.basename(where)


def match_findings(before: Sequence[Finding], after: Sequence[Finding]) -> dict[str, list[Any]]:
    """The baseline's findings that are gone (fixed), the run's that are new, and pairs found in both: matched by
    kind and location, then by kind and the script's file name and line, then by kind alone where either
    has no location (a metrics file records none)."""
    left, right = list(before), list(after)
    still: list[tuple[Finding, Finding]] = []
    keys: list[Callable[[Finding], Any]] = [
        lambda f: (f.kind, f.where) if f.where is not None else None,
        lambda f: (f.kind, _basename_where(f.where)) if f.where is not None else None,
    ]
    for key in keys:
        for f in list(left):
            k = key(f)
            match = next((g for g in right if k is not None and key(g) == k), None)
            if match is not None:
                still.append((f, match))
                left.remove(f)
                right.remove(match)
    for f in list(left):  # a location on one side only: the kind is all that can be matched
        match = next((g for g in right if g.kind == f.kind and (f.where is None or g.where is None)), None)
        if match is not None:
            still.append((f, match))
            left.remove(f)
            right.remove(match)
    return {"fixed": left, "new": right, "still": still}


def _ms(seconds: float) -> str:
    ms = round(seconds * 1e3, 6)  # (0.08 + 0.01 + 0.01 s is 100 ms, not 99.99...)
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 or ms == 0 else f"{ms:.2f}"


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.1f}x"


def _kinds(findings: Sequence[Finding]) -> str:
    kinds = list(dict.fromkeys(f.kind for f in findings))
    return kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " and " + kinds[-1]


def verdict(a: RunSummary, b: RunSummary, found: Mapping[str, Sequence[Any]], names: tuple[str, str] = ("A", "B"),
            ) -> str:
    """One line: how much faster or slower ``b`` is per step than ``a``, the time categories and compilations that
    moved, the findings gone and new, and the categories that did not move."""
    first, second = names
    if a.setup.get("backend") != b.setup.get("backend"):  # who ran where is part of what was compared
        first, second = f"{first} ({a.setup.get('backend') or '?'})", f"{second} ({b.setup.get('backend') or '?'})"
    if a.per_step and b.per_step:
        ratio = a.per_step / b.per_step
        span = f"({_ms(a.per_step)} -> {_ms(b.per_step)} ms)"
        if ratio >= 1 + _SAME:
            head = f"{second} is {_times(ratio)} faster per step than {first} {span}"
        elif ratio <= 1 / (1 + _SAME):
            head = f"{second} is {_times(1 / ratio)} slower per step than {first} {span}"
        else:
            head = f"{second} takes the same time per step as {first} {span}"
    else:
        missing = [n for n, r in ((first, a), (second, b)) if not r.per_step]
        head = f"the time per step cannot be compared: {' and '.join(missing)} measured none"
    moved, same = [], []
    scale = max(a.per_step or 0.0, b.per_step or 0.0)
    from accelport.observe.steptime import ordered

    names_seen = dict.fromkeys([*a.categories, *b.categories], 0.0)
    changes = []
    for name, _ in ordered(names_seen):
        x, y = a.categories.get(name, 0.0), b.categories.get(name, 0.0)
        if scale and max(x, y) < _SAME * scale:
            continue  # too small a share in either run to be worth a word
        if abs(x - y) <= _SAME * max(x, y):
            same.append(name)
        elif abs(x - y) >= _SAME * scale:  # (one that moved by less than that of the step goes unsaid)
            changes.append((abs(x - y), f"{name} {_ms(x)} -> {_ms(y)} ms"))
    moved += [text for _, text in sorted(changes, key=lambda c: -c[0])[:3]]
    if a.compilations is not None and b.compilations is not None and a.compilations != b.compilations:
        moved.append(f"compilations {a.compilations} -> {b.compilations}")
    if found.get("fixed"):
        fixed = found["fixed"]
        moved.append(f"the {_kinds(fixed)} {'is' if len({f.kind for f in fixed}) == 1 else 'are'} gone")
    if found.get("new"):
        moved.append(f"new: {_kinds(found['new'])}")
    tail = ", ".join(moved)
    if same:
        tail += ("; " if tail else "") + f"{', '.join(same)} unchanged"
    return f"{head}: {tail}" if tail else head


def compare(paths: Sequence[str]) -> Comparison:
    """Each run of ``paths`` against the first; UsageError where fewer than two are given or one is no run's."""
    if len(paths) < 2:
        raise UsageError(f"compare: give two runs or more (the first is the baseline): accelport compare "
                         f"A.json B.json; {WHAT_TO_PASS}")
    runs = [load_run(p) for p in paths]
    base = runs[0]
    rows = _rows(runs)
    differences, found, verdicts, notes = [], [], [], []
    for i, run in enumerate(runs[1:], start=1):
        name = _label(i)
        differences.append(_differences(base, run))
        matched = match_findings(base.findings, run.findings)
        found.append(matched)
        verdicts.append(verdict(base, run, matched, ("A", name)))
        said = []
        if base.steps and run.steps and max(base.steps, run.steps) >= 2 * min(base.steps, run.steps):
            said.append(f"A ran {base.steps} steps and {name} {run.steps}: each figure per step is an average "
                        "over its own run's steps, the first steps' compilation included")
        notes.append(said)
    return Comparison(runs, rows, differences, found, verdicts, notes)


def _label(i: int) -> str:
    """A, B, ..., Z, then R27, R28, ...: each run's name in the table."""
    return chr(ord("A") + i) if i < 26 else f"R{i + 1}"


# -- saying it ------------------------------------------------------------------------------------


def shown(value: float | None, unit: str) -> str:
    """A table cell: "-" where not measured."""
    from accelport.diagnose.memory import human_bytes

    if value is None:
        return "-"
    if unit == "s":
        return f"{_ms(value)} ms"
    if unit == "s_total":
        return f"{value:.2f} s"
    if unit == "bytes":
        return human_bytes(value)
    if unit == "share":
        return f"{value:.1%}"
    if unit in ("flops", "flop/s"):
        return _si(value) + ("FLOP/s" if unit == "flop/s" else "FLOP")
    return f"{value:.2f}" if value != int(value) else str(int(value))


def _si(value: float) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {prefix}"
    return f"{value:.0f} "


def _ratio_text(row: Row, i: int) -> str:
    ratio = row.ratio(i)
    if row.key == "steps" or ratio is None:
        return ""
    return f"{ratio:.2f}x" if ratio < 100 else f"{ratio:.0f}x"


def _setup_line(comparison: Comparison, i: int) -> str:
    name = _label(i + 1)
    differences = comparison.setup_differences[i]
    if not differences:
        known = {k: v for k, v in comparison.runs[0].setup.items() if v is not None and k != "args"}
        facts = ", ".join(f"{k} {v}" for k, v in known.items())
        return f"setup: {name} as A ({facts})" if facts else f"setup: {name} as A, as far as both files say"
    said = "; ".join(f"{field_} {_setup_value(x)} -> {_setup_value(y)}" for field_, x, y in differences)
    return f"setup: {name} differs from A: {said}"


def _setup_value(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) if value else "(none)"
    return str(value)


def render_text(comparison: Comparison) -> str:
    """The comparison for a terminal: the files, the setup differences, the table, the findings, the verdicts."""
    runs = comparison.runs
    names = [_label(i) for i in range(len(runs))]
    lines = ["runs: " + ", ".join(f"{n} = {r.path}" + (" (the baseline)" if i == 0 else "")
                                  for i, (n, r) in enumerate(zip(names, runs, strict=True)))]
    lines += [_setup_line(comparison, i) for i in range(len(runs) - 1)]
    header = ["", *(h for i, n in enumerate(names) for h in ((n,) if i == 0 else (n, f"{n}/A")))]
    table = [header]
    for row in comparison.rows:
        cells = [row.label]
        for i, value in enumerate(row.values):
            cells.append(shown(value, row.unit))
            if i:
                cells.append(_ratio_text(row, i))
        table.append(cells)
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    for cells in table:
        line = cells[0].ljust(widths[0]) + "".join("  " + cell.rjust(w) for cell, w in zip(cells[1:], widths[1:],
                                                                                         strict=True))
        lines.append(line.rstrip())
    for i, run in enumerate(runs):
        lines += [f"note: {names[i]}: {note}" for note in run.notes]
    for i in range(len(runs) - 1):
        name = names[i + 1]
        lines += [f"note: {note}" for note in comparison.notes[i]]
        found = comparison.findings[i]
        listed = ([("fixed", f) for f in found["fixed"]] + [("new", f) for f in found["new"]]
                  + [("still", after) for _, after in found["still"]])
        if listed:
            lines.append(f"findings of {name} against A:" if len(runs) > 2 else "findings:")
            lines += [f"  {state:<5}  {f.kind}" + (f" at {f.where}" if f.where else "") for state, f in listed]
        else:
            lines.append(f"findings: none in A or {name}")
        lines.append(f"verdict: {comparison.verdicts[i]}")
    return "\n".join(lines)


def to_dict(comparison: Comparison) -> dict[str, Any]:
    """The comparison as JSON holds it (``accelport compare --json``): setup differences first."""
    runs = comparison.runs
    out: dict[str, Any] = {"baseline": runs[0].path, "comparisons": []}
    for i, run in enumerate(runs[1:], start=1):
        found = comparison.findings[i - 1]
        out["comparisons"].append({
            "run": run.path,
            "label": _label(i),
            "setup_differences": [{"field": f, "baseline": x, "run": y}
                                  for f, x, y in comparison.setup_differences[i - 1]],
            "rows": [{"key": row.key, "label": row.label.strip(), "unit": row.unit, "baseline": row.values[0],
                      "run": row.values[i], "ratio": row.ratio(i)} for row in comparison.rows],
            "findings": {"fixed": [f.to_dict() for f in found["fixed"]], "new": [f.to_dict() for f in found["new"]],
                         "still": [after.to_dict() for _, after in found["still"]]},
            "verdict": comparison.verdicts[i - 1],
            "notes": comparison.notes[i - 1],
        })
    out["runs"] = [{"label": _label(i), "file": r.path, "source": r.source, "setup": r.setup, "steps": r.steps,
                    "exit_status": r.exit_status, "notes": r.notes, "findings": [f.to_dict() for f in r.findings]}
                   for i, r in enumerate(runs)]
    return out


_PAGE_STYLE = """
table.compare td:not(:first-child),table.compare th:not(:first-child){text-align:right}
.faster{color:#1a7f37}.slower{color:#cf222e}.state{font-weight:600}.fixed{color:#1a7f37}.new{color:#cf222e}
"""


def render_page(comparison: Comparison, safe: Callable[[object], str]) -> str:
    """The comparison as a self-contained HTML page; every text from the files goes through ``safe``
    (:func:`accelport.diagnose.report.escaper`: redacted, then escaped)."""
    from accelport.diagnose.report import html_page

    runs = comparison.runs
    names = [_label(i) for i in range(len(runs))]
    files = "".join(f"<li>{n}: {safe(r.path)} ({safe(r.source)}){' — the baseline' if i == 0 else ''}</li>"
                    for i, (n, r) in enumerate(zip(names, runs, strict=True)))
    setup = "".join(f"<p class=setup>{safe(_setup_line(comparison, i))}</p>" for i in range(len(runs) - 1))
    head = "<tr><th></th>" + "".join(f"<th>{n}</th>" + (f"<th>{n}/A</th>" if i else "")
                                    for i, n in enumerate(names)) + "</tr>"
    body_rows = []
    for row in comparison.rows:
        cells = [f"<td>{safe(row.label.strip())}</td>"]
        for i, value in enumerate(row.values):
            cells.append(f"<td>{safe(shown(value, row.unit))}</td>")
            if i:
                ratio = row.ratio(i)
                css = ""
                if row.unit == "s" and ratio is not None and abs(ratio - 1) > _SAME:
                    css = " class=faster" if ratio < 1 else " class=slower"
                cells.append(f"<td{css}>{safe(_ratio_text(row, i))}</td>")
        body_rows.append(f"<tr class=row>{''.join(cells)}</tr>")
    sections = []
    for i in range(len(runs) - 1):
        name = names[i + 1]
        found = comparison.findings[i]
        items = ([("fixed", f) for f in found["fixed"]] + [("new", f) for f in found["new"]]
                 + [("still", after) for _, after in found["still"]])
        listed = "".join(
            f"<tr class=finding><td class='state {state}'>{state}</td><td>{safe(f.kind)}</td>"
            f"<td>{safe(f.where or '')}</td><td>{safe(f.message)}</td></tr>" for state, f in items)
        table = (f"<table>{listed}</table>" if listed else f"<p class=ok>No finding in A or {name}.</p>")
        notes = "".join(f"<p class=sub>{safe(note)}</p>" for note in comparison.notes[i])
        sections.append(f"<h2>{name} against A</h2><p class=verdict><b>{safe(comparison.verdicts[i])}</b></p>"
                        f"{notes}<h3>Findings</h3>{table}")
    run_notes = "".join(f"<p class=sub>{n}: {safe(note)}</p>" for n, r in zip(names, runs, strict=True)
                        for note in r.notes)
    body = (f"<ul class=sub>{files}</ul>{setup}{''.join(sections)}"
            f"<h2>Side by side</h2><table class=compare>{head}{''.join(body_rows)}</table>{run_notes}")
    return html_page(f"accelport compare: {len(runs)} runs", body, safe, style=_PAGE_STYLE)
