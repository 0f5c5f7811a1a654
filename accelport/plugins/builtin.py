"""The plugins accelport ships, loaded through the same path as third-party entry points."""

from __future__ import annotations

__all__ = ["BUILTIN_PLUGINS", "ENTRY_POINT_GROUP"]

#: The entry-point group third-party plugins register under (``[project.entry-points.accelport]``).
ENTRY_POINT_GROUP = "accelport"

#: Built-in plugins: (name, "module" or "module:factory"), loaded like entry points
#: (a factory is called for a fresh plugin object); disable any of them by name
#: with ACCELPORT_DISABLED_PLUGINS.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("cpu", "accelport._backends.cpu"),
    ("cuda", "accelport._backends.cuda"),
    ("xla", "accelport._backends.xla"),
    ("tpu", "accelport._backends.tpu"),
    ("neuron", "accelport._backends.neuron"),
    ("neuron-xla", "accelport._backends.neuron_xla"),
    ("default-selection", "accelport.runtime.selection"),
    ("diagnostics", "accelport.diagnose.rules"),
    ("metrics-file", "accelport.diagnose.metrics_log:create_plugin"),
    ("launch-heartbeat", "accelport.launch.heartbeat:create_plugin"),
)
