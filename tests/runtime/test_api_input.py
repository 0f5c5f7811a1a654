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
    # Refused alone as with replicas: 200 + 200 wraps to 144 as uint8.
    (lambda: ap.all_reduce(__import__("torch").full((2,), 200, dtype=__import__("torch").uint8)), TypeError,
     "all_reduce of a torch.uint8 tensor would wrap around"),
    (lambda: ap.all_reduce(__import__("torch").ones(2, dtype=__import__("torch").int8)), TypeError,
     "torch.int8 tensor would wrap around (as uint8, 200 [+] 200 is 144): convert it first with .long"),
    (lambda: ap.all_reduce(__import__("torch").ones(2, dtype=__import__("torch").bool)), TypeError,
     "torch.bool tensor would wrap around"),
    (lambda: ap.broadcast(__import__("torch").eye(3).to_sparse()), TypeError,
     "takes dense tensors, not a torch.sparse_coo one (shape (3, 3)): broadcast t.to_dense()"),
    (lambda: ap.save({"a": 1}, ""), ap.CheckpointError, "needs the path of the checkpoint to write"),
    (lambda: ap.save({"a": 1}, None), ap.CheckpointError, "needs the path of the checkpoint to write"),
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
    assert ap.all_reduce(torch.full((2,), 200, dtype=torch.int16)).tolist() == [200, 200]
