"""A rule plugin that exits, raises a BaseException or hangs is disabled, and the run goes on; a Ctrl-C still
ends it. Every rule is a real distribution with an ``accelport`` entry point (the ``install_plugin`` fixture
in-process, a ``PYTHONPATH`` folder for a subprocess), found by importlib.metadata as a pip-installed one is.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings
from typing import Any

import pytest

import accelport as ap
from accelport.runtime.state import RUNTIME
from tests.conftest import default_signals
from tests.plugins.test_rules import SCRIPT, TINY_BATCH, _ported_loop

#: A rule of kind KIND whose METHOD does BODY (at step 2, for ``step``).
HOSTILE = '''
import os, sys
import accelport as ap


class Boom(BaseException):
    """Not an Exception: what a careless plugin might raise."""


class Hostile(ap.Rule):
    kind = "KIND"

    def start(self):
        if "METHOD" == "start":
            BODY

    def step(self, record):
        if "METHOD" == "step" and record.step == 2:
            BODY

    def settle(self):
        if "METHOD" == "settle":
            BODY


@ap.hookimpl
def accelport_register_rules(register):
    register(Hostile)
'''

#: What each hostile body does, and how the failure line says it.
BODIES = {
    "exit": ("sys.exit(3)", "it called sys.exit(3)"),
    "system-exit": ("raise SystemExit", "it raised SystemExit"),
    "interrupt": ("raise KeyboardInterrupt", "its own code raised KeyboardInterrupt (not a Ctrl-C)"),
    "base-exception": ("raise Boom('kaboom')", "it raised Boom: kaboom"),
    "hang": ("while True: pass", "it did not return within 2 s"),
}


def _source(kind: str, method: str, body: str) -> str:
    return HOSTILE.replace("KIND", kind).replace("METHOD", method).replace("BODY", body)


def _install_site(site: pathlib.Path, module: str, name: str, source: str) -> None:
    """A module and its distribution's metadata in ``site``, as pip would install them."""
    info = site / f"{module}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[accelport]\n{name} = {module}\n")
    (site / f"{module}.py").write_text(source)


@pytest.mark.parametrize(("method", "what"), [
    ("step", "exit"), ("step", "system-exit"), ("step", "interrupt"), ("step", "base-exception"), ("step", "hang"),
    ("start", "exit"), ("settle", "hang"), ("settle", "interrupt"),
])
def test_a_rule_that_exits_raises_or_hangs_is_disabled_and_the_run_goes_on(
        install_plugin: Any, monkeypatch: pytest.MonkeyPatch, method: str, what: str) -> None:
    body, why = BODIES[what]
    install_plugin("hostile", "hostile_rule", _source("hostile", method, body), dist="hostile-rule")
    install_plugin("tiny-batch", "tiny_batch_rule", TINY_BATCH, dist="tiny-batch-rule")
    monkeypatch.setenv("ACCELPORT_PLUGIN_TIMEOUT", "2")  # the bound a hang is held to (also set: it is read)
    RUNTIME.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ported_loop(batch_size=2)  # returns: the loop is not ended by the rule
    step = {"step": 2, "start": 0, "settle": 12}[method]
    engine = RUNTIME.diagnostics()
    assert engine is not None
    assert engine.failures == [f"the hostile rule of plugin 'hostile' was disabled at step {step}: {why}; "
                               "hostile was not judged after it"]
    said = [str(w.message) for w in caught if issubclass(w.category, ap.PluginWarning)]
    assert said == [f"accelport plugin 'hostile': its hostile rule was disabled at step {step}: {why}. The other "
                    "rules keep working; set ACCELPORT_DISABLED_PLUGINS=hostile to silence this."]
    # The other rules judged every step, the one disabled is said to be unjudged.
    assert [d.kind for d in ap.diagnostics()] == ["tiny-batch"]
    assert engine.unjudged().get("hostile") == "its rule was disabled"


