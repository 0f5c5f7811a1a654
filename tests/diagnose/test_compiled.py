"""torch.compile runs on the cpu backend: recompilation with its cause, the recompile-limit cliff,
graph breaks, buckets computed from the run; and silence on healthy compiled loops.

The loops compile for real with inductor (tiny models: each compilation costs about a
second); the one that needs a dozen compilations uses dynamo's "eager" backend, as
dynamo's reasons for recompiling do not depend on what compiles the graphs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo

import accelport as ap
from accelport.diagnose import compiled
from accelport.diagnose.buckets import describe, suggest
from accelport.observe.dynamo import FunctionCompiles, LimitHit, SizeChange, parse_reason
from tests.diagnose.test_diagnosis import feed, rec, sig
from tests.diagnose.test_diagnosis import kinds as rule_kinds
from tests.diagnoses import kinds, silent

HERE = os.path.abspath(__file__)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()  # compiled code and its counts from other tests stay out
    yield
    torch._dynamo.reset()


class Pool(torch.nn.Module):
    """A linear layer over each position, then the mean over the sequence: (batch, length, 4) -> (batch, 1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).mean(1)


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)  # then a graph break on every call:
        if h.sum().item() > 0:
            h = h * 2
        return h.mean(1)


def batches(lengths: list[int], batch: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, n, 4, generator=g), torch.randn(batch, 1, generator=g)) for n in lengths]


def train(model: torch.nn.Module, compiled_model: Any, data: list[Any]) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in ap.loader(data):
        torch.nn.functional.mse_loss(compiled_model(x), y).backward()
        ap.optimizer_step(opt)
        opt.zero_grad()


# -- the cliff, the breaks, the cause -----------------------------------------------------------------


def test_the_recompile_limit_is_a_problem_naming_the_function_the_shapes_and_buckets() -> None:
    ap.use("cpu")
    model = Pool()
    # dynamo's limit is 8; 3 here, so the cliff comes after three compilations, not eight.
    with torch._dynamo.config.patch(recompile_limit=3), \
            pytest.warns(ap.DiagnosticWarning, match=r"\[compile-limit\] PROBLEM: ") as caught:
        train(model, ap.compile(model, dynamic=False), batches(list(range(5, 15))))
    assert any(w.category.__name__ == "CompileLimitWarning" for w in caught)
    assert kinds() == ["compile-limit"]
    (found,) = ap.diagnostics()
    assert found.severity == "problem" and found.step == 4  # the fourth shape found the limit
    line = Pool.forward.__code__.co_firstlineno
    assert f"Pool.forward ({HERE}:{line}) reached torch._dynamo.config.recompile_limit (3)" in found.text
    assert "its input 'x' changed size along dim 1 (5, 6, 7, 8)" in found.text
    assert "runs it eagerly" in found.text
    # Buckets for the lengths this run saw, and the dynamic-shape fix inductor allows.
    assert "ap.data.BucketCollate(buckets=(" in found.text and "compilations instead of" in found.text
    assert found.evidence["buckets"][-1] == 8  # the longest length seen by then
    assert "torch._dynamo.mark_dynamic(x, 1)" in found.text and "dynamic=None" in found.text
    assert ap.metrics().compilations == 3  # and then it silently ran eagerly


def test_a_torch_nn_module_compiled_on_its_own_is_named_not_dynamos_wrapper_frame() -> None:
    """torch.compile of one of torch.nn's own classes compiles dynamo's wrapper (external_utils' ``inner``)."""
    ap.use("cpu")
    model = torch.nn.Linear(4, 1)
    compiled_linear = torch.compile(model, backend="eager", dynamic=False)
    data = [(torch.randn(n, 4), torch.randn(n, 1)) for n in (2, 3, 4, 5)]
    with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(ap.DiagnosticWarning, match="compile-limit"):
        train(model, compiled_linear, data)
    (found,) = ap.diagnostics()
    line = torch.nn.Linear.forward.__code__.co_firstlineno
    assert f"torch.nn.modules.linear.Linear.forward ({torch.nn.modules.linear.__file__}:{line}) reached" in found.text
    assert "inner" not in found.text and "external_utils" not in found.text


