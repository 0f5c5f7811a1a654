"""ap.memory_estimate says what the step really needs, or why it cannot: compiled models, buffers, wrong
keywords, a loss_fn that raises, a dtype mismatch the meta device lets by."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import accelport as ap
from accelport.diagnose.memory import COMPILED_NOTE, EstimateError, estimate
from accelport.errors import UsageError

GiB, MiB = 1 << 30, 1 << 20
# Saved for backward by mlp() at batch 32: the first Linear's input and the two ReLU outputs (each once).
ACTIVATIONS = (32 * 64 + 2 * 32 * 256) * 4
SIGNATURE = "memory_estimate(model, optimizer, sample_batch, *, loss_fn=None"


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


# -- torch.compile ---------------------------------------------------------------------------------


def _compiled_whole() -> torch.nn.Module:
    return torch.compile(mlp())


def _compiled_inside() -> torch.nn.Module:
    model = mlp()
    model[2] = torch.compile(model[2])  # one block compiled, as some scripts do
    return model


def _compiled_in_place() -> torch.nn.Module:
    model = mlp()
    model.compile()
    return model


@pytest.mark.parametrize("build", [_compiled_whole, _compiled_inside, _compiled_in_place])
def test_a_compiled_model_is_measured_eagerly_and_says_so(build: Any) -> None:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    est = ap.memory_estimate(model, opt, torch.randn(32, 64))
    assert est.activation_bytes == ACTIVATIONS  # the eager model's, not the 0 a compiled copy showed
    assert est.compiled and est.to_dict()["compiled"] is True
    assert COMPILED_NOTE in str(est) and "model._orig_mod" in str(est)
    assert opt.state == {} and all(p.grad is None for p in model.parameters())


def test_an_eager_model_says_nothing_of_compiling() -> None:
    model = mlp()
    est = ap.memory_estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64))
    assert not est.compiled and "torch.compile" not in str(est)


# -- buffers ---------------------------------------------------------------------------------------


def test_buffers_are_counted_on_their_own_line_and_not_twice() -> None:
    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = mlp()
            self.register_buffer("mask", torch.ones(64))  # saved for backward by the product below
            self.register_buffer("table", torch.zeros(256, 1024), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x * self.mask)

    model = Masked()
    est = ap.memory_estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(32, 64))
    buffers = 64 * 4 + 256 * 1024 * 4
    assert est.buffer_bytes == buffers and est.to_dict()["buffer_bytes"] == buffers
    assert est.activation_bytes == ACTIVATIONS  # the mask is a buffer, not an activation too
    assert est.total_bytes == est.parameter_bytes + est.gradient_bytes + est.optimizer_state_bytes + buffers \
        + ACTIVATIONS
    assert "1.0 MiB of buffers" in str(est)


def _with_buffer(nbytes: int) -> torch.nn.Module:
    with torch.device("meta"):  # never allocated
        model = mlp()
        model.register_buffer("table", torch.empty(nbytes // 4), persistent=False)
    return model


def test_a_6_gib_buffer_does_not_fit_a_16_mib_host() -> None:
    model = _with_buffer(6 * GiB)
    # The host's memory is what estimate() is given (ap.memory_estimate passes this machine's): a small one here.
    est = estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64), host_bytes=16 * MiB)
    assert est.buffer_bytes == 6 * GiB and est.total_bytes > 6 * GiB
    (host,) = est.verdicts
    assert host.devices != 1 and host.text().startswith("does not fit this host's memory (6.0 GiB")
    assert "6.0 GiB of buffers" in str(est)


def test_buffers_are_never_sharded_in_a_verdict() -> None:
    model = _with_buffer(20 * GiB)
    est = ap.memory_estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64), chip="v5e")
    verdicts = {v.device: v for v in est.verdicts}
    assert verdicts["v5e"].devices is None  # 20 GiB on every one of 16 GiB devices, however many
    assert "the buffers (20.0 GiB, never sharded)" in verdicts["v5e"].text()
    assert verdicts["v5p"].devices == 1  # 95 GiB
    assert not [f for f in est.fixes if f.kind == "shard" and "then it fits" in f.text]


# -- a wrong keyword -------------------------------------------------------------------------------


@pytest.mark.parametrize("keyword", ["batch", "input", "inputs"])
def test_a_wrong_keyword_is_a_usage_error_naming_the_signature(keyword: str) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(UsageError) as raised:
        ap.memory_estimate(model, opt, **{keyword: torch.randn(32, 64)})
    text = str(raised.value)
    assert f"takes no {keyword}= keyword" in text and SIGNATURE in text
    assert "sample_batch is one batch as the training loop passes it to the model" in text
    assert "loss_fn=lambda out: criterion(out, y)" in text  # where an (x, y) batch's y goes
    assert isinstance(raised.value, TypeError)  # what Python's own error was: `except TypeError` still holds


def test_no_sample_batch_at_all_names_the_signature() -> None:
    model = mlp()
    with pytest.raises(UsageError, match=r"needs the sample batch: it is memory_estimate\(model, optimizer"):
        ap.memory_estimate(model, torch.optim.AdamW(model.parameters()))


# -- a loss_fn that raises -------------------------------------------------------------------------


def _bad_target(output: torch.Tensor) -> torch.Tensor:
    raise ValueError("Expected target size (32, 5), got (32, 10)\nsecond line of detail")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_raising_loss_fn_is_said_as_loss_fns_with_its_first_line(device: str) -> None:
    with torch.device(device):
        model = mlp()
    with pytest.raises(EstimateError) as raised:
        ap.memory_estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64), loss_fn=_bad_target)
    text = str(raised.value)
    assert "the model ran, but loss_fn raised on its output (a tensor (32, 10) float32" in text
    assert "ValueError: Expected target size (32, 5), got (32, 10)." in text
    assert "second line" not in text and "on this sample batch" not in text
    assert ("on the meta device" in text) == (device == "meta")


def test_a_loss_fn_that_reads_values_still_runs_on_a_cpu_copy() -> None:
    model = mlp()

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # a value (impossible on the meta device), read without saving for backward
            if output.abs().max().item() < 0:
                raise AssertionError
        return output.sum()

    est = ap.memory_estimate(model, torch.optim.AdamW(model.parameters()), torch.randn(32, 64), loss_fn=loss_fn)
    assert est.ran_on == "cpu" and est.activation_bytes == ACTIVATIONS


# -- dtype mismatch --------------------------------------------------------------------------------


def test_a_float16_model_with_a_float32_batch_is_said_to_raise_not_estimated() -> None:
    model = mlp().half()
    with pytest.raises(EstimateError) as raised:
        ap.memory_estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(32, 64))
    text = str(raised.value)
    assert "must have the same dtype" in text  # the cpu kernel's own words: the step raises there
    assert "The batch is float32 and the model's parameters float16" in text and "x.to(torch.float16)" in text


def test_a_float16_meta_model_with_a_float32_batch_is_said_to_raise() -> None:
    with torch.device("meta"):
        model = mlp().half()
    with pytest.raises(EstimateError) as raised:
        ap.memory_estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(32, 64))
    text = str(raised.value)
    assert "the step raises on a real device, so it is not estimated: dtype mismatch in addmm" in text
    assert "must have one dtype, but got float" in text and "x.to(torch.float16)" in text


def test_a_layer_norm_of_another_dtype_than_its_input_is_said_to_raise() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.LayerNorm(64).half())
    with pytest.raises(EstimateError, match="dtype mismatch in layer_norm: a float32 input with float16 weights"):
        ap.memory_estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(32, 64))


def test_what_real_kernels_take_is_still_estimated() -> None:
    # float32 layer-norm weights on a bfloat16 input, and a float16 model fed token ids: no mismatch.
    with torch.device("meta"):
        norm = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 8).to(torch.bfloat16))
        tokens = torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 8)).half()
    ap.memory_estimate(norm, torch.optim.SGD(norm.parameters(), lr=0.1), torch.randn(4, 64, dtype=torch.bfloat16))
    est = ap.memory_estimate(tokens, torch.optim.SGD(tokens.parameters(), lr=0.1), torch.randint(0, 100, (4, 16)))
    assert est.ran_on == "meta" and est.activation_bytes > 0
