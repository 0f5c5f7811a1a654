"""The report page with the new kinds: the live run's diagnoses kept in the metrics file (with what
only it could see), problems first, and the distinct batch shapes with their counts and compile time."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

import accelport as ap
from accelport.diagnose.report import batch_shapes, diagnose, load_records, render_html


def cpu_step(n: int, length: int, **kw: Any) -> dict[str, Any]:
    base = {"step": n, "time": 1.0 + n, "backend": "cpu", "lazy": False, "seconds": 0.01,
            "data_wait_seconds": 0.0, "signature": [[[2, length, 4], "float32"]], "compilations": 0}
    base.update(kw)
    return base


def test_batch_shapes_are_listed_with_steps_compilations_and_compile_time() -> None:
    records = [cpu_step(1, 8, compilations=1, compile_seconds=1.5), cpu_step(2, 8), cpu_step(3, 16, compilations=1,
               compile_seconds=0.5), cpu_step(4, 8), cpu_step(5, 16)]
    shapes = batch_shapes(records)
    assert [(s["signature"][0][0][1], s["steps"], s["compilations"], s["compile_seconds"]) for s in shapes] == \
        [(8, 3, 1, 1.5), (16, 2, 1, 0.5)]
    page = render_html(records, [])
    assert page.count("<tr class=shape>") == 2
    assert "<td>(2, 8, 4) float32</td><td>3</td><td>1</td><td>1.50 s</td><td>1</td>" in page


def test_the_live_runs_diagnoses_reach_the_page_problems_first(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Any) -> None:
    import torch

    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("ACCELPORT_METRICS_FILE", str(path))
    ap.use("cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(20)]
    data[4][0][0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.DiagnosticWarning)
        for x, y in ap.loader(data):
            torch.nn.functional.mse_loss(model(x), y).backward()
            ap.optimizer_step(opt)
            opt.zero_grad()
    (live,) = ap.diagnostics()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    marked = [line for line in lines if line.get("diagnoses")]
    assert len(marked) == 1 and marked[0]["diagnoses"][0]["kind"] == "non-finite"
    assert marked[0]["diagnoses"][0]["severity"] == "problem"
    # The report shows it as the live run said it (the replay alone could not: it needs the batch).
    records = load_records(str(path))
    found = diagnose(records)
    assert [(d.kind, d.message, d.severity) for d in found] == [(live.kind, live.message, "problem")]
    page = render_html(records, found)
    assert "<div class='diag problem'><b>non-finite</b><span class=badge>problem</span>" in page
    assert "it came from the input batch" in page


def test_problems_come_before_warnings_on_the_page() -> None:
    from accelport.diagnose.rules import Diagnosis

    records = [cpu_step(n, 8) for n in range(1, 4)]
    page = render_html(records, [Diagnosis("graph-break", "a break", 3),
                                 Diagnosis("compile-limit", "the cliff", 5, {}, "problem")])
    assert page.index("compile-limit") < page.index("graph-break")
