"""The matrix data: meta-tests over the shipped files, schema errors, overrides and plugin rows."""

from __future__ import annotations

import pathlib
import textwrap
import warnings

import pytest

import accelport as ap
from accelport.compat import load, schema
from accelport.compat.schema import STATUSES, WORKING, minor_str
from accelport.compat.verdict import recommend
from accelport.platform import PLATFORMS
from accelport.runtime.state import RUNTIME

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIX = ("cpu", "cuda", "xla", "tpu", "neuron", "neuron-xla")
COVER = [(2, n) for n in range(1, 16)]  # torch 2.1 to 2.15


def quiet(platform: str, torch: str, **kw: object):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ap.CompatibilityWarning)
        kw.setdefault("matrix", RUNTIME.matrix())  # the matrix in effect: shipped, plugin rows, overrides
        return recommend(platform, torch, **kw)  # type: ignore[arg-type]


# -- meta-tests over the shipped data --------------------------------------------------------


def test_every_registered_backend_appears_on_its_platform() -> None:
    mx = load.build()
    registered = RUNTIME.host().backends
    assert registered, "no backend registered"
    for name, backend in registered.items():
        assert name in mx.backends(backend.platform), f"{name} has no row on {backend.platform}"


def test_the_six_backends_all_have_rows() -> None:
    mx = load.build()
    with_rows = {r.backend for r in mx.rows}
    assert set(SIX) <= with_rows


def test_every_row_has_a_source_with_a_url_and_a_date() -> None:
    for row in load.shipped().rows:
        assert row.sources, row.where
        assert all(s.title and s.url.startswith("https://") for s in row.sources), row.where
        assert row.as_of.year >= 2026, row.where
        assert row.message.strip(), row.where
        assert row.confirmed or row.note, row.where


def test_every_platform_covers_torch_2_1_to_2_15_for_each_of_its_backends() -> None:
    mx = load.build()
    for platform in PLATFORMS:
        backends = mx.backends(platform)
        assert backends, f"{platform} has no rows"
        for backend in backends:
            gaps = [minor_str(m) for m in COVER if mx.lookup(platform, backend, m) is None]
            assert not gaps, f"{backend} on {platform} has no row for torch {', '.join(gaps)}"


def test_at_most_one_recommended_backend_per_platform_and_torch() -> None:
    mx = load.build()
    for platform in PLATFORMS:
        for m in COVER:
            rec = [b for b in mx.backends(platform) if (r := mx.lookup(platform, b, m)) and r.status == "recommended"]
            assert len(rec) <= 1, (platform, m, rec)


def test_every_deprecated_row_names_a_replacement_that_has_rows() -> None:
    mx = load.build()
    for row in mx.rows:
        if row.status == "deprecated":
            assert row.replacement in {r.backend for r in mx.rows}, row.where


def test_torch_table_covers_the_matrix() -> None:
    mx = load.build()
    assert set(COVER) <= set(mx.torch)


def test_unconfirmed_facts_are_marked_and_explained() -> None:
    unconfirmed = [r for r in load.shipped().rows if not r.confirmed]
    assert unconfirmed, "the data marks its unconfirmed facts"
    assert all(r.note and len(r.note) > 20 for r in unconfirmed)


def test_every_schema_key_is_documented() -> None:
    doc = (ROOT / "docs" / "compat-matrix.md").read_text()
    for key in schema.ROW_KEYS + schema.TORCH_KEYS + schema.ENV_KEYS + schema.FILE_KEYS + schema.RELEASE_KEYS:
        assert f"`{key}`" in doc, key
    for status in STATUSES + schema.RELEASE_STATUSES:
        assert f"`{status}`" in doc, status


# -- schema errors name the file and the key ----------------------------------------------

GOOD_ROW = """
[[rows]]
platform = "cpu"
backend = "mychip"
torch = ["2.1", "2.15"]
status = "supported"
message = "runs"
as_of = 2026-12-01
sources = [{ title = "a test stand-in source", url = "https://example.org/" }]
"""


