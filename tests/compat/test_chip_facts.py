"""The matrix's chip facts: HBM per chip and devices per chip, sourced, validated like every row."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

import accelport as ap
from accelport.compat import load, schema
from accelport.compat.machine import CHIPS

ROOT = pathlib.Path(__file__).resolve().parents[2]
GiB = 1 << 30


def test_shipped_chips_have_their_memory_and_sources() -> None:
    chips = {fact.name: fact for fact in load.shipped().chips}
    assert {name: (fact.hbm_bytes // GiB, fact.devices) for name, fact in chips.items()} == {
        "v4": (32, 1), "v5e": (16, 1), "v5p": (95, 1), "v6e": (32, 1), "7x": (192, 2),
        "trn1": (32, 2), "trn2": (96, 4), "trn3": (144, 1), "inf2": (32, 2)}
    assert set(chips) == set(CHIPS) - {"v2/v3"}  # one matrix name for two chips of different memory
    for fact in chips.values():
        assert fact.sources and all(s.url.startswith("https://") for s in fact.sources)
        assert fact.confirmed or (fact.note and len(fact.note) > 20)
    assert chips["7x"].device_bytes == 96 * GiB and chips["trn2"].device_bytes == 24 * GiB


def test_every_chip_key_is_documented() -> None:
    doc = (ROOT / "docs" / "compat-matrix.md").read_text()
    assert "#### `chips`" in doc
    for key in schema.CHIP_KEYS:
        assert f"`{key}`" in doc, key


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "m.toml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(("body", "key", "words"), [
    ('chip = "v9z"\nhbm_gib = 16', "chips[0].chip", "unknown chip 'v9z'"),
    ('chip = "v5e"\nhbm_gib = 0', "chips[0].hbm_gib", "a number above 0"),
    ('chip = "v5e"\nhbm_gib = "16"', "chips[0].hbm_gib", "a number above 0"),
    ('chip = "v5e"\nhbm_gib = 16\ndevices = 0', "chips[0].devices", "1 to 64"),
    ('chip = "v5e"\nhbm_gib = 16\nconfirmed = false', "chips[0].note", "what is unconfirmed"),
    ('chip = "v5e"\nhbm_gb = 16', "chips[0].hbm_gb", "unknown key (did you mean 'hbm_gib'?)"),
])
def test_a_bad_chip_fact_names_the_file_and_key(tmp_path: pathlib.Path, body: str, key: str, words: str) -> None:
    path = write(tmp_path, f'[[chips]]\n{body}\nsources = [{{ title = "t", url = "https://example.org/" }}]\n')
    with pytest.raises(ap.CompatMatrixError) as info:
        load.load_file(path)
    assert str(path) in str(info.value) and key in str(info.value) and words in str(info.value)


def test_an_override_file_gives_a_chip_other_memory(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, """
        [[chips]]
        chip = "tpu-v5-lite"
        hbm_gib = 15.75
        sources = [{ title = "what our allocator reports", url = "https://example.org/limit" }]
        """)
    matrix = load.build(None, {"ACCELPORT_COMPAT_MATRIX": str(path)})
    assert matrix.chips["v5e"].hbm_bytes == int(15.75 * GiB)  # an alias, read as the matrix's name
    assert matrix.chips["v5p"].hbm_bytes == 95 * GiB  # the shipped facts for the rest
