"""Build the plugin manager: built-ins and entry points through one code path.

Like tox 4's manager: block what the user disabled, load, register, then
``check_pending()``. Unlike a bare pluggy manager, a plugin that fails to
import, to register, or raises inside a hook is disabled with one
:class:`~accelport.errors.PluginWarning` naming it, and the others keep working.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from accelport.contract import Backend, Probe
from accelport.errors import PluginWarning
from accelport.platform import PLATFORMS
from accelport.plugins import hookspecs
from accelport.plugins.builtin import BUILTIN_PLUGINS, ENTRY_POINT_GROUP
from accelport.settings import is_off, is_true

if TYPE_CHECKING:
    from accelport.compat.verdict import Verdict

__all__ = ["BUILTIN_PLUGINS", "ENTRY_POINT_GROUP", "PluginHost", "FailedPlugin", "create_manager"]

@dataclass(frozen=True)
class PluginInfo:
    name: str
    module: str
    distribution: str | None
    version: str | None
    builtin: bool
    hooks: tuple[str, ...]


@dataclass(frozen=True)
class FailedPlugin:
    name: str
    stage: str  # "import", "register", "hook <name>", "backend"
    error: str


def disabled_names(env: Mapping[str, str]) -> set[str]:
    """The plugins the environment turns off: ``ACCELPORT_DISABLED_PLUGINS``, and diagnostics when it is off."""
    raw = env.get("ACCELPORT_DISABLED_PLUGINS", "")
    names = {part.strip() for part in raw.split(",") if part.strip()}
    diagnostics = env.get("ACCELPORT_DIAGNOSTICS")
    if diagnostics is not None and is_off(diagnostics) and diagnostics.strip():
        names.add("diagnostics")
    return names


def _load_builtin(spec: str, environ: Mapping[str, str]) -> Any:
    """A built-in plugin: the module itself, or what its factory makes for this host's environment."""
    module, _, factory = spec.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, factory)(environ) if factory else obj


class PluginTimeout(Exception):
    """A plugin call did not return within the host's time limit."""


#: Backend names as ACCELPORT_BACKEND, ap.use() and the matrix spell them.
_BACKEND_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