def test_a_graph_break_on_every_call_is_named_with_its_line_and_fix_not_as_recompilation() -> None:
    ap.use("cpu")
    model = Branchy()
    with pytest.warns(ap.DiagnosticWarning, match=r"\[graph-break\]"):
        train(model, ap.compile(model), batches([6] * 14))
    assert kinds() == ["graph-break"]
    (found,) = ap.diagnostics()
    line = Branchy.forward.__code__.co_firstlineno + 2
    assert f"at {HERE}:{line} in forward (`if h.sum().item() > 0:`)" in found.text
    assert "Tensor.item()" in found.text and "torch.where" in found.text
    assert found.evidence["graph_breaks"] >= 1 and found.severity == "warning"


def test_recompilation_of_a_compiled_function_names_the_argument_the_dim_and_the_sizes() -> None:
    ap.use("cpu")
    model = Pool()
    lengths = [10 + (i * 7) % 40 for i in range(24)]
    # A limit of 64: no cliff, it keeps recompiling.
    with torch._dynamo.config.patch(recompile_limit=64), \
            pytest.warns(ap.DiagnosticWarning, match=r"\[recompilation\]"):
        train(model, ap.compile(model, dynamic=False, backend="eager"), batches(lengths))
    assert kinds() == ["recompilation"]
    (found,) = ap.diagnostics()
    line = Pool.forward.__code__.co_firstlineno
    assert f"the compiled function Pool.forward ({HERE}:{line}) was compiled" in found.text
    assert "its input 'x' changed size along dim 1 (10, 12, 17, " in found.text
    assert "collate_fn=ap.data.BucketCollate(buckets=(" in found.text
    assert "torch._dynamo.mark_dynamic(x, 1)" in found.text
    assert 2 <= len(found.evidence["buckets"]) <= 6


@pytest.mark.parametrize("case", ["fixed shapes", "default compile, varying lengths", "four buckets"])
def test_healthy_compiled_loops_are_silent(case: str) -> None:
    ap.use("cpu")
    model = Pool()
    if case == "fixed shapes":
        silent(lambda: train(model, ap.compile(model), batches([8] * 16)))
        assert ap.metrics().compilations == 1
    elif case == "default compile, varying lengths":
        # dynamo marks the length dynamic after the second shape: two compilations, not a problem
        # (one, where the profile it keeps on disk from an earlier run says so at once).
        silent(lambda: train(model, ap.compile(model), batches([5 + i % 13 for i in range(24)])))
        assert ap.metrics().compilations in (1, 2)
    else:
        lengths = [(8, 16, 24, 32)[(i * 3) % 4] for i in range(30)]
        data = batches(lengths) + batches([32], batch=1)  # and a short final batch
        silent(lambda: train(model, ap.compile(model, dynamic=False), data))
        assert ap.metrics().compilations == 5


# -- what the messages say, without compiling ----------------------------------------------------------


def test_static_only_compilers_get_bucketing_as_the_fix() -> None:
    f = FunctionCompiles("Net.forward", "model.py:12", compilations=8,
                         size_changes=[SizeChange("x", 1, tuple(range(100, 109)))])
    hit = LimitHit("recompile_limit", 8, "forward", "model.py:12", "0/7: tensor 'x' size mismatch at index 1")
    buckets = suggest({n: 1 for n in range(100, 109)})
    for backend in ("tpu", "neuron"):
        dynamic = compiled.accepts_dynamic(backend)
        text = " ".join(compiled.compile_limit_message(hit, [f], backend, dynamic, buckets, 9))
        assert f"Bucketing is the fix: the {backend} compiler rejects dynamic shapes" in text
        assert "mark_dynamic" not in text and "BucketCollate(buckets=(112,)): 1 compilation instead of 9" in text
    text = " ".join(compiled.compile_limit_message(hit, [f], "cuda", compiled.accepts_dynamic("cuda"), buckets, 9))
    assert "mark_dynamic(x, 1)" in text and "cuda's compiler (inductor) accepts dynamic shapes" in text
    assert compiled.accepts_dynamic("somebody-elses") is None


