"""The lazy backends' probes (xla, neuron-xla) and Neuron's cache location: no torch_xla needed.

These run in the default environment. Hardware is a fake /sys and /dev tree;
other package versions are temporary dist-info directories found by
importlib.metadata exactly as installed ones are. A fake module raises if it
is ever imported: probes must find it without importing it.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
from collections.abc import Callable

import pytest

import accelport as ap
from accelport import _packages
from accelport._backends.neuron_xla import DEFAULT_NEURON_CACHE, NeuronXlaBackend, neuron_cache_dir
from accelport._backends.xla import XlaBackend
from accelport.lazy import pjrt_device
from accelport.platform import detect

TORCH = _packages.version("torch")


@pytest.fixture(autouse=True)
def no_pjrt_or_neuron_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("PJRT_DEVICE", "NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def site(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """install(dist=version, ..., modules=[...]): temporary distributions and never-importable modules."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))

    def install(*modules: str, **dists: str) -> None:
        for name, version in dists.items():
            name = name.replace("_", "-") if name != "torch_xla" else name
            info = root / f"{name.replace('-', '_')}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        for module in modules:
            (root / module).mkdir()
            (root / module / "__init__.py").write_text(
                f"raise ImportError('{module} here is a stand-in for detection tests: never import it')\n")
        _packages.cache_clear()

    return install


def tree(tmp_path: pathlib.Path, kind: str) -> str:
    """A fake filesystem root: 'tpu-v5e' (4 chips), 'trn1' (16 Neuron devices) or 'bare'."""
    root = tmp_path / kind
    if kind == "tpu-v5e":
        for i in range(4):
            dev = root / f"sys/bus/pci/devices/0000:00:0{i + 4}.0"
            dev.mkdir(parents=True)
            (dev / "vendor").write_text("0x1ae0\n")
            (dev / "device").write_text("0x0063\n")
    elif kind == "trn1":
        (root / "dev").mkdir(parents=True)
        for i in range(16):
            (root / f"dev/neuron{i}").write_text("")
        dmi = root / "sys/devices/virtual/dmi/id"
        dmi.mkdir(parents=True)
        (dmi / "product_name").write_text("trn1.32xlarge\n")
    else:
        (root / "sys").mkdir(parents=True)
    return str(root)


def probe(cls: type, root: str) -> ap.Probe:
    backend = cls()
    backend.root = root
    return backend.probe()


# -- xla ---------------------------------------------------------------------------------


@pytest.mark.skipif(_packages.version("torch_xla") is not None,
                    reason="torch_xla is installed here; the default environment runs this")
def test_forcing_xla_without_torch_xla_is_a_specific_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELPORT_BACKEND", "xla")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(ap.BackendUnavailableError) as info:
        ap.device()
    assert info.value.name == "xla"
    assert info.value.reason.startswith("torch_xla is not installed: ")
    assert "torch_xla X.Y needs torch X.Y" in info.value.reason
    assert "torch_xla" not in sys.modules


