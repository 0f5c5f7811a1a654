"""Wrong values given to the public API get a specific error that says what to do."""

from __future__ import annotations

import pytest

import accelport as ap


@pytest.fixture(autouse=True)
def on_cpu() -> None:
    ap.use("cpu")


@pytest.mark.parametrize("call, error, words", [
    (lambda: ap.device(-1), ValueError, "takes a device number"),
    (lambda: ap.device("a"), ValueError, "takes a device number"),
    (lambda: ap.device(True), ValueError, "takes a device number"),
    (lambda: ap.optimizer_step(None), TypeError, "needs a torch.optim.Optimizer, not NoneType"),
    (lambda: ap.compile_cache(123), TypeError, "needs a directory path"),
    (lambda: ap.compile(None), TypeError, "needs a model or function to compile"),
    (lambda: ap.autocast("bf16"), TypeError, "torch.bfloat16"),
    (lambda: ap.all_reduce([1, 2]), TypeError, "needs a tensor, not list"),
    (lambda: ap.all_reduce(__import__("torch").ones(2), op="avg"), ValueError, "'sum' or 'mean', not 'avg'"),
    (lambda: ap.all_reduce(__import__("torch").ones(2, dtype=__import__("torch").long), op="mean"), TypeError,
     "needs a floating-point tensor"),
    (lambda: ap.loader([1], progress="no"), TypeError, "progress must be True or False"),
    (lambda: ap.loader([1], prefetch="2"), ValueError, "non-negative int"),
    (lambda: ap.data.pad_to(__import__("torch").ones(2, 3), 5, dim=3), ValueError, "dim 3 is out of range"),
    (lambda: ap.data.LengthGroupedBatchSampler("abc", 2), TypeError, "lengths must be non-negative ints"),
    (lambda: ap.data.LengthGroupedBatchSampler([3, -1], 2), TypeError, "lengths must be non-negative ints"),
])
def test_bad_input(call, error: type[Exception], words: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_good_input_still_works() -> None:
    import torch

    assert ap.device(0).type == "cpu" or ap.device().type == "cpu"
    with ap.autocast(torch.bfloat16):
        out = torch.ones(2, 2) @ torch.ones(2, 2)
    assert out.dtype == torch.bfloat16
    assert ap.all_reduce(torch.ones(2), op="mean").tolist() == [1.0, 1.0]
