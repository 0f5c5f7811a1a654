"""The matrix's sharding facts (compat_matrix/sharding.toml) and the doctor finding built on them."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelport.compat.load import build, load_file
from accelport.errors import CompatMatrixError


@pytest.mark.parametrize(
    ("backend", "torch", "available", "engine"),
    [
        ("cpu", (2, 3), False, "none"),
        ("cpu", (2, 5), False, "_composable"),  # FSDP2 only under its private name
        ("cpu", (2, 6), True, "torch.distributed.fsdp.fully_shard"),
        ("cuda", (2, 13), True, "torch.distributed.fsdp.fully_shard"),
        ("neuron", (2, 13), True, "torch.distributed.fsdp.fully_shard"),
        ("xla", (2, 1), False, "none"),
        ("xla", (2, 2), True, "spmd_fully_sharded_data_parallel"),
        ("neuron-xla", (2, 9), True, "spmd_fully_sharded_data_parallel"),
        ("xla", (2, 10), False, "none"),  # no torch_xla at all
    ],
)
def test_shipped_facts_per_backend_and_torch(backend: str, torch: tuple[int, int], available: bool,
                                             engine: str) -> None:
    fact = build().sharding_for(backend, torch)
    assert fact is not None and fact.available is available and engine in fact.engine
    assert fact.sources and all(s.url.startswith("https://") for s in fact.sources)


def test_every_torch_minor_of_every_backend_has_a_fact() -> None:
    matrix = build()
    for backend in ("cpu", "cuda", "tpu", "neuron", "xla", "neuron-xla"):
        for minor in range(1, 16):
            assert matrix.sharding_for(backend, (2, minor)) is not None, (backend, minor)


def test_a_broken_fact_names_its_key(tmp_path: Path) -> None:
    bad = tmp_path / "mine.toml"
    bad.write_text('schema = 1\n[[sharding]]\ntorch = "2.9"\nengine = "x"\nmessage = "m"\n'
                   'sources = ["torch-fsdp2-public"]\n')
    with pytest.raises(CompatMatrixError, match=r"sharding\[0\]\.backends.*is required"):
        load_file(bad)


def test_doctor_notes_the_engine_and_warns_where_an_override_says_there_is_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelport.doctor.gather import gather

    def titles(report: dict[str, object]) -> list[tuple[str, str]]:
        return [(f["severity"], f["title"]) for f in report["findings"] if "ap.shard" in f["title"]]  # type: ignore

    env = {"ACCELPORT_BACKEND": "cpu"}
    [(severity, title)] = titles(gather(env))
    assert severity == "note" and "torch.distributed.fsdp.fully_shard (FSDP2)" in title
    override = tmp_path / "no-fsdp.toml"
    override.write_text('schema = 1\n[[sharding]]\nbackends = ["cpu"]\ntorch = ["2.1", "2.15"]\navailable = false\n'
                        'engine = "none"\nmessage = "this site builds torch without torch.distributed"\n'
                        'sources = [{title = "site policy", url = "https://example.org/policy"}]\n')
    report = gather({**env, "ACCELPORT_COMPAT_MATRIX": str(override)})
    [(severity, title)] = titles(report)
    assert severity == "warning" and title.startswith("ap.shard cannot shard on cpu with torch ")
    [fix] = [f["fix"] for f in report["findings"] if "ap.shard" in f["title"]]  # type: ignore[index]
    assert fix == "this site builds torch without torch.distributed"
