"""What ``torch.compile`` did in this process, read from dynamo's own records.

Nothing is printed, no ``TORCH_LOGS`` and no logger level is changed, and nothing
here needs ``accelport``'s API: it works when the script only called
``torch.compile``. The surfaces, all process-wide (what each gives, per torch
version, is pinned in ``tests/diagnose/dynamo_surfaces.py``):

- ``torch._dynamo.utils.guard_failures``: ``{code object: [reason, ...]}``, why each
  recompilation happened (what ``TORCH_LOGS=recompiles`` prints), filled whether or
  not logging is on, e.g. ``"0/3: tensor 'x' size mismatch at index 1. expected 16, actual 17"``;
- ``torch._dynamo.utils.get_compilation_metrics()``: the last 64 compilations (function,
  file, first line, seconds, failure), drained here on every read and at each compile start;
- ``torch._dynamo.utils.graph_break_reasons``: one entry per compilation that broke its
  graph, with the user's frame;
- the WARNING dynamo logs on ``torch._dynamo.convert_frame`` when a function reaches
  ``config.recompile_limit`` (it then runs that function eagerly for every new shape):
  a :class:`logging.Handler` attached there records it.

Importing this module imports neither torch nor dynamo; the observer reads dynamo only
once something else imported it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from accelport.heap import live_instances
from accelport.observe.frames import library_of

__all__ = ["CompileEvents", "CompileObserver", "FunctionCompiles", "GraphBreak", "LimitHit", "SizeChange", "Mark",
           "observer", "parse_reason"]

#: The logger dynamo warns on when a function reaches its recompile limit.
LIMIT_LOGGER = "torch._dynamo.convert_frame"
LIMIT_PREFIX = "torch._dynamo hit config."

_SIZE = re.compile(r"^(?:\d+/\d+: )?tensor '(?P<arg>.+?)' (?P<what>size|stride) mismatch at index (?P<dim>\d+)\. "
                   r"expected (?P<expected>\d+), actual (?P<actual>\d+)")
_DTYPE = re.compile(r"^(?:\d+/\d+: )?tensor '(?P<arg>.+?)' dtype mismatch\. expected (?P<expected>\w+), "
                    r"actual (?P<actual>\w+)")
_VALUE = re.compile(r"^(?:\d+/\d+: )?(?P<arg>\S+) (?:==|<=|>=|<|>|!=) ")
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<parent>.+)_at_(?P<line>\d+)$")
_LOCAL = re.compile(r"^L\['(?P<name>[^']+)'\]$")
#: accelport's own frames are never where the user's graph breaks.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _arg_name(raw: str) -> str:
    m = _LOCAL.match(raw)
    return m.group("name") if m else raw


def parse_reason(reason: str) -> tuple[str, str, int | None, tuple[int, ...]]:
    """(kind, argument, dimension, sizes) of one guard-failure reason.

    ``kind`` is "size" (a tensor's size or stride changed: ``dimension`` and the two
    ``sizes``), "dtype", "value" (a Python value the graph was specialised on: a
    number argument, or the value read on the host at a graph break) or "other".
    """
    first = reason.splitlines()[0] if reason else ""
    m = _SIZE.match(first)
    if m:
        return "size", _arg_name(m["arg"]), int(m["dim"]), (int(m["expected"]), int(m["actual"]))
    m = _DTYPE.match(first)
    if m:
        return "dtype", _arg_name(m["arg"]), None, ()
    m = _VALUE.match(first)
    if m and "tensor '" not in first:
        return "value", _arg_name(m["arg"]), None, ()
    return "other", "", None, ()


@dataclass(frozen=True)
class SizeChange:
    """An input of a compiled function whose size changed along one dimension."""

    arg: str
    dim: int
    sizes: tuple[int, ...]  # every size seen, sorted


@dataclass
class FunctionCompiles:
    """One compiled function (the code after its graph breaks folded in): what made it recompile."""

    name: str  # qualified name where known: "Net.forward"
    where: str  # "file.py:12", the function's first line
    compilations: int = 0
    seconds: float = 0.0
    #: Distinct guard failures (dynamo lists one per cached graph it checked before recompiling).
    guard_failures: int = 0
    size_changes: list[SizeChange] = field(default_factory=list)
    dtype_changes: list[str] = field(default_factory=list)
    #: Recompilations of the code after a graph break, on the value read at the break.
    after_break_values: int = 0
    other_reasons: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.where})"


@dataclass(frozen=True)
class LimitHit:
    """A function that reached dynamo's recompile limit: new shapes now run it eagerly."""

    limit_type: str  # "recompile_limit" (or "accumulated_recompile_limit")
    limit: int
    function: str  # "forward"
    where: str  # "/path/model.py:12"
    last_reason: str


