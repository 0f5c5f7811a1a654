"""The compatibility verdict: which backend is recommended on a platform and torch version.

This first version ranks backends per platform from a fixed preference; the
data-driven matrix (``compat_matrix/``) replaces the ranking with rows that
carry status, messages and sources.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from . import _packages

__all__ = ["Verdict", "recommend"]

_PREFERENCE: Mapping[str, tuple[str, ...]] = {
    "gcp-tpu": ("tpu", "xla"),
    "aws-neuron": ("neuron", "neuron-xla"),
    "nvidia-gpu": ("cuda",),
    "cpu": ("cpu",),
}


@dataclass(frozen=True)
class Verdict:
    """Backends for one platform and torch version, best first."""

    platform: str
    torch_version: str | None
    ranked: tuple[str, ...]
    statuses: Mapping[str, str] = field(default_factory=dict)

    @property
    def recommended(self) -> str | None:
        return self.ranked[0] if self.ranked else None


def recommend(platform: str, torch_version: str | None = None) -> Verdict:
    """The verdict for ``platform`` and ``torch_version`` (default: the installed torch)."""
    if torch_version is None:
        torch_version = _packages.version("torch")
    ranked = _PREFERENCE.get(platform, ())
    return Verdict(platform, torch_version, ranked, {name: "recommended" for name in ranked[:1]})


#: Environment variables whose vendor has deprecated them, with what to do instead.
DEPRECATED_SETTINGS: Mapping[str, str] = {
    "XLA_USE_BF16": (
        "XLA_USE_BF16 is deprecated since torch_xla 2.6 and torch-neuronx 2.5 (and can stall bf16 "
        "accumulation or produce NaN): convert the model with model.to(torch.bfloat16) or use "
        "torch.autocast for the forward pass, and unset XLA_USE_BF16."
    ),
    "XLA_DOWNCAST_BF16": (
        "XLA_DOWNCAST_BF16 is deprecated since torch_xla 2.6 and torch-neuronx 2.5: convert the model "
        "with model.to(torch.bfloat16) or use torch.autocast, and unset XLA_DOWNCAST_BF16."
    ),
}


def deprecated_settings(environ: Mapping[str, str]) -> list[str]:
    """Messages for each deprecated setting in effect (set to anything but empty or 0)."""
    return [
        message
        for name, message in DEPRECATED_SETTINGS.items()
        if environ.get(name, "").strip() not in ("", "0")
    ]
