"""The compatibility matrix: which backend to use on a platform with a torch version, and why.

- :mod:`.schema`: the row types and the checks every row passes (``docs/compat-matrix.md``);
- :mod:`.load`: shipped TOML, plugin rows and ``ACCELPORT_COMPAT_MATRIX`` files, merged;
- :mod:`.verdict`: a :class:`Verdict` for a platform, torch version and chip;
- :mod:`.deprecations`: the warnings given when a deprecated path or setting is selected.

Nothing here imports torch: the installed version is read from package metadata.
"""

from accelport.compat.deprecations import deprecated_settings, deprecation_messages, target_platform, warn_deprecations
from accelport.compat.load import Matrix, build
from accelport.compat.schema import STATUSES, parse_torch_version
from accelport.compat.verdict import BackendStatus, Combination, Verdict, default_matrix, recommend

__all__ = [
    "STATUSES",
    "BackendStatus",
    "Combination",
    "Matrix",
    "Verdict",
    "build",
    "default_matrix",
    "deprecated_settings",
    "deprecation_messages",
    "parse_torch_version",
    "recommend",
    "target_platform",
    "warn_deprecations",
]