@dataclass(frozen=True)
class GraphBreak:
    """Where dynamo broke a compiled function's graph, and why, with how many compilations hit it."""

    reason: str  # dynamo's reason, first line
    where: str  # "file.py:15": where the graph broke
    function: str
    source: str  # the line's source text
    count: int
    #: The library whose code broke the graph ("transformers"), None where it is the user's own.
    library: str | None = None
    #: Where the user's code called into that library ("train.py:40"), when the break is a library's.
    caller: str | None = None


@dataclass(frozen=True)
class Mark:
    """A point in the observer's history: queries ``since`` it see only what came after."""

    failures: dict[Any, int]
    breaks: int
    metrics: int
    hits: int


class _LimitHandler(logging.Handler):
    def __init__(self, owner: CompileObserver) -> None:
        super().__init__(logging.WARNING)
        self.owner = owner

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if isinstance(record.msg, str) and record.msg.startswith(LIMIT_PREFIX):
                self.owner._limit_hit(record.args)
        except Exception:  # noqa: BLE001 - a diagnosis must never break the user's compilation
            pass


def _where(filename: str, line: int) -> str:
    return f"{filename}:{line}"


#: The frame torch.compile puts around what it cannot start tracing itself (a torch.nn class of torch's own,
#: a built-in function): torch/_dynamo/external_utils.py's wrap_inline, whose ``inner`` dynamo compiles.
_WRAPPER_FILE = os.path.join("torch", "_dynamo", "external_utils.py")


def _is_wrapper(name: str, filename: str) -> bool:
    return name in ("inner", "wrap_inline.<locals>.inner") and filename.endswith(_WRAPPER_FILE)


