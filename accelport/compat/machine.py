"""What a verdict is asked about besides platform and torch: the chip and the Python version.

Chip names are the ones the compatibility matrix uses (``v5e``, ``7x``, ``trn2``);
platform detection reports generations in its own words ("v7", "Trainium2"), which
:func:`chip_name` maps onto them. The running Python is read from ``sys.version_info``:
nothing is imported to learn either.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from accelport.errors import InvalidPythonVersionError, UnknownChipError

__all__ = ["Chip", "CHIPS", "chip_name", "parse_chip", "this_python", "parse_python", "python_key"]


@dataclass(frozen=True)
class Chip:
    """One accelerator generation: its matrix name, platform, the name people know it by, aliases."""

    name: str
    platform: str
    title: str
    aliases: tuple[str, ...] = ()


#: Every chip the matrix knows, in the order tables list them. Aliases are what platform
#: detection reports (accelport.platform: TPU_DEVICE_IDS, NEURON_FAMILIES) and what people type.
CHIPS: Mapping[str, Chip] = {c.name: c for c in (
    Chip("v2/v3", "gcp-tpu", "TPU v2/v3", ("v2", "v3", "tpu-v2", "tpu-v3")),
    Chip("v4", "gcp-tpu", "TPU v4", ("tpu-v4",)),
    Chip("v5e", "gcp-tpu", "TPU v5e", ("v5lite", "v5litepod", "tpu-v5e", "tpu-v5-lite")),
    Chip("v5p", "gcp-tpu", "TPU v5p", ("tpu-v5p",)),
    Chip("v6e", "gcp-tpu", "TPU v6e (Trillium)", ("trillium", "tpu-v6e", "v6", "tpu-v6-lite")),
    Chip("7x", "gcp-tpu", "TPU7x (Ironwood)", ("v7", "v7x", "tpu7x", "ironwood")),
    Chip("trn1", "aws-neuron", "Trainium", ("trainium", "trainium1", "trn1n")),
    Chip("trn2", "aws-neuron", "Trainium2", ("trainium2", "trn2n", "trn2u")),
    Chip("trn3", "aws-neuron", "Trainium3", ("trainium3",)),
    Chip("inf2", "aws-neuron", "Inferentia2", ("inferentia2",)),
)}
#: Platforms whose chip names the matrix knows; a row there may only list names from CHIPS.
CHIP_PLATFORMS: tuple[str, ...] = tuple(dict.fromkeys(c.platform for c in CHIPS.values()))

_ALIASES: dict[str, str] = {}
for _chip in CHIPS.values():
    for _alias in (_chip.name, _chip.title.lower(), *_chip.aliases):
        _ALIASES[_alias.lower()] = _chip.name


def chip_name(text: str | None) -> str | None:
    """The matrix's name for a chip ("Trainium2" -> "trn2", "v7" -> "7x"), or None if unknown."""
    if not text or not isinstance(text, str):
        return None
    return _ALIASES.get(text.strip().lower())


def parse_chip(text: str) -> str:
    """The matrix name for a chip the user typed; UnknownChipError listing the valid ones otherwise."""
    found = chip_name(text)
    if found is None:
        raise UnknownChipError(str(text), CHIPS)
    return found


def this_python() -> str:
    """The running interpreter's major.minor ("3.12")."""
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def python_key(text: str) -> tuple[int, int]:
    """(3, 12) for "3.12", for ordering; callers pass a validated major.minor."""
    major, minor = text.split(".")
    return int(major), int(minor)


_PY_RE = re.compile(r"^(\d+)\.(\d+)$")


def parse_python(text: str, known: Iterable[str]) -> str:
    """A Python major.minor the user typed, normalised ("3.09" -> "3.9").

    ``known`` is every Python the matrix has facts for: anything else is an
    InvalidPythonVersionError listing them (``3``, ``abc``, ``2.7``, ``3.12.1``).
    """
    names = list(known)
    m = _PY_RE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise InvalidPythonVersionError(str(text), names)
    value = f"{int(m.group(1))}.{int(m.group(2))}"
    if names and value not in names:
        raise InvalidPythonVersionError(str(text), names)
    return value


def python_range(lo: str, hi: str) -> list[str]:
    """Every minor from ``lo`` to ``hi`` inclusive (same major): ("3.10", "3.12") -> 3.10, 3.11, 3.12."""
    (a, b), (c, d) = python_key(lo), python_key(hi)
    if a != c:
        return [lo, hi]
    return [f"{a}.{n}" for n in range(b, d + 1)]


def in_range(python: str, bounds: tuple[str, str] | None) -> bool:
    """Whether ``python`` lies within inclusive ``bounds`` (no bounds: True)."""
    if bounds is None:
        return True
    return python_key(bounds[0]) <= python_key(python) <= python_key(bounds[1])
