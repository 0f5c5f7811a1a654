"""Every example runs (short form) on the default backend; tests/xla/ runs them on XLA:CPU."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quickstart_learns() -> None:
    assert load_example("quickstart").main(steps=120) < 0.3


def test_digits_classifier_learns() -> None:
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (in the test extra)")
    accuracy = load_example("digits").main(epochs=2, max_steps=40)
    assert accuracy > 0.75


def test_char_lm_bucketing_keeps_shapes_to_the_buckets() -> None:
    example = load_example("char_lm")
    result = example.main(padding="bucket", steps=20)
    assert result["metrics"].steps == 20
    assert result["metrics"].batch_signatures <= len(example.BUCKETS)
    assert result["losses"][-1] < result["losses"][0]


def test_char_lm_batch_max_padding_makes_many_shapes() -> None:
    result = load_example("char_lm").main(padding="batch-max", steps=20)
    # On an eager backend this costs nothing; on XLA each of these shapes is a compilation.
    assert result["metrics"].batch_signatures > 8
    assert "recompilation" not in result["diagnoses"]  # eager cpu compiles nothing


def test_data_parallel_example_on_two_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess

    import torch

    ckpt = tmp_path / "dp.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    out = subprocess.run(
        [sys.executable, "-m", "accelport", "launch", "--backend", "cpu", "--nprocs", "2",
         str(EXAMPLES / "data_parallel.py"), "--steps", "40", "--checkpoint", str(ckpt)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 replica(s) on cpu" in out.stdout
    assert out.stdout.count("replicas agree") == 1  # printed by the main process only
    final = float(out.stdout.split("final loss ")[1].split()[0])
    assert final < 0.1
    state = torch.load(ckpt, weights_only=True)
    assert state["model"]["weight"].shape == (1, 16)