class PluginHost:
    """A pluggy manager plus accelport's bookkeeping: what loaded, what failed, which backends.

    Every call into a plugin goes through :meth:`isolated`: whatever it raises (``SystemExit``
    included; only Ctrl-C passes) disables that plugin, and with ``timeout`` (seconds; the CLI
    sets one) a call that does not return in time disables it too, so ``accelport doctor`` and
    ``accelport backends`` always finish.
    """

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.failed: list[FailedPlugin] = []
        self.disabled: list[str] = []
        self.backends: dict[str, Backend] = {}
        self.backend_plugin: dict[str, str] = {}
        self._rules: list[tuple[str, Any]] | None = None
        # accelport_step_end's implementations: (plugin, function, whether it takes the diagnoses).
        self._step_end: list[tuple[str, Callable[..., Any], bool]] | None = None

    # -- isolation -------------------------------------------------------------------------
    def isolated(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; raises what it raised, or PluginTimeout when the host's limit passes first."""
        if self.timeout is None:
            return fn(*args)
        box: list[Any] = []

        def call() -> None:
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # handed to the caller's thread below
                box.append((False, exc))

        # A daemon thread: a plugin stuck forever cannot keep the process from exiting.
        worker = threading.Thread(target=call, name="accelport-plugin-call", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if not box:
            raise PluginTimeout(f"did not return within {self.timeout:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _guard(self, name: str, stage: str, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
        """(True, result) or, when the plugin failed (and was disabled), (False, None)."""
        try:
            return True, self.isolated(fn, *args)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit from a plugin must not end the caller's program
            self._fail(name, stage, exc)
            return False, None

    def probe(self, name: str) -> Probe:
        """Backend ``name``'s probe, isolated and bounded like every plugin call."""
        backend = self.backends[name]
        ok, found = self._guard(self.backend_plugin.get(name, name), "probe", backend.probe)
        if not ok:
            return Probe(False, f"its plugin was disabled: the probe {self.failed[-1].error}")
        return found

    # -- loading -------------------------------------------------------------------------
    def load(self, name: str, loader: Callable[[], Any], *, module: str, dist: Any = None,
             builtin: bool) -> None:
        ok, obj = self._guard(name, "import", loader)
        if not ok:
            return
        try:
            self.pm.register(obj, name=name)
        except Exception as exc:
            self._fail(name, "register", exc)
            return
        hooks = tuple(sorted(c.name for c in self.pm.get_hookcallers(obj) or ()))
        self.plugins[name] = PluginInfo(
            name=name,
            module=module,
            distribution=getattr(dist, "name", None) if dist is not None else None,
            version=getattr(dist, "version", None) if dist is not None else None,
            builtin=builtin,
            hooks=hooks,
        )

    def check_pending(self) -> None:
        """Disable every plugin that implements a hook accelport does not define."""
        for _ in range(len(self.plugins) + 1):
            try:
                self.pm.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                name = self.pm.get_name(exc.plugin) if exc.plugin is not None else None
                if name is None:
                    raise
                self._fail(name, "register", exc)

    def _fail(self, name: str, stage: str, exc: BaseException) -> None:
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin)
        self.plugins.pop(name, None)
        for backend, owner in list(self.backend_plugin.items()):
            if owner == name:
                del self.backend_plugin[backend]
                self.backends.pop(backend, None)
        if self._rules is not None:
            self._rules = [(owner, rule) for owner, rule in self._rules if owner != name]
        self._step_end = None
        message = f"{type(exc).__name__}: {exc}"
        self.failed.append(FailedPlugin(name, stage, message))
        warnings.warn(
            f"accelport plugin {name!r} was disabled: {stage} failed with {message}. "
            f"The other plugins keep working; set ACCELPORT_DISABLED_PLUGINS={name} to silence this.",
            PluginWarning,
            stacklevel=3,
        )

    def note_failure(self, name: str, stage: str, error: str) -> None:
        """Record that plugin ``name`` gave something unusable at ``stage``, without disabling it."""
        self.failed.append(FailedPlugin(name, stage, error))

    # -- calling hooks -------------------------------------------------------------------
    def _impls(self, hook: str) -> list[Any]:
        caller = getattr(self.pm.hook, hook)
        return [i for i in caller.get_hookimpls() if not (i.hookwrapper or i.wrapper)]

    def _results(self, impls: Any, hook: str, kwargs: dict[str, Any]) -> Any:
        """(plugin, result) for each implementation's non-None result; a raising plugin is disabled."""
        for impl in impls:
            if self.pm.get_plugin(impl.plugin_name) is None:
                continue  # disabled while this hook was being called (e.g. it timed out)
            ok, result = self._guard(impl.plugin_name, f"hook {hook}", impl.function,
                                     *(kwargs[a] for a in impl.argnames))
            if ok and result is not None:
                yield impl.plugin_name, result

    def call_each(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation (registration order), isolating failures: (plugin, result) pairs."""
        return list(self._results(self._impls(hook), hook, kwargs))

    def call(self, hook: str, **kwargs: Any) -> list[Any]:
        """Call every implementation, isolating failures; the non-None results."""
        return [result for _, result in self.call_each(hook, **kwargs)]

    def call_first(self, hook: str, **kwargs: Any) -> Any:
        """Call implementations in pluggy's order (tryfirst .. trylast); first non-None wins."""
        first = next(self._results(reversed(self._impls(hook)), hook, kwargs), None)
        return first[1] if first is not None else None

    def select_backend(self, candidates: Sequence[Backend], platform: str,
                       recommendation: Verdict) -> tuple[Backend, str] | None:
        """``accelport_select_backend`` in pluggy's order, each answer checked: the first valid one wins.

        A plugin may answer a candidate or ``(candidate, reason)``; any other answer
        (a backend that is not a candidate, a 3-tuple, a string) disables that plugin
        with a PluginWarning saying what it returned, and the next plugin is asked.
        """
        kwargs = {"candidates": candidates, "platform": platform, "recommendation": recommendation}
        for plugin, answer in self._results(reversed(self._impls("accelport_select_backend")),
                                            "accelport_select_backend", kwargs):
            backend, reason = answer if isinstance(answer, tuple) and len(answer) == 2 else (answer, "")
            if isinstance(backend, Backend) and any(backend is c for c in candidates) and isinstance(reason, str):
                return backend, reason
            names = ", ".join(c.name for c in candidates) or "none"
            self._fail(plugin, "hook accelport_select_backend", TypeError(
                f"returned {_describe(answer)}; expected one of the candidates ({names}), "
                "a (candidate, reason) pair, or None"))
        return None

    def _step_observers(self) -> list[tuple[str, Callable[..., Any], bool]]:
        if self._step_end is None:
            self._step_end = [(i.plugin_name, i.function, "diagnoses" in i.argnames)
                              for i in self._impls("accelport_step_end")]
        return self._step_end

    def step_end(self, record: Any, diagnoses: Sequence[Any] = ()) -> None:
        """The hot-path hook: a cached list of implementations, each isolated."""
        for name, function, takes_diagnoses in self._step_end or self._step_observers():
            try:
                # The hot path: no thread, no time limit; an implementation may take the record alone.
                if takes_diagnoses:
                    function(record, diagnoses)
                else:
                    function(record)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit from an observer must not end the training run
                self._fail(name, "hook accelport_step_end", exc)

    @property
    def has_step_observers(self) -> bool:
        return bool(self._step_observers())

    # -- rules -----------------------------------------------------------------------------
    def registered_rules(self) -> list[tuple[str, Any]]:
        """(plugin, rule class) for every ``register()`` call of ``accelport_register_rules``, in plugin order.

        Collected once per host; the classes are checked by whoever runs them
        (:func:`accelport.diagnose.engine.usable_rules`), which says why one is refused.
        """
        if self._rules is None:
            found: list[tuple[str, Any]] = []
            for impl in self._impls("accelport_register_rules"):
                given: list[Any] = []
                ok, _ = self._guard(impl.plugin_name, "hook accelport_register_rules", impl.function,
                                    *([given.append] if impl.argnames else []))
                if ok:  # a plugin that raised half-way gives no rule at all
                    found += [(impl.plugin_name, rule) for rule in given]
            self._rules = found
        return list(self._rules)

    def refuse(self, plugin: str, problem: str, where: tuple[str, int, str] | None = None) -> None:
        """Plugin ``plugin`` gave something unusable (``problem``): one PluginWarning, and doctor lists it.

        ``where``: the file, line and module of what was refused (a rule class), which the warning
        points at: the plugin's own code, not accelport's.
        """
        message = f"accelport plugin {plugin!r}: {problem}"
        if where is None:
            warnings.warn(message, PluginWarning, stacklevel=3)
        else:
            filename, line, name = where
            module = sys.modules.get(name)
            scope = vars(module) if module is not None else None
            # That module's registry, as warnings.warn would keep it: the "default" action says it once there.
            registry = scope.setdefault("__warningregistry__", {}) if scope is not None else None
            warnings.warn_explicit(message, PluginWarning, filename, line, module=name, registry=registry,
                                   module_globals=scope)
        self.failed.append(FailedPlugin(plugin, "rule", problem))

    # -- backends ------------------------------------------------------------------------
    def collect_backends(self) -> None:
        for impl in self._impls("accelport_register_backends"):
            plugin = impl.plugin_name

            def register(cls: type[Backend], _plugin: str = plugin) -> None:
                self._register_backend(_plugin, cls)

            self._guard(plugin, "hook accelport_register_backends", impl.function,
                        *([register] if impl.argnames else []))

    def _register_backend(self, plugin: str, cls: type[Backend]) -> None:
        try:
            problem = _class_problem(cls)
        except Exception as exc:  # a raising property on the class
            problem = f"reading its class attributes raised {type(exc).__name__}: {exc}"
        if problem is None and cls.name in self.backends:
            problem = (f"backend name {cls.name!r} is already registered by plugin "
                       f"{self.backend_plugin[cls.name]!r}; disable that plugin to replace it")
        if problem:
            warnings.warn(f"accelport plugin {plugin!r}: backend skipped: {problem}", PluginWarning,
                          stacklevel=4)
            self.failed.append(FailedPlugin(plugin, "backend", problem))
            return
        ok, backend = self._guard(plugin, "backend", cls)
        if not ok:
            return
        self.backends[cls.name] = backend
        self.backend_plugin[cls.name] = plugin


def _class_problem(cls: Any) -> str | None:
    """What makes ``cls`` unusable as a backend, or None."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        return f"{cls!r} is not a subclass of accelport.contract.Backend"
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        return f"{cls.__name__} has no string 'name'"
    if not _BACKEND_NAME.match(name):
        fixed = re.sub(r"[^a-z0-9_.-]", "-", name.lower())
        return (f"backend name {name!r} cannot be selected: use lower-case letters, digits, '-', '_' and '.' "
                f"(ACCELPORT_BACKEND and the matrix spell names that way), e.g. {fixed!r}")
    if getattr(cls, "platform", None) not in PLATFORMS:
        return f"{cls.__name__}.platform is {getattr(cls, 'platform', None)!r}; expected one of {', '.join(PLATFORMS)}"
    for attr, kind in (("lazy", bool), ("description", str)):
        if not isinstance(getattr(cls, attr), kind):
            return f"{cls.__name__}.{attr} is {getattr(cls, attr)!r}; expected a {kind.__name__}"
    return None


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _entry_points() -> list[tuple[Any, Any]]:
    """(distribution, entry point) for the accelport group, each distribution once (pluggy's way)."""
    seen: set[str] = set()
    found = []
    for dist in md.distributions():
        dist_name = getattr(dist, "name", None)
        key = (dist_name or "").lower()
        if key and key in seen:
            continue
        seen.add(key)
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP:
                found.append((dist, ep))
    return found


def create_manager(environ: Mapping[str, str] | None = None, *, timeout: float | None = None) -> PluginHost:
    """Build a fresh plugin host: built-ins, then third-party entry points, then backends.

    ``ACCELPORT_DISABLED_PLUGINS=a,b`` skips plugins by name (built-in or third
    party); ``ACCELPORT_DISABLE_PLUGIN_AUTOLOAD=1`` loads no entry points.
    ``environ`` is handed to the built-in plugins' factories; ``timeout`` bounds every
    plugin call (see :class:`PluginHost`).
    """
    env = os.environ if environ is None else environ
    host = PluginHost(timeout)
    disabled = disabled_names(env)
    for name, module in BUILTIN_PLUGINS:
        if name in disabled:
            host.disabled.append(name)
            continue
        host.load(name, functools.partial(_load_builtin, module, env), module=module, builtin=True)
    if not is_true(env.get("ACCELPORT_DISABLE_PLUGIN_AUTOLOAD")):
        try:
            entry_points = _entry_points()
        except Exception as exc:  # broken metadata on disk
            warnings.warn(f"accelport could not read entry points: {exc}", PluginWarning, stacklevel=2)
            entry_points = []
        for dist, ep in entry_points:
            if ep.name in disabled:
                host.disabled.append(ep.name)
                continue
            if ep.name in host.plugins:
                warnings.warn(
                    f"accelport plugin {ep.name!r} from {getattr(dist, 'name', '?')} skipped: "
                    "a plugin of that name is already loaded", PluginWarning, stacklevel=2)
                continue
            host.load(ep.name, ep.load, module=ep.value, dist=dist, builtin=False)
    host.check_pending()
    host.collect_backends()
    return host
