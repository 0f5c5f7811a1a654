"""A doctor finding and the facts checks receive: the types ``accelport_doctor_checks`` works with.

Backends import this module for :class:`Finding`; it depends on nothing else in
accelport, so a check never pulls the plugin host or the matrix in with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelport.contract import Backend, Probe
    from accelport.platform import PlatformInfo

__all__ = ["SEVERITIES", "Finding", "DoctorContext", "as_finding"]

SEVERITIES = ("ok", "note", "warning", "problem")


@dataclass(frozen=True)
class Finding:
    """One result of a check: ``severity`` (ok, note, warning, problem), what was seen, and the fix."""

    severity: str
    title: str
    fix: str = ""
    check: str = ""  # which plugin produced it

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {', '.join(SEVERITIES)}, not {self.severity!r}")

    def to_dict(self) -> dict[str, str]:
        return {"severity": self.severity, "title": self.title, "fix": self.fix, "check": self.check}


@dataclass
class DoctorContext:
    """Read-only facts gathered before the checks run (what ``accelport_doctor_checks`` receives)."""

    environ: Mapping[str, str]
    platform: PlatformInfo
    packages: Mapping[str, str | None]
    probes: Mapping[str, Probe]
    backends: Mapping[str, Backend]
    selected: str | None
    selection_reason: str
    cpu_count: int
    extra: dict[str, Any] = field(default_factory=dict)


def as_finding(item: Any, check: str) -> Finding:
    """A plugin's answer as a Finding attributed to ``check``; TypeError, ValueError or KeyError if it is none."""
    if isinstance(item, Finding):
        return item if item.check else Finding(item.severity, item.title, item.fix, check)
    if isinstance(item, Mapping):
        return Finding(str(item.get("severity", "note")), str(item["title"]), str(item.get("fix", "")), check)
    raise TypeError(f"got {type(item).__name__}; expected accelport.doctor.finding.Finding or a dict with a title")
