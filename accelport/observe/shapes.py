"""Where a tensor made inside the step changes shape from one step to the next (a lazy backend's recompilations
whose input batches kept their shapes: padding to a length the data decides, a mask that selects rows).

A :class:`ShapeTrace` is armed by the step tracker when a step compiled although its batch had a shape seen
before. It then records, for a few steps, every torch call's output shapes with the user's line that made it
(a ``TorchFunctionMode``, entered at the end of one optimizer step and left at the end of the next, in the
training loop's thread), and compares each step with the one before: the first call of the same op at the
same line whose output shape differs is the tensor that changes. The cost (a Python call and a frame walk per
op) is paid in those few steps only, once per run.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any

from accelport.observe.frames import user_site

__all__ = ["ShapeTrace", "ShapeChange"]


@dataclass(frozen=True)
class ShapeChange:
    """A tensor made inside the step whose shape changed: the op, the user's line, the shapes of two steps."""

    op: str
    where: str  # "train.py:31"
    before: tuple[int, ...]
    after: tuple[int, ...]


def _mode_class() -> Any:
    from torch.overrides import TorchFunctionMode

    class _Record(TorchFunctionMode):
        def __init__(self, calls: list[tuple[str, str, tuple[int, ...]]]) -> None:
            super().__init__()
            self.calls = calls

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            shape = getattr(out, "shape", None)
            if shape is not None:
                site = user_site(sys._getframe(1))
                if site is not None:
                    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
                    self.calls.append((name, f"{site[0]}:{site[1]}", tuple(shape)))
            return out

    return _Record


class ShapeTrace:
    """Records op output shapes over a few steps once armed; :attr:`found` is the first shape that changed."""

    #: Steps recorded at most: two to compare, and one more for a change that comes every other step.
    STEPS = 3

    def __init__(self) -> None:
        self.found: ShapeChange | None = None
        self.armed = False
        self._done = False
        self._thread: int | None = None
        self._mode: Any = None
        self._calls: list[tuple[str, str, tuple[int, ...]]] = []
        self._previous: list[tuple[str, str, tuple[int, ...]]] | None = None
        self._recorded = 0

    def arm(self) -> None:
        """Record the next steps (once per run: a second arming does nothing)."""
        if not self._done and not self.armed:
            self.armed = True

    def step_end(self) -> None:
        """An optimizer step ended (in the training loop's thread): close its record, start the next one."""
        if self._mode is not None:
            if threading.get_ident() != self._thread:
                return
            mode, self._mode = self._mode, None
            try:
                mode.__exit__(None, None, None)
            except Exception:  # the mode stack was changed under it: stop recording
                self._stop()
                return
            self._compare(self._calls)
            self._calls = []
        if self.armed and not self._done:
            if self._recorded >= self.STEPS:
                self._stop()
                return
            self._thread = threading.get_ident()
            self._mode = _mode_class()(self._calls)
            self._mode.__enter__()
            self._recorded += 1

    def _compare(self, calls: list[tuple[str, str, tuple[int, ...]]]) -> None:
        before, self._previous = self._previous, calls
        if before is None:
            return
        for (op_a, at_a, shape_a), (op_b, at_b, shape_b) in zip(before, calls, strict=False):
            if (op_a, at_a) != (op_b, at_b):
                break  # the steps took different paths: what follows cannot be paired
            if shape_a != shape_b:
                self.found = ShapeChange(op_a, at_a, shape_a, shape_b)
                self._stop()
                return

    def _stop(self) -> None:
        self.armed = False
        self._done = True
        if self._mode is not None and threading.get_ident() == self._thread:
            try:
                self._mode.__exit__(None, None, None)
            except Exception:
                pass
        self._mode = None

    def pause(self) -> None:
        """The loop left its steps (its end, ``ap.diagnostics()``): stop recording the partial step; the next
        step's end starts a new one."""
        if self._mode is not None and threading.get_ident() == self._thread:
            mode, self._mode = self._mode, None
            self._calls = []
            try:
                mode.__exit__(None, None, None)
            except Exception:
                self._stop()
