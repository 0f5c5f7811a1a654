"""Redaction and output hygiene: what accelport prints never shows a credential, and never lets a
value a user set forge a line, run a terminal escape or break the format it is printed in.

One pass does it all, over finished output (:class:`Redactor`): every string in a report,
whichever section quoted it, in every format. A value is redacted when

- the variable that holds it is named like a secret (``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ...):
  then that value is also redacted wherever else it is quoted (a cache path, a backend's reason);
- it matches a credential pattern: URL userinfo (``https://user:pass@host``), credential query
  parameters (``?sig=``, ``X-Amz-Signature=``, ``access_token=``), ``--token VALUE`` and
  ``--auth=VALUE`` flags, ``name=value`` and JSON ``"name": "value"`` pairs whose name says
  secret, ``Authorization``-style ``Bearer``/``Basic`` values, and known token formats (AWS access
  keys, GitHub, Slack, Google, Hugging Face, OpenAI-style ``sk-``), and long random-looking strings.

Control characters are shown escaped (``\\n``, ``\\x1b``), and text that Python decoded from
undecodable bytes is shown as ``\\xff`` escapes, so no encoding can fail on it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["REDACTED", "Redactor", "redact", "redact_text", "printable"]

REDACTED = "<redacted>"

#: Words that make a name a secret's name wherever it appears ("password: x" in a log line too).
_STRONG_WORDS = r"secret|token|password|passwd|passphrase|credential|api[_-]?key|apikey|private[_-]?key|access[_-]?key"
#: ...and, in ``name=value``, flags, JSON keys and query parameters, these as well.
_NAME_WORDS = _STRONG_WORDS + r"|auth|key"
#: Query parameters that carry signatures (presigned URLs).
_QUERY_WORDS = _NAME_WORDS + r"|sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token|code"
#: A variable whose name says it holds a secret.
_SECRET_NAME = re.compile(r"(?i)(secret|token|password|passwd|passphrase|credential|api[_-]?key|private|auth)")
_NAME = r"[a-z0-9_.-]*(?:" + _NAME_WORDS + r")[a-z0-9_.-]*"
_STRONG_NAME = r"[a-z0-9_.-]*(?:" + _STRONG_WORDS + r")[a-z0-9_.-]*"

# (pattern, replacement); each replacement keeps the name and hides the value.
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # scheme://user:password@host, scheme://token@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@:]*(?::[^/\s@]*)?@"), r"\1" + REDACTED + "@"),
    # credential query parameters: ?sig=, &X-Amz-Signature=, ?access_token=
    (re.compile(r"(?i)([?&;][a-z0-9_.-]*(?:" + _QUERY_WORDS + r")[a-z0-9_.-]*=)[^&\s#\"']+"), r"\1" + REDACTED),
    # Authorization-style values
    (re.compile(r"(?i)\b(bearer|basic)(\s+)(?!<redacted>)[A-Za-z0-9._~+/=-]{4,}"), r"\1\2" + REDACTED),
    # JSON / Python-literal pairs: "password": "x"
    (re.compile(r"(?i)([\"']" + _NAME + r"[\"']\s*:\s*[\"'])[^\"']*([\"'])"), r"\1" + REDACTED + r"\2"),
    # --token VALUE, --auth=VALUE, -api-key VALUE
    (re.compile(r"(?i)(?<![a-z0-9_])(--?" + _NAME + r")(=|\s+)(?!-|<redacted>)[^\s,;&\"']+"), r"\1\2" + REDACTED),
    # name=value, also inside longer names (client_secret=, HF_TOKEN=, key=), and "password: value"
    (re.compile(r"(?i)(?<![a-z0-9_.-])(" + _NAME + r")(\s*=\s*)(?!<redacted>)[^\s,;&\"']+"), r"\1\2" + REDACTED),
    (re.compile(r"(?i)(?<![a-z0-9_.-])(" + _STRONG_NAME + r")(\s*:\s*)(?!<redacted>|//)[^\s,;&\"']+"),
     r"\1\2" + REDACTED),
    # known token formats
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\b(?:gh[pousr]_|github_pat_|xox[abpr]-|ya29\.|glpat-|sk-)[A-Za-z0-9_\-.]{10,}"), REDACTED),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"), REDACTED),
    (re.compile(r"\bAIza[0-9A-Za-z_\-]{30,}"), REDACTED),
    # long random-looking strings: 32 or more letters and digits mixed, in one piece (a path's
    # directory names, joined by / _ -, are not one)
    (re.compile(r"(?<![A-Za-z0-9+_-])(?=[A-Za-z0-9+]*\d)(?=[A-Za-z0-9+]*[A-Za-z])[A-Za-z0-9+]{32,}={0,2}(?![A-Za-z0-9_-])"),
     REDACTED),
]

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def redact_text(text: str) -> str:
    """``text`` with every credential pattern's value replaced by ``<redacted>``."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def printable(text: str) -> str:
    """``text`` safe to print: control characters escaped, undecodable bytes as ``\\xNN``."""
    if any("\ud800" <= c <= "\udfff" for c in text):
        try:  # bytes Python decoded with surrogateescape (os.environ, file names)
            text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def redact(name: str, value: str) -> str:
    """The value to show for variable ``name``; anything that looks like a credential is redacted."""
    if _SECRET_NAME.search(name):
        return REDACTED
    return redact_text(value)


class Redactor:
    """The one pass over finished output: credentials hidden, text made safe to print.

    ``environ`` gives the values to hide wherever they appear: those of variables
    named like secrets, and the parts of other values that a pattern hides.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        known: set[str] = set()
        for name, value in (environ or {}).items():
            value = str(value)
            if _SECRET_NAME.search(name) and len(value.strip()) >= 4:
                known.add(value.strip())
            elif value:
                known.update(_hidden_parts(value))
        # Longest first, so a secret that contains another is replaced whole.
        self._known = sorted((k for k in known if len(k) >= 4), key=len, reverse=True)

    def text(self, text: str) -> str:
        """One string: known secrets, then patterns, then control characters."""
        for secret in self._known:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return printable(redact_text(text))

    def tree(self, obj: Any) -> Any:
        """Every string (keys too) in nested dicts and lists; NaN and infinities become None (valid JSON)."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, Mapping):
            return {self.text(k) if isinstance(k, str) else k: self.tree(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple, set, frozenset)):
            return [self.tree(v) for v in obj]
        if isinstance(obj, float) and not math.isfinite(obj):
            return None
        return obj


def _hidden_parts(value: str) -> Iterable[str]:
    """The substrings of ``value`` that the patterns would hide (to hide them where quoted elsewhere)."""
    marked = redact_text(value)
    if marked == value:
        return []
    # Split the original around the parts that survived: what is left between them was hidden.
    parts = marked.split(REDACTED)
    out, pos = [], 0
    for before, after in zip(parts, parts[1:], strict=False):
        start = value.find(before, pos) + len(before) if before else pos
        end = value.find(after, start) if after else len(value)
        if end < 0:
            break
        out.append(value[start:end])
        pos = end
    return [p for p in out if p.strip()]
