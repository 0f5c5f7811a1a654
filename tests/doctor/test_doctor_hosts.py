"""accelport doctor on fake machines: a TPU VM, a Trainium host, an NVIDIA host, a bare CPU host.

The hosts are directory trees shaped like the real /sys, /dev and /proc
(tests/fakes.py), read through ACCELPORT_SYSROOT; vendor packages are fake
dist-info entries. Nothing here is real hardware: these are stand-ins for it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from accelport.doctor.gather import gather
from accelport.doctor.render import exit_status
from tests import fakes


def report_for(monkeypatch: pytest.MonkeyPatch, root: Path) -> dict:  # type: ignore[type-arg]
    monkeypatch.setenv("ACCELPORT_SYSROOT", str(root))
    return gather()


def titled(report: dict, severity: str) -> list[str]:  # type: ignore[type-arg]
    return [f["title"] for f in report["findings"] if f["severity"] == severity]


def test_tpu_vm_without_torch_tpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    report = report_for(monkeypatch, fakes.tpu_vm(tmp_path / "host", "v5e", chips=4))
    assert report["platform"] | {"evidence": None} == {"name": "gcp-tpu", "chip": "v5e", "device_count": 4,
                                                       "evidence": None}
    assert report["selected"]["name"] == "cpu"
    assert report["recommendation"]["recommended"] == "tpu"
    assert any(t.startswith("tpu is recommended for gcp-tpu but unavailable: torch-tpu is not installed")
               for t in titled(report, "warning"))
    assert exit_status(report) == 0


def test_tpu_vm_with_torch_tpu_but_no_libtpu_is_a_problem(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fakes.install_dist(monkeypatch, tmp_path / "site", "torch-tpu", "0.2.0",
                       requires=["torch>=2.11.0,<=2.15.0", "libtpu>=0.0.50"], module="torch_tpu",
                       entry_points="[torch.backends]\ntorch_tpu = torch_tpu._loader:load\n")
    report = report_for(monkeypatch, fakes.tpu_vm(tmp_path / "host", "v6e", chips=8))
    assert report["platform"]["chip"] == "v6e" and report["packages"]["torch-tpu"] == "0.2.0"
    problems = titled(report, "problem")
    assert any("installed without libtpu" in t for t in problems)
    fixes = [f["fix"] for f in report["findings"] if "without libtpu" in f["title"]]
    assert fixes[0].startswith("pip install 'libtpu>=0.0.50'")
    assert exit_status(report) == 1


def test_tpu_vm_with_torch_outside_torch_tpus_range(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    site = tmp_path / "site"
    fakes.install_dist(monkeypatch, site, "torch", "2.9.0", module=None)
    fakes.install_dist(monkeypatch, site, "torch-tpu", "0.2.0", requires=["torch>=2.11.0,<=2.15.0",
                       "libtpu>=0.0.50"], module="torch_tpu")
    fakes.install_dist(monkeypatch, site, "libtpu", "0.0.52", module="libtpu")
    report = report_for(monkeypatch, fakes.tpu_vm(tmp_path / "host"))
    assert any("torch 2.9.0 is outside torch-tpu 0.2.0's range" in t for t in titled(report, "problem"))


def test_trainium1_host_has_no_recommended_backend_for_this_torch(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    report = report_for(monkeypatch, fakes.neuron_host(tmp_path / "host", 16, "trn1.32xlarge"))
    assert (report["platform"]["name"], report["platform"]["chip"], report["platform"]["device_count"]) == \
        ("aws-neuron", "Trainium", 16)
    assert report["selected"]["name"] == "cpu"
    (warning,) = [f for f in report["findings"] if f["title"].startswith("no backend is recommended")]
    assert "neuron-xla" in warning["fix"] and "torch 2.9" in warning["fix"]


def test_nvidia_host_with_a_cpu_only_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    report = report_for(monkeypatch, fakes.nvidia_host(tmp_path / "host", 8))
    assert (report["platform"]["name"], report["platform"]["device_count"]) == ("nvidia-gpu", 8)
    assert "H100" in report["platform"]["chip"]
    assert report["selected"]["name"] == "cpu"
    assert any(t.startswith("cuda is recommended for nvidia-gpu but unavailable") and "CPU-only build" in t
               for t in titled(report, "warning"))


def test_bare_cpu_host_is_all_clear(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    report = report_for(monkeypatch, fakes.bare_cpu_host(tmp_path / "host"))
    assert report["platform"]["name"] == "cpu" and report["selected"]["name"] == "cpu"
    assert titled(report, "warning") == [] and titled(report, "problem") == []
    assert exit_status(report) == 0


def test_missing_or_unreadable_system_tree_is_not_a_crash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = report_for(monkeypatch, tmp_path / "does-not-exist")
    assert report["platform"]["name"] == "cpu"
    # Said once, by the core, with its fix; no plugin fails over it.
    [found] = [f for f in report["findings"] if "ACCELPORT_SYSROOT=" in f["title"]]
    assert found["severity"] == "problem" and found["fix"] == "fix or unset ACCELPORT_SYSROOT"
    assert not [w for w in caught if "was disabled" in str(w.message)], [str(w.message) for w in caught]
    locked = tmp_path / "locked"
    fakes.tpu_vm(locked)
    (locked / "sys").chmod(0)
    try:
        report = report_for(monkeypatch, locked)
        assert report["platform"]["name"] in ("cpu", "gcp-tpu")  # root may still read it
    finally:
        (locked / "sys").chmod(0o755)


def test_pjrt_device_tpu_without_a_tpu_is_a_problem(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    report = report_for(monkeypatch, fakes.bare_cpu_host(tmp_path / "host"))
    (found,) = [f for f in report["findings"] if f["title"].startswith("PJRT_DEVICE=TPU but there are no TPU")]
    assert found["severity"] == "problem" and "PJRT_DEVICE=CPU" in found["fix"] and found["check"] == "xla"
    assert exit_status(report) == 1
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    # XLA:CPU needs no TPU: no "no TPU here" problem. (Without torch_xla here, the request for
    # XLA itself goes unmet, which is a warning of its own: tests/runtime/test_selection.py.)
    found = [f for f in gather()["findings"] if f["title"].startswith("PJRT_DEVICE")]
    assert not [f for f in found if f["severity"] == "problem" or "there are no" in f["title"]]


def test_torch_xla_minor_mismatch_is_a_problem(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A stand-in torch_xla 2.9.0 next to the real torch 2.13: the pairing torch_xla needs is broken.
    fakes.install_dist(monkeypatch, tmp_path / "site", "torch_xla", "2.9.0", module="torch_xla")
    report = report_for(monkeypatch, fakes.bare_cpu_host(tmp_path / "host"))
    (found,) = [f for f in report["findings"] if f["title"].startswith("xla: torch ")]
    assert "but torch_xla 2.9.0: torch_xla 2.9 needs torch 2.9 exactly" in found["title"]
    assert found["severity"] == "problem" and "torch==2.9.0 torch_xla==2.9.0" in found["fix"]


def test_choosing_the_deprecated_path_on_a_tpu_vm_is_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    # Stand-ins: torch_xla and libtpu for this torch, on a fake v5e TPU VM; xla forced.
    torch_version = report_for(monkeypatch, fakes.bare_cpu_host(tmp_path / "bare"))["packages"]["torch"]
    minor = ".".join(torch_version.split(".")[:2])
    fakes.install_dist(monkeypatch, tmp_path / "site", "torch_xla", f"{minor}.0", module="torch_xla")
    fakes.install_dist(monkeypatch, tmp_path / "site", "libtpu", "0.0.52", module="libtpu")
    monkeypatch.setenv("ACCELPORT_BACKEND", "xla")
    report = report_for(monkeypatch, fakes.tpu_vm(tmp_path / "host", "v5e", chips=4))
    assert report["selected"]["name"] == "xla"
    (found,) = [f for f in report["findings"] if f["title"].startswith("the selected path is deprecated")]
    assert found["severity"] == "warning"
    assert found["title"] == ("the selected path is deprecated or unsupported: "
                              f"xla on gcp-tpu with torch {torch_version}")
    assert "tpu" in found["fix"]  # it names the path to move to
    assert exit_status(report) == 0


def test_unwritable_neuron_cache_is_a_problem(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(blocker / "cache"))
    report = report_for(monkeypatch, fakes.neuron_host(tmp_path / "host", 16, "trn1.32xlarge"))
    (found,) = [f for f in report["findings"] if "Neuron compile cache" in f["title"]]
    assert found["severity"] == "problem" and "NEURON_COMPILE_CACHE_URL" in found["fix"]
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "fine" / "cache"))
    assert not [f for f in gather()["findings"] if "Neuron compile cache" in f["title"]]


def test_doctor_says_the_devices_memory_from_the_matrix_without_touching_them(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    report = report_for(monkeypatch, fakes.tpu_vm(tmp_path / "tpu", "v5e", chips=4))
    assert report["memory"] | {"sources": None} == {
        "device": "v5e", "per": "chip", "capacity_bytes": 16 << 30, "devices_per_chip": 1, "device_bytes": 16 << 30,
        "chips": 4, "sources": None}
    assert "https://docs.cloud.google.com/tpu/docs/v5e" in [s["url"] for s in report["memory"]["sources"]]
    assert any(t.startswith("device memory: 4 x TPU v5e, 16.0 GiB of HBM per chip (the compatibility matrix: "
                            "https://docs.cloud.google.com/tpu/docs/v5e") for t in titled(report, "note"))
    report = report_for(monkeypatch, fakes.neuron_host(tmp_path / "trn", instance="trn2.48xlarge"))
    assert (report["memory"]["device"], report["memory"]["chips"]) == ("trn2", 16)
    assert (report["memory"]["capacity_bytes"], report["memory"]["device_bytes"]) == (96 << 30, 24 << 30)
    assert any(t.startswith("device memory: 16 x Trainium2, 96.0 GiB of HBM per chip, 4 devices of 24.0 GiB each")
               for t in titled(report, "note"))


def test_doctor_on_a_cpu_host_says_the_hosts_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = fakes.bare_cpu_host(tmp_path / "cpu")
    fakes.write(root, "/proc/meminfo", "MemTotal:       16384000 kB\nMemFree:         1000 kB\n")
    fakes.write(root, "/sys/fs/cgroup/memory.max", "8589934592\n")  # a container's limit, lower
    report = report_for(monkeypatch, root)
    assert report["memory"] == {"device": "host", "per": "host", "capacity_bytes": 8 << 30}
    assert any(t.startswith("host memory: 8.0 GiB (MemTotal, or a lower cgroup limit)") for t in titled(report, "note"))
