"""Reading accelport's and the runtimes' environment variables: one parser per kind of value.

Every flag, count and device name read from the environment goes through here,
so ``ACCELPORT_DIAGNOSTICS=Off`` and ``ACCELPORT_DISABLE_PLUGIN_AUTOLOAD=yes`` mean
what they say everywhere, and ``PJRT_DEVICE`` is parsed the way torch_xla parses it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["TRUE_VALUES", "FALSE_VALUES", "is_true", "is_off", "env_int", "explicit_pjrt_device", "plugin_timeout"]

#: Spellings of a set flag and of an unset one (compared stripped and lower-cased).
TRUE_VALUES = frozenset({"1", "true", "yes", "on"})
FALSE_VALUES = frozenset({"", "0", "false", "no", "off"})


def is_true(value: str | None) -> bool:
    """Whether ``value`` turns a flag on (``1``, ``true``, ``yes``, ``on``)."""
    return (value or "").strip().lower() in TRUE_VALUES


def is_off(value: str | None) -> bool:
    """Whether ``value`` leaves a setting off: unset, empty, ``0``, ``false``, ``no``, ``off``."""
    return (value or "").strip().lower() in FALSE_VALUES


def env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """``environ[name]`` as an int; ``default`` when it is unset or not a whole number."""
    try:
        return int(environ.get(name, default))
    except (TypeError, ValueError):
        return default


#: How long the CLI lets one plugin call (an import, a probe, a hook) run before it disables the plugin.
DEFAULT_PLUGIN_TIMEOUT = 20.0


def plugin_timeout(environ: Mapping[str, str]) -> float:
    """``ACCELPORT_PLUGIN_TIMEOUT`` in seconds (a positive number), else :data:`DEFAULT_PLUGIN_TIMEOUT`."""
    try:
        value = float(environ.get("ACCELPORT_PLUGIN_TIMEOUT", ""))
    except ValueError:
        return DEFAULT_PLUGIN_TIMEOUT
    return value if 0 < value < 86400 else DEFAULT_PLUGIN_TIMEOUT


#: Seconds rank 0 of a job under ``accelport diagnose`` waits for the other ranks' summaries after its script ended.
DEFAULT_JOB_WAIT = 120.0


def job_wait(environ: Mapping[str, str]) -> tuple[float, str | None]:
    """``ACCELPORT_JOB_WAIT`` in seconds (0 or more), else :data:`DEFAULT_JOB_WAIT`; with why a value that was
    given is not taken (None when it is, or none was given)."""
    given = environ.get("ACCELPORT_JOB_WAIT")
    if given is None or not given.strip():
        return DEFAULT_JOB_WAIT, None
    try:
        value = float(given)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        return DEFAULT_JOB_WAIT, (f"ACCELPORT_JOB_WAIT={given} is not a number of seconds (0 or more): rank 0 waited "
                                  f"the default {DEFAULT_JOB_WAIT:.0f} s for the other ranks")
    return value, None


def explicit_pjrt_device(environ: Mapping[str, str]) -> str | None:
    """The device type ``PJRT_DEVICE`` names (``CPU``, ``TPU``, ``NEURON``, ``CUDA``), or None when unset.

    torch_xla reads the part before ``_`` as the device type (``runtime.device_type()``),
    so ``PJRT_DEVICE=TPU_C_API`` is ``TPU``.
    """
    raw = (environ.get("PJRT_DEVICE") or "").strip()
    return raw.split("_")[0].upper() if raw else None
