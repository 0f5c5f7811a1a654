"""Platform detection against fake /sys, /dev and /proc trees: real hosts and hostile ones."""

from __future__ import annotations

import os
import string
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accelport import platform
from accelport.platform import PLATFORMS, TPU_DEVICE_IDS, detect, tpu_generation
from tests import fakes

# -- the machines accelport targets --------------------------------------------------------


def test_v5e_tpu_vm(tmp_path: Path) -> None:
    fakes.tpu_vm(tmp_path, "v5e", 4)
    found = detect(str(tmp_path), {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_ID": "0"})
    assert (found.name, found.chip, found.device_count) == ("gcp-tpu", "v5e", 4)
    assert found.details["device_nodes"] == "4"
    assert found.details["TPU_ACCELERATOR_TYPE"] == "v5litepod-4"
    assert any("4 Google TPU PCI device(s)" in e for e in found.evidence)
    assert found.describe() == "gcp-tpu, v5e, 4 devices"


def test_v6e_tpu_vm_with_eight_chips(tmp_path: Path) -> None:
    fakes.tpu_vm(tmp_path, "v6e", 8)
    found = detect(str(tmp_path), {})
    assert (found.name, found.chip, found.device_count) == ("gcp-tpu", "v6e", 8)


# PCI device ids as the vendors' own code lists them (torch_xla _internal/tpu.py,
# torch_tpu utils/hardware.py), written out here so a wrong table in accelport fails.
@pytest.mark.parametrize("device_id, generation", [
    ("0x0027", "v2/v3"), ("0x005e", "v4"), ("0x0062", "v5p"), ("0x0063", "v5e"), ("0x006f", "v6e"),
    ("0x0076", "v7"),
])
def test_every_known_tpu_generation_is_read_from_the_pci_id(tmp_path: Path, device_id: str,
                                                            generation: str) -> None:
    fakes.host_basics(tmp_path)
    fakes.pci_device(tmp_path, "0000:00:06.0", "0x1ae0", device_id, iommu_group=0)
    fakes.write(tmp_path, "/dev/vfio/0")
    assert detect(str(tmp_path), {}).chip == generation
    assert set(TPU_DEVICE_IDS.values()) == {"v2/v3", "v4", "v5p", "v5e", "v6e", "v7"}


def test_v4_exposes_accel_nodes_instead_of_vfio(tmp_path: Path) -> None:
    fakes.tpu_vm(tmp_path, "v4", 4, vfio=False, accel_nodes=True)
    found = detect(str(tmp_path), {})
    assert (found.name, found.chip, found.details["device_nodes"]) == ("gcp-tpu", "v4", "4")


def test_tpu_chips_not_passed_into_a_container_are_reported(tmp_path: Path) -> None:
    fakes.tpu_vm(tmp_path, "v5e", 4, vfio=False)
    found = detect(str(tmp_path), {})
    assert found.name == "gcp-tpu" and found.details["device_nodes"] == "0"
    assert any("none exposed" in e for e in found.evidence)


def test_tpu_from_accelerator_type_and_device_nodes_when_pci_ids_are_hidden(tmp_path: Path) -> None:
    fakes.host_basics(tmp_path)
    for i in range(8):
        fakes.write(tmp_path, f"/dev/vfio/{i}")
    found = detect(str(tmp_path), {"TPU_ACCELERATOR_TYPE": "v6e-8"})
    assert (found.name, found.chip, found.device_count) == ("gcp-tpu", "v6e", 8)


def test_multi_host_slice_is_described(tmp_path: Path) -> None:
    fakes.tpu_vm(tmp_path, "v5p", 4)
    env = {"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3", "TPU_ACCELERATOR_TYPE": "v5p-32"}
    found = detect(str(tmp_path), env)
    assert "host 2 of 4 (TPU_WORKER_HOSTNAMES)" in found.evidence


def test_tpu_environment_on_a_machine_without_a_tpu_is_not_a_tpu(tmp_path: Path) -> None:
    fakes.bare_cpu_host(tmp_path)
    found = detect(str(tmp_path), {"TPU_ACCELERATOR_TYPE": "v5litepod-8"})
    assert found.name == "cpu"
    assert "TPU_ACCELERATOR_TYPE=v5litepod-8 is set but no TPU device is present" in found.evidence


def test_gce_vm_with_only_googles_nic_is_a_cpu_host(tmp_path: Path) -> None:
    fakes.host_basics(tmp_path)
    fakes.pci_device(tmp_path, "0000:00:05.0", "0x1ae0", "0x0042")  # gVNIC
    assert detect(str(tmp_path), {}).name == "cpu"


@pytest.mark.parametrize("accelerator_type, generation", [
    ("v5litepod-8", "v5e"), ("v5e-4", "v5e"), ("v5p-128", "v5p"), ("v6e-8", "v6e"), ("v4-8", "v4"),
    ("v3-8", "v2/v3"), ("v2-8", "v2/v3"), ("tpu7x-8", "v7"), ("V6E-16", "v6e"),
    ("", None), ("banana", None), ("v9-8", None), ("v5x-8", None),
])
def test_tpu_generation_from_accelerator_type(accelerator_type: str, generation: str | None) -> None:
    assert tpu_generation(accelerator_type) == generation


def test_trn1_with_sixteen_devices(tmp_path: Path) -> None:
    fakes.neuron_host(tmp_path, 16, "trn1.32xlarge")
    found = detect(str(tmp_path), {})
    assert (found.name, found.chip, found.device_count) == ("aws-neuron", "Trainium", 16)
    assert found.details["instance_type"] == "trn1.32xlarge"
    assert found.cores is None  # no neuron-ls installed: cores unknown, not guessed


def test_neuron_host_with_unknown_instance_type(tmp_path: Path) -> None:
    fakes.neuron_host(tmp_path, 2, instance=None)
    found = detect(str(tmp_path), {})
    assert (found.name, found.chip, found.device_count) == ("aws-neuron", None, 2)


def test_neuron_visible_cores_are_read(tmp_path: Path) -> None:
    fakes.neuron_host(tmp_path, 16, "trn2.48xlarge")
    found = detect(str(tmp_path), {"NEURON_RT_VISIBLE_CORES": "0-3,8"})
    assert found.chip == "Trainium2"
    assert "NEURON_RT_VISIBLE_CORES=0-3,8 (5 core(s) for this process)" in found.evidence
    bad = detect(str(tmp_path), {"NEURON_RT_VISIBLE_CORES": "all of them"})
    assert "NEURON_RT_VISIBLE_CORES=all of them (not a core list or range)" in bad.evidence


OLD_NEURON_LS = """cat <<'EOF'
[{"neuron_device": 0, "bdf": "10:1c.0", "connected_to": [1, 3], "nc_count": 8, "memory_size": 103079215104},
 {"neuron_device": 1, "bdf": "10:1d.0", "connected_to": [0, 2], "nc_count": 8, "memory_size": 103079215104}]
EOF
"""
NEW_NEURON_LS = """[ "$1" = "--json-output" ] && { echo "unknown option --json-output" >&2; exit 2; }
cat <<'EOF'
{"instance_type": "trn2.48xlarge", "neuron_devices": [{"neuron_device": 0, "nc_count": 8},
 {"neuron_device": 1, "nc_count": 8}, {"neuron_device": 2, "nc_count": 8}]}
EOF
"""


def test_neuron_ls_json_output_counts_devices_and_cores(tmp_path: Path) -> None:
    fakes.neuron_host(tmp_path, 2, "trn2.48xlarge")
    fakes.neuron_ls(tmp_path, OLD_NEURON_LS)
    found = detect(str(tmp_path), {})
    assert (found.device_count, found.cores) == (2, 16)
    assert "neuron-ls: 2 device(s), 16 NeuronCore(s)" in found.evidence


def test_neuron_ls_from_neuron_2_34_uses_output_format_json(tmp_path: Path) -> None:
    # Neuron 2.34 drops --json-output for --output-format json (aws-neuron-sdk announcement, 2026-10-16).
    fakes.neuron_host(tmp_path, 3, "trn2.48xlarge")
    fakes.neuron_ls(tmp_path, NEW_NEURON_LS)
    found = detect(str(tmp_path), {})
    assert (found.device_count, found.cores) == (3, 24)


@pytest.mark.parametrize("script, said", [
    ("echo 'this is not json'\n", "is not JSON"),
    # json.loads raises RecursionError, not ValueError: it took the whole platform down to "cpu".
    ("head -c 100000 /dev/zero | tr '\\0' '['\n", "printed JSON nested too deeply to read"),
    ("exit 3\n", "exited with status 3"),
    ("echo '[]'\n", "gave no device list"),
    ("echo '{\"nc_count\": \"eight\"}'\n", "gave no device list"),
])
def test_neuron_ls_that_misbehaves_falls_back_to_dev_nodes(tmp_path: Path, script: str, said: str) -> None:
    fakes.neuron_host(tmp_path, 16, "trn1.32xlarge")
    fakes.neuron_ls(tmp_path, script)
    found = detect(str(tmp_path), {})
    assert (found.name, found.device_count, found.cores) == ("aws-neuron", 16, None)
    assert any(said in e and "counted /dev nodes instead" in e for e in found.evidence), found.evidence


def test_a_neuron_ls_answer_that_breaks_the_reader_leaves_the_neuron_host(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever reading neuron-ls raises, the /dev/neuron nodes still say aws-neuron (not "cpu").
    def breaks(executable: str, mtime: float) -> Any:
        raise MemoryError

    fakes.neuron_host(tmp_path, 16, "trn1.32xlarge")
    fakes.neuron_ls(tmp_path, "echo '[]'\n")
    monkeypatch.setattr(platform, "_neuron_ls", breaks)
    found = detect(str(tmp_path), {})
    assert (found.name, found.chip, found.device_count) == ("aws-neuron", "Trainium", 16)
    assert "neuron-ls gave an answer that could not be read (MemoryError); counted /dev nodes instead" \
        in found.evidence


def test_neuron_ls_that_hangs_is_abandoned_after_the_timeout(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "NEURON_LS_TIMEOUT", 0.3)
    fakes.neuron_host(tmp_path, 4, "trn2.48xlarge")
    fakes.neuron_ls(tmp_path, "exec sleep 30\n")
    found = detect(str(tmp_path), {})
    assert (found.name, found.device_count) == ("aws-neuron", 4)
    assert any("did not answer within 0.3 s" in e for e in found.evidence)


def test_neuron_ls_that_is_not_executable_is_not_run(tmp_path: Path) -> None:
    fakes.neuron_host(tmp_path, 4, "trn2.48xlarge")
    fakes.write(tmp_path, platform.NEURON_LS, "#!/bin/sh\necho '[{\"nc_count\": 8}]'\n")  # mode 0644
    found = detect(str(tmp_path), {})
    assert found.cores is None and not any("neuron-ls" in e for e in found.evidence)


def test_nvidia_host(tmp_path: Path) -> None:
    fakes.nvidia_host(tmp_path, 8, "NVIDIA H100 80GB HBM3")
    found = detect(str(tmp_path), {})
    assert (found.name, found.chip, found.device_count) == ("nvidia-gpu", "NVIDIA H100 80GB HBM3", 8)


def test_nvidia_dev_nodes_without_proc_entries(tmp_path: Path) -> None:
    fakes.host_basics(tmp_path)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        fakes.write(tmp_path, f"/dev/{name}")
    found = detect(str(tmp_path), {})
    assert (found.name, found.chip, found.device_count) == ("nvidia-gpu", None, 2)


def test_nvidiactl_alone_is_not_a_gpu(tmp_path: Path) -> None:
    fakes.host_basics(tmp_path)
    fakes.write(tmp_path, "/dev/nvidiactl")
    assert detect(str(tmp_path), {}).name == "cpu"


def test_bare_cpu_host(tmp_path: Path) -> None:
    fakes.bare_cpu_host(tmp_path)
    found = detect(str(tmp_path), {})
    assert (found.name, found.chip, found.device_count) == ("cpu", None, 0)
    assert found.evidence == ("no TPU, Neuron or NVIDIA device found",)


def test_most_specific_platform_wins(tmp_path: Path) -> None:
    fakes.tpu_vm(tmp_path, "v6e", 4)
    fakes.write(tmp_path, "/dev/nvidia0")
    assert detect(str(tmp_path), {}).name == "gcp-tpu"


def test_sysroot_variable_points_detection_at_a_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes.neuron_host(tmp_path, 16, "trn1.32xlarge")
    monkeypatch.setenv("ACCELPORT_SYSROOT", str(tmp_path))
    assert detect().name == "aws-neuron"
    assert detect(str(tmp_path / "nowhere")).name == "cpu"  # an explicit root wins


def test_this_machine_is_detected_without_raising() -> None:
    assert detect().name in PLATFORMS


# -- hostile trees: never raise, never hang ----------------------------------------------------


def _detect_within(root: str, env: Any = None, seconds: float = 10.0) -> platform.PlatformInfo:
    """detect() in a thread: a test that would block forever (a FIFO) fails instead."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(detect(root, env if env is not None else {})),
                              daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"detect() did not return within {seconds} s"
    return box[0]


def test_missing_root_is_a_cpu_host(tmp_path: Path) -> None:
    assert _detect_within(str(tmp_path / "no" / "such" / "root")).name == "cpu"


def test_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert _detect_within(str(tmp_path / "file")).name == "cpu"


def test_root_with_a_nul_byte_or_of_the_wrong_type() -> None:
    assert _detect_within("/tmp/\x00bad").name == "cpu"
    found = _detect_within(42)  # type: ignore[arg-type]
    assert found.name == "cpu" and "detection failed" in found.evidence[0]


def test_directories_where_files_belong(tmp_path: Path) -> None:
    (tmp_path / "sys/bus/pci/devices/0000:00:04.0/vendor").mkdir(parents=True)
    (tmp_path / "sys/bus/pci/devices/0000:00:04.0/device").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/gpus/0000:18:00.0/information").mkdir(parents=True)
    (tmp_path / "sys/devices/virtual/dmi/id/product_name").mkdir(parents=True)
    (tmp_path / "dev/neuron0").mkdir(parents=True)
    found = _detect_within(str(tmp_path))
    assert found.name == "aws-neuron" and found.chip is None  # /dev/neuron0 exists; DMI unreadable


def test_a_fifo_in_place_of_a_sysfs_file_does_not_block(tmp_path: Path) -> None:
    fakes.tpu_vm(tmp_path, "v5e", 1)
    vendor = tmp_path / "sys/devices/pci0000:00/0000:00:06.0/vendor"
    vendor.unlink()
    os.mkfifo(vendor)
    fakes.neuron_host(tmp_path, 1)
    product = tmp_path / "sys/devices/virtual/dmi/id/product_name"
    product.unlink()
    os.mkfifo(product)
    found = _detect_within(str(tmp_path))
    assert found.name == "aws-neuron" and found.chip is None


def test_dangling_links_and_link_loops(tmp_path: Path) -> None:
    devices = tmp_path / "sys/bus/pci/devices"
    devices.mkdir(parents=True)
    os.symlink("../../../devices/gone", devices / "0000:00:04.0")
    loop = tmp_path / "sys/devices/loop"
    loop.mkdir(parents=True)
    os.symlink(loop / "vendor", loop / "vendor")  # ELOOP on open
    os.symlink("../../../devices/loop", devices / "0000:00:05.0")
    (tmp_path / "dev").mkdir()
    os.symlink("/nonexistent", tmp_path / "dev/nvidia0")
    found = _detect_within(str(tmp_path))
    assert found.name == "nvidia-gpu"  # the node name is there even if it points nowhere


def test_garbage_and_huge_files(tmp_path: Path) -> None:
    garbage = bytes(range(256)) * 64
    fakes.pci_device(tmp_path, "0000:00:04.0", "0x1ae0", "0x0063")
    fakes.write(tmp_path, "/sys/devices/pci0000:00/0000:00:04.0/iommu_group", garbage)  # not a link
    fakes.pci_device(tmp_path, "0000:00:05.0", "\x00\xff0x1ae0", "0x006f")
    fakes.write(tmp_path, "/sys/devices/virtual/dmi/id/product_name", garbage)
    fakes.write(tmp_path, "/proc/driver/nvidia/gpus/x/information", b"Model: \xff\xfe\x00" * 100_000)
    found = _detect_within(str(tmp_path))
    assert (found.name, found.chip, found.device_count) == ("gcp-tpu", "v5e", 1)


def test_non_utf8_file_names(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "neuron0").write_text("")
    os.close(os.open(os.fsencode(str(dev)) + b"/neuron\xff", os.O_CREAT | os.O_WRONLY))
    found = _detect_within(str(tmp_path))
    assert (found.name, found.device_count) == ("aws-neuron", 1)


def test_hostile_environment_values(tmp_path: Path) -> None:
    fakes.bare_cpu_host(tmp_path)
    for env in ({"TPU_ACCELERATOR_TYPE": 5, "NEURON_RT_VISIBLE_CORES": None},
                {"TPU_ACCELERATOR_TYPE": "\x00" * 10_000, "TPU_WORKER_HOSTNAMES": ",,,"}):
        assert _detect_within(str(tmp_path), env).name == "cpu"

    class Exploding(dict):  # type: ignore[type-arg]
        def get(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("environment exploded")

    assert _detect_within(str(tmp_path), Exploding()).name == "cpu"


# -- property-based: any tree, any environment ----------------------------------------------

_names = st.text(alphabet=string.ascii_letters + string.digits + "._-:", min_size=1, max_size=12).filter(
    lambda s: s not in (".", ".."))
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # encodable: no lone surrogates
_contents = st.one_of(
    st.sampled_from(["0x1ae0", "0x10de", "0x8086", *TPU_DEVICE_IDS, "0x0042", "0x1AE0\n", ""]),
    _text,
    st.binary(max_size=40),
)
# A PCI address is never a hidden name (sysfs writes 0000:00:04.0): detection's glob rightly skips those.
_pci = st.lists(st.tuples(_names.filter(lambda s: not s.startswith(".")), _contents, _contents), max_size=6,
                unique_by=lambda t: t[0])
_dev = st.lists(st.one_of(
    st.sampled_from(["neuron0", "neuron15", "nvidia0", "nvidiactl", "accel0", "vfio", "neuronx", "null"]),
    _names), max_size=8, unique=True)
_env = st.dictionaries(
    st.sampled_from(["TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "NEURON_RT_VISIBLE_CORES",
                     "TPU_NAME", "ACCELPORT_SYSROOT"]),
    st.text(max_size=30), max_size=4)


def _norm(value: Any) -> str:
    """What detection makes of a sysfs value (NULs dropped, whitespace stripped, lower case)."""
    return value.replace("\x00", "").strip().lower() if isinstance(value, str) else ""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pci=_pci, dev=_dev, product=_contents, env=_env)
def test_any_tree_gives_a_known_platform_and_never_raises(pci: list[tuple[str, Any, Any]], dev: list[str],
                                                          product: Any, env: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for bdf, vendor, device in pci:
            fakes.write(root, f"/sys/bus/pci/devices/{bdf}/vendor", vendor)
            fakes.write(root, f"/sys/bus/pci/devices/{bdf}/device", device)
        for name in dev:
            fakes.write(root, f"/dev/{name}")
        fakes.write(root, "/sys/devices/virtual/dmi/id/product_name", product)
        found = detect(tmp, env)
        assert found.name in PLATFORMS
        assert found.device_count >= 0 and all(isinstance(e, str) for e in found.evidence)
        tpus = [_norm(d) for _, v, d in pci if _norm(v) == "0x1ae0" and _norm(d) in TPU_DEVICE_IDS]
        if tpus:
            assert (found.name, found.device_count) == ("gcp-tpu", len(tpus))
            assert found.chip in {TPU_DEVICE_IDS[d] for d in tpus}
        elif found.name == "gcp-tpu":
            assert env.get("TPU_ACCELERATOR_TYPE", "").strip()  # only the accelerator-type route remains


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_any_accelerator_type_parses_to_a_known_generation_or_none(text: str) -> None:
    assert tpu_generation(text) in {None, *TPU_DEVICE_IDS.values()}