def _wait_for(path: pathlib.Path, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 300  # a hang guard only: the file is the event waited for
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the rule never started"
        time.sleep(0.05)


@pytest.mark.parametrize("handler", ["python's own", "the script's"])
def test_a_ctrl_c_while_a_rule_runs_still_ends_the_run(tmp_path: pathlib.Path, handler: str) -> None:
    site = tmp_path / "site"
    inside = tmp_path / "inside"
    _install_site(site, "hostile_rule", "hostile", _source(
        "hostile", "step", f"open({str(inside)!r}, 'w').close()\n            while True: pass"))
    script = tmp_path / "train.py"
    own = ("import signal\ndef stop(signum, frame):\n    raise KeyboardInterrupt\n"
           "signal.signal(signal.SIGINT, stop)\n") if handler == "the script's" else ""
    script.write_text(own + "import accelport as ap\n" + SCRIPT.replace(
        "for x, y in DataLoader(data, batch_size=2):", "for x, y in ap.loader(DataLoader(data, batch_size=2)):")
        .replace("    opt.step()", "    ap.optimizer_step(opt)"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "ACCELPORT_PLUGIN_TIMEOUT": "3600"}  # (the watchdog never steps in: the Ctrl-C is what ends it)
    with subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, preexec_fn=default_signals) as process:
        try:
            _wait_for(inside, process)
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=300)  # a hang guard
        finally:
            process.kill()
    assert process.returncode != 0 and "trained" not in out, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err
    assert "was disabled" not in err


