"""Which backend runs, and why, in one readable sentence.

Order: ``ap.use(name)`` > ``ACCELPORT_BACKEND`` > the ``accelport_select_backend``
hook (this module's default, ``trylast``: the recommended available backend)
> ``cpu``. This module is itself a built-in plugin, so a site policy plugin
can be asked first, or this default can be disabled by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from accelport.contract import Backend
from accelport.errors import AccelportError, BackendUnavailableError, UnknownBackendError
from accelport.plugins.hookspecs import hookimpl
from accelport.settings import explicit_pjrt_device

if TYPE_CHECKING:
    from accelport.compat.load import Matrix
    from accelport.compat.verdict import Verdict
    from accelport.platform import PlatformInfo
    from accelport.plugins.host import PluginHost

__all__ = ["resolve", "named", "quoted", "pjrt_request", "pjrt_unmet", "accelport_select_backend"]


@hookimpl(trylast=True)
def accelport_select_backend(
    candidates: Sequence[Backend], platform: str, recommendation: Verdict
) -> tuple[Backend, str] | None:
    """Default policy: the best-ranked available backend for the platform."""
    by_name = {b.name: b for b in candidates}
    ranked = tuple(getattr(recommendation, "ranked", ()))
    torch_v = getattr(recommendation, "torch_version", None)
    # The verdict says what it judged (chip and Python included); a plugin's stand-in may not.
    on = getattr(recommendation, "subject", None) or (f"{platform} with torch {torch_v}" if torch_v else platform)
    statuses = getattr(recommendation, "statuses", {}) or {}
    for position, name in enumerate(ranked):
        if name not in by_name:
            continue
        backend = by_name[name]
        if position == 0:
            status = statuses.get(name, "recommended")
            label = "the recommended backend" if status == "recommended" else f"the best backend ({status})"
            return backend, f"{name} is {label} for {on}; {backend.probe().reason}"
        skipped = ", ".join(ranked[:position])
        return backend, (f"{name} is the best available backend for {on} "
                         f"({skipped} ranked higher but not available; see `accelport backends`)")
    # A backend the matrix does not rank (a third-party plugin) may still drive this
    # platform; one the matrix marks unsupported for this torch is never picked on its
    # own (ACCELPORT_BACKEND can still force it, and doctor says why it is unsupported).
    for backend in candidates:
        if backend.platform == platform and backend.name != "cpu" and \
                statuses.get(backend.name) != "unsupported":
            return backend, f"{backend.name} is the only available backend for {on}"
    return None


#: No backend name is near this long: a longer one is quoted cut, and redacted, in its error (a
#: 100 KB ACCELPORT_BACKEND came back twice, whole).
MAX_NAME = 64


def quoted(value: str, environ: Mapping[str, str] | None = None) -> str:
    """``value`` as an error may quote it: whole up to MAX_NAME characters, else redacted and cut."""
    if len(value) <= MAX_NAME:
        return value
    from accelport.redact import Redactor

    # Redacted before the cut (with ``environ``'s secrets): a secret the cut would halve is still hidden.
    return Redactor(environ, limit=40).text(value)


def named(known: Mapping[str, Backend], name: str, source: str,
          environ: Mapping[str, str] | None = None) -> tuple[Backend, str]:
    """The backend ``name`` (from ``source``) if it is known and available; ``environ`` gives the secrets
    a long name is redacted of in the error."""
    key = name.strip().lower()
    if key not in known:
        raise UnknownBackendError(quoted(name, environ), known, source)
    backend = known[key]
    probe = backend.probe()
    if not probe.available:
        raise BackendUnavailableError(key, probe.reason, source)
    return backend, f"{key} was chosen by {source}; {probe.reason}"


def resolve(host: PluginHost, explicit: str | None, environ: Mapping[str, str], *,
            matrix: Matrix | None = None, found: PlatformInfo | None = None) -> tuple[Backend, str]:
    """Pick the backend; return it with the reason. Raises a specific error on bad input.

    ``matrix`` (default: built from ``host`` and ``environ``) ranks the candidates for
    the platform ``found`` (default: detected under ``environ``).
    """
    known: Mapping[str, Backend] = host.backends
    if explicit is not None:
        if not isinstance(explicit, str) or not explicit.strip():
            raise UnknownBackendError(str(explicit), known, "ap.use()")
        return named(known, explicit, f"ap.use({quoted(explicit.strip(), environ)!r})", environ)
    forced = environ.get("ACCELPORT_BACKEND", "").strip()
    if forced:
        return named(known, forced, f"ACCELPORT_BACKEND={quoted(forced, environ)}", environ)

    from accelport.compat.load import build
    from accelport.compat.verdict import recommend
    from accelport.platform import detect

    plat = detect(environ=environ) if found is None else found
    mx = build(host, environ) if matrix is None else matrix
    # host.probe: isolated (a plugin whose probe fails or hangs is disabled and drops out of `known`).
    candidates = [b for name, b in list(known.items()) if host.probe(name).available]
    asked = pjrt_request(known, environ)
    if asked is not None:
        wanted, setting = asked
        usable = [b for b in wanted if b in candidates]
        if usable:
            return usable[0], f"{usable[0].name} was chosen because {setting} asks for XLA; {usable[0].probe().reason}"
    backend, reason = _by_policy(host, candidates, known, plat, recommend(plat.name, chip=plat.chip, matrix=mx,
                                                                         environ=environ))
    unmet = pjrt_unmet(known, environ, backend)
    return backend, f"{reason}. {unmet}" if unmet else reason


def pjrt_request(known: Mapping[str, Backend], environ: Mapping[str, str]) -> tuple[list[Backend], str] | None:
    """The lazy backends a set ``PJRT_DEVICE`` asks for, and the setting as the user wrote it; None if unset."""
    device = explicit_pjrt_device(environ)
    if device is None:
        return None
    setting = f"PJRT_DEVICE={environ['PJRT_DEVICE'].strip()}"
    return [b for b in known.values() if b.lazy and device in b.pjrt_devices], setting


def pjrt_unmet(known: Mapping[str, Backend], environ: Mapping[str, str], chosen: Backend) -> str | None:
    """Why a set ``PJRT_DEVICE`` (a request for XLA) is not what runs, or None when it is unset or honoured.

    Selection appends it to the reason, the runtime warns with it, doctor makes it a finding:
    a user who set PJRT_DEVICE=CPU and silently got eager cpu would believe XLA ran.
    """
    asked = pjrt_request(known, environ)
    if asked is None or chosen.lazy:
        return None
    wanted, setting = asked
    if wanted:
        why = "; ".join(f"{b.name}: {b.probe().reason}" for b in wanted)
    else:
        why = f"no registered backend drives PJRT device {explicit_pjrt_device(environ)}"
    return (f"{setting} is set, which asks for XLA, but {chosen.name} runs instead because no XLA backend can run "
            f"here ({why}). Fix that, or unset PJRT_DEVICE to run on {chosen.name} without this warning")


def _by_policy(host: PluginHost, candidates: list[Backend], known: Mapping[str, Backend], plat: PlatformInfo,
               recommendation: Verdict) -> tuple[Backend, str]:
    """The selection hook's choice among ``candidates``, else cpu."""
    chosen = host.select_backend(candidates=candidates, platform=plat.name, recommendation=recommendation)
    if chosen is not None:
        backend, reason = chosen
        return backend, reason or f"{backend.name} was chosen by a selection plugin"
    cpu = known.get("cpu")
    if cpu is not None and cpu.probe().available:
        return cpu, f"cpu: no accelerator backend is available on this machine ({plat.describe()})"
    if not known:
        raise AccelportError(
            "no backend is registered: every backend plugin is disabled or failed to load "
            "(check ACCELPORT_DISABLED_PLUGINS and `accelport backends`)"
        )
    reason = cpu.probe().reason if cpu is not None else "the cpu plugin is disabled"
    raise BackendUnavailableError("cpu", reason, "the fallback")
