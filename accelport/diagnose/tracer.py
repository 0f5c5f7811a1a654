"""Where a step reads device values on the host: an opt-in trace (``ACCELPORT_DIAGNOSTICS=trace``).

The torch.Tensor methods that copy a device tensor to the host are wrapped once
per process (``print(tensor)`` goes through ``__repr__``; ``.cpu()`` and
``.to("cpu")`` copy). Each call from outside torch is counted by file:line in
every :class:`HostSyncSites` that is listening, so two plugin hosts (a run and
doctor, or a test's) each keep their own counts and never clear each other's.
It costs a Python call per wrapped method call, so it is off by default.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter
from typing import Any

__all__ = ["HostSyncSites", "METHODS", "COPIES"]

METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__format__", "__repr__", "numpy")
#: Methods that read the host only when their result is on the CPU.
COPIES = ("cpu", "to")

_listeners: weakref.WeakSet[HostSyncSites] = weakref.WeakSet()
_installed = False


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


def _install() -> None:
    global _installed
    if _installed:
        return
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    here = os.path.abspath(__file__)

    def note() -> None:
        if not _listeners:
            return
        frame: Any = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                     or frame.f_code.co_filename == here):
            frame = frame.f_back
        if frame is not None:
            site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
            for listener in list(_listeners):
                listener.sites[site] += 1

    def wrap(original: Any) -> Any:
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.device.type != "cpu":
                note()
            return original(self, *args, **kwargs)

        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced

    def wrap_copy(original: Any) -> Any:
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            if self.device.type != "cpu" and getattr(getattr(out, "device", None), "type", None) == "cpu":
                note()
            return out

        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced

    for name in METHODS:
        setattr(torch.Tensor, name, wrap(getattr(torch.Tensor, name)))
    for name in COPIES:
        setattr(torch.Tensor, name, wrap_copy(getattr(torch.Tensor, name)))
    _installed = True
