"""``accelport report run.jsonl -o report.html``: one self-contained page about a run.

Reads the per-step lines that ``ACCELPORT_METRICS_FILE`` wrote, runs the same
diagnosis rules the live run uses, and writes one HTML file with no network
access: a per-step chart of where time went (each step's time breakdown, stacked by
category; for files written before breakdowns: data wait, compilation, execution, the
rest), with the run's line and verdict under it (:mod:`accelport.diagnose.timing`),
compilation events marked, what a profiled window held, the diagnoses with their
fixes (problems first), and the distinct batch shapes with their steps,
compilations and compile time. Every text on the page that came from the run (the
title's path, the notes, the diagnoses, the shapes, the backend) goes through the one
redaction pass (:class:`accelport.redact.Redactor`), then HTML escaping.
"""

from __future__ import annotations

import html
import json
import math
import os
import stat
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accelport.diagnose.metrics_log import record_from_dict
from accelport.diagnose.rule import SEVERITIES, Diagnosis, Rule
from accelport.errors import AccelportError
from accelport.redact import Redactor
from accelport.safe_io import same_file, write_atomic

__all__ = ["ReportError", "Run", "Written", "load_runs", "read_runs", "load_records", "skipped_note", "diagnose",
           "batch_shapes", "breakdown", "render_html", "write_report", "escaper", "html_page"]


class ReportError(AccelportError, ValueError):
    """The metrics file cannot be read as a run."""


def _not_a_file(path: str) -> str | None:
    """What ``path`` is when it exists and is not a regular file ("a directory"), else None.

    Opening a named pipe blocks until something writes to it, and a directory or a device
    is no run either: say so instead of hanging or printing an errno.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # missing or unreadable: open() says which
    if stat.S_ISREG(mode):
        return None
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


@dataclass
class Run:
    """One run's step records and the lines of the file they came from."""

    records: list[dict[str, Any]] = field(default_factory=list)
    first_line: int = 0
    last_line: int = 0


#: Fields the page reads as seconds; a value that is not finite (NaN, inf) counts as unknown (0).
_SECONDS = ("seconds", "data_wait_seconds", "compile_seconds", "execute_seconds")
#: Larger integers are no counter or step number of a real run (and not every one converts to a float).
_MAX_INT = 2**63


def _parse(line: str) -> tuple[Any, str | None, Any]:
    """(the JSON value, why the line is not JSON, a record that starts later on the line).

    A run killed mid-write leaves a partial line; a run appended to the same file then
    continues that line with its own first record: that record is the third value.
    """
    try:
        return json.loads(line), None, None
    except RecursionError:
        return None, "nested too deeply to be a step record", None
    except json.JSONDecodeError as exc:
        problem = f"not a JSON line ({exc.msg})"
    except ValueError:  # an integer of more digits than Python converts (4300 by default)
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        return None, f"not a step record: a number of more than {limit} digits", None
    start = line.find('{"step"', 1)  # the first key accelport writes
    if start > 0:
        try:
            later = json.loads(line[start:])
        except (ValueError, RecursionError):
            later = None
        if isinstance(later, dict):
            return None, problem, later
    return None, problem, None


