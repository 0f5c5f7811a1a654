"""``deprecated-config``: a deprecated setting (an environment variable) is in effect for this run."""

from __future__ import annotations

from accelport.contract import StepRecord
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

__all__ = ["DeprecatedConfigRule", "DeprecatedConfigWarning"]


class DeprecatedConfigWarning(DiagnosticWarning):
    """A deprecated setting is in effect."""


class DeprecatedConfigRule(Rule):
    """Looked at once, on a run's first record: the settings that apply to the backend in use."""

    kind = "deprecated-config"
    warning = DeprecatedConfigWarning

    def start(self) -> None:
        self._looked = False

    def step(self, record: StepRecord) -> None:
        if self._looked:
            return
        self._looked = True
        from accelport.compat.deprecations import deprecated_settings

        found = deprecated_settings(self.run.environ, backend=record.backend, in_effect_only=True)
        if found:
            self.report(" ".join(message for _, message in found), record.step,
                        settings=[name for name, _ in found])