def test_accelport_diagnose_names_each_disabled_rule_and_why(tmp_path: pathlib.Path) -> None:
    from tests.diagnose_cli.runs import child_env

    site = tmp_path / "site"
    _install_site(site, "tiny_batch_rule", "tiny-batch", TINY_BATCH)
    for what, (body, _) in BODIES.items():
        _install_site(site, f"hostile_{what.replace('-', '_')}", f"hostile-{what}",
                      _source(f"hostile-{what}", "step", body))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "found.json"
    env = child_env({"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                     "ACCELPORT_PLUGIN_TIMEOUT": "2"})
    done = subprocess.run([sys.executable, "-m", "accelport", "diagnose", "--output", str(out), str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env,
                          preexec_fn=default_signals)
    assert done.returncode == 0 and done.stdout == "trained\n", done.stderr
    summary = " ".join(done.stderr.split())  # (the summary wraps its lines)
    assert "tiny-batch at step 3" in summary  # the other rules judged the whole run
    notes = json.loads(out.read_text())["notes"]
    for what, (_, why) in BODIES.items():
        line = (f"the hostile-{what} rule of plugin 'hostile-{what}' was disabled at step 2: {why}; "
                f"hostile-{what} was not judged after it")
        assert line in notes
        assert line in summary


# -- what a rule says is redacted, escaped and bounded on every path ---------------------------------------------

#: A URL's password, a known token format, a value only the environment says is secret (MY_API_TOKEN), a flag's
#: value; an embedded newline that would forge a summary line, and a terminal escape.
MESSAGE = ("the batches come from https://alice:hunter2pw@example.com/data with ghp_abcdefghijklmnopqrstu1234 and "
           "plainvalue42\n  [FAIL] forged line \x1b[31mred\x1b[0m")
FIX = "run again with --token=sekrit-value-99"
SECRETS = ("hunter2pw", "ghp_abcdefghijklmnopqrstu1234", "plainvalue42", "sekrit-value-99")
LEAKY = f'''
import accelport as ap


class Leaky(ap.Rule):
    kind = "leaky"

    def step(self, record):
        if record.step == 2:
            self.report({MESSAGE!r}, record.step, fix={FIX!r}, url="https://bob:pw4bob@example.com/x",
                        lines=["ok", "a\\n  [FAIL] forged too"])


@ap.hookimpl
def accelport_register_rules(register):
    register(Leaky)
'''


def _assert_clean(text: str, where: str) -> None:
    """``text`` (an output, whole) holds no secret, no forged line and no terminal escape."""
    for secret in (*SECRETS, "pw4bob"):
        assert secret not in text, (where, secret)
    assert "\x1b" not in text, where
    assert not any(line.lstrip().startswith("[FAIL] forged") for line in text.splitlines()), where


def test_a_findings_text_is_redacted_and_escaped_in_a_ported_script(install_plugin: Any, tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    install_plugin("leaky", "leaky_rule", LEAKY, dist="leaky-rule")
    metrics = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(metrics))
    monkeypatch.setenv("MY_API_TOKEN", "plainvalue42")
    RUNTIME.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ported_loop(batch_size=2)
    # stderr: the warning that says it
    (said,) = [str(w.message) for w in caught if "[leaky]" in str(w.message)]
    _assert_clean(said, "warning")
    assert said.startswith("[leaky] the batches come from https://<redacted>@example.com/data with <redacted> and "
                           "<redacted>\\n  [FAIL] forged line \\x1b[31mred\\x1b[0m")
    assert said.endswith("run again with --token=<redacted>")
    # ap.diagnostics()
    (finding,) = ap.diagnostics()
    _assert_clean(json.dumps(finding.to_dict(), ensure_ascii=False), "ap.diagnostics()")
    assert finding.evidence == {"url": "https://<redacted>@example.com/x", "lines": ["ok", "a\\n  [FAIL] forged too"]}
    # the metrics file: its text, and what a reader loads from it
    text = metrics.read_text()
    _assert_clean(text, "metrics file")
    (line,) = [json.loads(line) for line in text.splitlines() if "diagnoses" in json.loads(line)]
    _assert_clean("\n".join(str(v) for v in line["diagnoses"][0].values()), "metrics file, loaded")
    # the report page drawn from it
    from accelport.diagnose.report import write_report

    page = tmp_path / "run.html"
    write_report(str(metrics), str(page))
    _assert_clean(page.read_text(), "report page")


def test_a_findings_text_is_redacted_and_escaped_under_accelport_diagnose(tmp_path: pathlib.Path) -> None:
    from tests.diagnose_cli.runs import child_env

    site = tmp_path / "site"
    _install_site(site, "leaky_rule", "leaky", LEAKY)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out, report, metrics = tmp_path / "found.json", tmp_path / "run.html", tmp_path / "run.jsonl"
    env = child_env({"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
                     "MY_API_TOKEN": "plainvalue42"})
    done = subprocess.run([sys.executable, "-m", "accelport", "diagnose", "--output", str(out), "--report",
                           str(report), "--metrics-file", str(metrics), str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env, preexec_fn=default_signals)
    assert done.returncode == 0 and done.stdout == "trained\n", done.stderr
    assert "leaky at step 2: the batches come from https://<redacted>@example.com/data" in done.stderr
    for where, text in (("stderr", done.stderr), ("--output", out.read_text()), ("--report", report.read_text()),
                        ("--metrics-file", metrics.read_text())):
        _assert_clean(text, where)
    (finding,) = json.loads(out.read_text())["findings"]
    _assert_clean("\n".join(map(str, finding.values())), "--output, loaded")
    assert "\\n  [FAIL] forged line \\x1b[31m" in finding["message"]


def test_a_huge_finding_is_cut_and_says_how_long_it_was(install_plugin: Any, tmp_path: pathlib.Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from accelport.diagnose.engine import FINDING_CHARACTERS

    install_plugin("huge", "huge_rule", (
        "import accelport as ap\n"
        "class Huge(ap.Rule):\n"
        "    kind = 'huge'\n"
        "    def step(self, record):\n"
        "        self.report('x' * 5_000_000, record.step, fix='y' * 300_000, blob='z' * 1_000_000)\n"
        "@ap.hookimpl\n"
        "def accelport_register_rules(register):\n"
        "    register(Huge)\n"), dist="huge-rule")
    metrics = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(metrics))
    RUNTIME.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ported_loop(batch_size=2)
    (finding,) = ap.diagnostics()
    assert finding.message == "x" * FINDING_CHARACTERS + "... [cut: 5000000 characters in all]"
    assert finding.fix == "y" * FINDING_CHARACTERS + "... [cut: 300000 characters in all]"
    assert finding.evidence["blob"] == "z" * FINDING_CHARACTERS + "... [cut: 1000000 characters in all]"
    (said,) = [str(w.message) for w in caught if "[huge]" in str(w.message)]
    assert len(said) < 3 * FINDING_CHARACTERS and "[cut: 5000000 characters in all]" in said
    assert max(len(line) for line in metrics.read_text().splitlines()) < 4 * FINDING_CHARACTERS


def test_a_rule_refused_for_its_kind_is_warned_about_at_its_own_class(install_plugin: Any) -> None:
    source = "import accelport as ap\n\n\nclass R(ap.Rule):\n    kind = 'recompilation'\n\n\n" \
             "@ap.hookimpl\ndef accelport_register_rules(register):\n    register(R)\n"
    install_plugin("clash", "clash_rule", source, dist="clash-rule")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RUNTIME.diagnostics()
    (clash,) = [w for w in caught if "already registered by plugin 'diagnostics'" in str(w.message)]
    import clash_rule  # (the module the entry point loaded)

    assert (os.path.realpath(clash.filename), clash.lineno) == (os.path.realpath(clash_rule.__file__), 4)
    assert clash.category is ap.PluginWarning