def _wrapped() -> tuple[str, str] | None:
    """(name, where) of the module that dynamo's wrapper frame stands for, or None where it cannot be told.

    The frame names only the wrapper; the compiled module (``torch.compile(model.linear)``) is found among
    the live ``OptimizedModule`` objects whose forward goes through that wrapper: the one class there is."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if not isinstance(optimized, type):
        return None
    import inspect

    classes = set()
    for o in live_instances(optimized):  # read once per finding, when a wrapper frame is in dynamo's records
        code = getattr(getattr(getattr(o, "forward", None), "__wrapped__", None), "__code__", None)
        original = getattr(o, "_orig_mod", None)
        if code is not None and original is not None \
                and _is_wrapper(getattr(code, "co_qualname", code.co_name), code.co_filename):  # (3.11+)
            classes.add(type(original))
    if len(classes) != 1:
        return None
    (cls,) = classes
    try:
        first = inspect.getsourcelines(cls.forward)[1]
        where = _where(inspect.getsourcefile(cls.forward) or "?", first)
    except (OSError, TypeError):
        where = "?"
    return f"{cls.__module__}.{cls.__qualname__}.forward", where




class CompileObserver:
    """Reads dynamo's records of compilations, recompilation reasons, graph breaks and limit hits.

    One per process (:func:`observer`); :meth:`arm` is cheap and idempotent, and
    queries take a :class:`Mark` so that two runs in one process (a test suite, a
    second ``ap.use``) each see their own compilations.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handler = _LimitHandler(self)
        self._hits: list[LimitHit] = []
        self._metrics: list[Any] = []  # every CompilationMetrics drained, in order
        self._window: list[Any] = []  # the last drained window (held: ids stay unique)
        self._callback_on: Any = None  # the callback handler we registered with
        self._wrapper: tuple[int, tuple[str, str] | None] | None = None  # (compilations seen, _wrapped()'s answer)

    # -- arming ---------------------------------------------------------------------
    def arm(self) -> None:
        """Listen for the recompile-limit warning; once dynamo is loaded, drain at each compile start."""
        logger = logging.getLogger(LIMIT_LOGGER)  # no torch import: the logger is made now, torch finds it
        if self._handler not in logger.handlers:
            logger.addHandler(self._handler)
        callback = sys.modules.get("torch._dynamo.callback")
        handler = getattr(callback, "callback_handler", None)
        # torch._dynamo.reset() clears the callbacks: register again when ours is gone.
        registered = getattr(handler, "start_callbacks", None)
        if handler is not None and registered is not None and self._on_compile_start not in registered:
            try:
                handler.register_start_callback(self._on_compile_start)
                self._callback_on = handler
            except Exception:  # noqa: BLE001 - an older torch without callbacks: reads drain instead
                pass

    def _on_compile_start(self, *args: Any) -> None:
        self._drain()

    @staticmethod
    def _utils() -> Any:
        return sys.modules.get("torch._dynamo.utils")

    def _drain(self) -> None:
        utils = self._utils()
        get = getattr(utils, "get_compilation_metrics", None)
        if get is None:
            return
        try:
            current = list(get())
        except Exception:  # noqa: BLE001
            return
        with self._lock:
            seen = {id(m) for m in self._window}
            self._metrics.extend(m for m in current if id(m) not in seen)
            self._window = current

    def _limit_hit(self, args: Any) -> None:
        # args: (limit type, limit value, "'forward' (/path:line)", last reason, url), torch 2.9 to 2.13
        limit_type, value, function, reason = (list(args) + [None] * 4)[:4] if isinstance(args, tuple) else \
            (None, None, None, None)
        m = re.match(r"^'(?P<name>.*)' \((?P<where>.*)\)$", str(function or ""))
        name, where = (m["name"], m["where"]) if m else (str(function or "?"), "?")
        place = re.match(r"^(?P<file>.*):(?P<line>\d+)$", where)
        if place and _is_wrapper(name, place["file"]):
            name, where = self._named(name, place["file"], int(place["line"]))
        try:
            limit = int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            limit = -1
        with self._lock:
            self._hits.append(LimitHit(str(limit_type or "recompile_limit"), limit, name, where, str(reason or "")))

    def _named(self, name: str, filename: str, line: int) -> tuple[str, str]:
        """The name and place a finding gives a compiled function: the module itself for dynamo's wrapper frame
        (looked up once per new compilation: the lookup walks the process's objects)."""
        if not _is_wrapper(name, filename):
            return name, _where(filename, line)
        seen = len(self._metrics)
        if self._wrapper is None or self._wrapper[0] != seen:
            self._wrapper = (seen, _wrapped())
        return self._wrapper[1] or ("a module or built-in function compiled through dynamo's wrapper frame "
                                    "(torch.nn's own classes are compiled so)", _where(filename, line))

    # -- marks ------------------------------------------------------------------------
    def mark(self) -> Mark:
        """The present state: queries ``since`` it leave out everything before."""
        self.arm()
        self._drain()
        utils = self._utils()
        failures = {code: len(reasons) for code, reasons in getattr(utils, "guard_failures", {}).items()}
        return Mark(failures, len(getattr(utils, "graph_break_reasons", ()) or ()), len(self._metrics), len(self._hits))

    # -- cheap counts (read every step) ----------------------------------------------------
    def limit_hit_count(self, since: Mark | None = None) -> int:
        return len(self._hits) - (since.hits if since else 0)

    def graph_break_count(self, since: Mark | None = None) -> int:
        utils = self._utils()
        breaks = getattr(utils, "graph_break_reasons", None)
        if breaks is None:
            return 0
        n = len(breaks)
        base = since.breaks if since else 0
        return n - base if n >= base else n  # torch._dynamo.reset() empties the list

    # -- what happened -------------------------------------------------------------------
    def limit_hits(self, since: Mark | None = None) -> list[LimitHit]:
        return list(self._hits[since.hits if since else 0:])

    def compile_seconds(self, since: Mark | None = None) -> float:
        self._drain()
        # A backward graph compiled at its first call (not found in inductor's cache) is a record of its own,
        # with no frame time: its time is in backward_cumulative_compile_time_us.
        return sum(float(getattr(m, "entire_frame_compile_time_s", 0) or 0)
                   + float(getattr(m, "backward_cumulative_compile_time_us", 0) or 0) / 1e6
                   for m in self._metrics[since.metrics if since else 0:])

    def functions(self, since: Mark | None = None) -> list[FunctionCompiles]:
        """Every function compiled (or recompiled) since ``since``, most recompilations first.

        The code dynamo compiles after a graph break (``torch_dynamo_resume_in_forward_at_15``)
        is folded into the function it belongs to; instances of one class share one entry
        (they share ``forward``'s code).
        """
        self._drain()
        utils = self._utils()
        found: dict[tuple[str, int], FunctionCompiles] = {}
        names: dict[tuple[str, str], tuple[str, int]] = {}  # (file, co_name) -> key, to fold resume code into

        def entry(co_name: str, filename: str, line: int, qualname: str | None = None) -> FunctionCompiles:
            m = _RESUME.match(co_name)
            if m:
                parent = names.get((filename, m["parent"]))
                if parent is not None:
                    return found[parent]
                key = (filename, -int(m["line"]))
                if key not in found:
                    found[key] = FunctionCompiles(f"{m['parent']} (after its graph break at line {m['line']})",
                                                  _where(filename, int(m["line"])))
                return found[key]
            key = (filename, line)
            if key not in found:
                found[key] = FunctionCompiles(*self._named(qualname or co_name, filename, line))
                names.setdefault((filename, co_name), key)
            elif qualname and found[key].name == co_name:
                found[key].name = qualname
            return found[key]

        failures = getattr(utils, "guard_failures", {}) or {}
        codes = list(failures)
        # Parents before their resume functions, so the latter fold in.
        codes.sort(key=lambda c: bool(_RESUME.match(getattr(c, "co_name", ""))))
        metrics = self._metrics[since.metrics if since else 0:]
        for m in sorted(metrics, key=lambda m: bool(_RESUME.match(getattr(m, "co_name", "") or ""))):
            if getattr(m, "co_filename", None):
                entry(str(m.co_name), str(m.co_filename), int(m.co_firstlineno or 0))
        for code in codes:
            entry(code.co_name, code.co_filename, code.co_firstlineno, getattr(code, "co_qualname", None))
        for m in metrics:
            if not getattr(m, "co_filename", None):
                continue
            f = entry(str(m.co_name), str(m.co_filename), int(m.co_firstlineno or 0))
            if getattr(m, "fail_type", None) is None:
                f.compilations += 1
            f.seconds += float(getattr(m, "entire_frame_compile_time_s", 0) or 0)
        for code in codes:
            reasons = failures[code]
            base = since.failures.get(code, 0) if since else 0
            new = reasons[base:] if len(reasons) >= base else reasons
            if not new:
                continue
            f = entry(code.co_name, code.co_filename, code.co_firstlineno, getattr(code, "co_qualname", None))
            resume = bool(_RESUME.match(code.co_name))
            _add_reasons(f, new, resume)
        out = [f for f in found.values() if f.compilations or f.guard_failures]
        out.sort(key=lambda f: (-f.compilations, -f.guard_failures))
        return out

    def graph_breaks(self, since: Mark | None = None, top: int = 3) -> list[GraphBreak]:
        """The most frequent graph breaks since ``since``: reason, the user's line, how many compilations hit it."""
        utils = self._utils()
        breaks = list(getattr(utils, "graph_break_reasons", ()) or ())
        base = since.breaks if since else 0
        new = breaks[base:] if len(breaks) >= base else breaks
        counts: Counter[tuple[str, str, str, str, str | None, str | None]] = Counter()
        for b in new:
            stack = [f for f in getattr(b, "user_stack", None) or [] if not str(f.filename).startswith(_OWN_DIR)]
            frame = stack[-1] if stack else None
            reason = (str(getattr(b, "reason", "")) or "?").splitlines()[0].strip()
            where = _where(frame.filename, frame.lineno) if frame is not None else "?"
            library = library_of(str(frame.filename)) if frame is not None else None
            # A break inside a library's code: the innermost frame of the user's that led there.
            mine = next((f for f in reversed(stack) if library_of(str(f.filename)) is None), None) if library else None
            counts[(reason, where, getattr(frame, "name", "?") if frame else "?",
                    (getattr(frame, "line", "") or "").strip() if frame else "", library,
                    _where(mine.filename, mine.lineno) if mine is not None else None)] += 1
        return [GraphBreak(r, w, f, s, n, lib, caller) for (r, w, f, s, lib, caller), n in counts.most_common(top)]