def test_forcing_xla_with_a_mismatched_torch_xla_names_both_versions(
        site: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    site(torch_xla="2.7.0")
    monkeypatch.setenv("ACCELPORT_BACKEND", "xla")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(ap.BackendUnavailableError) as info:
        ap.device()
    assert f"torch {TORCH} but torch_xla 2.7.0: torch_xla 2.7 needs torch 2.7 exactly" in info.value.reason
    assert "ACCELPORT_BACKEND=xla" in str(info.value)


def test_xla_on_a_tpu_vm_uses_the_tpu(site: Callable[..., None], tmp_path: pathlib.Path) -> None:
    site("libtpu", torch="2.9.0", torch_xla="2.9.0")
    p = probe(XlaBackend, tree(tmp_path, "tpu-v5e"))
    assert p.available, p.reason
    assert p.device_count == 4
    assert p.details["pjrt_device"] == "TPU" and p.details["torch_xla"] == "2.9.0"
    assert "on PJRT device TPU (gcp-tpu, v5e, 4 devices)" in p.reason


def test_xla_probe_reads_the_tree_accelport_sysroot_names(site: Callable[..., None], tmp_path: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Doctor and `accelport backends` build backends with no root of their own: the
    # probe must then read ACCELPORT_SYSROOT like every other detection, not "/".
    site("libtpu", torch="2.9.0", torch_xla="2.9.0")
    monkeypatch.setenv("ACCELPORT_SYSROOT", tree(tmp_path, "tpu-v5e"))
    p = XlaBackend().probe()
    assert p.available, p.reason
    assert p.device_count == 4 and p.details["pjrt_device"] == "TPU"


@pytest.mark.skipif(_packages.version("torch_xla") is not None,
                    reason="torch_xla is installed here; the default environment runs this")
def test_a_torch_xla_that_pairs_but_does_not_import_is_a_specific_error(
        site: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    # The versions pair, so the probe says yes; the build itself fails to load (a wheel
    # for another torch build): the error says so instead of an ImportError traceback.
    site("torch_xla", torch_xla=TORCH)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    expected = re.escape(f"torch_xla {TORCH} is installed but does not import")
    with pytest.raises(ap.AccelportError, match=expected) as info:
        ap.use("xla")
        ap.device()
    assert "reinstall both together" in str(info.value)


def test_xla_on_a_tpu_vm_without_libtpu_says_so(site: Callable[..., None], tmp_path: pathlib.Path) -> None:
    site(torch="2.9.0", torch_xla="2.9.0")
    p = probe(XlaBackend, tree(tmp_path, "tpu-v5e"))
    assert not p.available
    assert "libtpu is not installed: pip install 'torch_xla[tpu]'" in p.reason


def test_xla_on_a_plain_host_needs_pjrt_device_cpu(site: Callable[..., None], tmp_path: pathlib.Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    site(torch="2.9.0", torch_xla="2.9.0")
    root = tree(tmp_path, "bare")
    p = probe(XlaBackend, root)
    assert not p.available and "set PJRT_DEVICE=CPU to run XLA on the host CPU" in p.reason
    assert p.details["pjrt_device"] == "CPU"  # what torch_xla itself would fall back to

    monkeypatch.setenv("PJRT_DEVICE", "cpu")
    p = probe(XlaBackend, root)
    assert p.available and p.device_count == 1
    assert p.details["pjrt_device"] == "CPU" and p.details["pjrt_device_source"] == "PJRT_DEVICE=cpu"

    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    p = probe(XlaBackend, root)
    assert not p.available
    assert "PJRT_DEVICE=NEURON selects PJRT device NEURON; this backend needs PJRT_DEVICE=TPU or PJRT_DEVICE=CPU" \
        in p.reason


def test_pjrt_device_follows_torch_xla_default_order(site: Callable[..., None], tmp_path: pathlib.Path) -> None:
    tpu, bare = detect(tree(tmp_path, "tpu-v5e")), detect(tree(tmp_path, "bare"))
    assert pjrt_device({}, bare) == ("CPU", "torch_xla's default without a TPU or Neuron runtime")
    assert pjrt_device({"PJRT_DEVICE": "tpu"}, bare) == ("TPU", "PJRT_DEVICE=tpu")
    assert pjrt_device({}, tpu)[0] == "CPU"  # chips without libtpu: torch_xla would not pick TPU
    site("libtpu", "libneuronxla")
    assert pjrt_device({}, tpu)[0] == "TPU"
    assert pjrt_device({}, bare) == ("NEURON", "libneuronxla is installed")


# -- neuron-xla ----------------------------------------------------------------------------


def test_neuron_xla_here_lists_everything_missing() -> None:
    # The real machine: no torch-neuronx, no libneuronxla, no /dev/neuron*.
    with pytest.raises(ap.BackendUnavailableError) as info:
        ap.use("neuron-xla")
    reason = info.value.reason
    assert "torch-neuronx is not installed: pip install 'torch-neuronx<2.13' from the Neuron package index" in reason
    assert "libneuronxla is not installed" in reason
    assert "no Neuron devices (/dev/neuron*) on this machine (cpu)" in reason


def test_neuron_xla_on_a_trn1_with_legacy_torch_neuronx(site: Callable[..., None], tmp_path: pathlib.Path) -> None:
    site("libneuronxla", torch="2.9.0", torch_xla="2.9.0", torch_neuronx="2.9.0.2.10")
    p = probe(NeuronXlaBackend, tree(tmp_path, "trn1"))
    assert p.available, p.reason
    assert p.device_count == 16
    assert p.details["pjrt_device"] == "NEURON"
    assert p.details["pjrt_device_source"] == "libneuronxla is installed"
    assert p.details["torch-neuronx"] == "2.9.0.2.10"
    assert p.details["compile_cache"] == DEFAULT_NEURON_CACHE
    assert "on PJRT device NEURON (aws-neuron, Trainium, 16 devices)" in p.reason


def test_native_torch_neuronx_is_not_neuron_xla(site: Callable[..., None], tmp_path: pathlib.Path) -> None:
    # Same pip name: the version decides (2.13 and newer is TorchNeuron).
    site("libneuronxla", torch="2.13.0", torch_xla="2.9.0", torch_neuronx="2.13.3.0")
    p = probe(NeuronXlaBackend, tree(tmp_path, "trn1"))
    assert not p.available
    assert "torch-neuronx 2.13.3.0 is TorchNeuron, the native backend (2.13 and newer): use the 'neuron' backend" \
        in p.reason


def test_neuron_xla_with_torch_neuronx_for_another_torch(site: Callable[..., None],
                                                         tmp_path: pathlib.Path) -> None:
    site("libneuronxla", torch="2.8.0", torch_xla="2.8.0", torch_neuronx="2.9.0.2.10")
    p = probe(NeuronXlaBackend, tree(tmp_path, "trn1"))
    assert not p.available
    assert "torch 2.8.0 but torch-neuronx 2.9.0.2.10: torch-neuronx 2.9 needs torch 2.9 exactly" in p.reason


def test_neuron_xla_refuses_another_pjrt_device(site: Callable[..., None], tmp_path: pathlib.Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    site("libneuronxla", torch="2.9.0", torch_xla="2.9.0", torch_neuronx="2.9.0.2.10")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    p = probe(NeuronXlaBackend, tree(tmp_path, "trn1"))
    assert not p.available
    assert p.reason == "PJRT_DEVICE=CPU selects PJRT device CPU; this backend needs PJRT_DEVICE=NEURON"


def test_neuron_cache_location_flag_wins_over_url_over_default() -> None:
    assert neuron_cache_dir({}) == DEFAULT_NEURON_CACHE == "/var/tmp/neuron-compile-cache"
    assert neuron_cache_dir({"NEURON_COMPILE_CACHE_URL": "s3://bucket/cache"}) == "s3://bucket/cache"
    both = {"NEURON_COMPILE_CACHE_URL": "/url", "NEURON_CC_FLAGS": "--model-type=transformer --cache_dir=/flag"}
    assert neuron_cache_dir(both) == "/flag"
    assert neuron_cache_dir({"NEURON_CC_FLAGS": "--cache_dir /spaced -O1"}) == "/spaced"
    assert neuron_cache_dir({"NEURON_CC_FLAGS": "--cache_dir='/with space'"}) == "/with space"
    assert neuron_cache_dir({"NEURON_CC_FLAGS": "--no_cache", "NEURON_COMPILE_CACHE_URL": "/url"}) is None


def test_neuron_cache_location_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "/tmp/from-env")
    assert NeuronXlaBackend().compile_cache_dir() == "/tmp/from-env"


# -- the compile cache on a backend without one ---------------------------------------------


def test_compile_cache_on_cpu_says_it_does_nothing_and_the_script_goes_on(tmp_path: pathlib.Path) -> None:
    # A portable script calls ap.compile_cache() once for the backends that have one.
    ap.use("cpu")
    with pytest.warns(ap.CompatibilityWarning, match="does nothing on backend 'cpu'") as caught:
        assert ap.compile_cache(tmp_path / "cache") is None
    assert caught[0].filename == __file__  # it points at the caller's line
    assert ap.metrics().compile_cache_dir is None
    assert not os.path.exists(tmp_path / "cache")
