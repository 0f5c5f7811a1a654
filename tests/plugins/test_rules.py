"""A third party's rule, installed as a real distribution: it reports like a built-in kind everywhere.

The plugin is a module plus a ``.dist-info`` with an ``accelport`` entry point, found by
importlib.metadata exactly as a pip-installed one would be (the ``install_plugin``
fixture in-process; a ``PYTHONPATH`` entry for ``accelport diagnose`` in a subprocess).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings
from typing import Any

import pytest

import accelport as ap
from accelport.runtime.state import RUNTIME

#: The whole of a small third-party rule (docs/plugins.md walks through the same one).
TINY_BATCH = '''
import accelport as ap


class TinyBatchWarning(ap.DiagnosticWarning):
    """Batches too small to keep a device busy."""


class TinyBatchRule(ap.Rule):
    kind = "tiny-batch"
    warning = TinyBatchWarning
    SAMPLES = 4  # fewer samples than this in a batch...
    STEPS = 3  # ...this many steps in a row

    def start(self):
        self.small = 0

    def step(self, record):
        sizes = [shape[0] for shape, _ in record.signature or () if len(shape)]
        self.small = self.small + 1 if sizes and max(sizes) < self.SAMPLES else 0
        if self.small == self.STEPS:
            self.report(
                f"the last {self.STEPS} batches held {max(sizes)} samples: each step pays its fixed costs for "
                f"almost no work. Raise the DataLoader's batch_size to {self.SAMPLES} or more.",
                record.step, samples=max(sizes))


@ap.hookimpl
def accelport_register_rules(register):
    register(TinyBatchRule)
'''

SCRIPT = '''
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(data, batch_size=2):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
print("trained")
'''


def _site(tmp_path: pathlib.Path, source: str, module: str = "tiny_batch_rule", name: str = "tiny-batch") -> str:
    """A folder holding the plugin module and its distribution's metadata, as pip would install them."""
    site = tmp_path / "site"
    info = site / "tiny_batch_rule-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-batch-rule\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[accelport]\n{name} = {module}\n")
    (site / f"{module}.py").write_text(source)
    return str(site)


