"""Redaction and output hygiene: what accelport prints never shows a credential, and never lets a
value a user set forge a line, run a terminal escape or break the format it is printed in.

One pass does it all, over finished output (:class:`Redactor`): every string in a report,
whichever section quoted it, in every format. A value is redacted when

- the variable that holds it is named like a secret (``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ...):
  then that value is also redacted wherever else it is quoted (a cache path, a backend's reason);
- it matches a credential pattern: URL userinfo (``https://user:pass@host``, also with the one
  slash a normalised path leaves: ``https:/user:pass@host``), credential query parameters
  (``?sig=``, ``X-Amz-Signature=``, ``access_token=``), ``--token VALUE`` and ``--auth=VALUE``
  flags, ``name=value`` (``pass=``, ``pwd=`` too) and JSON ``"name": "value"`` pairs whose name
  says secret, with the value bare or quoted (``password="a b"``), ``Authorization``-style
  ``Bearer``/``Basic`` values, and known token formats (AWS access keys and secret keys, GitHub,
  Slack, Google, Hugging Face, OpenAI-style ``sk-``), and long random-looking strings.

Every pattern runs in time linear in the text (names are matched to a bounded length, and a
match starts only where a name or word starts), so a huge value costs no more than its size.

Control characters are shown escaped (``\\n``, ``\\x1b``), and text that Python decoded from
undecodable bytes is shown as ``\\xff`` escapes, also where a message quoted it with ``repr()``
(``'\\udcff'``), so no encoding can fail on it and every output spells it alike.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
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
#: Characters of a name; at most 64 of them on either side of the word: bounded, so that
#: no match backtracks over a long run (128 KB of dashes took doctor hours).
_RUN = r"[a-z0-9_.-]{0,64}"
#: "pass" and "pwd" only as a whole part of a name (DB_PASS, pwd, pass_word), never inside a word
#: (bypass, passes, compass).
_SHORT = r"(?:" + _RUN + r"[_.-])?(?:pass|pwd)(?:[_.-]" + _RUN + r")?"
_NAME = r"(?:" + _RUN + r"(?:" + _NAME_WORDS + r")" + _RUN + r"|" + _SHORT + r")"
_STRONG_NAME = _RUN + r"(?:" + _STRONG_WORDS + r")" + _RUN
#: A name starts where no name character precedes it: a match never restarts inside a run.
_START = r"(?<![a-z0-9_.-])"
#: A value: quoted (the quotes stay, what is between them goes; an unclosed quote runs to the
#: end of the line), or bare up to a separator.
_VALUE = r"""(?P<v>"[^"\n]*"?|'[^'\n]*'?|[^\s,;&"']+)"""


def _hide_value(match: re.Match[str]) -> str:
    """The match with its value (group ``v``) replaced, quotes kept; unchanged if already hidden."""
    value = match.group("v")
    head = match.group(0)[: match.start("v") - match.start()]
    quote = value[:1] if value[:1] in "\"'" else ""
    inner = value[len(quote):]
    if inner.startswith(REDACTED):
        return match.group(0)
    closed = quote if quote and len(value) > 1 and value.endswith(quote) else ""
    return head + quote + REDACTED + closed


def _aws_secret(match: re.Match[str]) -> str:
    """A 40-character AWS secret access key (base64: it may hold / and +), not a path of that length."""
    text = match.group(0)
    keylike = (any(c.isdigit() for c in text) and any(c.islower() for c in text) and any(c.isupper() for c in text)
               and ("/" in text or "+" in text) and not text.startswith("/") and not text.endswith("/")
               and "//" not in text)
    return REDACTED if keylike else text


_Replacement = str | Callable[[re.Match[str]], str]

