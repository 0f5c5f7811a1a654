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
