"""Redaction: what accelport prints never shows a credential a user exported or typed."""

from __future__ import annotations

import re

__all__ = ["REDACTED", "redact"]

_SECRET_NAME = re.compile(r"(?i)(secret|token|password|passwd|credential|api[_-]?key|private)")
_SECRET_VALUE = [
    re.compile(r"(?i)\b(token|secret|password|passwd|apikey|api_key|key|credential)(\s*[=:]\s*)([^\s,;&]+)"),
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"\b(?:gh[pousr]_|xox[abp]-|ya29\.)[A-Za-z0-9_\-.]{10,}"),
    re.compile(r"(?<![A-Za-z0-9/])(?=[A-Za-z0-9+/_\-]*\d)(?=[A-Za-z0-9+/_\-]*[A-Za-z])[A-Za-z0-9+/_\-]{32,}={0,2}"),
]
REDACTED = "<redacted>"


def redact(name: str, value: str) -> str:
    """The value to show for variable ``name``; anything that looks like a credential is redacted."""
    if _SECRET_NAME.search(name):
        return REDACTED
    out = value
    for pattern in _SECRET_VALUE:
        if pattern.groups >= 3:
            out = pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", out)
        else:
            out = pattern.sub(REDACTED, out)
    return out