# (pattern, replacement); each replacement keeps the name and hides the value.
_PATTERNS: list[tuple[re.Pattern[str], _Replacement]] = [
    # scheme://user:password@host, scheme://token@host; scheme:/user:pw@host is what os.path.abspath
    # leaves of a URL inside a path
    (re.compile(r"(?i)(?<![a-z0-9+.-])([a-z][a-z0-9+.-]{1,31}:/{1,2})[^/\s@:]*(?::[^/\s@]*)?@"),
     r"\1" + REDACTED + "@"),
    # credential query parameters: ?sig=, &X-Amz-Signature=, ?access_token=
    (re.compile(r"(?i)([?&;]" + _RUN + r"(?:" + _QUERY_WORDS + r")" + _RUN + r"=)[^&\s#\"']+"), r"\1" + REDACTED),
    # Authorization-style values
    (re.compile(r"(?i)(?<![a-z0-9])(bearer|basic)(\s+)(?!<redacted>)[A-Za-z0-9._~+/=-]{4,}"), r"\1\2" + REDACTED),
    # JSON / Python-literal pairs: "password": "x"
    (re.compile(r"(?i)([\"']" + _NAME + r"[\"']\s*:\s*[\"'])[^\"']*([\"'])"), r"\1" + REDACTED + r"\2"),
    # --token VALUE, --auth=VALUE, -api-key VALUE, --api-key="x y"
    (re.compile(r"(?i)" + _START + r"(--?" + _NAME + r")(=|\s+)(?!-)" + _VALUE), _hide_value),
    # name=value, also inside longer names (client_secret=, HF_TOKEN=, key=), quoted or not
    (re.compile(r"(?i)" + _START + r"(" + _NAME + r")(\s*=\s*)" + _VALUE), _hide_value),
    # "password: value", 'token: "abc"'
    (re.compile(r"(?i)" + _START + r"(" + _STRONG_NAME + r")(\s*:\s*)(?!//)" + _VALUE), _hide_value),
    # known token formats (after "_" too: a file named run_hf_...)
    (re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[0-9A-Z]{16}(?![A-Za-z0-9])"), REDACTED),
    (re.compile(r"(?<![A-Za-z0-9])(?:gh[pousr]_|github_pat_|xox[abpr]-|ya29\.|glpat-|sk-)[A-Za-z0-9_\-.]{10,}"),
     REDACTED),
    (re.compile(r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"(?<![A-Za-z0-9])AIza[0-9A-Za-z_\-]{30,}"), REDACTED),
    # an AWS secret access key on its own: 40 base64 characters, "/" among them
    (re.compile(r"(?<![A-Za-z0-9/+=_-])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=_-])"), _aws_secret),
    # long random-looking strings: 32 or more letters and digits mixed, in one piece (a path's
    # directory names, joined by / _ -, are not one)
    (re.compile(r"(?<![A-Za-z0-9+_-])(?=[A-Za-z0-9+]*\d)(?=[A-Za-z0-9+]*[A-Za-z])[A-Za-z0-9+]{32,}={0,2}(?![A-Za-z0-9_-])"),
     REDACTED),
]

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
#: What repr() makes of an undecodable byte (surrogateescape maps 0x80-0xff to U+DC80-U+DCFF).
_REPR_SURROGATE = re.compile(r"(?<!\\)\\udc([89a-fA-F][0-9a-fA-F])")
#: How far past a cut the patterns still read, so a credential that the cut crosses is still seen whole.
_CUT_CONTEXT = 1024


def redact_text(text: str) -> str:
    """``text`` with every credential pattern's value replaced by ``<redacted>``."""
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def printable(text: str) -> str:
    """``text`` safe to print: control characters escaped, undecodable bytes as ``\\xNN``."""
    if _SURROGATE.search(text):
        try:  # bytes Python decoded with surrogateescape (os.environ, file names)
            text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if "\\u" in text:  # a message that quoted such a value with repr(): the same \xNN
        text = _REPR_SURROGATE.sub(lambda m: "\\x" + m.group(1).lower(), text)
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
    ``limit``: a string longer than this many characters is cut there and says how long it
    was (a report that quotes a 128 KB value ten times stays readable and quick to make);
    None keeps every character.
    """

    def __init__(self, environ: Mapping[str, str] | None = None, limit: int | None = None) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be a positive number of characters or None, not {limit!r}")
        known: set[str] = set()
        for name, value in (environ or {}).items():
            value = str(value)
            if _SECRET_NAME.search(name) and len(value.strip()) >= 4:
                known.add(value.strip())
            elif value:
                known.update(_hidden_parts(value))
        # Longest first, so a secret that contains another is replaced whole.
        self._known = sorted((k for k in known if len(k) >= 4), key=len, reverse=True)
        self.limit = limit

    def text(self, text: str) -> str:
        """One string: known secrets, then patterns, then control characters; cut at ``limit``."""
        for secret in self._known:  # on the whole text: a secret the cut crosses is still found
            if secret in text:
                text = text.replace(secret, REDACTED)
        limit = self.limit
        if limit is None or len(text) <= limit:
            return printable(redact_text(text))
        # The patterns read a little past the cut, so a credential that crosses it is hidden
        # whole; what they read is bounded, and so is their time.
        shown = printable(redact_text(text[: limit + _CUT_CONTEXT]))[:limit]
        return f"{shown}... [cut: {len(text)} characters in all]"

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
