"""Deprecation warnings: a vendor path or a setting on its way out, said where the backend is chosen.

The facts are the matrix's (a row marked deprecated, its ``[[env]]`` tables); this
module turns them into messages (pure) and warnings (once, at selection).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from accelport import _packages
from accelport.compat.load import Matrix
from accelport.compat.schema import Source
from accelport.compat.verdict import default_matrix, recommend
from accelport.errors import AccelportDeprecationWarning, InvalidVersionError, warn_user
from accelport.platform import PLATFORMS, PlatformInfo
from accelport.settings import explicit_pjrt_device, is_off

if TYPE_CHECKING:
    from accelport.contract import Backend

__all__ = ["target_platform", "deprecation_messages", "deprecated_settings", "warn_deprecations"]


_PJRT_PLATFORM = {"CPU": "cpu", "TPU": "gcp-tpu", "CUDA": "nvidia-gpu", "GPU": "nvidia-gpu", "NEURON": "aws-neuron"}


def target_platform(backend: Backend, environ: Mapping[str, str] | None = None, detected: str | None = None) -> str:
    """The platform a backend actually drives here, which picks the matrix rows that judge it.

    A backend may say so itself (``target_platform()``). An XLA (lazy) backend
    follows ``PJRT_DEVICE``; unset, torch_xla picks TPU or Neuron when present
    and otherwise the CPU (never CUDA on its own). Any other backend drives its
    declared ``platform``.
    """
    env = os.environ if environ is None else environ
    own = getattr(backend, "target_platform", None)
    if callable(own):
        try:
            value = own()
        except Exception:  # a backend's hint must never break selection
            value = None
        if value in PLATFORMS:
            return str(value)
    if getattr(backend, "lazy", False):
        pjrt = explicit_pjrt_device(env)
        if pjrt in _PJRT_PLATFORM:
            return _PJRT_PLATFORM[pjrt]
        if detected is None:
            from accelport.platform import detect

            detected = detect(environ=env).name
        return "cpu" if detected == "nvidia-gpu" else detected
    return str(getattr(backend, "platform", "cpu"))


def _cite(sources: tuple[Source, ...]) -> str:
    if not sources:
        return ""
    s = sources[0]
    return f" Source: {s.title} <{s.url}>."


def deprecation_messages(
    backend: str,
    platform: str,
    torch_version: str | None,
    environ: Mapping[str, str] | None = None,
    *,
    chip: str | None = None,
    matrix: Matrix | None = None,
) -> list[str]:
    """Why ``backend`` on ``platform`` with ``torch_version`` deserves a deprecation warning, if it does.

    One message when the matrix marks the combination deprecated (or
    unsupported), naming the replacement and the source; one per deprecated
    environment variable that is set. Pure: emits nothing.
    """
    env = os.environ if environ is None else environ
    mx = matrix if matrix is not None else default_matrix(env)
    out: list[str] = []
    if torch_version is not None:
        try:
            verdict = recommend(platform, torch_version, chip=chip, matrix=mx, warn=False)
        except InvalidVersionError:
            verdict = None
        st = verdict.backends.get(backend) if verdict is not None else None
        if st is not None and st.status in ("deprecated", "unsupported"):
            what = "deprecated" if st.status == "deprecated" else "not supported"
            instead = f"; use the {st.replacement} backend instead" if st.replacement else ""
            out.append(f"accelport: {backend} is {what} on {platform} with torch {torch_version}{instead}. "
                       f"{st.message}{_cite(st.sources)}")
    for _, message in deprecated_settings(env, backend=backend, matrix=mx):
        out.append(f"accelport: {message}")
    return out


def deprecated_settings(
    environ: Mapping[str, str], backend: str | None = None, matrix: Matrix | None = None,
    *, in_effect_only: bool = False,
) -> list[tuple[str, str]]:
    """(variable, message) for each deprecated environment variable set, from the matrix's env rows.

    With ``in_effect_only``, only those that act on ``backend`` (a setting read by
    torch_xla does nothing on cpu).
    """
    mx = matrix if matrix is not None else default_matrix(environ)
    out = []
    for name, dep in mx.env.items():
        value = environ.get(name)
        if value is None or is_off(value):
            continue
        if in_effect_only and backend and dep.backends and backend not in dep.backends:
            continue
        effect = (f" It has no effect on the {backend} backend." if backend and dep.backends
                  and backend not in dep.backends else "")
        out.append((name, f"{name}={value} is set. {dep.message} Instead use {dep.replacement}.{effect}"
                          f"{_cite(dep.sources)}"))
    return out


def warn_deprecations(backend: Backend, environ: Mapping[str, str], *, matrix: Matrix | None = None,
                      found: PlatformInfo | None = None) -> list[str]:
    """Emit one AccelportDeprecationWarning per problem with the selected ``backend``; return the messages.

    Called once, where the backend is first selected. The warning points at
    the user's code, so Python shows it by default in a script.
    """
    if found is None:
        from accelport.platform import detect

        found = detect(environ=environ)
    platform = target_platform(backend, environ, found.name)
    chip = found.chip if platform == found.name else None
    messages = deprecation_messages(backend.name, platform, _packages.version("torch"), environ, chip=chip,
                                    matrix=matrix)
    for message in messages:
        warn_user(message, AccelportDeprecationWarning)
    return messages
