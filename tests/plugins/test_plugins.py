"""The plugin system: built-ins and entry points through one path, isolation of broken plugins."""

from __future__ import annotations

import warnings

import pytest

import accelport as ap
from accelport.plugins.host import BUILTIN_PLUGINS, create_manager
from accelport.runtime.state import RUNTIME
from tests.conftest import builtin_backends

# The built-in backends, in registration order (a new built-in must not break these tests).

THIRD_PARTY_BACKEND = '''
import accelport as ap
from accelport.eager import EagerBackend
from accelport.contract import Probe

class MyCpu(EagerBackend):
    name = "mycpu"
    platform = "cpu"
    device_type = "cpu"
    def _probe(self):
        return Probe(True, "always here", 1)

@ap.hookimpl
def accelport_register_backends(register):
    register(MyCpu)
'''


def test_builtins_are_registered_under_their_names() -> None:
    host = create_manager({})
    for name, module in BUILTIN_PLUGINS:
        assert host.plugins[name].module == module
        assert host.plugins[name].builtin
    assert host.backend_plugin["cpu"] == "cpu"
    assert host.failed == []


def test_third_party_backend_via_entry_point_is_listed_and_usable(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin("mycpu", "my_accel_plugin", THIRD_PARTY_BACKEND, dist="my-accel")
    names = [b.name for b in ap.backends()]
    assert names[:2] == ["cpu", "cuda"] and "mycpu" in names
    info = RUNTIME.host().plugins["mycpu"]
    assert info.distribution == "my-accel" and info.version == "1.0" and not info.builtin
    assert info.hooks == ("accelport_register_backends",)
    assert ap.use("mycpu").name == "mycpu"
    assert ap.device().type == "cpu"


def test_disable_autoload_skips_entry_points(install_plugin, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    install_plugin("mycpu", "my_accel_plugin2", THIRD_PARTY_BACKEND)
    monkeypatch.setenv("ACCELPORT_DISABLE_PLUGIN_AUTOLOAD", "1")
    RUNTIME.reset()
    assert "mycpu" not in [b.name for b in ap.backends()]
    with pytest.raises(ap.UnknownBackendError):
        ap.use("mycpu")


def test_disabled_plugins_by_name(install_plugin, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    install_plugin("mycpu", "my_accel_plugin3", THIRD_PARTY_BACKEND)
    monkeypatch.setenv("ACCELPORT_DISABLED_PLUGINS", "mycpu, cuda")
    RUNTIME.reset()
    names = [b.name for b in ap.backends()]
    assert names == [n for n in builtin_backends() if n != "cuda"]
    assert set(RUNTIME.host().disabled) == {"mycpu", "cuda"}


def test_plugin_that_fails_to_import_is_disabled_with_one_warning(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin("broken", "no_such_module_for_accelport", None, dist="broken-dist")
    with pytest.warns(ap.PluginWarning, match=r"plugin 'broken' was disabled: import failed") as rec:
        host = create_manager({})
    assert len([w for w in rec if issubclass(w.category, ap.PluginWarning)]) == 1
    assert [f.name for f in host.failed] == ["broken"]
    assert "cpu" in host.backends  # the rest works


def test_plugin_raising_in_register_hook_is_disabled(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(
        "raiser", "raising_plugin",
        "import accelport as ap\n"
        "@ap.hookimpl\n"
        "def accelport_register_backends(register):\n"
        "    raise RuntimeError('boom in register')\n",
    )
    with pytest.warns(ap.PluginWarning, match="raiser.*boom in register"):
        infos = ap.backends()
    assert [i.name for i in infos] == builtin_backends()
    assert "raiser" not in RUNTIME.host().plugins


def test_plugin_raising_in_step_end_is_disabled_and_training_continues(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(
        "observer", "raising_observer",
        "import accelport as ap\n"
        "calls = []\n"
        "@ap.hookimpl\n"
        "def accelport_step_end(record):\n"
        "    calls.append(record.step)\n"
        "    raise ValueError('observer bug')\n",
    )
    from tests.conftest import train_tiny

    with pytest.warns(ap.PluginWarning, match="observer.*accelport_step_end.*observer bug"):
        losses = train_tiny(steps=5)
    import sys

    assert sys.modules["raising_observer"].calls == [1]  # called once, then disabled
    assert len(losses) == 5 and ap.metrics().steps == 5


def test_plugin_implementing_an_unknown_hook_is_disabled(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(
        "typo", "typo_plugin",
        "import accelport as ap\n"
        "@ap.hookimpl\n"
        "def accelport_register_backend(register):\n"  # missing "s"
        "    pass\n",
    )
    with pytest.warns(ap.PluginWarning, match="typo.*unknown hook"):
        ap.backends()
    assert "typo" in [f.name for f in RUNTIME.host().failed]


@pytest.mark.parametrize(
    "body, problem",
    [
        ("class NotABackend: name = 'x'\n", "not a subclass"),
        ("from accelport.eager import EagerBackend\n"
         "class Bad(EagerBackend):\n    name = 'bad'\n    platform = 'mars'\n    device_type = 'cpu'\n"
         "    def _probe(self): pass\n", "platform is 'mars'"),
        ("from accelport.eager import EagerBackend\n"
         "class Dup(EagerBackend):\n    name = 'cpu'\n    platform = 'cpu'\n    device_type = 'cpu'\n"
         "    def _probe(self): pass\n", "already registered by plugin 'cpu'"),
    ],
)
def test_invalid_backend_classes_are_skipped_with_a_reason(install_plugin, body: str, problem: str) -> None:  # type: ignore[no-untyped-def]
    cls = body.split("class ")[1].split("(")[0].split(":")[0]
    install_plugin(
        "badbackend", f"bad_backend_{abs(hash(body))}",
        "import accelport as ap\n" + body +
        f"@ap.hookimpl\ndef accelport_register_backends(register):\n    register({cls})\n",
    )
    with pytest.warns(ap.PluginWarning, match=problem):
        infos = ap.backends()
    assert [i.name for i in infos] == builtin_backends()
    assert ap.backend().name == "cpu"


def test_probe_that_raises_becomes_an_unavailable_reason(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin(
        "flaky", "flaky_probe",
        "import accelport as ap\n"
        "from accelport.eager import EagerBackend\n"
        "class Flaky(EagerBackend):\n"
        "    name = 'flaky'\n    platform = 'cpu'\n    device_type = 'cpu'\n"
        "    def _probe(self):\n        raise OSError('sysfs exploded')\n"
        "@ap.hookimpl\ndef accelport_register_backends(register):\n    register(Flaky)\n",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: a failing probe is a reason, not a plugin failure
        info = {i.name: i for i in ap.backends()}["flaky"]
    assert not info.available
    assert info.reason == "probe failed: OSError: sysfs exploded"
    with pytest.raises(ap.BackendUnavailableError, match="sysfs exploded"):
        ap.use("flaky")


def test_collect_all_hooks_gather_every_plugin_and_isolate_failures(install_plugin) -> None:  # type: ignore[no-untyped-def]
    # accelport_compat_rows and accelport_doctor_checks are collect-all hooks: every
    # plugin's results come back, and one plugin raising does not lose the others'.
    install_plugin(
        "rows", "rows_plugin",
        "import accelport as ap\n"
        "@ap.hookimpl\n"
        "def accelport_compat_rows():\n"
        "    return [{'backend': 'mycpu', 'platform': 'cpu'}]\n"
        "@ap.hookimpl\n"
        "def accelport_doctor_checks(context):\n"
        "    return [('note', context.extra['who'])]\n",
    )
    from accelport.doctor.finding import DoctorContext
    from accelport.platform import detect

    def context(**extra: str) -> DoctorContext:
        return DoctorContext(environ={}, platform=detect(), packages={}, probes={}, backends={}, selected=None,
                             selection_reason="", cpu_count=1, extra=dict(extra))

    host = RUNTIME.host()
    assert [{"backend": "mycpu", "platform": "cpu"}] in host.call("accelport_compat_rows")
    # Built-in plugins may add their own findings; this plugin's result is among them.
    assert [("note", "doctor")] in host.call("accelport_doctor_checks", context=context(who="doctor"))
    with pytest.warns(ap.PluginWarning, match="rows.*accelport_doctor_checks.*KeyError") as caught:
        assert [("note", "doctor")] not in host.call("accelport_doctor_checks", context=context())
    assert [str(w.message).split("'")[1] for w in caught if issubclass(w.category, ap.PluginWarning)] == ["rows"]
    assert "rows" not in host.plugins
