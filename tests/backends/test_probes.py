"""The cuda, tpu and neuron probes: fake hosts plus fake installed packages (metadata only).

The vendor packages cannot be installed here (TorchNeuron is on AWS's index only;
a CUDA torch is 7 GB), so their *metadata* is faked: a ``*.dist-info`` directory
that importlib.metadata reads like a pip-installed one. Nothing is imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401 - imported before any fake distribution can join torch's backend autoload

import accelport as ap
from accelport import _packages
from accelport._backends.cuda import probe_cuda, visible_gpus
from accelport._backends.neuron import probe_neuron
from accelport._backends.tpu import NO_CHIPS, keep_tpu_runtime_from_waiting, probe_tpu, tpu_findings
from tests import fakes

TORCH_TPU_REQUIRES = ("numpy>=2", "libtpu>=0.0.50", "torch>=2.11.0,<=2.15.0")
TORCH_TPU_ENTRY_POINTS = "[torch.backends]\ntorch_tpu = torch_tpu._loader:load\n"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    return tmp_path / "site"


def torch_tpu_installed(monkeypatch: pytest.MonkeyPatch, site: Path, *, libtpu: str | None = "0.0.52",
                        libtpu_module: bool = True, requires: tuple[str, ...] = TORCH_TPU_REQUIRES) -> None:
    fakes.install_dist(monkeypatch, site, "torch-tpu", "0.2.0", requires=requires,
                       entry_points=TORCH_TPU_ENTRY_POINTS)
    if libtpu is not None:
        fakes.install_dist(monkeypatch, site, "libtpu", libtpu, module="libtpu" if libtpu_module else None)


# -- cuda ---------------------------------------------------------------------------------


def test_cuda_on_this_machine_names_what_is_missing() -> None:
    probe = probe_cuda()
    assert not probe.available
    assert probe.reason.startswith("no NVIDIA GPU found") or "CPU-only build" in probe.reason


def test_cuda_available_with_a_cuda_build_on_an_nvidia_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            site: Path) -> None:
    fakes.nvidia_host(tmp_path / "host", 8)
    fakes.install_dist(monkeypatch, site, "torch", "2.13.0+cu128")
    assert _packages.torch_build() == "cuda"
    probe = probe_cuda(str(tmp_path / "host"), {})
    assert probe.available and probe.device_count == 8
    assert probe.reason == "8 NVIDIA GPU(s) (NVIDIA H100 80GB HBM3) with torch 2.13.0+cu128"


def test_cuda_with_a_cpu_build_on_an_nvidia_host_says_install_a_cuda_build(tmp_path: Path) -> None:
    fakes.nvidia_host(tmp_path, 2)
    if _packages.torch_build() != "cpu":
        pytest.skip("this environment's torch is not a CPU build")
    probe = probe_cuda(str(tmp_path), {})
    assert not probe.available and "CPU-only build; install a CUDA build of torch" in probe.reason


@pytest.mark.parametrize("spec, reason", [
    ("", "CUDA_VISIBLE_DEVICES='' hides all 8 NVIDIA GPU(s) from this process"),
    ("-1", "CUDA_VISIBLE_DEVICES='-1' hides all 8 NVIDIA GPU(s) from this process"),
    ("0,1", "2 of 8 NVIDIA GPU(s)"),
    ("GPU-5d1f0c2a", "1 of 8 NVIDIA GPU(s)"),
])
def test_cuda_visible_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site: Path, spec: str,
                              reason: str) -> None:
    fakes.nvidia_host(tmp_path / "host", 8)
    fakes.install_dist(monkeypatch, site, "torch", "2.13.0+cu128")
    probe = probe_cuda(str(tmp_path / "host"), {"CUDA_VISIBLE_DEVICES": spec})
    assert reason in probe.reason
    assert probe.details["CUDA_VISIBLE_DEVICES"] == spec


@pytest.mark.parametrize("spec, present, visible", [
    (None, 4, 4), ("", 4, 0), ("0", 4, 1), ("3,1", 4, 2), ("1,7,2", 4, 1), ("-1,0", 4, 0),
    ("GPU-a,GPU-b", 4, 2), ("MIG-x", 4, 1), ("0,0,0,0,0", 2, 2), ("banana", 4, 0),
])
def test_visible_gpus_follows_cudas_rule(spec: str | None, present: int, visible: int) -> None:
    assert visible_gpus(spec, present) == visible


def test_torch_build_is_read_without_importing_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from accelport import _packages; b = _packages.torch_build(); "
                               "print(b, 'torch' in sys.modules)"],
        capture_output=True, text=True, timeout=60, check=True)
    build, imported = out.stdout.split()
    assert build in {"cpu", "cuda", "rocm"} and imported == "False"


# -- tpu ----------------------------------------------------------------------------------


def test_tpu_without_chips_or_package() -> None:
    probe = probe_tpu(environ={})
    if _packages.version("torch-tpu") is None:
        assert probe.reason == f"{NO_CHIPS}; torch-tpu is not installed (pip install torch-tpu)"
    assert not probe.available and probe.reason.startswith("no TPU chips found")


def test_tpu_available_on_a_v5e_vm_with_torch_tpu_and_libtpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            site: Path) -> None:
    fakes.tpu_vm(tmp_path / "host", "v5e", 4)
    torch_tpu_installed(monkeypatch, site)
    probe = probe_tpu(str(tmp_path / "host"), {})
    torch_v = _packages.version("torch")
    assert probe.available and probe.device_count == 4
    assert probe.reason == f"4 TPU v5e chip(s) with torch-tpu 0.2.0, libtpu 0.0.52, torch {torch_v}"
    assert probe.details["torch range"] == ">=2.11.0,<=2.15.0"  # read from torch-tpu's own metadata
    assert probe.details["libtpu range"] == ">=0.0.50"
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in probe.details["autoload"]
    assert "warning" not in probe.details


def test_torch_tpu_without_libtpu_warns_that_import_torch_aborts(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 site: Path) -> None:
    fakes.tpu_vm(tmp_path / "host", "v6e", 8)
    torch_tpu_installed(monkeypatch, site, libtpu=None)
    probe = probe_tpu(str(tmp_path / "host"), {})
    assert not probe.available
    assert ("torch-tpu 0.2.0 is installed but libtpu is not, so `import torch` aborts the process "
            "('libtpu not found.'): pip install 'libtpu>=0.0.50'") in probe.reason
    assert "libtpu not found" in probe.details["warning"]
    (finding,) = [f for f in tpu_findings(str(tmp_path / "host"), {}) if f.check == "tpu: libtpu"]
    assert finding.severity == "problem" and finding.fix.startswith("pip install 'libtpu>=0.0.50'")


def test_libtpu_metadata_without_the_module_is_still_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             site: Path) -> None:
    fakes.tpu_vm(tmp_path / "host", "v5e", 1)
    torch_tpu_installed(monkeypatch, site, libtpu_module=False)
    assert "libtpu is not" in probe_tpu(str(tmp_path / "host"), {}).reason


def test_libtpu_older_than_torch_tpu_requires(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site: Path) -> None:
    fakes.tpu_vm(tmp_path / "host", "v5e", 1)
    torch_tpu_installed(monkeypatch, site, libtpu="0.0.40")
    assert ("libtpu 0.0.40 does not meet torch-tpu 0.2.0's requirement libtpu>=0.0.50"
            in probe_tpu(str(tmp_path / "host"), {}).reason)


def test_torch_outside_torch_tpus_range_comes_from_its_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               site: Path) -> None:
    fakes.tpu_vm(tmp_path / "host", "v5e", 1)
    # A torch-tpu whose range excludes the installed torch: the probe reads the range, it does not know it.
    torch_tpu_installed(monkeypatch, site, requires=("libtpu>=0.0.50", "torch>=2.14,<2.16"))
    torch_v = _packages.version("torch")
    probe = probe_tpu(str(tmp_path / "host"), {})
    assert f"torch {torch_v} is outside torch-tpu 0.2.0's supported range torch>=2.14,<2.16" in probe.reason
    assert [f.check for f in tpu_findings(str(tmp_path / "host"), {})] == ["tpu: torch version"]


def test_a_torch_newer_than_the_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site: Path) -> None:
    fakes.tpu_vm(tmp_path / "host", "v5e", 1)
    torch_tpu_installed(monkeypatch, site)
    fakes.install_dist(monkeypatch, tmp_path / "site-torch", "torch", "2.16.0")
    assert "torch 2.16.0 is outside torch-tpu 0.2.0's supported range torch>=2.11.0,<=2.15.0" in \
        probe_tpu(str(tmp_path / "host"), {}).reason


def test_autoload_switched_off_keeps_the_tpu_device_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         site: Path) -> None:
    fakes.tpu_vm(tmp_path / "host", "v5e", 4)
    torch_tpu_installed(monkeypatch, site)
    probe = probe_tpu(str(tmp_path / "host"), {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert not probe.available
    assert probe.reason.startswith("TORCH_DEVICE_BACKEND_AUTOLOAD=0 stops TorchTPU from registering the tpu device")


def test_autoload_note_on_a_machine_without_a_tpu(monkeypatch: pytest.MonkeyPatch, site: Path,
                                                  tmp_path: Path) -> None:
    fakes.bare_cpu_host(tmp_path / "host")
    torch_tpu_installed(monkeypatch, site)
    assert [f.severity for f in tpu_findings(str(tmp_path / "host"), {})] == ["warning"]
    assert tpu_findings(str(tmp_path / "host"), {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}) == []
    probe = probe_tpu(str(tmp_path / "host"), {})
    assert probe.reason == NO_CHIPS and "torch.backends" in probe.details["autoload"]


def test_a_stray_tpu_runtime_start_is_made_to_fail_fast_only_where_there_is_no_tpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site: Path) -> None:
    bare, vm = fakes.bare_cpu_host(tmp_path / "bare"), fakes.tpu_vm(tmp_path / "vm", "v5e", 4)
    env: dict[str, str] = {}
    assert not keep_tpu_runtime_from_waiting(str(bare), env) and env == {}  # torch-tpu not installed
    torch_tpu_installed(monkeypatch, site)
    assert keep_tpu_runtime_from_waiting(str(bare), env) and env == {"TPU_SKIP_MDS_QUERY": "1"}
    for keep in ({"TPU_SKIP_MDS_QUERY": "0"}, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
                 {"TPU_ACCELERATOR_TYPE": "v5litepod-4"}):
        env = dict(keep)
        assert not keep_tpu_runtime_from_waiting(str(bare), env) and env == keep  # the user's settings win
    env = {}
    assert not keep_tpu_runtime_from_waiting(str(vm), env) and env == {}  # a TPU VM needs the metadata server


def test_tpu_chips_hidden_from_a_container_are_available_with_a_warning(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        site: Path) -> None:
    fakes.tpu_vm(tmp_path / "host", "v5e", 4, vfio=False)
    torch_tpu_installed(monkeypatch, site)
    probe = probe_tpu(str(tmp_path / "host"), {})
    assert probe.available and "--privileged or --device" in probe.details["warning"]


# -- neuron -------------------------------------------------------------------------------


def torch_neuronx_installed(monkeypatch: pytest.MonkeyPatch, site: Path, version: str,
                            requires: tuple[str, ...] = ()) -> None:
    fakes.install_dist(monkeypatch, site, "torch-neuronx", version, requires=requires)


@pytest.mark.parametrize("version, kind", [
    ("2.13.3.0", "native"), ("2.14.3.0", "native"), ("3.0.0", "native"),
    ("2.9.0.2.11", "legacy"), ("2.1.2.2.3.0", "legacy"), ("1.13.1.1.17.0", "legacy"),
    ("2.11.0.0", "private-beta"), ("2.12.1", "private-beta"),
    ("", None), ("not-a-version", None),
])
def test_torch_neuronx_kind_is_decided_by_version(version: str, kind: str | None) -> None:
    assert _packages.torch_neuronx_kind(version) == kind


def test_neuron_without_devices_or_package() -> None:
    probe = probe_neuron(environ={})
    assert not probe.available and probe.reason.startswith("no Neuron devices found (no /dev/neuron<N>)")
    if _packages.version("torch-neuronx") is None:
        assert "torch-neuronx is not installed: pip install 'torch-neuronx>=2.13' --extra-index-url" in probe.reason


def test_neuron_available_on_trn2_with_torchneuron(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   site: Path) -> None:
    fakes.neuron_host(tmp_path / "host", 16, "trn2.48xlarge")
    torch_v = _packages.version("torch")
    minor = ".".join(torch_v.split(".")[:2])
    torch_neuronx_installed(monkeypatch, site, f"{minor}.3.0", requires=(f"torch=={minor}.*",))
    probe = probe_neuron(str(tmp_path / "host"), {})
    assert probe.available and probe.device_count == 16
    assert probe.reason == f"16 Trainium2 Neuron device(s) with torch-neuronx {minor}.3.0, torch {torch_v}"
    assert probe.details["torch-neuronx kind"] == "native" and probe.details["torch range"] == f"=={minor}.*"


def test_neuron_reports_cores_from_neuron_ls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site: Path) -> None:
    fakes.neuron_host(tmp_path / "host", 2, "trn2.48xlarge")
    fakes.neuron_ls(tmp_path / "host", "echo '[{\"nc_count\": 8}, {\"nc_count\": 8}]'\n")
    torch_v = _packages.version("torch")
    torch_neuronx_installed(monkeypatch, site, f"{torch_v.split('+')[0]}.0")
    assert ", 16 NeuronCores with" in probe_neuron(str(tmp_path / "host"), {}).reason


def test_neuron_torch_mismatch_from_requires_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  site: Path) -> None:
    fakes.neuron_host(tmp_path / "host", 16, "trn2.48xlarge")
    torch_neuronx_installed(monkeypatch, site, "2.14.3.0", requires=("torch==2.14.*",))
    fakes.install_dist(monkeypatch, tmp_path / "site-torch", "torch", "2.13.0")
    probe = probe_neuron(str(tmp_path / "host"), {})
    assert probe.reason == "torch-neuronx 2.14.3.0 needs torch==2.14.*, but torch 2.13.0 is installed"


def test_neuron_torch_mismatch_without_requires_dist_uses_major_minor(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      site: Path) -> None:
    fakes.neuron_host(tmp_path / "host", 16, "trn3.48xlarge")
    torch_neuronx_installed(monkeypatch, site, "2.14.3.0")
    fakes.install_dist(monkeypatch, tmp_path / "site-torch", "torch", "2.13.0")
    assert probe_neuron(str(tmp_path / "host"), {}).reason == (
        "torch-neuronx 2.14.3.0 needs the torch of the same major.minor, but torch 2.13.0 is installed")


def test_legacy_torch_neuronx_points_to_neuron_xla(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   site: Path) -> None:
    fakes.neuron_host(tmp_path / "host", 16, "trn2.48xlarge")
    torch_neuronx_installed(monkeypatch, site, "2.9.0.2.11", requires=("torch==2.9.*",))
    probe = probe_neuron(str(tmp_path / "host"), {})
    assert not probe.available
    assert probe.reason == ("torch-neuronx 2.9.0.2.11 is the legacy XLA-based library (2.9 and earlier), which the "
                            "neuron-xla backend drives; the neuron device needs torch-neuronx 2.13 or later")


def test_torchneuron_on_trn1_is_refused_with_the_way_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         site: Path) -> None:
    fakes.neuron_host(tmp_path / "host", 16, "trn1.32xlarge")
    torch_neuronx_installed(monkeypatch, site, "2.13.3.0")
    probe = probe_neuron(str(tmp_path / "host"), {})
    assert probe.reason.startswith("TorchNeuron runs on Trn2 and Trn3 only and this host is trn1.32xlarge "
                                   "(Trainium): use torch-neuronx 2.9 or earlier with the neuron-xla backend")


def test_private_beta_builds_are_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, site: Path) -> None:
    fakes.neuron_host(tmp_path / "host", 16, "trn2.48xlarge")
    torch_neuronx_installed(monkeypatch, site, "2.11.0.0")
    assert "private-beta TorchNeuron build" in probe_neuron(str(tmp_path / "host"), {}).details["note"]


def test_unknown_instance_type_is_a_note_not_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       site: Path) -> None:
    fakes.neuron_host(tmp_path / "host", 4, instance=None)
    torch_v = _packages.version("torch")
    torch_neuronx_installed(monkeypatch, site, f"{torch_v.split('+')[0]}.0")
    probe = probe_neuron(str(tmp_path / "host"), {})
    assert probe.available and "Trn2 or Trn3" in probe.details["note"]


# -- the whole picture, through the command line --------------------------------------------


def _backends_json(env: dict[str, str]) -> dict:  # type: ignore[type-arg]
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    full.update(env)
    out = subprocess.run([sys.executable, "-m", "accelport", "backends", "--json"], capture_output=True,
                         text=True, env=full, timeout=120)
    return json.loads(out.stdout)


def test_every_backend_is_listed_with_a_reason() -> None:
    data = _backends_json({})
    by_name = {b["name"]: b for b in data["backends"]}
    assert {"cpu", "cuda", "xla", "tpu", "neuron", "neuron-xla"} <= set(by_name)
    assert all(isinstance(b["reason"], str) and b["reason"] for b in data["backends"])
    assert by_name["cpu"]["available"] and data["selected"]["name"] == "cpu"
    assert by_name["cuda"]["reason"].startswith("no NVIDIA GPU found")
    assert by_name["tpu"]["reason"].startswith("no TPU chips found")
    assert by_name["neuron"]["reason"].startswith("no Neuron devices found")
    # This environment has no torch_xla: both lazy backends say what to install.
    assert "torch_xla is not installed" in by_name["xla"]["reason"]
    assert "torch_xla is not installed" in by_name["neuron-xla"]["reason"]
    assert "torch-neuronx is not installed" in by_name["neuron-xla"]["reason"]


@pytest.mark.parametrize("host, backend, not_said, selected_reason", [
    ("tpu", "tpu", "no TPU chips found", "no accelerator backend is available on this machine (gcp-tpu, v5e"),
    ("trn2", "neuron", "no Neuron devices found", "(aws-neuron, Trainium2, 16 devices)"),
])
def test_a_captured_host_tree_through_accelport_sysroot(tmp_path: Path, host: str, backend: str, not_said: str,
                                                        selected_reason: str) -> None:
    if host == "tpu":
        fakes.tpu_vm(tmp_path, "v5e", 4)
    else:
        fakes.neuron_host(tmp_path, 16, "trn2.48xlarge")
    data = _backends_json({"ACCELPORT_SYSROOT": str(tmp_path)})
    reason = {b["name"]: b for b in data["backends"]}[backend]["reason"]
    if _packages.version("torch-tpu" if backend == "tpu" else "torch-neuronx") is None:
        assert not_said not in reason and "is not installed" in reason
    assert data["selected"]["name"] == "cpu" and selected_reason in data["selected"]["reason"]


def test_ap_backends_lists_the_new_backends_in_process() -> None:
    names = [b.name for b in ap.backends()]
    assert set(names) >= {"cpu", "cuda", "xla", "tpu", "neuron", "neuron-xla"}
    assert names[:2] == ["cpu", "cuda"]