def _add_reasons(f: FunctionCompiles, reasons: Iterable[str], resume: bool) -> None:
    sizes: dict[tuple[str, int], set[int]] = {(c.arg, c.dim): set(c.sizes) for c in f.size_changes}
    seen: set[str] = set()
    for reason in reasons:
        head = reason.splitlines()[0] if reason else ""
        if head in seen:  # dynamo lists a failure once per cache entry it checked
            continue
        seen.add(head)
        f.guard_failures += 1
        kind, arg, dim, values = parse_reason(head)
        if kind == "size" and dim is not None and not resume:  # (after a break: a consequence of the inputs)
            sizes.setdefault((arg, dim), set()).update(values)
        elif kind == "dtype" and not resume:
            if arg not in f.dtype_changes:
                f.dtype_changes.append(arg)
        elif kind == "value" and resume:
            f.after_break_values += 1
        elif kind == "size" or kind == "dtype":
            pass
        elif len(f.other_reasons) < 5:
            f.other_reasons.append(head.split("  #")[0].strip())
    f.size_changes = sorted((SizeChange(arg, dim, tuple(sorted(v))) for (arg, dim), v in sizes.items()),
                            key=lambda c: -len(c.sizes))


_OBSERVER: CompileObserver | None = None
_OBSERVER_LOCK = threading.Lock()