def write(tmp_path: pathlib.Path, text: str, name: str = "m.toml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_error(path: pathlib.Path) -> ap.CompatMatrixError:
    with pytest.raises(ap.CompatMatrixError) as info:
        load.load_file(path)
    assert str(path) in str(info.value)
    return info.value


def test_good_file_loads(tmp_path: pathlib.Path) -> None:
    parsed = load.load_file(write(tmp_path, GOOD_ROW))
    assert [r.backend for r in parsed.rows] == ["mychip"]


def test_bad_status_names_file_key_and_valid_statuses(tmp_path: pathlib.Path) -> None:
    err = load_error(write(tmp_path, GOOD_ROW.replace('"supported"', '"recomended"')))
    assert err.key == "rows[0].status"
    assert "did you mean 'recommended'" in str(err) and "unsupported" in str(err)


def test_overlapping_ranges_name_both_rows(tmp_path: pathlib.Path) -> None:
    second = GOOD_ROW.replace('["2.1", "2.15"]', '["2.9", "2.10"]')
    err = load_error(write(tmp_path, GOOD_ROW + second))
    assert err.key == "rows[1].torch"
    assert "overlaps" in str(err) and "rows[0]" in str(err) and "2.1-2.15" in str(err)


def test_row_without_source_is_an_error(tmp_path: pathlib.Path) -> None:
    text = GOOD_ROW.replace('sources = [{ title = "a test stand-in source", url = "https://example.org/" }]', "")
    err = load_error(write(tmp_path, text))
    assert err.key == "rows[0].sources" and "at least one source" in str(err)
    err = load_error(write(tmp_path, text + "sources = []\n", "empty.toml"))
    assert err.key == "rows[0].sources"


@pytest.mark.parametrize("old,new,key,words", [
    ('platform = "cpu"', 'platform = "mars"', "rows[0].platform", "valid platforms: gcp-tpu"),
    ('platform = "cpu"', "platform = 3", "rows[0].platform", "must be a string"),
    ('backend = "mychip"', 'backend = ["a"]', "rows[0].backend", "must be a string"),
    ('torch = ["2.1", "2.15"]', 'torch = "2.9.1"', "rows[0].torch", "major.minor"),
    ('torch = ["2.1", "2.15"]', 'torch = ["2.9", "2.1"]', "rows[0].torch", "empty"),
    ('torch = ["2.1", "2.15"]', 'torch = ["2.9", "3.1"]', "rows[0].torch", "one major"),
    ('status = "supported"', "status = true", "rows[0].status", "must be a string"),
    ('as_of = 2026-12-01', 'as_of = "last week"', "rows[0].as_of", "date"),
    ('message = "runs"', 'mesage = "runs"', "rows[0].mesage", "did you mean 'message'"),
    ('status = "supported"', 'status = "deprecated"', "rows[0].replacement", "backend to use instead"),
    ('status = "supported"', 'status = "supported"\nconfirmed = false', "rows[0].note", "unconfirmed"),
    ('status = "supported"', 'status = "supported"\npackage_version = "==1.*"', "rows[0].package_version",
     "needs 'package'"),
    ('status = "supported"', 'status = "supported"\npackage = "x"\npackage_version = "=={py}"',
     "rows[0].package_version", "placeholder"),
    ('url = "https://example.org/"', 'url = "example.org"', "rows[0].sources[0].url", "http"),
    ('sources = [{', 'sources = ["no-such-source", {', "rows[0].sources[0]", "unknown source id"),
])
def test_schema_errors_name_the_key(tmp_path: pathlib.Path, old: str, new: str, key: str, words: str) -> None:
    text = GOOD_ROW.replace(old, new, 1)
    assert text != GOOD_ROW
    err = load_error(write(tmp_path, text))
    assert err.key == key and words in str(err), str(err)


def test_toml_syntax_error_names_the_file(tmp_path: pathlib.Path) -> None:
    err = load_error(write(tmp_path, "[[rows]\nbackend = "))
    assert "not valid TOML" in str(err)


def test_missing_file_names_the_file(tmp_path: pathlib.Path) -> None:
    load_error(tmp_path / "absent.toml")


def test_shipped_source_ids_can_be_cited_from_a_user_file(tmp_path: pathlib.Path) -> None:
    text = GOOD_ROW.replace('sources = [{ title = "a test stand-in source", url = "https://example.org/" }]',
                            'sources = ["pytorch-release-matrix"]')
    parsed = load.load_file(write(tmp_path, text))
    assert "RELEASE.md" in parsed.rows[0].sources[0].title


# -- ACCELPORT_COMPAT_MATRIX adds and overrides rows ---------------------------------------


def test_override_file_adds_a_backend(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELPORT_COMPAT_MATRIX", str(write(tmp_path, GOOD_ROW)))
    v = quiet("cpu", "2.13")
    assert v.status("mychip") == "supported" and v.recommended == "cpu"
    assert str(tmp_path) in v.backends["mychip"].origin


def test_override_file_replaces_shipped_rows_over_its_range(tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    override = """
    [[rows]]
    platform = "gcp-tpu"
    backend = "xla"
    torch = "2.13"
    status = "supported"
    message = "our own torch_xla build for torch 2.13"
    as_of = 2026-12-02
    sources = [{ title = "internal build notes", url = "https://example.org/xla" }]
    """
    monkeypatch.setenv("ACCELPORT_COMPAT_MATRIX", str(write(tmp_path, override)))
    assert quiet("gcp-tpu", "2.13").status("xla") == "supported"
    assert quiet("gcp-tpu", "2.12").status("xla") == "deprecated"  # the shipped row elsewhere
    assert quiet("gcp-tpu", "2.13").recommended == "tpu"


def test_broken_override_file_is_a_clear_error_at_selection(tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, GOOD_ROW.replace('"supported"', '"fine"'))
    monkeypatch.setenv("ACCELPORT_COMPAT_MATRIX", str(path))
    with pytest.raises(ap.CompatMatrixError, match=r"rows\[0\]\.status"):
        ap.device()


def _unreadable(tmp_path: pathlib.Path, kind: str) -> str:
    """A path ACCELPORT_COMPAT_MATRIX may name that holds no readable matrix file."""
    import os

    if kind == "a process's memory":
        if not os.path.exists("/proc/self/mem"):
            pytest.skip("no /proc/self/mem here")
        return "/proc/self/mem"  # a regular file that opens, and whose read at offset 0 fails (EIO)
    if kind == "a directory":
        return str(tmp_path)
    if kind == "a FIFO":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs here")
        os.mkfifo(tmp_path / "pipe")  # no writer: opening it to read would block
        return str(tmp_path / "pipe")
    if kind == "a huge file":
        with open(tmp_path / "huge.toml", "wb") as f:
            f.truncate(load.MAX_FILE_BYTES + 1)  # sparse: costs no disk
        return str(tmp_path / "huge.toml")
    return str(tmp_path / "missing.toml")


@pytest.mark.parametrize("kind,problem", [
    ("a process's memory", "cannot be read (Input/output error): point ACCELPORT_COMPAT_MATRIX at a readable"),
    ("a directory", "is a directory: point it at a regular file"),
    ("a FIFO", "is a FIFO: point it at a regular file"),
    ("a huge file", "is larger than 4 MB: point it at the file you meant"),
    ("a missing file", "cannot be read (No such file or directory): point ACCELPORT_COMPAT_MATRIX at a readable"),
])
def test_an_override_that_cannot_be_read_is_a_matrix_error_saying_what_to_do(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        kind: str, problem: str) -> None:
    import json

    from accelport.cli import main

    path = _unreadable(tmp_path, kind)
    monkeypatch.setenv("ACCELPORT_COMPAT_MATRIX", path)
    with pytest.raises(ap.CompatMatrixError) as caught:  # not a raw OSError
        ap.device()
    assert str(caught.value).startswith(f"invalid compatibility matrix {path}: {problem}")
    assert main(["matrix", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "CompatMatrixError" and problem in data["error"]


# -- third-party rows through accelport_compat_rows ------------------------------------------

PLUGIN = '''
import accelport as ap

ROWS = [{
    "platform": "cpu", "backend": "mychip", "torch": ["2.1", "2.15"], "status": "experimental",
    "message": "mychip runs its own eager device", "as_of": "2026-12-01",
    "sources": [{"title": "mychip release notes", "url": "https://example.org/mychip"}],
    "chips": ["MyChip1"],
}]

@ap.hookimpl
def accelport_compat_rows():
    return ROWS
'''


def test_plugin_rows_join_the_matrix(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin("mychip", "mychip_rows", PLUGIN)
    v = quiet("cpu", "2.13")
    assert v.status("mychip") == "experimental"
    assert v.backends["mychip"].origin == "plugin 'mychip' rows[0]"
    assert v.ranked == ("cpu", "mychip")
    assert any(r.backend == "mychip" for r in RUNTIME.matrix().rows)


def test_invalid_plugin_row_names_the_plugin_and_is_ignored(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin("badrows", "bad_rows", PLUGIN.replace('"experimental"', '"stable"'))
    with pytest.warns(ap.PluginWarning, match=r"plugin 'badrows'.*rows\[0\]\.status.*'stable'"):
        v = quiet("cpu", "2.13")
    assert "mychip" not in v.backends and v.recommended == "cpu"
    failed = RUNTIME.host().failed
    assert failed and failed[-1].name == "badrows" and failed[-1].stage == "hook accelport_compat_rows"


def test_plugin_may_not_rewrite_shipped_rows(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin("sneaky", "sneaky_rows", PLUGIN.replace('"mychip"', '"cpu"', 1))
    with pytest.warns(ap.PluginWarning,
                      match=r"plugin 'sneaky'.*overlaps .*cpu\.toml rows\[0\].*ACCELPORT_COMPAT_MATRIX"):
        v = quiet("cpu", "2.13")
    assert v.status("cpu") == "recommended"


def test_plugin_returning_garbage_is_reported(install_plugin) -> None:  # type: ignore[no-untyped-def]
    install_plugin("garbage", "garbage_rows",
                   "import accelport as ap\n@ap.hookimpl\ndef accelport_compat_rows():\n    return 'rows'\n")
    with pytest.warns(ap.PluginWarning, match="plugin 'garbage'.*must return a list"):
        quiet("cpu", "2.13")


def test_statuses_list_is_ordered_best_first() -> None:
    assert STATUSES[0] == "recommended" and STATUSES[-1] == "unsupported"
    assert WORKING == STATUSES[:4]
