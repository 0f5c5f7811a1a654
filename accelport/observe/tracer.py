"""Host reads of device tensors: counted on eager accelerators, located in trace mode.

The torch.Tensor methods that copy a device tensor to the host are wrapped once
per process (``print(tensor)`` goes through ``__repr__``; ``.cpu()`` and
``.to("cpu")`` copy). Two uses share the wrappers:

- counting (:func:`count_reads`): an eager accelerator backend (``cuda``, ``tpu``,
  ``neuron``) has no runtime counter of device-to-host reads, so each call on a
  tensor of its device type made from the user's code (not torch's, so a ``print``
  counts once, not once per element torch reads to format it; not accelport's, so
  ``ap.after_step`` reads never count) adds one to a plain integer, which the
  backend reads with its step counters. Never on ``cpu``, where the host is the device;
- tracing (``ACCELPORT_DIAGNOSTICS=trace``): each such call is counted by
  ``file:line`` in every :class:`HostSyncSites` that is listening, so two plugin
  hosts (a run and doctor, or a test's) each keep their own counts;
- timing (:func:`time_reads`): on an eager accelerator and on XLA, the time each such
  call takes in the training loop's thread is a host read on the run's step clock
  (:mod:`accelport.observe.steptime`): the loop waits there for the device. accelport's
  own reads (``ap.after_step``'s, which wait for a step that already ran) are left out.

The wrappers cost a Python call per wrapped method call, so they are installed
only when a backend counts or a trace listens, and never while torch.compile
compiles (see :func:`guard_compiles`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
import weakref
from collections import Counter
from typing import Any

__all__ = ["HostSyncSites", "METHODS", "COPIES", "count_reads", "reads", "time_reads", "guard_compiles"]

METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__format__", "__repr__", "numpy")
#: Methods that read the host only when their result is on the CPU.
COPIES = ("cpu", "to")

_listeners: weakref.WeakSet[HostSyncSites] = weakref.WeakSet()
_installed = False
#: Device type -> host reads counted so far (only the types a backend asked for).
_counts: dict[str, int] = {}
#: Device type -> the step clocks its host reads are timed on (weakly: a run's clock goes with it).
_timers: dict[str, list[weakref.ReferenceType[Any]]] = {}


class HostSyncSites:
    """Counts of host reads by ``file:line``, from the moment :meth:`listen` is called."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()

    def listen(self) -> None:
        """Start counting (wraps torch.Tensor's host-reading methods on first use in the process)."""
        _install()
        _listeners.add(self)

    def most_common(self, n: int) -> list[str]:
        return [site for site, _ in self.sites.most_common(n)]


def count_reads(device_type: str) -> None:
    """Count host reads of tensors on ``device_type`` from now on (see :func:`reads`)."""
    _counts.setdefault(device_type, 0)
    _install()


def reads(device_type: str) -> int:
    """Host reads of ``device_type`` tensors counted since :func:`count_reads` (0 if not counting)."""
    return _counts.get(device_type, 0)


def time_reads(device_type: str, clock: Any) -> None:
    """Time host reads of ``device_type`` tensors made in ``clock``'s thread as its ``read`` phase."""
    refs = [ref for ref in _timers.get(device_type, []) if ref() is not None and ref() is not clock]
    refs.append(weakref.ref(clock))
    _timers[device_type] = refs
    _install()


def _install() -> None:
    global _installed
    if _installed:
        return
    import torch

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    # accelport's own reads (ap.after_step's, the loader's copies, the diagnostics' own looks)
    # are not the user's: they wait for a step that already ran, or read nothing back.
    own_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    counts = _counts
    # While dynamo traces a compiled function it inlines these wrappers: it must see the
    # plain method (a frame lookup would break the graph), and nothing happens then anyway.
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None) or (lambda: False)

    def internal(f: Any) -> bool:
        name = f.f_code.co_filename
        return name.startswith(torch_dir) or name.startswith(own_dir)

    def note(device_type: str) -> None:
        frame: Any = sys._getframe(2)  # the caller of the wrapped method

        # One per call from the user's code: torch reading its own tensors (formatting a
        # print, an optimizer's step count) is not another read.
        if device_type in counts and not internal(frame):
            counts[device_type] += 1
        if not _listeners or (device_type == "cpu" and device_type not in counts):
            return
        # The site: the user's line, above torch's frames; accelport's own reads have none.
        while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
            frame = frame.f_back
        if frame is not None and not frame.f_code.co_filename.startswith(own_dir):
            site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            for listener in list(_listeners):
                listener.sites[site] += 1

    timers = _timers
    clock = time.perf_counter

    def timed(device_type: str, start: float) -> None:
        # The read's time on the run's clocks, unless accelport itself made it (ap.after_step's reads).
        if sys._getframe(2).f_code.co_filename.startswith(own_dir):
            return
        refs = timers.get(device_type) or ()
        alive = False
        for ref in refs:
            step_clock = ref()
            if step_clock is not None:
                alive = True
                step_clock.span("read", start)
        if not alive:  # every run that asked has ended: stop timing this device type's reads
            timers.pop(device_type, None)

    def wrap(original: Any) -> Any:
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not is_compiling():
                device_type = self.device.type
                if device_type in counts or (device_type != "cpu" and _listeners):
                    note(device_type)
                if device_type in timers:
                    start = clock()
                    try:
                        return original(self, *args, **kwargs)
                    finally:
                        timed(device_type, start)
            return original(self, *args, **kwargs)

        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced

    def wrap_copy(original: Any) -> Any:
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = clock()
            out = original(self, *args, **kwargs)
            if not is_compiling():
                device_type = self.device.type
                to_host = getattr(getattr(out, "device", None), "type", None) == "cpu"
                if (device_type in counts or (device_type != "cpu" and _listeners)) and to_host:
                    note(device_type)
                if to_host and device_type in timers:
                    timed(device_type, start)
            return out

        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced

    for name in METHODS:
        _originals[name] = getattr(torch.Tensor, name)
        _wrappers[name] = wrap(_originals[name])
    for name in COPIES:
        _originals[name] = getattr(torch.Tensor, name)
        _wrappers[name] = wrap_copy(_originals[name])
    _put(_wrappers)
    _own_code.extend([note.__code__, internal.__code__, timed.__code__, _wrappers[METHODS[0]].__code__,
                      _wrappers[COPIES[0]].__code__])
    _installed = True
    guard_compiles()