def observer() -> CompileObserver:
    """The process's observer, armed (torch.compile's records are process-wide, so is this)."""
    global _OBSERVER
    if _OBSERVER is None:
        with _OBSERVER_LOCK:
            if _OBSERVER is None:
                _OBSERVER = CompileObserver()
    _OBSERVER.arm()
    return _OBSERVER


class CompileEvents:
    """torch.compile's records from one point on (a run's start): what the rules read of dynamo.

    The records are process-wide; a run reads them since its own :class:`Mark`, so two runs
    in one process (a test suite, a second ``ap.use``) each see their own compilations.
    """

    def __init__(self, source: CompileObserver | None = None) -> None:
        self._observer = source if source is not None else observer()
        self._mark = self._observer.mark()

    def limit_hit_count(self) -> int:
        return self._observer.limit_hit_count(self._mark)

    def graph_break_count(self) -> int:
        return self._observer.graph_break_count(self._mark)

    def limit_hits(self) -> list[LimitHit]:
        return self._observer.limit_hits(self._mark)

    def compile_seconds(self) -> float:
        return self._observer.compile_seconds(self._mark)

    def functions(self) -> list[FunctionCompiles]:
        return self._observer.functions(self._mark)

    def graph_breaks(self, top: int = 3) -> list[GraphBreak]:
        return self._observer.graph_breaks(self._mark, top)
