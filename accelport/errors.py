"""Exceptions and warning categories: each one says what went wrong and what to do."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Iterable

__all__ = [
    "AccelportError",
    "UnknownBackendError",
    "BackendUnavailableError",
    "PluginWarning",
    "AccelportDeprecationWarning",
    "DiagnosticWarning",
    "ProfileWarning",
    "CompatibilityWarning",
    "CompatMatrixError",
    "UnknownPlatformError",
    "InvalidVersionError",
    "UnknownChipError",
    "InvalidPythonVersionError",
    "ShardingError",
    "CheckpointError",
    "CheckpointWarning",
    "UsageError",
    "nearest",
    "did_you_mean",
    "warn_user",
    "user_stacklevel",
    "ending_with_error",
    "mark_ending_with_error",
]


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The closest known name to ``name`` (for "did you mean"), or None.

    A name that is one hyphen-separated part of exactly one known name wins
    ("tpu" -> "gcp-tpu", "gpu" -> "nvidia-gpu"); otherwise the closest spelling.
    """
    import difflib

    names = list(known)
    lowered = name.lower()
    if lowered in names:
        return lowered
    parts = [k for k in names if lowered in k.lower().split("-") and lowered != k.lower()]
    if len(parts) == 1:
        return parts[0]
    matches = difflib.get_close_matches(lowered, names, n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(name: str, known: Iterable[str], *, aside: bool = False) -> str:
    """`` Did you mean 'x'?`` (or `` (did you mean 'x'?)`` as an aside) for the nearest known name, else ``""``."""
    guess = nearest(name, known)
    if not guess:
        return ""
    return f" (did you mean {guess!r}?)" if aside else f" Did you mean {guess!r}?"


#: Where accelport's own code lives; a source checkout maps ``accelport._backends`` to ``backends/``.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _own_dirs() -> tuple[str, ...]:
    dirs = [_PACKAGE_DIR]
    backends = sys.modules.get("accelport._backends")
    for path in getattr(backends, "__path__", ()):
        dirs.append(os.path.abspath(path) + os.sep)
    return tuple(dirs)


def user_stacklevel(skip: int = 1, also: frozenset[str] = frozenset()) -> int:
    """The ``stacklevel`` that points a warning at the first frame outside accelport.

    For a ``warnings.warn`` called ``skip`` frames above this function (1: in the
    function that asks). Python shows a DeprecationWarning by default only when it is
    attributed to ``__main__``: pointing at the user's line makes the warnings
    visible in scripts without any filter set. ``also``: files skipped as accelport's
    own (a plugin's rules, whose findings are about the user's code, not theirs).
    """
    own = _own_dirs()
    frame = sys._getframe(skip)
    level = 1
    while frame is not None and (frame.f_code.co_filename.startswith(own) or frame.f_code.co_filename in also):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn_user(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the user's line, whatever depth accelport called it from."""
    warnings.warn(message, category, stacklevel=user_stacklevel())


#: Set once something caught the error that ends this process (see mark_ending_with_error).
_ENDING_WITH_ERROR = threading.Event()


def mark_ending_with_error() -> None:
    """This process ends with an error that something caught and turned into its exit status (a launched worker's
    wrapper, ``accelport diagnose``): the exit hooks treat it as an uncaught one."""
    _ENDING_WITH_ERROR.set()


def ending_with_error() -> bool:
    """Whether the process is ending with an error (asked in an exit hook): an exception Python did not catch
    (kept as ``sys.last_exc``, ``sys.last_value`` before 3.12), or one marked by :func:`mark_ending_with_error`.
    A plain ``sys.exit(1)`` is neither."""
    return _ENDING_WITH_ERROR.is_set() or getattr(sys, "last_exc", None) is not None or \
        getattr(sys, "last_value", None) is not None


class AccelportError(Exception):
    """Base class of every error accelport raises on purpose."""


class UsageError(AccelportError, ValueError):
    """Bad command-line or call input that the user fixes by changing what they typed (CLI exit status 2)."""


class UnknownBackendError(AccelportError, ValueError):
    """A backend name that no registered plugin provides."""

    def __init__(self, name: str, known: Iterable[str], source: str = "") -> None:
        self.name = name
        self.known = sorted(known)
        self.suggestion = nearest(name, self.known)
        where = f" (from {source})" if source else ""
        hint = did_you_mean(name, self.known)
        super().__init__(
            f"unknown backend {name!r}{where}.{hint} "
            f"Known backends: {', '.join(self.known)}."
        )


class BackendUnavailableError(AccelportError, RuntimeError):
    """A known backend that cannot run here; ``reason`` is its probe's explanation."""

    def __init__(self, name: str, reason: str, source: str = "") -> None:
        self.name = name
        self.reason = reason
        where = f" (from {source})" if source else ""
        super().__init__(
            f"backend {name!r}{where} is not available: {reason}. "
            "Run `accelport backends` to see what is available here."
        )


class CompatMatrixError(AccelportError, ValueError):
    """A compatibility-matrix file or plugin row that breaks the schema.

    ``origin`` is the file (or ``plugin 'name'``) and ``key`` the offending key,
    e.g. ``rows[3].status``; both are in the message.
    """

    def __init__(self, origin: str, key: str, problem: str) -> None:
        self.origin = origin
        self.key = key
        self.problem = problem
        where = f"{origin}, key {key}" if key else origin
        super().__init__(f"invalid compatibility matrix {where}: {problem}")


class UnknownPlatformError(AccelportError, ValueError):
    """A platform name accelport does not know; ``known`` lists the valid ones."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = list(known)
        self.suggestion = nearest(name, self.known)
        hint = did_you_mean(name, self.known)
        super().__init__(f"unknown platform {name!r}.{hint} Valid platforms: {', '.join(self.known)}.")


class InvalidVersionError(AccelportError, ValueError):
    """A torch version that is not a PEP 440 version."""

    def __init__(self, text: str, covered: str = "") -> None:
        self.text = text
        known = f"; the matrix covers torch {covered}" if covered else ""
        super().__init__(
            f"invalid torch version {text!r}: expected a PEP 440 version such as 2.9, 2.9.0+cu128, "
            f"2.10.0a0+git1234 or 2.15.0.dev20261001{known}."
        )


class UnknownChipError(AccelportError, ValueError):
    """A chip name the compatibility matrix does not know; ``known`` lists the valid ones."""

    def __init__(self, name: str, known: Iterable[str], platform: str | None = None) -> None:
        from accelport.redact import redact

        self.name = name
        self.known = list(known)
        self.platform = platform
        hint = did_you_mean(name, self.known)
        where = f" for {platform}" if platform else ""
        super().__init__(f"unknown chip {redact('chip', name)!r}{where}.{hint} Valid chips{where}: "
                         f"{', '.join(self.known)}.")


class InvalidPythonVersionError(AccelportError, ValueError):
    """A Python version that is not major.minor, or one the matrix knows nothing of."""

    def __init__(self, text: str, known: Iterable[str]) -> None:
        from accelport.redact import redact

        self.text = text
        self.known = list(known)
        super().__init__(f"invalid Python version {redact('python', text)!r}: expected major.minor, one of "
                         f"{', '.join(self.known)}.")
class ShardingError(AccelportError):
    """``ap.shard`` or ``ap.optimizer_step`` cannot do what was asked with this model or optimizer."""


class CheckpointError(AccelportError):
    """A checkpoint cannot be written or restored as asked (``ap.save``, ``ap.load``)."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (torn or incomplete), or a run resumes less exactly than it was saved."""


class PluginWarning(UserWarning):
    """A plugin failed to load or raised in a hook and was disabled."""


class AccelportDeprecationWarning(DeprecationWarning):
    """The selected path or a setting in effect is deprecated by its vendor."""


class CompatibilityWarning(UserWarning):
    """The compatibility matrix cannot vouch for this combination (e.g. a torch newer than every row)."""


class DiagnosticWarning(UserWarning):
    """A diagnosis of a slow or wrong training run (see ``ap.diagnostics()``)."""


class ProfileWarning(UserWarning):
    """What a profile of chosen steps says (``ap.profile``, ``ACCELPORT_PROFILE``): why a window was not
    profiled, or, once it was, where its traces are and what it found. Training goes on either way."""