# -- torch.compile must never see the wrappers ----------------------------------------------------
# dynamo inlines a Python function found on torch.Tensor, and the C method it then calls
# is one it cannot trace: each .to(), .cpu() or .item() in a compiled function would break
# its graph there. So the plain methods are put back for the duration of every compilation
# (dynamo's compile start and end callbacks wrap the whole of it, bytecode tracing included),
# and the wrappers return when it ends. Reads made by other threads meanwhile are not counted.

_originals: dict[str, Any] = {}
_wrappers: dict[str, Any] = {}
_own_code: list[Any] = []  # the wrappers' code: dynamo must run it as it is, never compile it
_compiling = 0


def _put(methods: dict[str, Any]) -> None:
    import torch

    for name, fn in methods.items():
        setattr(torch.Tensor, name, fn)


def _compile_started(*args: Any) -> None:
    global _compiling
    _compiling += 1
    if _compiling == 1:
        _put(_originals)
        # A wrapper called at run time from a compiled function's eager part (after a graph
        # break) would itself be a frame dynamo compiles, and breaks: have dynamo skip it.
        skip = getattr(sys.modules.get("torch._dynamo.eval_frame"), "skip_code", None)
        if skip is not None:
            for code in _own_code:
                skip(code)
        _rearm_after_reset()


def _compile_ended(*args: Any) -> None:
    global _compiling
    _compiling = max(_compiling - 1, 0)
    if _compiling == 0:
        _put(_wrappers)


def guard_compiles() -> None:
    """Have every torch.compile compilation run with the plain methods (idempotent, cheap).

    Once dynamo is loaded, its callbacks are registered (again after ``torch._dynamo.reset()``,
    which clears them); before that, an import hook registers them as dynamo loads, so
    nothing here imports it.
    """
    if not _installed:
        return
    module = sys.modules.get("torch._dynamo.callback")
    if module is None:
        if not any(isinstance(f, _WhenDynamoLoads) for f in sys.meta_path):
            sys.meta_path.insert(0, _WhenDynamoLoads())
        return
    handler = getattr(module, "callback_handler", None)
    starts = getattr(handler, "start_callbacks", None)
    if handler is not None and starts is not None and _compile_started not in starts:
        handler.register_start_callback(_compile_started)
        handler.register_end_callback(_compile_ended)
    _rearm_after_reset()


def _rearm_after_reset() -> None:
    """``torch._dynamo.reset()`` (and ``torch.compiler.reset()``) clear the callbacks: register them again after it."""
    dynamo = sys.modules.get("torch._dynamo")
    reset = getattr(dynamo, "reset", None)
    if reset is None or getattr(reset, "_accelport_rearms", False):
        return  # (not yet defined while dynamo is still loading: the first compile start comes back here)

    @functools.wraps(reset)
    def rearming_reset(*args: Any, **kwargs: Any) -> Any:
        try:
            return reset(*args, **kwargs)
        finally:
            guard_compiles()

    rearming_reset._accelport_rearms = True  # type: ignore[attr-defined]
    dynamo.reset = rearming_reset  # type: ignore[union-attr]


class _WhenDynamoLoads:
    """An import hook: when ``torch._dynamo.callback`` is executed, register the callbacks."""

    target = "torch._dynamo.callback"

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.target:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module: Any) -> None:
            run(module)
            sys.modules[name] = module
            guard_compiles()

        loader.exec_module = exec_module  # type: ignore[union-attr]
        return spec

    def find_module(self, *args: Any) -> None:  # pragma: no cover - pre-3.4 protocol, never used
        return None
