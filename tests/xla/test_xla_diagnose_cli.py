"""``accelport diagnose`` on unmodified torch_xla scripts, for real on XLA:CPU.

The scripts (tests/diagnose_cli/scripts/xla_*.py) never import accelport. Three run in this
process through the CLI's ``main`` (torch_xla is already loaded here: one XLA start less
each); the loop that never syncs runs as its own process, where the hooks go in as the script
imports torch_xla. Each script uses its own feature size, so no two share a cached graph.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import pytest

from accelport.cli import main
from tests.conftest import REPO

pytestmark = pytest.mark.xla

SCRIPTS = pathlib.Path(REPO) / "tests" / "diagnose_cli" / "scripts"


def line_of(script: pathlib.Path, text: str) -> int:
    return next(n for n, line in enumerate(script.read_text().splitlines(), 1) if text in line)


def diagnose(script: pathlib.Path, tmp_path: pathlib.Path, capfd: pytest.CaptureFixture[str],
             *args: str) -> tuple[dict[str, Any], str, str]:
    """The --output JSON, the script's stdout and the stderr of `accelport diagnose SCRIPT ARGS`, run in this
    process."""
    import torch_xla.debug.metrics as met

    # diagnose counts torch_xla's counters from the process's start (as the script's own process would):
    # what earlier tests in this process counted is not this script's.
    met.clear_all()
    out = tmp_path / "findings.json"
    assert main(["diagnose", "--output", str(out), str(script), *args]) == 0
    captured = capfd.readouterr()
    return json.loads(out.read_text()), captured.out, captured.err


def test_padding_each_batch_to_its_longest_is_recompilation_naming_the_input(tmp_path, capfd) -> None:  # type: ignore[no-untyped-def]
    result, _, err = diagnose(SCRIPTS / "xla_padded.py", tmp_path, capfd)
    assert result["backend"] == "xla" and result["steps"] == 12
    assert [f["kind"] for f in result["findings"]] == ["recompilation"], err
    message = result["findings"][0]["message"]
    assert re.search(r"input 0 changed from \(8, \d+, 11\) to \(8, \d+, 11\)", message), message
    assert result["metrics"]["compilations"] >= 10 and result["metrics"]["batch_signatures"] == 12


def test_loss_item_every_step_is_host_sync_at_that_line(tmp_path, capfd) -> None:  # type: ignore[no-untyped-def]
    script = SCRIPTS / "xla_item.py"
    result, _, err = diagnose(script, tmp_path, capfd)
    assert [f["kind"] for f in result["findings"]] == ["host-sync"], err
    site = f"{script}:{line_of(script, 'total += loss.item()')}"
    assert f"It happens at {site}" in result["findings"][0]["message"]
    # (The summary wraps its lines at spaces, where the checkout's path length puts them.)
    assert result["findings"][0]["evidence"]["where"] == site and f"at {site}" in " ".join(err.split())


def test_a_healthy_torch_xla_loop_has_no_finding(tmp_path, capfd) -> None:  # type: ignore[no-untyped-def]
    # MpDeviceLoader, xm.optimizer_step, and the loss read every step inside xm.add_step_closure
    # (after the step ran: not a host sync, as ap.after_step's reads are not).
    result, out, err = diagnose(SCRIPTS / "xla_healthy.py", tmp_path, capfd)
    assert result["findings"] == [] and result["steps"] == 30, err
    assert "30 losses logged" in out and "[ok  ] no finding" in err
    assert result["metrics"]["device_to_host"] >= 30  # the closures' reads happened, and were left out


def test_a_nan_batch_is_found_at_its_step_without_a_read_per_step(tmp_path, capfd) -> None:  # type: ignore[no-untyped-def]
    # The script reads nothing; the gradient check is read once, at the end, and the
    # inputs were looked at on the host before they moved.
    result, out, err = diagnose(SCRIPTS / "xla_nan.py", tmp_path, capfd)
    assert out == "trained\n" and result["steps"] == 20, err
    [found] = result["findings"]
    assert (found["kind"], found["step"], found["severity"]) == ("non-finite", 7, "problem")
    assert "it came from the input batch (input 0: 1 of 208 values are NaN or Inf)" in found["message"]
    assert result["metrics"]["device_to_host"] <= 2


def test_a_nan_batch_right_after_a_read_is_still_named_at_its_step(tmp_path, capfd) -> None:  # type: ignore[no-untyped-def]
    # The step checks' read due at step 256 runs at the script's next sync, step 257's, after its update: it
    # reads values that step's NaN input already made NaN, before that step ended. The input is still named.
    # 260 steps, the NaN in batch 257, 17 features (a graph of its own).
    result, out, err = diagnose(SCRIPTS / "xla_nan.py", tmp_path, capfd, "260", "257", "17")
    assert out == "trained\n" and result["steps"] == 260, err
    [found] = result["findings"]
    assert (found["kind"], found["step"]) == ("non-finite", 257)
    assert "it came from the input batch (input 0: 1 of 272 values are NaN or Inf)" in found["message"]


def test_a_loop_that_never_syncs_is_graph_growth_saying_where_to_sync(tmp_path: pathlib.Path) -> None:
    script = SCRIPTS / "xla_no_sync.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    out = subprocess.run([sys.executable, "-m", "accelport", "diagnose", "--output", str(tmp_path / "f.json"),
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "f.json").read_text())
    assert result["backend"] == "xla" and result["steps"] == 8
    assert [f["kind"] for f in result["findings"]] == ["graph-growth"]
    finding = result["findings"][0]
    assert "the loop never syncs" in finding["message"] and "Add torch_xla.sync()" in finding["fix"]
    step = f"{script}:{line_of(script, 'opt.step()')}"
    assert finding["evidence"] == {"steps_without_sync": 5, "where": step, "where_is": "the optimizer step"}
    assert "[FAIL] graph-growth at step 5: 5 optimizer steps in a row ran without a sync" in out.stderr
    # Said once, in the summary, at the script's line (no warning while it runs as well).
    assert f"at {step} (the optimizer step)" in out.stderr and "GraphGrowthWarning" not in out.stderr


def test_a_plain_pytorch_script_never_gets_torch_xla_imported() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    out = subprocess.run([sys.executable, "-m", "accelport", "diagnose", str(SCRIPTS / "cpu_healthy.py"),
                          "--steps", "12"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torch_xla imported False" in out.stdout  # installed here, never imported for it
    assert "took 12 optimizer step(s) on cpu" in out.stderr


def test_accelports_own_step_closures_are_not_counted_again_as_the_scripts() -> None:
    # The checks read through step closures; the watcher counts the script's closures' reads
    # (after the step, like ap.after_step's) and must leave accelport's own to the backend.
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import accelport as ap
    from accelport.runtime.state import RUNTIME
    from accelport.runtime.watch import Watcher

    watcher = Watcher(environ={})
    watcher.install()
    try:
        with RUNTIME.scoped():
            RUNTIME.reset()
            ap.use("xla")
            t = torch.ones(3, device=ap.device()) * 2
            got: list[float] = []
            ap.backend().diagnostic_read(lambda v: got.append(float(v.sum())), (t,))
            xm.add_step_closure(lambda v: got.append(float(v.sum().item())), args=(t,))  # the script's
            torch_xla.sync()
    finally:
        watcher.uninstall()
    assert got == [6.0, 6.0]
    assert watcher.closure_reads == 1


# -- in the script's own terms (raw torch_xla) ------------------------------------------------------


def test_a_host_read_in_a_raw_torch_xla_loop_is_fixed_with_torch_xlas_step_closure(tmp_path, capfd) -> None:  # type: ignore[no-untyped-def]
    script = SCRIPTS / "xla_mnist.py"
    result, out, err = diagnose(script, tmp_path, capfd)
    assert "step 5 loss " in out and out.rstrip().splitlines()[-1].startswith("accuracy ")
    [found] = result["findings"]
    assert found["kind"] == "host-sync"
    assert found["evidence"]["where"] == f"{script}:{line_of(script, 'correct += ')}"
    # torch_xla's own spelling first (the script already is torch_xla), accelport's as the portable one.
    assert found["fix"].startswith("Read them in a step closure instead: xm.add_step_closure(fn, args=(loss,))")
    assert "ap.after_step(fn, loss) is the portable spelling" in found["fix"]
    assert found["totals"]["reads_per_step"] >= 1 and found["totals"]["steps"] >= 10
    said = " ".join(err.split())
    assert said.count("host-sync at step") == 1 and "HostSyncWarning" not in err  # said once, at the end


def test_a_tensor_made_inside_the_step_that_changes_shape_is_named_with_its_line(tmp_path, capfd) -> None:  # type: ignore[no-untyped-def]
    script = SCRIPTS / "xla_device_pad.py"
    result, _, err = diagnose(script, tmp_path, capfd)
    [found] = [f for f in result["findings"] if f["kind"] == "recompilation"]
    cut = f"{script}:{line_of(script, 'h = x[:, : lengths[step]]')}"
    # Not "look for x[mask], nonzero, .item()", none of which the script has: the tensor, its line, its shapes.
    assert "the input shapes did not change, but a tensor made inside the step does" in found["message"]
    assert f"at {cut} gave (8, " in found["message"], found["message"]
    assert found["evidence"]["where"] == cut


def _spawned(tmp_path: pathlib.Path, devices: int, *args: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """`accelport diagnose --output F xla_spawn.py ARGS` in a process of its own, with ``devices`` XLA:CPU devices."""
    from tests.diagnose_cli.runs import child_env, default_signals

    out = tmp_path / "f.json"
    done = subprocess.run([sys.executable, "-m", "accelport", "diagnose", "--output", str(out),
                           str(SCRIPTS / "xla_spawn.py"), *args], capture_output=True, text=True, timeout=600,
                          preexec_fn=default_signals,
                          env=child_env({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}))
    assert done.returncode == 0 and done.stdout.endswith("done\n"), done.stderr
    return done, json.loads(out.read_text())


def test_training_in_a_worker_torch_xla_launch_starts_is_watched_there_and_said_as_the_job(tmp_path):
    """torch_xla.launch calls xmp.spawn, which runs the function in a worker process, in a thread per device:
    the worker is watched in that thread, its steps counted once (the inner launcher is part of the outer)."""
    done, result = _spawned(tmp_path, 1, "--launch", "--slow-device", "0")
    said = " ".join(done.stderr.split())
    assert said.count("accelport diagnose:") == 1 and "a job of 1 rank on 1 host(s), took 12 optimizer step(s)" \
        in said and "on xla" in said, said
    assert "diagnose watches this process only" not in said
    (rank,) = result["ranks"]
    assert (rank["rank"], rank["steps"], rank["exit_status"]) == (0, 12, 0) and rank["pid"] != os.getpid()
    # The device's 60 ms of host work a step is the worker's own: its loop's time, not the parent's.
    assert rank["time_breakdown"]["other"] > 0.04, rank


def test_a_further_device_thread_of_a_watched_worker_is_said_unwatched_not_lost(tmp_path):
    """Two XLA:CPU devices: xmp.spawn's one worker runs two loops in two threads. One is watched, with its own
    12 steps (not the other thread's too); the other is said unwatched, with why, not as a rank that crashed."""
    done, result = _spawned(tmp_path, 2)
    said = " ".join(done.stderr.split())
    assert said.count("accelport diagnose:") == 1 and "a job of 2 ranks" in said, said
    (rank,) = result["ranks"]
    other = 1 - rank["rank"]
    assert rank["steps"] == 12 and result["job"]["ranks_unwatched"] == [other] == result["job"]["ranks_missing"]
    assert f"not judged: rank(s) {other} (each a further device thread of a process" in said
    assert "crashed" not in said and "[ok ]" not in said
    assert result["verdict"]["judged_every_step"] is False


def test_launch_diagnose_on_xla_watches_the_replica_torch_xla_launch_starts(tmp_path: pathlib.Path) -> None:
    """`accelport launch --backend xla --diagnose`: the launch's worker calls torch_xla.launch under `accelport
    diagnose`, which watches the replica: one job summary naming the script, its finding at the script's line,
    and the page drawn from the replica's steps. A replica that raises is named by its own error."""
    from tests.launch.test_launch import launch

    script = SCRIPTS / "xla_item.py"
    out, page = tmp_path / "job.json", tmp_path / "job.html"
    done = launch("--backend", "xla", "--diagnose", "--output", str(out), "--report", str(page), str(script),
                  timeout=600, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    assert done.returncode == 0 and "mean loss" in done.stdout, done.stderr[-3000:]
    said = " ".join(done.stderr.split())
    assert said.count("accelport diagnose:") == 1 and f"accelport diagnose: {script}, a job of 1 rank" in said, said
    result = json.loads(out.read_text())
    (rank,) = result["ranks"]
    assert (rank["rank"], rank["steps"], rank["exit_status"]) == (0, 14, 0)
    site = f"{script}:{line_of(script, 'total += loss.item()')}"
    assert [(f["kind"], f["evidence"]["where"]) for f in result["findings"]] == [("host-sync", site)]
    assert page.read_text().count("<tr class=rank>") == 1

    failing = tmp_path / "fails.py"
    failing.write_text(script.read_text().replace("    loss.backward()\n", "    loss.backward()\n"
                                                  "    if total > 0: raise ValueError('bad batch')\n", 1))
    done = launch("--backend", "xla", "--diagnose", "--output", str(out), str(failing), timeout=600,
                  PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "accelport: error: rank 0" in done.stderr and "ValueError: bad batch" in done.stderr
    assert [r["exit_status"] for r in json.loads(out.read_text())["ranks"]] == [1]


def test_launch_timeout_stops_a_hung_replica_which_still_hands_over_its_run(tmp_path: pathlib.Path) -> None:
    """The replica hangs after 5 steps (its function runs in a device thread, where no handler can be): --timeout
    stops the job with SIGTERM, taken in the replica's main thread, which writes the run before the replica ends."""
    from tests.launch.test_launch import launch

    script = tmp_path / "hangs.py"
    script.write_text(
        "import time, torch, torch_xla\n"
        "device = torch_xla.device()\n"
        "model = torch.nn.Linear(10, 1).to(device)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "for step in range(12):\n"
        "    if step == 5:\n"
        "        time.sleep(600)  # hung\n"
        "    model(torch.randn(4, 10).to(device)).pow(2).mean().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "    torch_xla.sync()\n")
    out = tmp_path / "job.json"
    done = launch("--backend", "xla", "--diagnose", "--timeout", "10", "--output", str(out), str(script),
                  timeout=600, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    assert done.returncode != 0, done.stderr[-3000:]
    said = " ".join(done.stderr.split())
    assert f"accelport diagnose: {script}, a job of 1 rank" in said and "more than --timeout 10" in said, said[-3000:]
    (rank,) = json.loads(out.read_text())["ranks"]
    assert (rank["rank"], rank["steps"], rank["exit_status"]) == (0, 5, 143)
