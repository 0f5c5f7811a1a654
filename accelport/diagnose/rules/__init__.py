"""The built-in kinds of finding, one rule per module, registered as a plugin (name ``diagnostics``).

They are registered through ``accelport_register_rules``, exactly as a third party's
rules are (see docs/plugins.md), so ``ACCELPORT_DISABLED_PLUGINS=diagnostics`` turns
them all off and leaves any other plugin's rules running; ``ACCELPORT_DIAGNOSTICS=0``
turns diagnosis off altogether. A new built-in kind is one module here and one line in
:data:`BUILTIN_RULES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from accelport.diagnose.rule import Diagnosis, Rule, describe_shape_change
from accelport.diagnose.rules.compile_limit import CompileLimitRule, CompileLimitWarning
from accelport.diagnose.rules.cpu_fallback import CpuFallbackRule, CpuFallbackWarning
from accelport.diagnose.rules.deprecated_config import DeprecatedConfigRule, DeprecatedConfigWarning
from accelport.diagnose.rules.graph_break import GraphBreakRule, GraphBreakWarning
from accelport.diagnose.rules.graph_growth import GraphGrowthRule, GraphGrowthWarning
from accelport.diagnose.rules.host_sync import HostSyncRule, HostSyncWarning
from accelport.diagnose.rules.input_bound import InputBoundRule, InputBoundWarning
from accelport.diagnose.rules.memory_growth import MemoryGrowthRule, MemoryGrowthWarning
from accelport.diagnose.rules.non_finite import NonFiniteRule, NonFiniteWarning
from accelport.diagnose.rules.out_of_memory import OutOfMemoryRule, OutOfMemoryWarning
from accelport.diagnose.rules.precision import PrecisionRule, PrecisionWarning
from accelport.diagnose.rules.recompilation import RecompilationRule, RecompilationWarning
from accelport.errors import DiagnosticWarning
from accelport.plugins.hookspecs import hookimpl

__all__ = [
    "BUILTIN_RULES",
    "KINDS",
    "PROBLEMS",
    "Diagnosis",
    "describe_shape_change",
    "RecompilationWarning",
    "HostSyncWarning",
    "InputBoundWarning",
    "GraphGrowthWarning",
    "CpuFallbackWarning",
    "DeprecatedConfigWarning",
    "CompileLimitWarning",
    "GraphBreakWarning",
    "NonFiniteWarning",
    "PrecisionWarning",
    "MemoryGrowthWarning",
    "OutOfMemoryWarning",
]

#: The built-in rules, in the order they judge a step (a finding made on the same record as
#: another comes after the ones before it here).
BUILTIN_RULES: tuple[type[Rule], ...] = (
    DeprecatedConfigRule,
    RecompilationRule,
    HostSyncRule,
    InputBoundRule,
    CompileLimitRule,
    NonFiniteRule,
    PrecisionRule,
    GraphBreakRule,
    GraphGrowthRule,
    CpuFallbackRule,
    MemoryGrowthRule,
    OutOfMemoryRule,
)

#: Each built-in kind and its warning category.
KINDS: Mapping[str, type[DiagnosticWarning]] = {rule.kind: rule.warning for rule in BUILTIN_RULES}
#: The built-in kinds that are always a problem (the run is wrong or crippled, not only slower);
#: graph-growth is one too where the loop never syncs (see ``Rule.severity_of``).
PROBLEMS = frozenset(rule.kind for rule in BUILTIN_RULES if rule.severity == "problem")


@hookimpl
def accelport_register_rules(register: Callable[[type[Rule]], None]) -> None:
    for rule in BUILTIN_RULES:
        register(rule)
