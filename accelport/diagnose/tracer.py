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
  hosts (a run and doctor, or a test's) each keep their own counts.

The wrappers cost a Python call per wrapped method call, so they are installed
only when a backend counts or a trace listens.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from typing import Any

__all__ = ["HostSyncSites", "METHODS", "COPIES", "count_reads", "reads"]

METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__format__", "__repr__", "numpy")
#: Methods that read the host only when their result is on the CPU.
COPIES = ("cpu", "to")

_listeners: weakref.WeakSet[HostSyncSites] = weakref.WeakSet()
_installed = False
#: Device type -> host reads counted so far (only the types a backend asked for).
_counts: dict[str, int] = {}


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

    def note(device_type: str) -> None:
        frame: Any = sys._getframe(2)  # the caller of the wrapped method

        def internal(f: Any) -> bool:
            name = f.f_code.co_filename
            return name.startswith(torch_dir) or name.startswith(own_dir)

        # One per call from the user's code: torch reading its own tensors (formatting a
        # print, an optimizer's step count) is not another read.
        if device_type in counts and not internal(frame):
            counts[device_type] += 1
        if not _listeners or (device_type == "cpu" and device_type not in counts):
            return
        while frame is not None and internal(frame):
            frame = frame.f_back
        if frame is not None:
            site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            for listener in list(_listeners):
                listener.sites[site] += 1

    def wrap(original: Any) -> Any:
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not is_compiling():
                device_type = self.device.type
                if device_type in counts or (device_type != "cpu" and _listeners):
                    note(device_type)
            return original(self, *args, **kwargs)

        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced

    def wrap_copy(original: Any) -> Any:
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            if not is_compiling():
                device_type = self.device.type
                if (device_type in counts or (device_type != "cpu" and _listeners)) and \
                        getattr(getattr(out, "device", None), "type", None) == "cpu":
                    note(device_type)
            return out

        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced

    for name in METHODS:
        setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
    for name in COPIES:
        setattr(torch.Tensor, name, wrap_copy(getattr(torch.Tensor, name)))
    _installed = True