def _check(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` if the page and the rules can use it; ValueError names the field that is wrong."""
    for key, value in record.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= _MAX_INT:
            digits = len(str(abs(value)))
            raise ValueError(f"{key!r} is an integer of {digits} digits, too large for a step record")
    compilations = record.get("compilations")
    if compilations is not None and (isinstance(compilations, bool) or not isinstance(compilations, (int, float))
                                     or not math.isfinite(compilations) or compilations < 0):
        raise ValueError(f"'compilations' must be a non-negative number, not {compilations!r}")
    for key in _SECONDS[1:]:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{key!r} must be a number of seconds, not {value!r}")
    record_from_dict(record)
    return record


def load_runs(path: str) -> list[Run]:
    """The runs in ``path``, oldest first: a bad line is an error naming its number.

    A run's steps count from 1, so a step 1 after other records starts the next run
    (the same file appended to again). A partial line left by a run that was killed is
    skipped: the last line, one the next run's first record continues, and one followed by
    the next run's first line (:func:`read_runs` also says which lines were skipped).
    """
    return read_runs(path)[0]


def _starts_a_run(lines: Sequence[str], index: int) -> bool:
    """Whether the first non-blank line from ``index`` on is a run's first record (step 1), or there is none."""
    for line in lines[index:]:
        if line.strip():
            record, problem, _later = _parse(line)
            return problem is None and isinstance(record, dict) and record.get("step") == 1
    return True


def read_runs(path: str) -> tuple[list[Run], list[int]]:
    """:func:`load_runs`'s runs, and the numbers of the lines skipped as partial records of a killed run."""
    what = _not_a_file(path)
    if what is not None:
        pipe = " (save what the pipe carries to a file first)" if "pipe" in what else ""
        raise ReportError(f"{path}: is {what}, not a metrics file; give the JSON-lines file a run wrote "
                          f"with ACCELPORT_METRICS_FILE set{pipe}")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file; write one by running with ACCELPORT_METRICS_FILE={path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot be read ({exc})") from None
    runs: list[Run] = []
    skipped: list[int] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record, problem, later = _parse(line)
        if problem is not None:
            if later is not None:
                record = later  # the killed run's partial record is lost; the next run starts here
                skipped.append(number)
            elif problem.startswith("not a JSON line") and _starts_a_run(lines, number):
                # A run killed mid-write leaves a partial line: the file's last, or one that the
                # next run appended after (its step 1 follows). A bad line inside a run is an error.
                skipped.append(number)
                continue
            elif _a_diagnose_output(lines):
                raise ReportError(f"{path}: is the --output of accelport diagnose, not a metrics file: give the file "
                                  "its --metrics-file wrote (and, for a job of several ranks, this one as --job)")
            else:
                raise ReportError(f"{path}:{number}: {problem}")
        if not isinstance(record, dict):
            raise ReportError(f"{path}:{number}: not a step record (a JSON object per line)")
        try:
            _check(record)
        except (ValueError, OverflowError) as exc:
            raise ReportError(f"{path}:{number}: not a step record: {exc}") from None
        if not runs or (record["step"] == 1 and runs[-1].records):
            runs.append(Run(first_line=number))
        runs[-1].records.append(record)
        runs[-1].last_line = number
    if not runs:
        raise ReportError(f"{path}: no step records; was the run started with ACCELPORT_METRICS_FILE set?")
    return runs, skipped


def _a_diagnose_output(lines: Sequence[str]) -> bool:
    """Whether ``lines`` are one JSON object as ``accelport diagnose --output`` writes it."""
    try:
        whole = json.loads("".join(lines))
    except (ValueError, RecursionError):
        return False
    return isinstance(whole, dict) and "verdict" in whole and "findings" in whole


def skipped_note(name: str, skipped: Sequence[int]) -> str:
    """The sentence saying which lines of ``name`` were skipped as partial records, or ""."""
    if not skipped:
        return ""
    which = f"line {_listed(skipped)} holds" if len(skipped) == 1 else f"lines {_listed(skipped)} hold"
    return (f"{name}: {which} a partial record left by a run stopped while writing it; skipped, "
            "and the steps around it read as they are.")


def load_records(path: str) -> list[dict[str, Any]]:
    """The step records of the last run in ``path`` (see :func:`load_runs`)."""
    return load_runs(path)[-1].records


def diagnose(records: Sequence[dict[str, Any]], rules: Sequence[tuple[str, type[Rule]]] | None = None
             ) -> list[Diagnosis]:
    """The run's diagnoses: those the live run wrote on its lines, then the rules replayed on the records.

    The live ones come first and win for their kind: they saw what only a live run
    can (dynamo's reasons, parameter names). Replaying finds the rest, and everything
    in files written before diagnoses were recorded. ``rules`` are (plugin, rule class)
    pairs; by default every rule registered here, as a live run has them.
    """
    from accelport.diagnose.engine import Diagnostics, rules_from

    if rules is None:
        from accelport.plugins.host import create_manager

        rules = rules_from(create_manager())
    engine = Diagnostics(rules)
    found: list[Diagnosis] = []
    for r in records:
        for d in r.get("diagnoses") or ():
            if isinstance(d, dict) and isinstance(d.get("kind"), str) and all(x.kind != d["kind"] for x in found):
                # Severity from today's rules: a file from an older build may say otherwise.
                evidence = dict(d.get("evidence") or {})
                said = d.get("severity")  # what a kind no rule here knows keeps (a plugin not installed here)
                severity = engine.severity_of(d["kind"], evidence, default=said if said in SEVERITIES else "warning")
                totals = d.get("totals")
                # (Through the engine's pass, as a live finding is: a file written by hand or by an older
                # build may hold what it would have redacted, escaped or cut.)
                found.append(engine.shown(Diagnosis(
                    d["kind"], str(d.get("message", "")), int(d.get("step", r["step"])), evidence, severity,
                    str(d.get("fix") or ""), dict(totals) if isinstance(totals, dict) else {})))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in records:
            engine.step_end(record_from_dict(r))
    found += [d for d in engine.current() if all(x.kind != d.kind for x in found)]
    return found


def after_steps(record: dict[str, Any]) -> bool:
    """Whether ``record`` holds what the counters moved by after the run's last step (a final evaluation's
    compilations): no step's time, no batch, ``counted_steps`` 0 (see accelport.diagnose.metrics_log)."""
    return record.get("counted_steps") == 0 and not record.get("breakdown") and not record.get("seconds")


def batch_shapes(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each distinct batch shape: the steps that had it, the compilations and compile time at those steps."""
    shapes: dict[str, dict[str, Any]] = {}
    for r in records:
        if after_steps(r):
            continue
        sig = r.get("signature") or []
        key = json.dumps(sig)
        entry = shapes.setdefault(key, {"signature": sig, "steps": 0, "compilations": 0, "compile_seconds": 0.0,
                                        "first_step": r["step"]})
        entry["steps"] += 1
        entry["compilations"] += int(r.get("compilations", 0) or 0)
        entry["compile_seconds"] += float(r.get("compile_seconds", 0.0) or 0.0)
    return sorted(shapes.values(), key=lambda e: (-e["steps"], e["first_step"]))


def _shape_text(signature: Sequence[Any]) -> str:
    parts = []
    for item in signature:
        try:
            shape, dtype = item
            parts.append(f"({', '.join(str(n) for n in shape)}) {dtype}")
        except (TypeError, ValueError):
            parts.append(str(item))
    return ", ".join(parts) or "(not known: the batches did not come through ap.loader)"


def _seconds(record: dict[str, Any], key: str) -> float:
    """A duration of the record: 0 where it is missing, negative or not finite (NaN never reaches the page)."""
    value = float(record.get(key) or 0.0)
    return value if math.isfinite(value) and value > 0 else 0.0


def breakdown(record: dict[str, Any]) -> dict[str, float]:
    """Seconds of one step split into data wait, compilation, execution and the rest."""
    total = _seconds(record, "seconds")
    wait = min(_seconds(record, "data_wait_seconds"), total)
    compile_s = min(_seconds(record, "compile_seconds"), total - wait)
    execute = min(_seconds(record, "execute_seconds"), total - wait - compile_s)
    return {"wait": wait, "compile": compile_s, "execute": execute, "rest": total - wait - compile_s - execute}


#: The chart's colour of each time category; two joined (not told apart) take the first one's, lighter.
CATEGORY_COLORS = {"data": "#d4a72c", "transfer": "#e16f24", "compile": "#cf222e", "device": "#0969da",
                   "host_sync": "#8250df", "collective": "#1a7f37", "other": "#8c959f", "between_steps": "#57606a"}


def _color(category: str) -> str:
    """A time category's colour; a joined one (``device+other``) its first part's, translucent."""
    return CATEGORY_COLORS.get(category) or CATEGORY_COLORS.get(category.split("+")[0], "#8c959f") + (
        "" if "+" not in category else "99")


def _categories(records: Sequence[dict[str, Any]]) -> tuple[dict[str, float], dict[str, str], dict[str, str]]:
    """The time categories the records hold, in order: zero totals, their labels and colours."""
    from accelport.observe.steptime import ordered

    seen: dict[str, float] = {}
    for r in records:
        for key in r["breakdown"]:
            seen[key] = 0.0
    totals = dict(ordered(seen))
    labels = {k: k.replace("+", " + ") for k in totals}
    colors = {k: _color(k) for k in totals}
    colors.setdefault("compile", CATEGORY_COLORS["compile"])  # (the compile marks)
    return totals, labels, colors


def _category_parts(record: dict[str, Any], totals: dict[str, float]) -> dict[str, float]:
    raw = record["breakdown"]
    out = {}
    for k in totals:
        value = float(raw.get(k) or 0.0)
        out[k] = value if math.isfinite(value) and value > 0 else 0.0
    return out


def _verdict(records: Sequence[dict[str, Any]], diagnoses: Sequence[Any]) -> list[str]:
    """The run's one line, verdict and fix (accelport.diagnose.timing), from the records' breakdowns."""
    from accelport.diagnose.timing import explain
    from accelport.observe.steptime import add_into

    timed = [r for r in records if r.get("breakdown")]
    if not timed:
        return []
    shapes = len({json.dumps(r.get("signature")) for r in timed if r.get("signature")}) or None
    total: dict[str, float] = {}
    for r in timed:
        add_into(total, _category_parts(r, {k: 0.0 for k in r["breakdown"]}))
    first = _category_parts(timed[0], {k: 0.0 for k in timed[0]["breakdown"]}) if timed[0]["step"] == 1 else None
    last = timed[-1]
    return explain(total, len(timed), first=first, loader=last.get("loader") or {}, findings=diagnoses,
                   lazy=bool(last.get("lazy")), shapes=shapes)


def _profiles_html(records: Sequence[dict[str, Any]], safe: Any) -> str:
    """What each profiled window held (the record of its last step carries it)."""
    from accelport.observe.profile import describe

    out = []
    for r in records:
        profile = r.get("profile")
        if not profile:
            continue
        try:
            lines = describe(profile)
        except (KeyError, TypeError, ValueError, AttributeError):
            lines = [f"step {r['step']} carries a profile this page cannot read"]
        out.append("<pre class=profile>" + "\n".join(safe(line) for line in lines) + "</pre>")
    return f"<h2>Profile</h2>{''.join(out)}" if out else ""


def _unknown_times(records: Sequence[dict[str, Any]]) -> str:
    """A sentence naming the steps whose times are NaN or infinite, or ""."""
    steps = [r["step"] for r in records if any(
        isinstance(r.get(k), float) and not math.isfinite(r[k]) for k in _SECONDS)]
    if not steps:
        return ""
    return f"{len(steps)} step(s) recorded a time that is not a number (step {_listed(steps)}): counted as 0 s."


def _listed(numbers: Sequence[int]) -> str:
    """The first five of ``numbers``, and "..." for more."""
    return ", ".join(map(str, numbers[:5])) + (" ..." if len(numbers) > 5 else "")


_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#1b1f24;padding:0 16px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
.sub{color:#57606a}table{border-collapse:collapse}td,th{padding:3px 12px 3px 0;text-align:left}
.legend span{display:inline-block;margin-right:16px}.sw{display:inline-block;width:11px;height:11px;
margin-right:5px;vertical-align:-1px}.diag{border-left:4px solid #d4a72c;background:#fff8e6;padding:8px 12px;
margin:8px 0}.diag b{text-transform:uppercase;font-size:12px;letter-spacing:.04em}.ok{color:#1a7f37}
.diag.problem{border-left:6px solid #cf222e;background:#ffebe9}.badge{background:#cf222e;color:#fff;
border-radius:3px;padding:1px 6px;font-size:11px;margin-left:6px}
svg{display:block;border:1px solid #d0d7de;background:#fff}
.verdict{margin:8px 0 0;max-width:1060px}pre.profile{background:#f6f8fa;padding:8px 12px;overflow-x:auto}
"""

_SCRIPT = """
(function () {
  const data = JSON.parse(document.getElementById('run-data').textContent);
  const steps = data.steps, svg = document.getElementById('chart'), NS = 'http://www.w3.org/2000/svg';
  const W = 1060, H = 320, L = 64, B = 28, T = 10, plotW = W - L - 10, plotH = H - B - T;
  const max = Math.max(1e-9, ...steps.map(s => s.total));
  // Seconds once the tallest step reaches one (a compile), so labels stay short.
  const fmt = v => max >= 1 ? v.toFixed(2) + ' s' : (v * 1000).toFixed(1) + ' ms';
  const bw = plotW / Math.max(steps.length, 1);
  const colors = data.colors;
  function el(name, attrs) { const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]); svg.appendChild(e); return e; }
  for (let i = 0; i <= 4; i++) { const y = T + plotH - plotH * i / 4;
    el('line', {x1: L, x2: W - 10, y1: y, y2: y, stroke: '#eaeef2'});
    el('text', {x: L - 6, y: y + 4, 'text-anchor': 'end', 'font-size': 11, fill: '#57606a'})
      .textContent = fmt(max * i / 4); }
  steps.forEach((s, i) => { let y = T + plotH; const x = L + i * bw;
    for (const part of data.parts) { const h = plotH * s[part] / max;
      if (h <= 0) continue; y -= h;
      const r = el('rect', {x: x, y: y, width: Math.max(bw - (bw > 3 ? 1 : 0), 0.5), height: h,
                            fill: colors[part], class: 'seg seg-' + part});
      const t = document.createElementNS(NS, 'title');
      t.textContent = 'step ' + s.step + ': ' + part + ' ' + (s[part] * 1000).toFixed(2) + ' ms'; r.appendChild(t); }
    if (s.compilations > 0) el('path', {d: `M${x + bw / 2 - 4},${T + plotH + 12} l4,-8 l4,8 z`,
                                        fill: colors.compile, class: 'compile-mark'}); });
  el('text', {x: L, y: H - 4, 'font-size': 11, fill: '#57606a'}).textContent = 'step ' + steps[0].step;
  el('text', {x: W - 10, y: H - 4, 'font-size': 11, fill: '#57606a', 'text-anchor': 'end'})
    .textContent = 'step ' + steps[steps.length - 1].step;
  svg.setAttribute('data-drawn', String(steps.length));
})();
"""


_MEMORY_SCRIPT = """
(function () {
  const data = JSON.parse(document.getElementById('memory-data').textContent);
  const pts = data.points, svg = document.getElementById('memory'), NS = 'http://www.w3.org/2000/svg';
  const W = 1060, H = 220, L = 64, B = 28, T = 10, plotW = W - L - 10, plotH = H - B - T;
  const max = Math.max(1, ...pts.map(p => Math.max(p[1], p[2] || 0)));
  const first = pts[0][0], last = pts[pts.length - 1][0], span = Math.max(last - first, 1);
  const x = s => L + plotW * (s - first) / span, y = v => T + plotH - plotH * v / max;
  const units = [['GiB', 1073741824], ['MiB', 1048576], ['KiB', 1024]];
  const unit = units.find(u => max >= u[1]) || ['B', 1];
  function el(name, attrs) { const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]); svg.appendChild(e); return e; }
  for (let i = 0; i <= 4; i++) { const v = max * i / 4;
    el('line', {x1: L, x2: W - 10, y1: y(v), y2: y(v), stroke: '#eaeef2'});
    el('text', {x: L - 6, y: y(v) + 4, 'text-anchor': 'end', 'font-size': 11, fill: '#57606a'})
      .textContent = (v / unit[1]).toFixed(1) + ' ' + unit[0]; }
  const line = (i, color, dash, cls) => { const p = pts.filter(q => q[i] !== null);
    if (p.length) el('polyline', {points: p.map(q => x(q[0]) + ',' + y(q[i])).join(' '), fill: 'none',
                                  stroke: color, 'stroke-width': 2, 'stroke-dasharray': dash, class: cls}); };
  line(2, '#8c959f', '5,4', 'memory-static');
  line(1, '#8250df', '', 'memory-used');
  el('text', {x: L, y: H - 4, 'font-size': 11, fill: '#57606a'}).textContent = 'step ' + first;
  el('text', {x: W - 10, y: H - 4, 'font-size': 11, fill: '#57606a', 'text-anchor': 'start'})
    .textContent = 'step ' + last;
  svg.setAttribute('data-drawn', String(pts.length));
})();
"""


def _memory_section(records: Sequence[dict[str, Any]]) -> str:
    """The memory chart: what the device held at each step whose memory was read, and the static part
    (parameters, gradients, optimizer state); "" where no step carries a reading."""
    points = []
    resident = False
    capacity = peak = None
    for r in records:
        memory = r.get("memory")
        if not isinstance(memory, dict) or not isinstance(memory.get("memory_bytes"), int):
            continue
        static = [memory.get(k) for k in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")]
        counted = [v for v in static if isinstance(v, int)]
        total = sum(counted) if len(counted) == len(static) else None
        points.append([r["step"], memory["memory_bytes"], total])
        resident = resident or bool(memory.get("resident"))
        capacity = memory.get("capacity_bytes") if isinstance(memory.get("capacity_bytes"), int) else capacity
        highs = [v for v in (memory.get("peak_memory_bytes"), memory["memory_bytes"]) if isinstance(v, int)]
        peak = max([peak or 0, *highs])
    if not points:
        return ""
    from accelport.diagnose.memory import human_bytes

    what = "resident memory of the process (the host is the device)" if resident else "device memory in use"
    facts = [f"highest {human_bytes(peak)}"] + ([f"capacity {human_bytes(capacity)}"] if capacity else [])
    data = json.dumps({"points": points}, allow_nan=False).replace("</", "<\\/")
    return f"""<h2>Memory, per step</h2>
<div class=legend><span><span class=sw style='background:#8250df'></span>{what}</span>
<span><span class=sw style='background:#8c959f'></span>parameters, gradients and optimizer state</span></div>
<svg id=memory viewBox="0 0 1060 220" width=1060 height=220 role=img aria-label="per-step memory chart"></svg>
<p class=sub>{len(points)} step(s) read; {", ".join(facts)}.</p>
<script type="application/json" id="memory-data">{data}</script>
<script>{_MEMORY_SCRIPT}</script>
"""


def render_html(records: Sequence[dict[str, Any]], diagnoses: Sequence[Any], title: str = "accelport run",
                notes: Sequence[str] = (), redactor: Redactor | None = None,
                ranks: Sequence[Mapping[str, Any]] = (), goodput: Mapping[str, Any] | None = None) -> str:
    """The report page as a string (self-contained: inline CSS, data and script); ``notes`` go under the title;
    ``ranks`` (a job's: ``--output``'s ``ranks`` entries) a row each, its time per step stacked by category;
    ``goodput``: the job's account (:func:`accelport.goodput.account`), its parts and the checkpoint interval.

    Every text from the run (title, notes, diagnoses, shapes, backend) is redacted by ``redactor``
    (give one built from the run's environment, so its secrets are known; default: the
    credential patterns alone), then HTML-escaped.
    """
    safe = escaper(redactor)
    steps = []
    totals = {"wait": 0.0, "compile": 0.0, "execute": 0.0, "rest": 0.0}
    # Step records carry execution time only where a backend measures it per step; where
    # none does, say so instead of drawing an "execution" of zero.
    timed = any(r.get("execute_seconds") is not None for r in records)
    if not timed:
        del totals["execute"]
    labels = {"wait": "data wait", "compile": "compilation", "execute": "execution",
              "rest": "the rest" if timed else "the rest (execution, Python, transfers)"}
    colors = {"wait": "#d4a72c", "compile": "#cf222e", "execute": "#0969da", "rest": "#8c959f"}
    # (A step of no time, the first of a loop without ap.loader, has an empty breakdown.)
    categorized = all(isinstance(r.get("breakdown"), dict) for r in records) and any(r.get("breakdown")
                                                                                      for r in records)
    if categorized:  # where each step's time went, as the run measured it (see accelport.observe.steptime)
        totals, labels, colors = _categories(records)
    for r in records:
        parts = _category_parts(r, totals) if categorized else breakdown(r)
        for k in totals:
            totals[k] += parts[k]
        steps.append({"step": r["step"], "total": sum(parts.values()),
                      "compilations": r.get("compilations", 0) or 0, **parts})
    total = sum(totals.values()) or 1e-12
    compilations = sum(int(r.get("compilations", 0) or 0) for r in records)  # (after the last step's too)
    stepped = [r for r in records if not after_steps(r)]
    signatures = len({json.dumps(r.get("signature")) for r in stepped})
    backend = records[-1].get("backend", "?")
    # json.dumps does not escape "</script>"; make the embedded data unable to close the tag.
    # allow_nan=False: every number above is finite, and JSON.parse rejects NaN.
    data = json.dumps({"steps": steps, "parts": list(totals), "colors": colors},
                      allow_nan=False).replace("</", "<\\/")
    notes = [*notes, *filter(None, [_unknown_times(records)])]
    notes_html = "".join(f"<p class=sub>{safe(n)}</p>" for n in notes)
    said = _verdict(records, diagnoses)  # the line, the verdict and its fix
    verdict_html = "".join(f"<p class=verdict>{safe(line)}</p>"
                           for line in [*said[:2], *(f"fix: {fix}" for fix in said[2:])])
    profiles_html = _profiles_html(records, safe)
    rows = "".join(
        f"<tr><td><span class=sw style='background:{colors[k]}'></span>{labels[k]}</td>"
        f"<td>{v:.3f} s</td><td>{v / total:.0%}</td></tr>" for k, v in totals.items()
    )
    shapes = batch_shapes(records)
    shown = shapes[:50]
    shape_rows = "".join(
        f"<tr class=shape><td>{safe(_shape_text(e['signature']))}</td><td>{e['steps']}</td>"
        f"<td>{e['compilations']}</td><td>{e['compile_seconds']:.2f} s</td><td>{e['first_step']}</td></tr>"
        for e in shown)
    more = f"<p class=sub>... and {len(shapes) - len(shown)} more shapes.</p>" if len(shapes) > len(shown) else ""
    if diagnoses:
        # Problems (the run is wrong or crippled) first, marked as such.
        ordered = sorted(diagnoses, key=lambda d: getattr(d, "severity", "warning") != "problem")
        diag_html = "".join(
            f"<div class='diag{' problem' if getattr(d, 'severity', '') == 'problem' else ''}'>"
            f"<b>{safe(d.kind)}</b>"
            f"{'<span class=badge>problem</span>' if getattr(d, 'severity', '') == 'problem' else ''}"
            f" (step {safe(d.step)})<br>{safe(d.message)}"
            f"{'<br><i>fix:</i> ' + safe(d.fix) if getattr(d, 'fix', '') else ''}"
            f"{'<br><span class=sub>over the run: ' + safe(d.totals_text) + '</span>' if d.totals_text else ''}"
            "</div>"
            for d in ordered)
    else:
        diag_html = "<p class=ok>No diagnosis: nothing in this run looks slow or wrong.</p>"
    return html_page(title, f"""<div class=sub>backend {safe(backend)} · {len(stepped)} steps · {total:.2f} s in steps ·
{compilations} compilations · {signatures} distinct batch shapes</div>
{notes_html}
<h2>Where the time went, per step</h2>
<div class=legend>{"".join(f"<span><span class=sw style='background:{colors[k]}'></span>{labels[k]}</span>"
                           for k in totals)}<span>▲ compiled at this step</span></div>
<svg id=chart viewBox="0 0 1060 320" width=1060 height=320 role=img aria-label="per-step time chart"></svg>
<noscript>The chart needs JavaScript; the totals below do not.</noscript>
{verdict_html}
<h2>Totals</h2><table>{rows}</table>{profiles_html}
{_memory_section(records)}{_ranks_html(ranks, safe)}{_goodput_html(goodput, safe)}<h2>Diagnoses</h2>{diag_html}
<h2>Batch shapes</h2>
<table id=shapes><tr><th>shape of each input</th><th>steps</th><th>compilations</th><th>compile time</th>
<th>first step</th></tr>{shape_rows}</table>{more}
<script type="application/json" id="run-data">{data}</script>
<script>{_SCRIPT}</script>""", safe)


def _ranks_html(ranks: Sequence[Mapping[str, Any]], safe: Callable[[object], str]) -> str:
    """A job's ranks, a row each: host, steps, exit status, and its time per step as a bar stacked by category
    (the same scale for every rank, so the straggler's and the waiting ranks' bars compare), the straggler marked."""
    if not ranks:
        return ""
    from accelport.observe.steptime import ordered

    longest = max((sum(float(v) for v in dict(r.get("time_breakdown") or {}).values()) for r in ranks),
                  default=0.0) or 1e-12
    rows = []
    for r in ranks:
        parts = ordered({str(k): float(v) for k, v in dict(r.get("time_breakdown") or {}).items() if float(v) > 0})
        total = sum(v for _, v in parts)
        bar = "".join(
            f"<span title='{safe(k)} {v * 1e3:.1f} ms' style='display:inline-block;height:12px;"
            f"width:{max(v / longest * 400, 0.5):.1f}px;background:{_color(k)}'></span>"
            for k, v in parts)
        said = ", ".join(f"{safe(k)} {v * 1e3:.1f}" for k, v in parts)
        mark = " <span class=badge>straggler</span>" if r.get("straggler") else ""
        rows.append(f"<tr class=rank><td>{safe(r.get('rank'))}{mark}</td><td>{safe(r.get('host'))}</td>"
                    f"<td>{safe(r.get('steps'))}</td><td>{safe(r.get('exit_status'))}</td>"
                    f"<td>{total * 1e3:.1f} ms</td><td>{bar}<br><span class=sub>{said}</span></td></tr>")
    return ("<h2>Ranks</h2><p class=sub>Time per step after the first, by category (ms); the time a rank waits for "
            "the others is collective.</p><table id=ranks><tr><th>rank</th><th>host</th><th>steps</th>"
            "<th>status</th><th>per step</th><th>where it goes</th></tr>" + "".join(rows) + "</table>")


#: The goodput account's parts, in the order of a job's life, with their names on the page and their colours.
_GOODPUT_PARTS = (("productive_s", "productive steps", "#1a7f37"), ("recomputed_s", "recomputed steps", "#cf222e"),
                  ("start_up_s", "start-up and restore", "#8250df"), ("restart_s", "restarts", "#bc4c00"),
                  ("save_blocked_s", "saves", "#d4a72c"), ("other_s", "other", "#8c959f"))


def _goodput_html(goodput: Mapping[str, Any] | None, safe: Callable[[object], str]) -> str:
    """The job's wall time by part (a stacked bar and a table) and the account's own lines, where one was kept."""
    if not goodput or not goodput.get("wall_s"):
        return ""
    from accelport.goodput import render

    wall = float(goodput["wall_s"])
    seconds = {key: float(goodput.get(key) or 0) for key, _, _ in _GOODPUT_PARTS}
    rows = "".join(f"<tr><td><span class=sw style='background:{color}'></span>{label}</td>"
                   f"<td>{seconds[key]:.2f} s</td><td>{seconds[key] / wall:.0%}</td></tr>"
                   for key, label, color in _GOODPUT_PARTS)
    bar = "".join(f"<span title='{label} {seconds[key]:.2f} s' style='display:inline-block;height:14px;"
                  f"width:{max(seconds[key] / wall * 600, 0.5):.1f}px;background:{color}'></span>"
                  for key, label, color in _GOODPUT_PARTS if seconds[key] > 0)
    lines = "".join(f"<p class=verdict>{safe(line)}</p>" for line in render(goodput))
    return (f"<h2>Goodput</h2><p class=sub>The job's wall time over its {int(goodput.get('runs') or 0)} run(s), from "
            f"the account ap.Checkpointer keeps ({safe(goodput.get('journal', ''))}).</p><div id=goodput>{bar}</div>"
            f"{lines}<table>{rows}</table>")


def escaper(redactor: Redactor | None = None) -> Callable[[object], str]:
    """What every text from a run goes through on a page: the one redaction pass (``redactor``: one built from
    the run's environment, so its secrets are known; default: the credential patterns alone), then HTML escaping."""
    redactor = redactor or Redactor()

    def safe(text: object) -> str:
        return html.escape(redactor.text(str(text)))

    return safe


def html_page(title: str, body: str, safe: Callable[[object], str], style: str = "") -> str:
    """A self-contained page (inline style and script, no network): ``title`` (passed through ``safe``) as its
    title and heading, then ``body``, HTML already escaped; ``style``: rules added to the page's own."""
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><title>{safe(title)}</title>
<meta name=viewport content="width=device-width,initial-scale=1"><style>{_STYLE}{style}</style></head>
<body>
<h1>{safe(title)}</h1>
{body}
</body></html>
"""


@dataclass
class Written:
    """What :func:`write_report` wrote: the page, the diagnoses, and which run of the file it covers."""

    path: str
    findings: list[Any]
    runs: int = 1
    first_line: int = 0
    last_line: int = 0
    skipped_lines: list[int] = field(default_factory=list)  # partial records of killed runs, read past


def read_job(path: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """The job's findings (as diagnoses) and its ranks from ``path``, the ``--output`` of ``accelport diagnose``
    of a job; a specific error for a file that is not one."""
    from accelport.diagnose.rule import Diagnosis

    what = _not_a_file(path)
    if what is not None:
        raise ReportError(f"--job {path}: is {what}, not a file; give the --output file accelport diagnose wrote "
                          "for the job")
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except FileNotFoundError:
        raise ReportError(f"--job {path}: no such file; give the --output file accelport diagnose wrote for the "
                          "job") from None
    except RecursionError:
        raise ReportError(f"--job {path}: not the --output of accelport diagnose (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ReportError(f"--job {path}: not the --output of accelport diagnose ({exc})") from None
    ranks = result.get("ranks") if isinstance(result, dict) else None
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        raise ReportError(f"--job {path}: not a job's --output (it has no 'ranks': accelport diagnose writes them "
                          "for a job of several ranks, as under torchrun)")
    for r in ranks:
        parts = r.get("time_breakdown") or {}
        if not isinstance(parts, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in parts.values()):
            raise ReportError(f"--job {path}: rank {r.get('rank')!r}'s 'time_breakdown' is not seconds by category "
                              "(a number per category); give the --output file accelport diagnose wrote")
    listed = result.get("findings") or []
    if not isinstance(listed, list):
        raise ReportError(f"--job {path}: 'findings' is not a list; give the --output file accelport diagnose wrote")
    findings = [Diagnosis.from_dict(item) for item in listed
                if isinstance(item, dict) and isinstance(item.get("kind"), str)]
    return findings, ranks


def write_report(source: str, output: str | None = None, redactor: Redactor | None = None,
                 goodput: Mapping[str, Any] | None = None, job: str | None = None) -> Written:
    """Read ``source`` (JSON lines), write the page about its last run; return what was written.
    ``goodput``: the job's goodput account, shown on the page where given. ``job``: the ``--output`` of
    ``accelport diagnose`` for the job whose rank 0 wrote ``source``: the page says the job's findings and
    a row per rank, as diagnose's ``--report`` of a job does.

    Refuses to write over ``source`` itself (``-o`` naming it, or an input ending in
    ``.html`` whose default output is the input): that would destroy the run's record.
    ``redactor``: the pass every text on the page goes through (see :func:`render_html`).
    """
    target = output or os.path.splitext(source)[0] + ".html"
    if same_file(source, target):
        how = "-o names" if output else "the default output (the input's name with .html) is"
        raise ReportError(f"cannot write {target}: {how} the metrics file itself, and the page would replace "
                          "the run's record; give -o another path, e.g. -o report.html")
    ranks: list[dict[str, Any]] = []
    if job is not None:
        if same_file(job, target):
            raise ReportError(f"cannot write {target}: it is the --job file, and the page would replace the job's "
                              "--output; give -o another path, e.g. -o report.html")
        findings, ranks = read_job(job)
    runs, skipped = read_runs(source)
    run = runs[-1]
    name = os.path.basename(source)
    if job is None:
        findings = diagnose(run.records)
    notes = []
    if len(runs) > 1:
        notes.append(f"{name} holds {len(runs)} runs, one after the other; this page is about "
                     f"the last one (lines {run.first_line} to {run.last_line}).")
    notes += filter(None, [skipped_note(name, skipped)])
    if job is not None:
        notes.append(f"the steps are {name}'s (rank 0's); the findings and the ranks are the job's, from "
                     f"{os.path.basename(job)}.")
    page = render_html(run.records, findings, title=f"accelport {'job' if job else 'run'}: {name}", notes=notes,
                       redactor=redactor, ranks=ranks, goodput=goodput)
    what = _not_a_file(target)
    if what is not None:
        raise ReportError(f"cannot write {target}: it is {what}; give -o the path of an HTML file to write")
    try:  # whole or not at all: a full disk leaves the page that was there
        write_atomic(target, page.encode("utf-8"), what="the report page")
    except AccelportError as exc:
        raise ReportError(str(exc)) from None
    return Written(target, findings, len(runs), run.first_line, run.last_line, skipped)