def test_each_graph_break_gets_the_fix_for_its_cause() -> None:
    assert "torch.where" in compiled.break_fix("Unsupported Tensor.item() call", "if h.sum().item() > 0:")
    assert "torch.where" in compiled.break_fix("generic_jump TensorVariable()", "if y.sum() > 0:")
    assert "masked_sum" in compiled.break_fix("Dynamic shape operator", "return x[x > 0].sum()")
    assert "ap.after_step" in compiled.break_fix("Failed to trace builtin operator", 'print("y", y.shape)')
    assert "out of the compiled region" in compiled.break_fix("Attempted to call function marked as skipped",
                                                               "scipy.special.erf(x)")


def test_dynamos_reasons_are_parsed() -> None:
    assert parse_reason("0/3: tensor 'x' size mismatch at index 1. expected 16, actual 17") == \
        ("size", "x", 1, (16, 17))
    assert parse_reason("2/0: tensor 'L['x']' stride mismatch at index 0. expected 4, actual 1")[:3] == \
        ("size", "x", 0)  # (older torch names locals L['x'])
    assert parse_reason("2/2: tensor 'args[0]' dtype mismatch. expected Float, actual Double")[:2] == \
        ("dtype", "args[0]")
    assert parse_reason("1/0: ___stack0 == 0.88  # if h.sum().item() > 0:")[:2] == ("value", "___stack0")
    assert parse_reason("something new in a later torch")[0] == "other"


def test_buckets_are_the_fewest_that_keep_padding_low() -> None:
    import random
    from collections import Counter

    rng = random.Random(0)
    lengths = Counter(rng.randint(20, 128) for _ in range(400))
    s = suggest(lengths)
    assert s is not None and 2 <= s.compilations <= 6 and s.buckets[-1] == 128
    assert all(b % 8 == 0 for b in s.buckets) and s.padding_share <= 0.15
    assert s.shapes_seen == len(lengths)
    assert describe(s).startswith(f"ap.data.BucketCollate(buckets={s.buckets!r}): {s.compilations} compilations "
                                  f"instead of {len(lengths)}, ")
    # More buckets never pad more; one length needs one bucket; tiny lengths are not rounded to 8.
    assert suggest(lengths, max_buckets=6).padding_share <= suggest(lengths, max_buckets=2).padding_share  # type: ignore[union-attr]
    assert suggest({40: 7}).buckets == (40,)  # type: ignore[union-attr]
    assert suggest({3: 1, 5: 1, 11: 1}).buckets == (5, 11)  # type: ignore[union-attr]  # not (8, 16)
    assert suggest({}) is None


def test_replayed_records_carry_the_limit_and_the_breaks() -> None:
    # What a metrics file holds (accelport report): counts, no dynamo records.
    records = [rec(s, compiles=int(s < 4), sig=sig(10 + s), lazy=False, backend="cpu") for s in range(1, 12)]
    records[4] = rec(5, sig=sig(15), lazy=False, backend="cpu")
    records[4].delta["compile_limit_hits"] = 1  # type: ignore[index]
    records[0].delta["graph_breaks"] = 2  # type: ignore[index]
    d = feed(records)
    assert rule_kinds(d) == ["graph-break", "compile-limit"]
    limit = d.findings[1]
    assert limit.severity == "problem" and limit.step == 5 and "runs it eagerly" in limit.text
    assert "BucketCollate(buckets=(" in limit.text  # from the batch shapes the records carry
    assert "2 compilations broke a graph" in d.findings[0].text
