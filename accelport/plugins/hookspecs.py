"""Every hook accelport calls: the one place to read the extension API.

A plugin is a module or object with functions decorated ``@accelport.hookimpl``
and named like the specifications below. Built-in backends are plugins of
exactly this kind (see ``backends/``); third-party packages expose theirs
through the ``accelport`` entry-point group::

    [project.entry-points.accelport]
    mybackend = "mypackage.accelport_plugin"

Hooks are for discovery, selection and observation. The per-step hot path is
plain method calls on the selected :class:`accelport.contract.Backend`.

A plugin that raises in a hook is disabled with one :class:`PluginWarning`
naming it; the remaining plugins keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from accelport.compat.verdict import Verdict
    from accelport.contract import Backend, StepRecord
    from accelport.doctor.finding import DoctorContext, Finding

PROJECT = "accelport"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def accelport_register_backends(register: Callable[[type[Backend]], None]) -> None:
    """Register the backends this plugin ships.

    Call ``register(BackendClass)`` once per backend class (a subclass of
    :class:`accelport.contract.Backend` with a unique ``name``). Every plugin's
    implementation is called (collect-all); the return value is ignored. A name
    that is already registered is skipped with a warning: to replace a built-in
    backend, disable its plugin with ``ACCELPORT_DISABLED_PLUGINS``.
    """


@hookspec(firstresult=True)
def accelport_select_backend(
    candidates: Sequence[Backend],
    platform: str,
    recommendation: Verdict,
) -> Backend | tuple[Backend, str] | None:
    """Choose the backend to use when neither ``ap.use()`` nor ``ACCELPORT_BACKEND`` did.

    ``candidates`` are the registered backends whose probe says available, in
    registration order; ``platform`` is the detected platform name (``cpu``,
    ``nvidia-gpu``, ``gcp-tpu``, ``aws-neuron``); ``recommendation`` is the
    compatibility matrix's verdict for this platform and torch version.

    Return the chosen backend (one of ``candidates``), or ``(backend, reason)`` with
    the sentence a user reads, or None to defer. Any other answer disables the
    plugin with a warning, and the next one is asked. Stops at the first valid result.
    The built-in default is ``trylast``, so
    a site policy plugin is asked before it.
    """


@hookspec
def accelport_compat_rows() -> Sequence[Mapping[str, Any]] | None:
    """Return extra compatibility-matrix rows (same schema as ``compat_matrix/*.toml``).

    A third-party backend uses this to bring its own support data, so
    selection and ``accelport matrix`` know about it. Each row is a mapping
    with its own ``platform`` and ``as_of`` (there is no file to inherit them
    from); ``sources`` may cite shipped source ids or give ``{title, url}``.
    Collect-all; each result is validated like the shipped data. An invalid
    row, or one overlapping an existing row, makes that plugin's rows ignored
    with one PluginWarning naming the plugin and the key: plugins add rows,
    ``ACCELPORT_COMPAT_MATRIX`` overrides them (see ``docs/compat-matrix.md``).
    """


@hookspec
def accelport_doctor_checks(context: DoctorContext) -> Sequence[Finding | Mapping[str, str]] | None:
    """Return findings for ``accelport doctor``.

    ``context`` gives read-only facts already gathered (platform, installed
    package versions, environment, probes). Return a list of findings
    (:class:`accelport.doctor.finding.Finding`, or dicts with ``severity``, ``title``, ``fix``).
    Collect-all. Must never import a vendor runtime
    or touch a device: a training job may hold it.
    """


@hookspec
def accelport_register_rules(register: Callable[[type[Any]], None]) -> None:
    """Register the diagnosis rules this plugin ships.

    Call ``register(RuleClass)`` once per rule: a subclass of :class:`accelport.Rule` with its
    own ``kind`` (lower-case words joined by '-'). Every plugin's implementation is called
    (collect-all); the return value is ignored. A kind that is already registered is skipped
    with a PluginWarning: to replace a built-in kind, disable the built-in rules with
    ``ACCELPORT_DISABLED_PLUGINS=diagnostics``. The rules run on every run's step records and
    report like the built-in kinds (a warning, ``ap.diagnostics()``, ``accelport diagnose``'s
    summary and ``--output``, the metrics file and the report page); see docs/plugins.md.
    """


@hookspec
def accelport_step_end(record: StepRecord, diagnoses: Sequence[Any]) -> None:
    """Observe one finished training step.

    Called once for every ``ap.optimizer_step()`` (and every optimizer step a script
    under ``accelport diagnose`` takes), in order, with a
    :class:`accelport.contract.StepRecord`: the step number, its wall time,
    the time spent waiting for data, the batch signature and the change in the
    backend's counters; and ``diagnoses``, the findings the rules made on this record
    (:class:`accelport.Diagnosis` items; usually none), after the rules judged it.
    In quiet stretches the counters are read once per 16
    steps and those steps' records arrive together, up to 15 steps late, the
    change on the last of them (``record.counted_steps`` says how many steps a
    record's counters cover; see StepRecord). An implementation may take ``record``
    alone. Collect-all; keep it cheap. The metrics file (``ACCELPORT_METRICS_FILE``)
    is an implementation of this hook.
    """
