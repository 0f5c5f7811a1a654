"""A plugin that exits, hangs, prints or answers nonsense never takes a command or a run down with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BACKEND = textwrap.dedent("""
    import sys, time
    import accelport as ap
    from accelport.eager import EagerBackend

    class Mine(EagerBackend):
        name = "mine"
        platform = "cpu"
        device_type = "cpu"
        dist_backend = "gloo"
        def _probe(self):
            {probe}

    @ap.hookimpl
    def accelport_register_backends(register):
        register(Mine)
""")


def _site(tmp_path: Path, source: str, name: str = "hostile") -> Path:
    """A real (temporary) distribution whose `accelport` entry point is module `name`."""
    site = tmp_path / "site"
    info = site / "hostile_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[accelport]\n{name} = {name}\n")
    (site / f"{name}.py").write_text(source)
    return site


def _run(site: Path, *args: str, timeout_s: str = "2") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "ACCELPORT_PLUGIN_TIMEOUT": timeout_s}
    # The subprocess timeout guards against the hang under test; it measures nothing.
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def _doctor(site: Path) -> dict:  # type: ignore[type-arg]
    out = _run(site, "-m", "accelport", "doctor", "--json")
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _failed(report: dict) -> dict[str, str]:  # type: ignore[type-arg]
    return {p["name"]: p["error"] for p in report["plugins"] if p.get("failed")}


@pytest.mark.parametrize("where,source", [
    ("import", "raise SystemExit(0)\n"),
    ("probe", BACKEND.format(probe="raise SystemExit(0)")),
    ("select", "import accelport as ap\n@ap.hookimpl\ndef accelport_select_backend(candidates, platform, "
               "recommendation):\n    raise SystemExit(0)\n"),
    ("doctor check", "import accelport as ap\n@ap.hookimpl\ndef accelport_doctor_checks(context):\n"
                     "    raise SystemExit(0)\n"),
])
def test_a_plugin_that_exits_is_disabled_and_doctor_still_answers_in_json(tmp_path: Path, where: str,
                                                                         source: str) -> None:
    report = _doctor(_site(tmp_path, source))
    assert "SystemExit" in _failed(report).get("hostile", "") or any(
        "SystemExit" in b["reason"] for b in report["backends"] if b["name"] == "mine"), (where, report["plugins"])
    assert report["selected"]["name"] == "cpu"


@pytest.mark.parametrize("where,source", [
    ("import", "import time\ntime.sleep(600)\n"),
    ("probe", BACKEND.format(probe="time.sleep(600)")),
    ("select", "import time, accelport as ap\n@ap.hookimpl\ndef accelport_select_backend(candidates, platform, "
               "recommendation):\n    time.sleep(600)\n"),
    ("doctor check", "import time, accelport as ap\n@ap.hookimpl\ndef accelport_doctor_checks(context):\n"
                     "    time.sleep(600)\n"),
])
def test_a_plugin_that_hangs_is_disabled_after_the_time_limit(tmp_path: Path, where: str, source: str) -> None:
    site = _site(tmp_path, source)
    report = _doctor(site)
    errors = " ".join(_failed(report).values()) + " ".join(b["reason"] for b in report["backends"])
    assert "did not return within 2 s" in errors, (where, report["plugins"])
    listing = _run(site, "-m", "accelport", "backends", "--json")
    assert json.loads(listing.stdout)["selected"]["name"] == "cpu"


def test_a_plugin_that_exits_in_a_step_observer_does_not_end_the_run(tmp_path: Path) -> None:
    site = _site(tmp_path, "import accelport as ap\n@ap.hookimpl\ndef accelport_step_end(record):\n"
                           "    raise SystemExit(0)\n")
    script = tmp_path / "train.py"
    script.write_text("import torch, accelport as ap\nm = torch.nn.Linear(2, 1)\n"
                      "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for x in ap.loader([torch.randn(4, 2) for _ in range(5)]):\n"
                      "    m(x).sum().backward(); ap.optimizer_step(opt); opt.zero_grad()\n"
                      "print('finished', ap.metrics().steps)\n")
    out = _run(site, str(script))
    assert out.returncode == 0 and "finished 5" in out.stdout, out.stderr[-2000:]
    assert "plugin 'hostile' was disabled" in out.stderr and "SystemExit" in out.stderr


@pytest.mark.parametrize("answer", ["None", "'yes'"])
def test_a_probe_that_answers_no_probe_makes_its_backend_unavailable(tmp_path: Path, answer: str) -> None:
    report = _doctor(_site(tmp_path, BACKEND.format(probe=f"return {answer}")))
    (mine,) = [b for b in report["backends"] if b["name"] == "mine"]
    assert not mine["available"] and "not an accelport.Probe" in mine["reason"]


def test_a_backend_whose_class_attributes_are_wrong_is_skipped_with_the_reason(tmp_path: Path) -> None:
    source = BACKEND.format(probe="return ap.Probe(True, 'ok')").replace(
        'name = "mine"', 'name = "mine"\n    lazy = property(lambda self: 1 / 0)')
    report = _doctor(_site(tmp_path, source))
    assert "mine" not in [b["name"] for b in report["backends"]]
    assert any("Mine.lazy is" in f["title"] for f in report["findings"]), report["findings"]


def test_a_backend_name_that_cannot_be_selected_is_refused_with_the_spelling_to_use(tmp_path: Path) -> None:
    source = BACKEND.format(probe="return ap.Probe(True, 'ok')").replace('name = "mine"', 'name = "MyChip"')
    report = _doctor(_site(tmp_path, source))
    assert any("'MyChip' cannot be selected" in f["title"] and "'mychip'" in f["title"] for f in report["findings"])


def test_a_plugin_that_prints_leaves_json_output_valid(tmp_path: Path) -> None:
    site = _site(tmp_path, "import os\nprint('hello from a plugin')\nos.write(1, b'and from C code\\n')\n")
    for args in (("doctor", "--json"), ("backends", "--json"), ("matrix", "--json")):
        out = _run(site, "-m", "accelport", *args)
        json.loads(out.stdout)
        assert "hello from a plugin" in out.stderr and "and from C code" in out.stderr


def test_matrix_rows_with_absurd_torch_versions_are_refused_at_once(tmp_path: Path) -> None:
    rows = tmp_path / "rows.toml"
    rows.write_text('[[rows]]\nplatform = "cpu"\nbackend = "x"\ntorch = ["2.0", "2.999"]\n'
                    'status = "supported"\nmessage = "m"\nsources = [{ title = "t", url = "https://e.org/" }]\n')
    out = subprocess.run([sys.executable, "-m", "accelport", "matrix", "--json"], capture_output=True, text=True,
                         env={**os.environ, "ACCELPORT_COMPAT_MATRIX": str(rows)}, timeout=120)
    assert out.returncode == 1 and "is not a torch version" in json.loads(out.stdout)["error"]