def _ported_loop(batch_size: int, steps: int = 12) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(batch_size * steps, 4), torch.randn(batch_size * steps, 1))
    model = torch.nn.Linear(4, 1).to(ap.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in ap.loader(DataLoader(data, batch_size=batch_size)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ap.optimizer_step(opt)
        opt.zero_grad()


def test_a_third_party_rule_reports_like_a_built_in_kind(install_plugin: Any, tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    install_plugin("tiny-batch", "tiny_batch_rule", TINY_BATCH, dist="tiny-batch-rule")
    metrics = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(metrics))
    RUNTIME.reset()
    with pytest.warns(ap.DiagnosticWarning, match=r"^\[tiny-batch\] the last 3 batches held 2 samples") as caught:
        _ported_loop(batch_size=2)
    category = next(w.category for w in caught if "[tiny-batch]" in str(w.message))
    assert category.__name__ == "TinyBatchWarning" and issubclass(category, ap.DiagnosticWarning)
    found = ap.diagnostics()
    assert [(d.kind, d.step, d.severity) for d in found] == [("tiny-batch", 3, "warning")]
    assert found[0].evidence == {"samples": 2}
    # The metrics file carries it on the line of the step it was made on ...
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines if line.get("diagnoses")] == [3]
    assert lines[2]["diagnoses"][0]["kind"] == "tiny-batch"
    # ... and the report page shows it, from the live finding and, replayed, from the records alone.
    from accelport.diagnose.report import diagnose, load_records, write_report

    page = tmp_path / "run.html"
    write_report(str(metrics), str(page))
    assert "tiny-batch" in page.read_text() and "batch_size to 4 or more" in page.read_text()
    for line in lines:
        line.pop("diagnoses", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replayed = diagnose(lines)
    assert [d.kind for d in replayed] == ["tiny-batch"]
    assert [d.kind for d in diagnose(load_records(str(metrics)))] == ["tiny-batch"]


def test_a_third_party_rule_stays_silent_on_a_healthy_run(install_plugin: Any) -> None:
    install_plugin("tiny-batch", "tiny_batch_rule", TINY_BATCH, dist="tiny-batch-rule")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ap.DiagnosticWarning)
        _ported_loop(batch_size=8)
    assert ap.diagnostics() == []


def test_a_third_party_rule_under_accelport_diagnose(tmp_path: pathlib.Path) -> None:
    from tests.diagnose_cli.runs import child_env, default_signals

    site = _site(tmp_path, TINY_BATCH)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out, report, metrics = tmp_path / "found.json", tmp_path / "run.html", tmp_path / "run.jsonl"
    env = child_env({"PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])})
    done = subprocess.run([sys.executable, "-m", "accelport", "diagnose", "--output", str(out), "--report",
                           str(report), "--metrics-file", str(metrics), str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env, preexec_fn=default_signals)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "trained\n"
    assert "tiny-batch at step 3: the last 3 batches held 2 samples" in done.stderr
    result = json.loads(out.read_text())
    assert [f["kind"] for f in result["findings"]] == ["tiny-batch"]
    assert result["findings"][0]["evidence"]["where"].startswith(str(script))
    assert "tiny-batch" in report.read_text()
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [d["kind"] for line in lines for d in line.get("diagnoses", ())] == ["tiny-batch"]


def test_a_rule_that_raises_is_disabled_and_the_others_keep_judging(install_plugin: Any) -> None:
    install_plugin("broken", "broken_rule", (
        "import accelport as ap\n"
        "class Broken(ap.Rule):\n"
        "    kind = 'broken'\n"
        "    def step(self, record):\n"
        "        if record.step == 2:\n"
        "            raise ZeroDivisionError('rule bug')\n"
        "@ap.hookimpl\n"
        "def accelport_register_rules(register):\n"
        "    register(Broken)\n"), dist="broken-rule")
    install_plugin("tiny-batch", "tiny_batch_rule", TINY_BATCH, dist="tiny-batch-rule")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ported_loop(batch_size=2)
    plugin_warnings = [str(w.message) for w in caught if issubclass(w.category, ap.PluginWarning)]
    assert len(plugin_warnings) == 1 and "'broken'" in plugin_warnings[0] and "rule bug" in plugin_warnings[0]
    assert [d.kind for d in ap.diagnostics()] == ["tiny-batch"]
    engine = RUNTIME.diagnostics()
    assert engine is not None
    assert engine.failures == ["the broken rule of plugin 'broken' was disabled at step 2: it raised "
                               "ZeroDivisionError: rule bug; broken was not judged after it"]


def test_accelport_diagnose_says_which_rule_failed_and_what_it_did_not_judge(tmp_path: pathlib.Path) -> None:
    from tests.diagnose_cli.runs import child_env, default_signals

    site = _site(tmp_path, TINY_BATCH.replace("        sizes = [", "        assert record.step < 5, 'rule bug'\n"
                                                                     "        sizes = ["))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = child_env({"PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])})
    done = subprocess.run([sys.executable, "-m", "accelport", "diagnose", str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env, preexec_fn=default_signals)
    assert done.returncode == 0 and done.stdout == "trained\n", done.stderr
    assert "tiny-batch at step 3" in done.stderr  # found before the rule broke
    assert "the tiny-batch rule of plugin 'tiny-batch' was disabled at step 5: it raised AssertionError" in done.stderr


@pytest.mark.parametrize(("body", "problem"), [
    ("class R(ap.Rule):\n    kind = 'Tiny Batch'\n", "a kind is lower-case words joined by '-'"),
    ("class R:\n    kind = 'plain'\n", "is not a subclass of accelport.Rule"),
    ("class R(ap.Rule):\n    kind = 'odd'\n    severity = 'fatal'\n", "expected one of warning, problem"),
    ("class R(ap.Rule):\n    kind = 'odd'\n    needs = frozenset({'telepathy'})\n",
     "sensor names among memory, nan-search, numerics"),
    ("class R(ap.Rule):\n    kind = 'recompilation'\n", "already registered by plugin 'diagnostics'"),
])
def test_a_rule_that_cannot_run_is_refused_with_the_reason(install_plugin: Any, body: str, problem: str) -> None:
    install_plugin("bad", "bad_rule", f"import accelport as ap\n{body}@ap.hookimpl\n"
                   "def accelport_register_rules(register):\n    register(R)\n", dist="bad-rule")
    with pytest.warns(ap.PluginWarning, match="plugin 'bad': rule skipped") as caught:
        engine = RUNTIME.diagnostics()
    assert any(problem in str(w.message) for w in caught)
    assert engine is not None and "recompilation" in engine.kinds
    assert any(f.name == "bad" and f.stage == "rule" and problem in f.error for f in RUNTIME.host().failed)
    from accelport.doctor.gather import gather

    report = gather()  # doctor lists it with the plugins that failed
    assert any(p.get("name") == "bad" and p.get("failed") == "rule" and problem in p["error"]
               for p in report["plugins"])


def test_a_warning_filter_set_to_error_never_turns_a_finding_into_an_exception(install_plugin: Any) -> None:
    install_plugin("tiny-batch", "tiny_batch_rule", TINY_BATCH, dist="tiny-batch-rule")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ported_loop(batch_size=2)  # raises nothing into the loop
    assert [d.kind for d in ap.diagnostics()] == ["tiny-batch"]


def test_disabling_the_built_in_rules_leaves_a_plugins_rules_running(install_plugin: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    install_plugin("tiny-batch", "tiny_batch_rule", TINY_BATCH, dist="tiny-batch-rule")
    monkeypatch.setenv("ACCELPORT_DISABLED_PLUGINS", "diagnostics")
    RUNTIME.reset()
    engine = RUNTIME.diagnostics()
    assert engine is not None and list(engine.kinds) == ["tiny-batch"]
    monkeypatch.setenv("ACCELPORT_DIAGNOSTICS", "0")  # diagnosis off altogether: no rule runs
    RUNTIME.reset()
    assert RUNTIME.diagnostics() is None
