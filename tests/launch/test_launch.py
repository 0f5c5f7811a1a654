"""`accelport launch`: plans for every engine, bad input, and real 2-process jobs on cpu (gloo)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import accelport as ap
from accelport.cli import UsageError, main
from accelport.contract import Probe
from accelport.device_loader import shard_batches
from accelport.eager import EagerBackend
from accelport.launch.plan import LaunchError, Rendezvous, build_plan, engine_for
from accelport.launch.run import parent_launch_env
from tests.conftest import DEFAULT_SIGNALS, REPO, default_signals

SCRIPTS = Path(REPO) / "tests" / "scripts"


def launch(*args: str, timeout: float = 180, **extra: str) -> subprocess.CompletedProcess[str]:
    """`accelport launch ...` in a fresh process, as a user runs it. The timeout only guards a hang."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")} | extra
    return subprocess.run([sys.executable, "-c", DEFAULT_SIGNALS, "-m", "accelport", "launch", *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


#: The exit barrier in tests of launches that must not be held by it: so long that a launch held
#: for it is told from one that is not by a wide margin, whatever start-up takes on a busy machine.
HELD_S = "300"


def timed_launch(*args: str, **kwargs: Any) -> tuple[subprocess.CompletedProcess[str], float]:
    """:func:`launch` and the seconds it took (asserted only against bounds far from it)."""
    import time

    start = time.monotonic()
    proc = launch(*args, **kwargs)
    return proc, time.monotonic() - start


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


# -- stand-ins for backends that live outside this test environment --------------------


class XlaStandIn(EagerBackend):
    """Stand-in for the torch_xla backend: only what the launcher reads (family, name, probe)."""

    name = "xla"
    platform = "gcp-tpu"
    lazy = True
    device_type = "xla"

    def _probe(self) -> Probe:
        return Probe(False, "stand-in: no torch_xla in this environment")


class TorchTpuStandIn(EagerBackend):
    """Stand-in for the TorchTPU backend: eager, with TorchTPU's parent-side launch environment."""

    name = "tpu"
    platform = "gcp-tpu"
    device_type = "tpu"
    launch_env_function = "torch.tpu.distributed:set_tpu_launch_env"

    def _probe(self) -> Probe:
        return Probe(False, "stand-in: no TPU here", 0)


def cpu() -> Any:
    from accelport.runtime.state import RUNTIME

    return RUNTIME.host().backends["cpu"]


# -- plans ------------------------------------------------------------------------------


def test_cpu_plan_runs_torchrun_standalone_with_the_backend_in_the_environment(script: str) -> None:
    plan = build_plan(cpu(), script, ["--epochs", "3"], nprocs=2)
    assert plan.engine == "torchrun" and plan.nprocs == 2 and plan.available
    assert plan.command[1:3] == ["-m", "torch.distributed.run"]
    assert "--standalone" in plan.command  # one host: a free port, never a clash on 29500
    i = plan.command.index("--nproc-per-node")
    assert plan.command[i + 1] == "2"
    assert plan.command[-5:] == ["-m", "accelport.launch.worker", script, "--epochs", "3"]
    assert plan.env == {"ACCELPORT_BACKEND": "cpu"}
    assert plan.parent_env_function is None


def test_default_nprocs_is_one_per_device(script: str) -> None:
    assert build_plan(cpu(), script).nprocs == 1  # the cpu probe reports one device


def test_the_printed_command_is_what_torchrun_parses(script: str) -> None:
    from torch.distributed.run import parse_args

    plan = build_plan(cpu(), script, ["--lr", "0.1"], nprocs=3, oversubscribe=True,  # 3 on any host
                      rdzv=Rendezvous(nnodes="2", rdzv_endpoint="10.0.0.1:29400", rdzv_id="job7"))
    args = parse_args(plan.command[3:])
    assert (args.nproc_per_node, args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == \
        ("3", "2", "c10d", "10.0.0.1:29400", "job7")
    assert args.module and args.training_script == "accelport.launch.worker"
    assert args.training_script_args == [script, "--lr", "0.1"]


def test_static_rendezvous_for_several_hosts(script: str) -> None:
    plan = build_plan(cpu(), script, nprocs=2,
                      rdzv=Rendezvous(nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=1234))
    c = plan.command
    assert c[c.index("--master-addr") + 1] == "10.0.0.1" and c[c.index("--node-rank") + 1] == "1"
    assert c[c.index("--master-port") + 1] == "1234" and "--standalone" not in c


@pytest.mark.parametrize(
    ("rdzv", "message"),
    [
        (Rendezvous(nnodes="2"), "needs a meeting point"),
        (Rendezvous(nnodes="2", master_addr="h0"), "needs --node-rank"),
        (Rendezvous(nnodes="2", rdzv_endpoint="h0:1", master_addr="h0", node_rank=0), "not both"),
        (Rendezvous(node_rank=1), r"--node-rank only applies with --nnodes > 1"),
        (Rendezvous(node_rank=0), r"--node-rank only applies with --nnodes > 1"),
        (Rendezvous(master_addr="h0"), r"--master-addr only applies with --nnodes > 1"),
        (Rendezvous(master_addr="h0", node_rank=0, master_port=29500),
         r"--node-rank, --master-addr, --master-port only apply with --nnodes > 1"),
        (Rendezvous(nnodes="1:1", rdzv_endpoint="h0:29400"), r"--rdzv-endpoint only applies with --nnodes > 1"),
        (Rendezvous(rdzv_id="job", rdzv_backend="c10d", rdzv_timeout=30),
         r"--rdzv-backend, --rdzv-id, --rdzv-timeout only apply"),
        (Rendezvous(nnodes="2", rdzv_endpoint="h0:1", master_port=29500), "not both: drop --master-port"),
        (Rendezvous(nnodes="2", rdzv_endpoint="h0:1", rdzv_backend="static"), "use --master-addr"),
        (Rendezvous(nnodes="2", master_addr="h0", node_rank=1, rdzv_backend="c10d"), "go with --rdzv-endpoint"),
        (Rendezvous(nnodes="2", rdzv_endpoint="h0:1", rdzv_timeout=0), "--rdzv-timeout must be at least 1"),
        (Rendezvous(nnodes="two"), "--nnodes must be"),
        (Rendezvous(nnodes="4:2"), "--nnodes must be"),
        (Rendezvous(nnodes="1:4", master_addr="h0", node_rank=0), "needs --rdzv-endpoint"),
    ],
)
def test_rendezvous_options_that_cannot_work_are_refused(script: str, rdzv: Rendezvous, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build_plan(cpu(), script, nprocs=2, rdzv=rdzv)


def test_the_rendezvous_wait_is_bounded_with_options_this_torchrun_reads(script: str) -> None:
    from datetime import timedelta

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler
    from torch.distributed.run import config_from_args, parse_args

    from accelport.launch.plan import RDZV_TIMEOUT_S

    c10d = build_plan(cpu(), script, nprocs=1, rdzv=Rendezvous(nnodes="2", rdzv_endpoint="h0:29400"))
    config, _, _ = config_from_args(parse_args(c10d.command[3:]))
    assert config.rdzv_backend == "c10d" and config.rdzv_configs["join_timeout"] == str(RDZV_TIMEOUT_S)
    assert c10d.rendezvous == {"option": "--rdzv-endpoint", "host": "h0", "port": 29400,
                               "timeout_s": RDZV_TIMEOUT_S}

    static = build_plan(cpu(), script, nprocs=1,
                        rdzv=Rendezvous(nnodes="2", master_addr="h0", node_rank=1, rdzv_timeout=30))
    config, _, _ = config_from_args(parse_args(static.command[3:]))
    assert config.rdzv_backend == "static" and config.rdzv_configs == {"timeout": "30", "rank": 1}
    params = RendezvousParameters(config.rdzv_backend, config.rdzv_endpoint, config.run_id, 2, 2,
                                  **config.rdzv_configs)
    assert create_rdzv_handler(params).timeout == timedelta(seconds=30)  # the key torch reads
    assert static.rendezvous["timeout_s"] == 30 and static.rendezvous["host"] == "h0"
    assert build_plan(cpu(), script).rendezvous == {}  # one host: nothing to meet at


def test_xla_family_launches_through_torch_xla(script: str) -> None:
    backend = XlaStandIn()
    assert engine_for(backend) == "xla"
    plan = build_plan(backend, script, ["a"], environ={}, platform="gcp-tpu")
    assert plan.engine == "xla" and plan.nprocs is None  # every chip torch_xla finds
    assert plan.command[1:] == ["-m", "accelport.launch.worker", "--engine", "xla", script, "a"]
    assert plan.env == {"ACCELPORT_BACKEND": "xla", "PJRT_DEVICE": "TPU"}
    assert not plan.available and "stand-in" in plan.reason
    assert any("not been verified" in n for n in plan.notes)
    one = build_plan(backend, script, environ={"PJRT_DEVICE": "cpu"}, nprocs=1)
    assert "--single-process" in one.command and one.env["PJRT_DEVICE"] == "CPU"
    assert not one.notes  # one replica is what the xla test environment runs
    # --diagnose: the worker that calls torch_xla.launch runs under accelport diagnose, which watches its replicas.
    watched = build_plan(backend, script, ["a"], environ={}, platform="gcp-tpu", diagnose=["--output", "/o.json"])
    assert watched.command[1:] == ["-m", "accelport", "diagnose", "--output", "/o.json", "-m",
                                   "accelport.launch.worker", "--engine", "xla", script, "a"]


def test_xla_nprocs_maps_to_the_device_count_variable_or_is_refused(script: str) -> None:
    backend = XlaStandIn()
    neuron = build_plan(backend, script, nprocs=4, environ={}, platform="aws-neuron")
    assert neuron.env["PJRT_DEVICE"] == "NEURON" and neuron.env["NEURONCORE_NUM_DEVICES"] == "4"
    with pytest.raises(UsageError, match="cannot be told how many"):
        build_plan(backend, script, nprocs=4, environ={"PJRT_DEVICE": "TPU"})
    with pytest.raises(UsageError, match="deadlock"):
        build_plan(backend, script, nprocs=2, environ={"PJRT_DEVICE": "CPU"})
    with pytest.raises(UsageError, match="finds the other hosts"):
        build_plan(backend, script, environ={}, platform="gcp-tpu",
                   rdzv=Rendezvous(nnodes="2", rdzv_endpoint="h0:1"))


def test_torchtpu_plan_names_its_parent_side_environment(script: str) -> None:
    plan = build_plan(TorchTpuStandIn(), script, nprocs=4)
    assert plan.engine == "torchrun"
    assert plan.parent_env_function == "torch.tpu.distributed:set_tpu_launch_env"
    assert plan.parent_env_kwargs == {"nproc_per_node": 4}
    multi = build_plan(TorchTpuStandIn(), script, nprocs=4,
                       rdzv=Rendezvous(nnodes="2", rdzv_endpoint="h0:29400"))
    assert multi.parent_env_kwargs == {"nproc_per_node": 4, "nnodes": 2}


def test_parent_launch_env_returns_what_the_function_sets(tmp_path: Path) -> None:
    # A stand-in for torch.tpu.distributed.set_tpu_launch_env, which needs a TPU.
    (tmp_path / "standin_launch_env.py").write_text(
        "import os\n"
        "def set_env(*, nproc_per_node, nnodes=None):\n"
        "    os.environ['STANDIN_ADDRESSES'] = ','.join(f'localhost:{8000 + i}' for i in range(nproc_per_node))\n"
        "    os.environ.setdefault('KEEP', 'x')\n"
        "def fail(**kw):\n"
        "    raise ValueError('expected TPU devices, got none')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "KEEP": "already"}
    got = parent_launch_env("standin_launch_env:set_env", {"nproc_per_node": 2}, env)
    assert got == {"STANDIN_ADDRESSES": "localhost:8000,localhost:8001"}  # KEEP was already set
    with pytest.raises(LaunchError, match=r"standin_launch_env:fail\(nproc_per_node=2\) failed on this "
                                          r"host before any worker started: ValueError: expected TPU"):
        parent_launch_env("standin_launch_env:fail", {"nproc_per_node": 2}, env)
    with pytest.raises(LaunchError, match="'module:function'"):
        parent_launch_env("no_colon", {}, env)


@pytest.mark.tpu_pkg
def test_real_set_tpu_launch_env_without_a_tpu_fails_before_any_worker() -> None:
    with pytest.raises(LaunchError, match="expected TPU devices"):
        parent_launch_env("torch.tpu.distributed:set_tpu_launch_env", {"nproc_per_node": 2}, os.environ,
                          preload="torch_tpu")


def test_tpu_launch_plan_names_torchtpus_launch_environment(script: str) -> None:
    from accelport._backends.tpu import TpuBackend
    from accelport.launch.plan import build_plan

    plan = build_plan(TpuBackend(), script, nprocs=2)
    assert plan.parent_env_function == "torch.tpu.distributed:set_tpu_launch_env"
    assert plan.parent_env_preload == "torch_tpu" and plan.parent_env_kwargs == {"nproc_per_node": 2}


# -- the command line: dry runs and bad input --------------------------------------------


def test_dry_run_json_prints_the_plan(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", "--json", "--nprocs", "2", script, "--json-is-the-script's"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["engine"] == "torchrun" and plan["backend"] == "cpu" and plan["nprocs"] == 2
    assert plan["command"][-2:] == [script, "--json-is-the-script's"]


def test_dry_run_human_output_is_a_shell_line(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", script]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("env ACCELPORT_BACKEND=cpu ") and "torch.distributed.run" in line


def test_dry_run_for_an_unavailable_backend_says_so(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", "--json", "--backend", "cuda", script]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["backend"] == "cuda" and plan["available"] is False and plan["reason"]


def test_dry_run_imports_no_torch(script: str) -> None:
    code = (f"from accelport.cli import main; main(['launch', '--dry-run', '--json', {script!r}]); "
            "import sys; print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "NO-TORCH"


@pytest.mark.parametrize(
    ("argv", "kind", "code", "message"),
    [
        (["--nprocs", "0"], "usage", 2, "--nprocs must be at least 1"),
        (["--nprocs", "-2"], "usage", 2, "--nprocs must be at least 1"),
        (["--backend", "cuda"], "BackendUnavailableError", 1, "is not available: no NVIDIA GPU found"),
        (["--backend", "cdua"], "usage", 2, r"unknown backend 'cdua' \(from --backend cdua\)\. Did you mean 'cuda'"),
        (["--nnodes", "2", "--node-rank", "2"], "usage", 2, "--node-rank must be between 0 and 1"),
        (["--nnodes", "2", "--node-rank", "-1"], "usage", 2, "--node-rank must be between 0 and 1"),
        (["--master-port", "99999"], "usage", 2, "--master-port must be a TCP port"),
        (["--rdzv-endpoint", "node0:abc"], "usage", 2, "--rdzv-endpoint must be HOST:PORT"),
        (["--nprocs", "500"], "usage", 2, rf"--nprocs 500 is more than the {os.cpu_count()} CPU cores of this "
                                          r"host: workers would share them .* or --oversubscribe to start them"),
        (["--timeout", "0"], "usage", 2, r"--timeout must be at least 1 \(seconds a worker may go without ending"),
        (["--timeout", "-5"], "usage", 2, "--timeout must be at least 1"),
    ],
)
def test_bad_input_is_a_specific_error_and_valid_json(script: str, capsys: pytest.CaptureFixture[str],
                                                      argv: list[str], kind: str, code: int,
                                                      message: str) -> None:
    import re

    assert main(["launch", "--json", *argv, script]) == code
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == kind and re.search(message, data["error"]), data
    assert main(["launch", *argv, script]) == code
    err = capsys.readouterr().err
    assert err.startswith("accelport: error:") and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # One host (--nnodes 1, the default): these used to hang torchrun on the address.
        (["--master-addr", "h.invalid"], r"^--master-addr only applies with --nnodes > 1 \(several hosts\)"),
        (["--master-addr", "h.invalid", "--node-rank", "0"],
         r"^--node-rank, --master-addr only apply with --nnodes > 1"),
        # Several hosts, a name that never resolves (the reserved .invalid TLD): refused at once.
        (["--nnodes", "2", "--node-rank", "1", "--master-addr", "h.invalid"],
         r"^--master-addr 'h\.invalid' does not resolve on this host"),
        (["--nnodes", "2", "--rdzv-endpoint", "node0.invalid:29400"],
         r"^the host of --rdzv-endpoint 'node0\.invalid' does not resolve on this host"),
    ],
)
@pytest.mark.parametrize("as_json", [False, True], ids=["plain", "json"])
def test_a_rendezvous_that_cannot_work_fails_before_anything_starts(script: str, argv: list[str], message: str,
                                                                    as_json: bool) -> None:
    import re

    proc = launch(*(["--json"] if as_json else []), "--backend", "cpu", "--nprocs", "1", *argv, script,
                  timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-3000:])
    if as_json:
        data = json.loads(proc.stdout)
        assert data["kind"] == "usage" and re.search(message, data["error"]), data
    else:
        assert proc.stdout == ""
        first = proc.stderr.splitlines()[0]
        assert first.startswith("accelport: error: ") and re.search(message, first[len("accelport: error: "):])
        assert "Traceback" not in proc.stderr and "c10d" not in proc.stderr


def test_a_dry_run_does_not_resolve_the_address(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The plan may be meant for another machine, on a network where the name resolves.
    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h.invalid", "--rdzv-timeout", "60"]
    assert main(["launch", "--dry-run", "--json", *argv, script]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["rendezvous"] == {"option": "--master-addr", "host": "h.invalid", "port": 29500, "timeout_s": 60}
    assert "timeout=60" in plan["command"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("style", ["master-addr", "rdzv-endpoint"])
def test_a_host_that_never_comes_ends_the_launch_after_the_rendezvous_timeout(script: str, style: str) -> None:
    port = str(_free_port())
    meet = (["--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", port] if style == "master-addr"
            else ["--rdzv-endpoint", f"127.0.0.1:{port}"])
    # This host is the only one of two that ever comes: the wait ends after --rdzv-timeout.
    proc = launch("--json", "--backend", "cpu", "--nprocs", "1", "--nnodes", "2", *meet, "--rdzv-timeout", "2",
                  script, timeout=150)
    assert proc.returncode == 1, (proc.stdout, proc.stderr[-3000:])
    data = json.loads(proc.stdout)
    assert data["kind"] == "LaunchError", data
    assert data["error"].startswith("the 2 hosts did not meet within 2 s ("), data


@pytest.mark.parametrize("as_json", [False, True], ids=["plain", "json"])
def test_a_script_path_that_starts_with_a_dash_is_refused_with_the_path_to_give(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], as_json: bool) -> None:
    # Python and torchrun take it for an option (`python --evil.py`: "unknown option"), so would the worker.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "--evil.py").write_text("print('ran')\n")
    flags = ["--json"] if as_json else []
    cases = [("--evil.py", "script '--evil.py' starts with '-', which Python and torchrun read as an option; "
                           "give its path as './--evil.py'"),
             ("--nprocs", "script '--nprocs' starts with '-' and is not a file: accelport launch's own options go "
                          "before the script")]
    for script, message in cases:
        assert main(["launch", *flags, "--backend", "cpu", "--", script]) == 2
        out = capsys.readouterr()
        if as_json:
            data = json.loads(out.out)
            assert data["kind"] == "usage" and data["error"].startswith(message), data
        else:
            assert out.err.startswith(f"accelport: error: {message}") and "Traceback" not in out.err, out.err
    assert main(["launch", "--dry-run", "--json", "--backend", "cpu", "--", "./--evil.py"]) == 0  # the way to give it
    assert json.loads(capsys.readouterr().out)["command"][-1] == "./--evil.py"


def test_the_start_up_allowance_is_at_least_the_timeout_and_shown_in_the_plan(script: str) -> None:
    from accelport.launch.plan import STARTUP_TIMEOUT_S

    assert build_plan(cpu(), script).startup_timeout is None  # no --timeout: no limit
    assert build_plan(cpu(), script, timeout=5).startup_timeout == STARTUP_TIMEOUT_S == 600
    assert build_plan(cpu(), script, timeout=900).startup_timeout == 900
    assert build_plan(cpu(), script, timeout=5, startup_timeout=30).startup_timeout == 30
    assert build_plan(cpu(), script, startup_timeout=30).startup_timeout == 30
    with pytest.raises(UsageError, match=r"--startup-timeout 3 is shorter than --timeout 5"):
        build_plan(cpu(), script, timeout=5, startup_timeout=3)
    with pytest.raises(UsageError, match=r"--startup-timeout must be at least 1"):
        build_plan(cpu(), script, startup_timeout=0)


def test_missing_script_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--json", str(tmp_path / "nope.py")]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "usage" and "nope.py' not found" in data["error"]


# -- helpers the workers use ----------------------------------------------------------------


def test_shard_batches_gives_each_replica_its_share_and_equal_step_counts() -> None:
    data = list(range(11))
    shares = [list(shard_batches(data, r, 3)) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]  # 9 and 10 dropped on every replica
    assert list(shard_batches(iter(range(4)), 1, 2)) == [1, 3]  # generators too
    assert list(shard_batches([], 0, 2)) == []


def test_loader_shard_argument_is_checked_and_a_no_op_alone() -> None:
    with pytest.raises(TypeError, match="shard must be"):
        ap.loader([1], shard="yes")  # type: ignore[arg-type]
    ap.use("cpu")
    assert list(ap.loader([1, 2, 3], shard=True)) == [1, 2, 3]
    assert len(ap.loader([1, 2, 3], shard=True)) == 3


def test_print_prints_host_values_on_the_main_process(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    ap.use("cpu")
    ap.print("loss", torch.tensor(0.25), [1], sep="|")
    assert capsys.readouterr().out == "loss|0.25|[1]\n"


def test_all_reduce_mean_of_integers_is_refused_at_every_world_size() -> None:
    import torch

    ap.use("cpu")
    with pytest.raises(TypeError, match="floating-point"):
        ap.all_reduce(torch.tensor([1, 2]), op="mean")
    assert ap.all_reduce(torch.tensor([1, 2]), op="sum").tolist() == [1, 2]


# -- real jobs: two processes on cpu (gloo) -----------------------------------------------


@pytest.fixture(scope="module")
def dp_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("dp")
    return launch("--nprocs", "2", "--backend", "cpu", str(SCRIPTS / "train_dp.py"), str(out)), out


def _rank(out: Path, r: int) -> dict[str, Any]:
    import torch

    return torch.load(out / f"rank{r}.pt", weights_only=False)


def test_two_process_job_succeeds(dp_job: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = dp_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = _rank(out, 0), _rank(out, 1)
    assert (r0["rank"], r0["world"], r0["main"]) == (0, 2, True)
    assert (r1["rank"], r1["world"], r1["main"]) == (1, 2, False)


def test_gradients_are_averaged_in_fewer_all_reduces_than_parameters(
        dp_job: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = dp_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in (0, 1):
        got = _rank(out, r)
        calls = got["all_reduce_calls_per_step"]
        assert len(calls) == got["steps"] == 20
        assert all(1 <= c < got["parameters"] for c in calls), calls  # coalesced, not one per parameter
        assert calls == [1] * 20  # 4 small float32 cpu tensors: one bucket, one collective per step


def test_replicas_hold_identical_parameters_equal_to_one_process_on_the_combined_batch(
        dp_job: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    import importlib.util

    import torch

    proc, out = dp_job
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = _rank(out, 0), _rank(out, 1)
    assert r0["steps"] == r1["steps"] == 20
    for key in r0["params"]:
        assert torch.equal(r0["params"][key], r1["params"][key]), key  # bit-identical across ranks

    spec = importlib.util.spec_from_file_location("train_dp", SCRIPTS / "train_dp.py")
    job = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(job)  # type: ignore[union-attr]
    model = job.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = job.make_data()
    for k in range(20):  # one process, the two replicas' batches of each step together
        x = torch.cat([data[2 * k][0], data[2 * k + 1][0]])
        y = torch.cat([data[2 * k][1], data[2 * k + 1][1]])
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(r0["params"][key], value, rtol=1e-5, atol=1e-6)


def test_a_parameter_used_on_one_rank_only_is_averaged_without_hanging(
        dp_job: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    import torch

    _, out = dp_job
    r0, r1 = _rank(out, 0), _rank(out, 1)
    # Parameters 0-1 are branch 0 (used on rank 0), 2-3 branch 1 (used on rank 1).
    for i in range(4):
        local = r0["local_grads"][i] if i < 2 else r1["local_grads"][i]
        assert torch.equal(r0["averaged_grads"][i], r1["averaged_grads"][i])
        torch.testing.assert_close(r0["averaged_grads"][i], local / 2)


def test_collectives_across_two_processes(dp_job: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    import torch

    _, out = dp_job
    for r in (0, 1):
        got = _rank(out, r)
        assert got["sum"].tolist() == [3.0, 6.0] and got["mean"].tolist() == [1.5, 3.0]
        assert torch.equal(got["strided_sum"], (torch.arange(6.0).view(2, 3) * 3).T)


def test_loader_warns_once_without_a_distributed_sampler(
        dp_job: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, out = dp_job
    r0, r1 = _rank(out, 0), _rank(out, 1)
    assert r0["warnings_with_sampler"] == r1["warnings_with_sampler"] == 0
    assert r0["warnings_without_sampler"] == r1["warnings_without_sampler"] == 1
    assert r0["sampled"] == [[0.0, 2.0], [4.0, 6.0]] and r1["sampled"] == [[1.0, 3.0], [5.0, 7.0]]


def test_only_the_main_process_prints_and_writes(dp_job: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    import torch

    proc, out = dp_job
    assert proc.stdout.count("PRINTED-BY-RANK") == 1 and "PRINTED-BY-RANK 0 1.5" in proc.stdout
    assert torch.load(out / "shared.pt")["writer"].item() == 0
    assert sorted(p.name for p in out.iterdir()) == ["rank0.pt", "rank1.pt", "shared.pt"]


def test_a_worker_that_raises_ends_the_job_and_is_named() -> None:
    proc = launch("--nprocs", "2", str(SCRIPTS / "fail_at_step.py"))
    assert proc.returncode == 1
    summary = [line for line in proc.stderr.splitlines() if line.startswith("accelport: error:")]
    assert len(summary) == 1, proc.stderr[-3000:]
    assert "rank 1" in summary[0] and "failed first: RuntimeError: worker error at step 3" in summary[0]
    assert "Traceback" in proc.stderr  # the worker's own traceback is shown, from its stderr


# -- the xla engine for real (the xla environment: torch_xla on XLA:CPU) ---------------------


@pytest.mark.xla
def test_xla_launch_runs_the_script_under_torch_xla_and_names_a_failure(tmp_path: Path) -> None:
    from accelport.launch.run import WorkerFailedError, run_plan

    class XlaHere(XlaStandIn):
        """The stand-in made available: the script below uses torch_xla only, not this backend."""

        def _probe(self) -> Probe:
            return Probe(True, "torch_xla is installed (test)")

    script = tmp_path / "job.py"
    script.write_text(
        "import sys\nimport torch_xla.runtime as xr\n"
        "open(sys.argv[1], 'w').write(f'{xr.world_size()} {xr.global_ordinal()}')\n"
        "if len(sys.argv) > 2:\n    raise ValueError('replica failed on purpose')\n"
    )
    out = tmp_path / "world.txt"
    run_plan(build_plan(XlaHere(), str(script), [str(out)], environ={"PJRT_DEVICE": "CPU"}))
    assert out.read_text() == "1 0"  # torch_xla.launch spawned one replica: world size 1

    plan = build_plan(XlaHere(), str(script), [str(out), "fail"], nprocs=1, environ={"PJRT_DEVICE": "CPU"})
    with pytest.raises(WorkerFailedError, match="rank 0 failed first: ValueError: replica failed on purpose"):
        run_plan(plan)


def test_world_size_one_reduces_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from tests.conftest import train_tiny

    ap.use("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        calls: list[Any] = []
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a))  # a spy, not a stand-in
        losses = train_tiny(steps=3)
        assert ap.world_size() == 1 and len(losses) == 3 and calls == []
    finally:
        dist.destroy_process_group()


def test_the_first_failure_is_the_cause_not_a_peer_that_lost_its_connection() -> None:
    from accelport.launch.run import WorkerFailure, _failure_from, _first

    raised = _failure_from(1, 1, {"rank": 1, "error": "ValueError: bad batch", "traceback": "tb", "time": 10.5})
    peer = _failure_from(0, 1, {"rank": 0, "error": "RuntimeError: Connection closed by peer",
                                "traceback": "tb", "time": 10.9})
    stopped = _failure_from(2, -15, None, observed=10.0)  # SIGTERM from the launcher
    assert "stopped by the launcher" in stopped.error
    assert _first([peer, stopped, raised]) is raised
    oom = _failure_from(3, -9, None, observed=11.0)  # no chance to record anything
    assert oom.error == "killed by SIGKILL (out of memory?)"
    assert _first([peer, raised, oom, stopped]) is oom
    silent = _failure_from(4, 3, None, observed=9.0)
    assert "status 3" in silent.error and _first([silent, stopped]) is silent
    assert isinstance(silent, WorkerFailure)


def test_a_directory_is_not_a_script(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["launch", "--json", "--backend", "cpu", str(tmp_path)]) == 2
    assert "is a directory" in json.loads(capsys.readouterr().out)["error"]


def test_json_meant_for_the_script_does_not_change_the_launchers_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--backend", "cdua", "train.py", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("accelport: error: unknown backend 'cdua'")


@pytest.mark.xla
def test_print_of_text_alone_on_xla_comes_out_at_once_and_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    ap.use("xla")
    loss = torch.tensor(2.0, device=ap.device()) + 1  # pending: no sync has run it yet
    ap.print("epoch", 1, ["a"])
    assert capsys.readouterr().out == "epoch 1 ['a']\n"  # nothing to wait for
    ap.print("loss", loss)
    ap.print("after the loss")  # queued behind the line that waits for the sync, not ahead of it
    assert capsys.readouterr().out == ""
    ap.sync()
    assert capsys.readouterr().out == "loss 3.0\nafter the loss\n"
    ap.print("done", {"k": [1]})
    assert capsys.readouterr().out == "done {'k': [1]}\n"


# -- launches that always end -----------------------------------------------------------------


def test_oversubscribing_is_allowed_when_asked_and_the_timeout_is_in_the_plan(
        script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", "--json", "--nprocs", "500", "--oversubscribe", "--timeout", "90",
                 script]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["nprocs"] == 500 and plan["timeout"] == 90
    # Not counted here (a plan for a GPU host prepared elsewhere): not refused either.
    assert main(["launch", "--dry-run", "--json", "--backend", "cuda", "--nprocs", "64", script]) == 0
    assert json.loads(capsys.readouterr().out)["nprocs"] == 64


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie waiting for init: gone
    except OSError:
        return True


def _until(condition: Any, tries: int = 600) -> bool:
    """Poll ``condition`` (a bound on the number of tries, not a time the test asserts)."""
    import time

    for _ in range(tries):
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_end_when_the_launcher_is_killed(tmp_path: Path) -> None:
    job = tmp_path / "sleeper.py"
    job.write_text("import os, sys, time\n"
                   "open(os.path.join(sys.argv[1], f\"pid{os.environ['RANK']}\"), 'w').write(str(os.getpid()))\n"
                   "time.sleep(300)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")}
    launcher = subprocess.Popen([sys.executable, "-m", "accelport", "launch", "--backend", "cpu", "--nprocs", "2",
                                 str(job), str(tmp_path)], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        assert _until(lambda: all((tmp_path / f"pid{r}").exists() and (tmp_path / f"pid{r}").read_text()
                                  for r in (0, 1))), "the workers did not start"
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
        launcher.kill()  # SIGKILL: the launcher cannot stop anything itself
        launcher.wait()
        assert _until(lambda: all(_gone(p) for p in pids)), [p for p in pids if not _gone(p)]
    finally:
        launcher.kill()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, 9)  # only the workers this test started


STEPPING = """
import os, sys, time
if os.environ["RANK"] == "0":
    time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0)  # a slow start: before any step or import
import torch
import accelport as ap

model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = int(sys.argv[1 + ap.rank()])
for step in range(steps + 1):
    if ap.rank() == 1 and step == int(sys.argv[3]):
        time.sleep(300)  # HANG: outside any collective (after the last step where it equals the count)
    if step == steps:
        break
    model(torch.ones(4, 2)).sum().backward()
    ap.optimizer_step(opt)  # STEP: the gradient all-reduce, a collective every step
    opt.zero_grad()
"""


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(STEPPING.splitlines(), 1) if marker in text)


def _stalled_for(error: str, timeout: int) -> bool:
    """Whether ``error`` says rank 1 stopped making progress past ``--timeout``. Both ranks last beat at the
    same step, milliseconds apart: if the monitor's look falls between them, rank 0 (waiting for rank 1 in a
    collective) crossed the limit first, and rank 1 is named through it; the verdict is the same."""
    return re.match(r"rank 1 stopped making progress: (rank 0 waited for it in a collective \()?no training step "
                    rf"ended for \d+ s \(last heartbeat at step \d+\), more than --timeout {timeout}\)?; "
                    "its script is at ", error) is not None


def _failures(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {f["rank"]: f for f in data["failures"]}


def test_a_job_that_stops_making_progress_names_the_rank_that_hangs_not_a_slow_starter(tmp_path: Path) -> None:
    job = tmp_path / "hang.py"
    job.write_text(STEPPING)
    # Rank 0 starts 8 s late, longer than --timeout: start-up is not a step, so it is not stalled
    # (it used to be, after 5 s: "none since it started"). Then rank 1 hangs at step 3 while
    # rank 0 waits for it in the gradient all-reduce of step 4.
    proc = launch("--json", "--backend", "cpu", "--nprocs", "2", "--timeout", "5", str(job), "1000", "1000", "3",
                  "8", timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["kind"] == "WorkerFailedError", data
    first, ranks = data["first"], _failures(data)
    assert (first["rank"], first["cause"]) == (1, "stalled"), data
    assert _stalled_for(data["error"], 5), data["error"]
    assert f"hang.py:{_line('HANG')} (time.sleep(300)" in first["error"]
    assert "after 3 step(s), outside any collective; stopped by the launcher" in first["error"]
    waiting = ranks[0]
    assert waiting["cause"] == "stopped" and "first training step" not in waiting["error"], data
    assert waiting["error"].startswith(f"its script waits in ap.optimizer_step at {job}:{_line('STEP')} ")
    assert "after 3 step(s), a collective, for rank 1, which stopped making progress" in waiting["error"]
    assert first["exitcode"] in (-15, -9)


def test_a_rank_that_hangs_after_its_steps_is_named_not_the_rank_that_finished(tmp_path: Path) -> None:
    job = tmp_path / "hang.py"
    job.write_text(STEPPING)
    # Both take 6 steps; rank 0 returns and waits at its exit, rank 1 hangs after its last step.
    proc, took = timed_launch("--json", "--backend", "cpu", "--nprocs", "2", "--timeout", "5", str(job),
                              "6", "6", "6", timeout=240, ACCELPORT_EXIT_BARRIER_S=HELD_S)
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    first, ranks = data["first"], _failures(data)
    assert (first["rank"], first["cause"]) == (1, "stalled"), data  # not "rank 0 ended early"
    assert f"hang.py:{_line('HANG')} (time.sleep(300)" in first["error"]
    assert "after 6 step(s), outside any collective" in first["error"]
    assert ranks[0]["error"].startswith("had finished its script after 6 step(s) and waited at its exit for the "
                                        "others; stopped by the launcher (--timeout 5)"), data
    assert took < 150, took  # not held for the finished rank's exit barrier (300 s here)


def test_a_rank_that_ends_early_is_named_within_seconds_not_the_peer_it_left_waiting(tmp_path: Path) -> None:
    job = tmp_path / "uneven.py"
    job.write_text(STEPPING)
    # Rank 0 runs 6 steps, rank 1 only 2: rank 0 then waits in an all-reduce rank 1 never joins.
    # No --timeout, and an exit barrier of 300 s: the launch still ends at once.
    proc, took = timed_launch("--json", "--backend", "cpu", "--nprocs", "2", str(job), "6", "2", "-1", timeout=240,
                              ACCELPORT_EXIT_BARRIER_S=HELD_S)
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    first, ranks = data["first"], _failures(data)
    assert (first["rank"], first["cause"]) == (1, "ended-early"), data
    assert data["error"].startswith("rank 1 ended early: its script returned after 2 step(s) while rank 0 still "
                                    "ran and waited for it in a collective it never joined (rank 0 in "
                                    f"ap.optimizer_step at {job}:{_line('STEP')})"), data["error"]
    assert "give each the same number of batches" in data["error"]
    assert ranks[0]["error"].startswith("its script waits in ap.optimizer_step") and \
        "for rank 1, whose script had returned" in ranks[0]["error"], data
    assert took < 150, took  # it used to take the whole exit barrier (300 s here)


#: Two ranks that step in lockstep (a gradient all-reduce a step, 0.1 s apart), for --max-restarts with --timeout.
#: "crash": in the first attempt, rank 1 SIGKILLs itself once CRASH_AFTER seconds have passed since LAUNCHED (the
#: time before the launch began); later attempts take 20 steps and end. "hang": rank 1 hangs after step 3, in
#: every attempt. Each rank records which attempts it started, finished or hung in.
RESTARTING = """
import os, signal, sys, time
import torch
import accelport as ap

# The crash clock starts in the worker, which the launcher starts after its monitor: a crash at crash_after
# is at least that long after the monitor's start, however slowly the launcher itself started.
begun = time.time()
out, mode, crash_after = sys.argv[1], sys.argv[2], float(sys.argv[3])
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], ap.rank()
open(os.path.join(out, f"started-{attempt}-{rank}"), "w").close()
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
while step < 20 or (mode == "crash" and attempt == "0"):
    model(torch.ones(4, 2)).sum().backward()
    ap.optimizer_step(opt)
    opt.zero_grad()
    step += 1
    if rank == 1 and mode == "hang" and step == 3:
        open(os.path.join(out, f"hung-{attempt}-{rank}"), "w").close()
        time.sleep(600)
    if rank == 1 and mode == "crash" and attempt == "0" and time.time() > begun + crash_after:
        with open(os.path.join(out, "crashed"), "w") as f:
            f.write(str(time.time() - begun))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.1)
open(os.path.join(out, f"finished-{attempt}-{rank}"), "w").close()
"""


def test_a_restart_after_the_start_up_allowance_has_passed_is_watched_from_its_own_start(tmp_path: Path) -> None:
    job = tmp_path / "restarting.py"
    job.write_text(RESTARTING)
    out = tmp_path / "out"
    out.mkdir()
    # Rank 1 crashes 45 s after its own start, so past --startup-timeout 40; the restarted workers
    # start from nothing (Python, torch, the process group) and step again well within 40 s of
    # the restart. The monitor used to measure their start-up from the launch and stopped them
    # at once ("did not end its first training step within 40 s of the launch").
    proc = launch("--json", "--backend", "cpu", "--nprocs", "2", "--max-restarts", "1", "--timeout", "10",
                  "--startup-timeout", "40", str(job), str(out), "crash", "45", timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # "crashed" (in the listing below): the first attempt outlived the start-up allowance, as its clock
    # started after the monitor's.
    assert "exitcode: -9" in proc.stderr  # rank 1 really died (torchrun's report), and the group was restarted
    assert sorted(p.name for p in out.iterdir()) == ["crashed", "finished-1-0", "finished-1-1", "started-0-0",
                                                      "started-0-1", "started-1-0", "started-1-1"]


def test_a_restarted_attempt_that_hangs_is_stopped_by_the_timeout_too(tmp_path: Path) -> None:
    job = tmp_path / "restarting.py"
    job.write_text(RESTARTING)
    out = tmp_path / "out"
    out.mkdir()
    # Both attempts hang. The monitor used to stop watching after its first verdict: the second
    # attempt then hung until this test's own bound.
    proc = launch("--json", "--backend", "cpu", "--nprocs", "2", "--max-restarts", "1", "--timeout", "10",
                  str(job), str(out), "hang", "0", timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {"hung-0-1", "hung-1-1"} <= {p.name for p in out.iterdir()}  # each attempt hung, and was stopped
    assert not any(p.name.startswith("finished-") for p in out.iterdir())
    data = json.loads(proc.stdout)
    first = data["first"]
    assert (first["rank"], first["cause"]) == (1, "stalled"), data
    assert _stalled_for(data["error"], 10), data["error"]
    assert f"restarting.py:{_restarting_line('time.sleep(600)')} (time.sleep(600)) after 3 step(s), outside any " \
        "collective" in first["error"]
    waiting = _failures(data)[0]
    assert waiting["cause"] == "stopped" and "for rank 1, which stopped making progress" in waiting["error"], data


def _restarting_line(marker: str) -> int:
    return next(i for i, text in enumerate(RESTARTING.splitlines(), 1) if marker in text)


#: A rank-0-only slow end of its last step, after the gradient all-reduce: a step hook (a plugin).
SLOW_HOOK = """
import os, sys, time
import accelport as ap
from accelport.launch.heartbeat import DONE_PREFIX, PROBE_FILE, read

@ap.hookimpl
def accelport_step_end(record):
    if os.environ.get("RANK") != "0" or record.step != 3:
        return
    # Still inside ap.optimizer_step, past its all-reduce: stay until rank 1 has returned and the
    # launcher has asked where rank 0 is five more times (it judges on two answers in one place).
    directory = os.environ["ACCELPORT_LAUNCH_DIR"]
    seq = lambda: (read(os.path.join(directory, PROBE_FILE)) or {}).get("seq") or 0
    first = None
    for _ in range(1200):  # (a bound on a hang of this test, not a time it asserts)
        if first is None and os.path.exists(os.path.join(directory, f"{DONE_PREFIX}1.json")):
            first = seq()
        if first is not None and seq() >= first + 5:
            open(os.path.join(sys.argv[1], "probes-seen"), "w").write(str(seq() - first))
            return
        time.sleep(0.1)
"""

HOOKED = """
import sys
import torch
import accelport as ap

model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(4, 2)).sum().backward()
    ap.optimizer_step(opt)  # rank 0's third one ends in the slow hook
    opt.zero_grad()
"""


def _plugin_site(tmp_path: Path, name: str, source: str) -> Path:
    """A real (temporary) distribution whose `accelport` entry point is module ``name``."""
    site = tmp_path / "site"
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[accelport]\n{name} = {name}\n")
    (site / f"{name}.py").write_text(source)
    return site


def test_a_rank_that_finished_is_not_blamed_while_a_peer_ends_its_last_step_slowly(tmp_path: Path) -> None:
    # Both ranks take 3 steps. Rank 0 spends its last step's end in a slow step hook, inside
    # ap.optimizer_step but past its all-reduce, long after rank 1 returned: a healthy run. It was
    # stopped as "rank 1 ended early", because ap.optimizer_step on the stack counted as waiting.
    job = tmp_path / "job.py"
    job.write_text(HOOKED)
    site = _plugin_site(tmp_path, "slow_hook", SLOW_HOOK)
    proc = launch("--backend", "cpu", "--nprocs", "2", str(job), str(tmp_path), timeout=400,
                  PYTHONPATH=os.pathsep.join([str(site), REPO]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ended early" not in proc.stderr
    assert int((tmp_path / "probes-seen").read_text()) >= 5  # the launcher looked, rank 1 finished


WAITS = """
import sys
import torch
import accelport as ap

ap.barrier()  # both ranks have set up the process group
if ap.rank() == 0:  # rank 1 returns; rank 0 waits for it
    if sys.argv[1] == "barrier":
        ap.barrier()  # WAIT barrier
    elif sys.argv[1] == "all_reduce":
        ap.all_reduce(torch.ones(3))  # WAIT all_reduce
    else:
        ap.broadcast(torch.ones(3), src=1)  # WAIT broadcast
"""


@pytest.mark.parametrize("collective", ["barrier", "all_reduce", "broadcast"])
def test_a_rank_left_waiting_in_any_of_accelports_collectives_is_seen_waiting(tmp_path: Path,
                                                                             collective: str) -> None:
    job = tmp_path / "waits.py"
    job.write_text(WAITS)
    line = next(i for i, text in enumerate(WAITS.splitlines(), 1) if f"WAIT {collective}" in text)
    proc, took = timed_launch("--json", "--backend", "cpu", "--nprocs", "2", str(job), collective, timeout=240,
                              ACCELPORT_EXIT_BARRIER_S=HELD_S)
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["error"].startswith("rank 1 ended early: its script returned after 0 step(s) while rank 0 still "
                                    "ran and waited for it in a collective it never joined (rank 0 in "
                                    f"ap.{collective} at {job}:{line})"), data["error"]
    assert took < 150, took


#: ap.all_reduce given arguments that differ between the ranks, then 300 good calls, counted.
REDUCES = """
import json, os, sys
import torch
import torch.distributed as dist
import accelport as ap

rank = ap.rank()
count = [0]
reduce = dist.all_reduce

def counted(*args, **kwargs):
    count[0] += 1
    return reduce(*args, **kwargs)

dist.all_reduce = counted  # every all-reduce of this process, accelport's checks included

def error_of(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None

got = {
    "op": error_of(lambda: ap.all_reduce(torch.ones(2), op=("max", "sum")[rank])),
    "uint8": error_of(lambda: ap.all_reduce(torch.ones(2, dtype=(torch.uint8, torch.int64)[rank]))),
    "list": error_of(lambda: ap.all_reduce([torch.ones(2)] if rank == 0 else torch.ones(2))),
    "same_bad": error_of(lambda: ap.all_reduce(torch.ones(2, dtype=torch.uint8))),
    "in_step": ap.all_reduce(torch.ones(1)).item(),
}
before = count[0]
for _ in range(300):
    ap.all_reduce(torch.ones(1))
got["collectives_for_300_calls"] = count[0] - before
json.dump(got, open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w"))
"""


def test_all_reduce_checks_its_arguments_across_ranks_on_a_shared_schedule_and_stays_in_step(
        tmp_path: Path) -> None:
    job = tmp_path / "reduces.py"
    job.write_text(REDUCES)
    proc = launch("--backend", "cpu", "--nprocs", "2", str(job), str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        differ = "ValueError: ap.all_reduce: the replicas passed different tensors (here rank"
        # A bad argument on one rank only: every rank raises (the bad one used to raise alone and
        # leave the other in the check's collective, every later collective paired wrong).
        assert got["op"].startswith(f"{differ} {rank}: shape (2,), torch.float32, op={('max', 'sum')[rank]!r})")
        assert got["uint8"].startswith(f"{differ} {rank}: shape (2,), {('torch.uint8', 'torch.int64')[rank]}")
        assert got["list"].startswith(f"{differ} {rank}: {('a list', 'shape (2,), torch.float32')[rank]}, op='sum')")
        assert got["same_bad"].startswith("TypeError: ap.all_reduce of a torch.uint8 tensor would wrap around")
        assert got["in_step"] == 2.0
        # Calls 6 to 305: 300 reductions, and checks on calls 6, 7, 8, 100, 200 and 300 (not 300 checks).
        assert got["collectives_for_300_calls"] == 306, got


EXITS = """
import os, sys, time
import accelport as ap

how = sys.argv[1]
# Both ranks meet first: a rank may return from setting up the process group while its peer
# is still connecting, and an exit then fails the peer's set-up ("Connection closed by peer").
ap.barrier()
if ap.rank() == 1:
    if how == "message":
        sys.exit("rank 1 found no data")
    if how == "status":
        raise SystemExit(3)
    if how == "os-exit":
        os._exit(4)
    if how == "success":
        raise SystemExit(None)
if how == "success":
    sys.exit(0)
time.sleep(120)  # rank 0 runs on: held for the exit barrier, the launch would take 60 s and more
"""


@pytest.mark.parametrize(
    ("how", "status", "error"),
    [
        ("message", 1, "failed first: SystemExit: rank 1 found no data (exit status 1)"),
        ("status", 3, "failed first: SystemExit: exit status 3"),
        ("os-exit", 4, "failed first: exited with status 4 without raising a Python exception"),
    ],
)
def test_a_rank_that_exits_with_an_error_ends_the_launch_at_once_and_is_named(
        tmp_path: Path, how: str, status: int, error: str) -> None:
    job = tmp_path / "exits.py"
    job.write_text(EXITS)
    proc, took = timed_launch("--backend", "cpu", "--nprocs", "2", str(job), how, timeout=240,
                              ACCELPORT_EXIT_BARRIER_S=HELD_S)
    summary = [line for line in proc.stderr.splitlines() if line.startswith("accelport: error:")]
    assert proc.returncode == status, proc.stderr[-3000:]
    assert len(summary) == 1 and summary[0].startswith("accelport: error: rank 1 ") and error in summary[0], summary
    assert took < 150, took  # it used to wait for rank 0 for the whole exit barrier (300 s here)


def test_exit_status_zero_is_success_and_meets_the_peers(tmp_path: Path) -> None:
    job = tmp_path / "exits.py"
    job.write_text(EXITS)
    proc = launch("--backend", "cpu", "--nprocs", "2", str(job), "success", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accelport: error" not in proc.stderr and "terminate called" not in proc.stderr


TEARDOWN = """
import atexit, os, sys
import torch

def check():  # registered first, so it runs last: after accelport's own clean-up
    ok = torch.distributed.is_available() and not torch.distributed.is_initialized()
    open(os.path.join(sys.argv[1], f"destroyed{os.environ['RANK']}"), "w").write(str(ok))

atexit.register(check)
import accelport as ap

rank = ap.rank()
torch.manual_seed(rank)  # every replica starts from other weights...
model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
model[1].num_batches_tracked.fill_(10 + rank)
flags = torch.tensor([rank == 0, rank == 1])
ap.broadcast(model)  # ...and from rank 0's after this
ap.broadcast(flags, src=1)
ap.broadcast([t := torch.full((2, 3), float(rank)).t()], src=1)  # not contiguous
state = {k: v.clone() for k, v in model.state_dict().items()}
try:
    ap.broadcast(model, src=2)
except ValueError as exc:
    state["src_error"] = str(exc)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(4, 3)).sum().backward()
    ap.optimizer_step(opt)
    opt.zero_grad()
import json
beat = json.load(open(os.environ["ACCELPORT_HEARTBEAT"]))  # rewritten as steps end (the first one at once)
torch.save({"state": state, "flags": flags, "t": t, "beat": beat}, os.path.join(sys.argv[1], f"rank{rank}.pt"))
"""


def test_replicas_start_from_one_ranks_weights_and_the_group_is_destroyed_at_exit(tmp_path: Path) -> None:
    import torch

    job = tmp_path / "job.py"
    job.write_text(TEARDOWN)
    proc = launch("--backend", "cpu", "--nprocs", "2", str(job), str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    assert [(tmp_path / f"destroyed{r}").read_text() for r in (0, 1)] == ["True", "True"]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).state_dict()
    for key, value in expected.items():
        if key.endswith("num_batches_tracked"):
            value = torch.tensor(10)  # rank 0's buffer, an integer one
        assert torch.equal(r0["state"][key], value) and torch.equal(r1["state"][key], value), key
    assert r0["flags"].tolist() == r1["flags"].tolist() == [False, True]  # bool, from rank 1
    assert torch.equal(r0["t"], torch.ones(3, 2)) and torch.equal(r1["t"], torch.ones(3, 2))
    assert r0["beat"]["step"] >= 1 and r1["beat"]["step"] >= 1  # a heartbeat from a training step, not the start
    assert r0["state"]["src_error"] == ("ap.broadcast(src=...) takes the rank whose values every replica gets, "
                                        "between 0 and 1 here (world size 2), not 2")


def test_broadcast_alone_is_a_no_op_and_bad_input_says_what_to_pass() -> None:
    import torch

    ap.use("cpu")
    model = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert ap.broadcast(model) is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    t = torch.ones(2)
    assert ap.broadcast(t) is t
    with pytest.raises(TypeError, match="needs a tensor, a list of tensors or a torch.nn.Module, not dict"):
        ap.broadcast({"w": t})
    with pytest.raises(ValueError, match=r"between 0 and 0 here \(world size 1\), not 1"):
        ap.broadcast(t, src=1)
    with pytest.raises(ValueError, match="not True"):
        ap.broadcast(t, src=True)  # type: ignore[arg-type]


# -- the launcher's verdicts, from the files the workers write ------------------------------------


def _beat(step: int, at: float, pid: int = 0) -> dict[str, Any]:
    return {"pid": pid, "step": step, "time": at}


def _answer(waiting: str | None, where: str = "job.py:9", steps: int = 3) -> dict[str, Any]:
    return {"seq": 1, "where": where, "code": "work()", "waiting": waiting, "world": bool(waiting), "steps": steps}


def test_the_rank_outside_any_collective_is_the_one_that_hangs_whichever_stalled_first() -> None:
    from accelport.launch.run import _verdict

    beats = {0: _beat(3, 90.0), 1: _beat(3, 91.0)}
    answers = {0: _answer(None), 1: _answer("ap.optimizer_step", "job.py:12")}
    # Rank 0 hangs at job.py:9; rank 1, waiting for it, may be the one past --timeout first.
    for stalled in ({0: "no step"}, {1: "no step"}, {0: "no step", 1: "no step"}):
        records = _verdict(100.0, stalled, beats, {}, answers, "--timeout 5")
        if 0 in stalled:
            assert records[0]["cause"] == "stalled" and records[1]["cause"] == "stopped", records
            assert "job.py:9 (work()) after 3 step(s), outside any collective" in records[0]["error"]
            assert records[1]["error"].startswith("its script waits in ap.optimizer_step at job.py:12 (work()) after "
                                                  "3 step(s), a collective, for rank 0, which stopped making progress")
        else:  # only the waiting rank is past the limit yet (heartbeats come late): rank 0 is still the cause
            assert records[0]["cause"] == "stalled" and records[1]["cause"] == "stopped", records
            assert records[0]["error"] == ("rank 1 waited for it in a collective (no step); its script is at "
                                           "job.py:9 (work()) after 3 step(s), outside any collective; stopped by "
                                           "the launcher")
            assert records[1]["error"].startswith("its script waits in ap.optimizer_step at job.py:12 (work()) "
                                                  "after 3 step(s), a collective, for rank 0, which stopped making")
    unknown = _verdict(100.0, {0: "no step"}, beats, {}, {0: None, 1: answers[1]}, "--timeout 5")
    assert unknown[0]["cause"] == "stalled" and "no answer to the launcher's probe" in unknown[0]["error"]


def test_a_rank_outside_any_collective_is_blamed_for_waiting_ones_only_if_it_is_not_ahead_of_them() -> None:
    from accelport.launch.run import _verdict

    beats = {0: _beat(3, 90.0), 1: _beat(3, 91.0), 2: _beat(3, 91.0)}
    waits = {1: _answer("ap.optimizer_step", steps=4), 2: _answer("ap.optimizer_step", steps=5)}
    # Rank 0 has taken more steps than rank 1, which waits: it is past that collective, not the cause.
    ahead = _verdict(100.0, {1: "no step", 2: "no step"}, beats, {}, {0: _answer(None, steps=5), **waits}, "x")
    assert ahead[1]["cause"] == ahead[2]["cause"] == "stalled" and ahead[0]["cause"] == "stopped", ahead
    assert "as every rank of this host does" in ahead[1]["error"]
    behind = _verdict(100.0, {1: "no step", 2: "no step"}, beats, {}, {0: _answer(None, steps=4), **waits}, "x")
    assert behind[0]["cause"] == "stalled" and behind[1]["cause"] == behind[2]["cause"] == "stopped", behind
    assert behind[0]["error"].startswith("ranks 1, 2 waited for it in a collective (no step); its script is at ")
    # A rank that did not answer, or whose steps are not known, is not blamed on a guess.
    for answer in (None, {**_answer(None), "steps": None}):
        unknown = _verdict(100.0, {1: "no step"}, beats, {}, {0: answer, 1: waits[1], 2: waits[2]}, "x")
        assert unknown[1]["cause"] == "stalled" and unknown[0]["cause"] == "stopped", unknown


def test_a_finished_rank_is_named_only_when_the_stalled_ranks_wait_in_a_collective() -> None:
    from accelport.launch.run import _verdict

    beats = {0: _beat(2, 90.0)}
    done = {1: {"rank": 1, "pid": 7, "time": 89.0, "steps": 2}}
    waits = _verdict(100.0, {0: "no step"}, beats, done, {0: _answer("ap.optimizer_step")}, "--timeout 5")
    assert waits[1]["cause"] == "ended-early" and waits[1]["time"] == 89.0, waits
    assert waits[1]["error"].startswith("its script returned after 2 step(s) while rank 0 still ran and waited "
                                        "for it in a collective it never joined (rank 0 in ap.optimizer_step at "
                                        "job.py:9)")
    hangs = _verdict(100.0, {0: "no step"}, beats, done, {0: _answer(None)}, "--timeout 5")
    assert hangs[0]["cause"] == "stalled" and hangs[1]["cause"] == "stopped", hangs
    assert hangs[1]["error"].startswith("had finished its script after 2 step(s) and waited at its exit")


def _sleeper(attempt: int | None = None) -> subprocess.Popen[bytes]:
    """A process that stands for a worker: a session of its own, as torchrun starts them, for ``attempt`` (its
    TORCHELASTIC_RESTART_COUNT; none by default, whatever the test run inherited)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
    if attempt is not None:
        env["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env, start_new_session=True,
                            preexec_fn=default_signals)  # it answers SIGTERM as a worker would


def test_the_monitor_ends_a_job_whose_finished_rank_leaves_another_waiting_only_when_it_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    from accelport.launch import run
    from accelport.launch.heartbeat import write_json

    stopped: list[list[int]] = []
    monkeypatch.setattr(run, "_stop", stopped.append)  # a spy: the verdict and the order, nothing stopped
    ranks = [_sleeper() for _ in range(2)]
    request.addfinalizer(lambda: [p.kill() or p.wait() for p in ranks])  # type: ignore[func-returns-value]
    first, second = (p.pid for p in ranks)
    d = str(tmp_path)
    write_json(os.path.join(d, "heartbeat-rank0"), _beat(2, 10.0, pid=first))
    write_json(os.path.join(d, "done-rank1.json"), {"rank": 1, "pid": second, "time": 11.0, "steps": 2})
    monitor = run._Monitor(d, timeout=None, startup=None, expected=2, workers=lambda: [first, second])

    def answer(seq: int, at: float, **change: Any) -> None:
        write_json(os.path.join(d, "where-rank0.json"), {**_answer("ap.optimizer_step", steps=2), "seq": seq,
                                                          "time": at, "pid": first, **change})

    assert not monitor.check(12.0) and read_probe(d) == 1  # asked once
    answer(1, 12.5)
    assert not monitor.check(13.0) and read_probe(d) == 1  # one answer is not enough, and the next waits a gap
    assert not monitor.check(12.0 + run.PROBE_GAP_S) and read_probe(d) == 2
    answer(2, 14.5, steps=3, where="job.py:20")  # it moved on between the probes: not stuck
    assert not monitor.check(15.0)
    assert not monitor.check(14.0 + run.PROBE_GAP_S) and read_probe(d) == 3
    assert not stopped and not os.path.exists(os.path.join(d, "failure-rank1.json"))
    answer(3, 16.5, steps=3, where="job.py:20")  # twice in the same place, at a step rank 1 never took
    assert monitor.check(17.0) and stopped == [[first, second]] and monitor.fired  # rank 1, the cause, last
    assert read(os.path.join(d, "failure-rank1.json"))["cause"] == "ended-early"  # type: ignore[index]
    assert read(os.path.join(d, "failure-rank0.json"))["cause"] == "stopped"  # type: ignore[index]


def read_probe(directory: str) -> int | None:
    from accelport.launch.heartbeat import read

    return (read(os.path.join(directory, "probe")) or {}).get("seq")


def read(path: str) -> dict[str, Any] | None:
    from accelport.launch.heartbeat import read as read_json

    return read_json(path)


def test_a_finished_rank_is_not_blamed_for_a_peer_still_in_a_step_it_took_part_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelport.launch import run
    from accelport.launch.heartbeat import write_json

    monkeypatch.setattr(run, "_stop", lambda pids: pytest.fail("stopped"))
    d = str(tmp_path)
    write_json(os.path.join(d, "heartbeat-rank0"), _beat(2, 10.0))
    write_json(os.path.join(d, "done-rank1.json"), {"rank": 1, "time": 11.0, "steps": 3})
    monitor = run._Monitor(d, timeout=None, startup=None, expected=2, workers=lambda: [])
    for seq, at in ((1, 12.0), (2, 15.0)):  # still at step 2 of the 3 rank 1 took: in its last all-reduce
        write_json(os.path.join(d, "where-rank0.json"), {**_answer("ap.optimizer_step", steps=2), "seq": seq,
                                                          "time": at})
        assert not monitor.check(at + 0.5)
    write_json(os.path.join(d, "done-rank1.json"), {"rank": 1, "time": 11.0, "steps": 2, "peers_met": True})
    assert not monitor.check(20.0)  # the ranks met at their exit: nothing to judge


def test_a_lost_connection_after_a_rank_finished_blames_the_rank_that_finished(tmp_path: Path) -> None:
    from accelport.launch.heartbeat import write_json
    from accelport.launch.run import _explain, _failure_from

    write_json(str(tmp_path / "done-rank1.json"), {"rank": 1, "pid": 5, "time": 10.0, "steps": 2, "peers_met": False})
    victim = _failure_from(0, 1, {"rank": 0, "error": "RuntimeError: [pair.cc:553] Connection closed by peer",
                                  "traceback": "tb", "time": 12.0})
    first, failures = _explain([victim], str(tmp_path), None)
    assert (first.rank, first.cause, first.exitcode) == (1, "ended-early", 0) and failures == [first, victim]
    assert first.error.startswith("its script returned after 2 step(s) while rank 0 still ran and waited for it in "
                                  "a collective it never joined (then rank 0: RuntimeError: [pair.cc:553] "
                                  "Connection closed by peer)")
    raised = _failure_from(0, 1, {"rank": 0, "error": "ValueError: bad batch", "traceback": "tb", "time": 12.0})
    assert _explain([raised], str(tmp_path), None)[0] is raised  # its own error: the cause


def test_where_a_script_waits_is_read_from_its_thread_and_its_backends_marks() -> None:
    import threading

    from accelport.collectives import Collectives
    from accelport.launch.worker import api_functions, locate

    collectives = Collectives()
    release = threading.Event()

    def optimizer_step() -> None:  # stands for ap.optimizer_step, in the code that waits for the others
        with collectives.waiting("ap.optimizer_step"):
            release.wait(60)

    def optimizer_step_after_its_wait() -> None:  # ... and in the optimizer's own step, or a step hook
        release.wait(60)

    def in_wait(thread: threading.Thread, target: Any) -> bool:
        frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
        if frame is None or frame.f_code.co_filename != threading.__file__:
            return False
        while frame is not None and frame.f_code is not target.__code__:
            frame = frame.f_back
        return frame is not None

    api = {optimizer_step.__code__: "ap.optimizer_step", optimizer_step_after_its_wait.__code__: "ap.optimizer_step"}
    targets = (optimizer_step, optimizer_step_after_its_wait)
    threads = [threading.Thread(target=f, daemon=True) for f in targets]
    try:
        for t in threads:
            t.start()
        # Both threads inside release.wait: the mark is set a few bytecodes before the wait is entered.
        _until(lambda: all(in_wait(t, f) for t, f in zip(threads, targets, strict=True)))
        frames = sys._current_frames()
        marks = [collectives.waiting_in(t.ident) for t in threads]  # type: ignore[arg-type]
        waiting = locate(frames[threads[0].ident], api, marks[0])  # type: ignore[index]
        after = locate(frames[threads[1].ident], api, marks[1])  # type: ignore[index]
    finally:
        release.set()
        for t in threads:
            t.join()
    assert (waiting["waiting"], waiting["world"]) == ("ap.optimizer_step", True), waiting
    assert (after["waiting"], after["world"]) == (None, False), after  # it used to count as waiting
    assert collectives.waiting_in(threads[0].ident) is None  # type: ignore[arg-type]  # the mark goes with the wait
    # The user's line: this test's, not threading's.
    assert waiting["where"].startswith(f"{__file__}:") and waiting["code"] == "release.wait(60)", waiting
    names = set(api_functions(ap).values())
    assert {"ap.optimizer_step", "ap.barrier", "ap.all_reduce", "ap.broadcast", "ap.save"} <= names


def test_the_all_reduce_check_runs_on_the_first_calls_then_every_hundredth_or_always_when_asked() -> None:
    from accelport.collectives import CHECK_SETTING, Collectives

    scheduled = Collectives()
    due = [n for n in range(1, 1001) if scheduled.check_due({})]
    assert due == [1, 2, 3, 4, 5, 6, 7, 8, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]
    always = Collectives()
    assert all(always.check_due({CHECK_SETTING: "1"}) for _ in range(1000))


def test_a_record_written_without_replace_keeps_the_first_verdict(tmp_path: Path) -> None:
    from accelport.launch.heartbeat import read, write_json

    path = str(tmp_path / "failure-rank0.json")
    assert write_json(path, {"cause": "stalled"}, replace=False)
    assert not write_json(path, {"cause": "raised"}, replace=False)
    assert read(path) == {"cause": "stalled"} and sorted(os.listdir(tmp_path)) == ["failure-rank0.json"]
    assert write_json(path, {"cause": "raised"}) and read(path) == {"cause": "raised"}


def test_where_hard_links_are_not_allowed_a_record_is_still_written_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from accelport.launch.heartbeat import read, write_json

    def no_link(src: str, dst: str) -> None:  # stands in for a file system without hard links (vfat, some FUSE)
        raise PermissionError(errno.EPERM, "Operation not permitted", src)

    monkeypatch.setattr(os, "link", no_link)
    path = str(tmp_path / "failure-rank0.json")
    assert write_json(path, {"cause": "stalled"}, replace=False)  # it used to be lost
    assert not write_json(path, {"cause": "raised"}, replace=False)
    assert read(path) == {"cause": "stalled"} and sorted(os.listdir(tmp_path)) == ["failure-rank0.json"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="tells a process's parent from /proc")
def test_a_rank_that_exited_is_not_stopped_through_its_pid(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from accelport.launch import run
    from accelport.launch.heartbeat import write_json

    # Rank 1 has exited and its pid now belongs to a process the launch never started (here: one
    # adopted by init, as a recycled pid would be); rank 0 hangs.
    stranger = int(subprocess.run(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], capture_output=True,
                                  text=True, check=True).stdout)
    request.addfinalizer(lambda: _gone(stranger) or os.kill(stranger, 9))  # type: ignore[func-returns-value]
    rank0 = _sleeper()
    request.addfinalizer(lambda: rank0.kill() or rank0.wait())  # type: ignore[func-returns-value]
    d = str(tmp_path)
    write_json(os.path.join(d, "heartbeat-rank0"), _beat(2, 10.0, pid=rank0.pid))
    write_json(os.path.join(d, "done-rank1.json"), {"rank": 1, "pid": stranger, "time": 11.0, "steps": 2,
                                                     "peers_met": True})
    monitor = run._Monitor(d, timeout=5, startup=None, expected=2, workers=lambda: [rank0.pid])
    assert monitor.check(100.0)  # rank 0 stalled: every rank is stopped
    assert rank0.wait(timeout=120) == -15  # (SIGTERM: the bound guards a hang only)
    assert not _gone(stranger)  # it used to be sent SIGTERM too


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a worker's attempt and parent from /proc")
def test_the_monitor_watches_each_restart_from_its_own_start_and_never_judges_the_attempt_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    from accelport.launch import run
    from accelport.launch.heartbeat import write_json

    stopped: list[list[int]] = []
    monkeypatch.setattr(run, "_stop", stopped.append)  # a spy: the verdicts and their order, nothing stopped
    monkeypatch.setattr(run, "PROBE_WAIT_S", 0.0)  # nobody answers the probes here
    started: list[subprocess.Popen[bytes]] = []
    request.addfinalizer(lambda: [p.kill() or p.wait() for p in started])  # type: ignore[func-returns-value]

    def attempt(n: int) -> list[int]:  # two workers, as torchrun's agent starts them for attempt n
        started.extend(_sleeper(n) for _ in range(2))
        return [p.pid for p in started[-2:]]

    d = str(tmp_path)
    workers: list[int] = attempt(0)
    monitor = run._Monitor(d, timeout=5, startup=30, expected=2, workers=lambda: workers)
    monitor.started_at = 0.0  # the launch
    write_json(os.path.join(d, "heartbeat-rank0"), {**_beat(8, 100.0, pid=workers[0]), "attempt": 0})
    write_json(os.path.join(d, "heartbeat-rank1"), {**_beat(5, 90.0, pid=workers[1]), "attempt": 0})
    assert monitor.check(96.0) and stopped == [[workers[0], workers[1]]]  # rank 1 hangs: stopped last
    assert read(os.path.join(d, "failure-rank1.json"))["attempt"] == 0  # type: ignore[index]
    assert not monitor.check(97.0)  # one verdict an attempt
    for p in started:  # the engine ends attempt 0 ...
        p.kill()
        p.wait()
    workers = []
    assert not monitor.check(300.0) and len(stopped) == 1  # (its heartbeats are old, and nobody runs)
    workers = attempt(1)  # ... and starts attempt 1, 300 s into the launch: past --startup-timeout 30
    assert not monitor.check(400.0) and (monitor.attempt, monitor.fired) == (1, False)
    assert not monitor.check(425.0)  # the old heartbeats are older than --timeout 5: not judged
    for rank in (0, 1):  # the new worker of each rank forgets what its rank said in attempt 0 (worker.py)
        os.unlink(os.path.join(d, f"failure-rank{rank}.json"))
    write_json(os.path.join(d, "heartbeat-rank0"), {**_beat(0, 410.0, pid=workers[0]), "attempt": 1})
    assert not monitor.check(429.0) and len(stopped) == 1  # 29 s since the restart: still starting
    assert monitor.check(431.0) and stopped[1] == [workers[1], workers[0]]
    verdict = read(os.path.join(d, "failure-rank0.json"))
    assert verdict is not None and (verdict["cause"], verdict["attempt"]) == ("stalled", 1), verdict
    assert verdict["error"].startswith("did not end its first training step within 30 s of restart 1 "
                                       "(--startup-timeout 30)"), verdict


def test_a_long_backend_name_is_quoted_cut_and_redacted_as_ap_use_quotes_it(
        script: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    huge = "x" * 100_000
    assert main(["launch", "--backend", huge, script]) == 2
    err = capsys.readouterr().err
    cut = "x" * 40 + "... [cut: 100000 characters in all]"
    assert err.startswith(f"accelport: error: unknown backend '{cut}' (from --backend {cut}). ")
    assert len(err) < 400, len(err)  # the name came back whole in "(from --backend ...)", up to the line's limit
    monkeypatch.setenv("HF_TOKEN", "s3cr3t-value-of-a-token")
    assert main(["launch", "--backend", "s3cr3t-value-of-a-token" + "x" * 200, script]) == 2
    err = capsys.readouterr().err
    assert "s3cr3t" not in err and "<redacted>" in err, err


def test_a_failing_worker_leaves_its_process_group_alone_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    import atexit

    from accelport import eager
    from accelport.launch import worker

    unregistered: list[Any] = []
    monkeypatch.setattr(atexit, "unregister", unregistered.append)  # a spy on the one call that matters
    monkeypatch.delenv("ACCELPORT_LAUNCH_DIR", raising=False)
    worker.record_failure(1, SystemExit("no data"))
    assert unregistered == [eager._teardown_at_exit]
    assert worker._describe(SystemExit("no data")) == "SystemExit: no data (exit status 1)"
    assert worker._describe(SystemExit(3)) == "SystemExit: exit status 3"
    assert worker._describe(SystemExit(True)) == "SystemExit: exit status 1"


def test_the_heartbeat_is_written_at_most_once_an_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelport.contract import StepRecord
    from accelport.launch import heartbeat
    from accelport.launch.heartbeat import Heartbeat, create_plugin, read

    monkeypatch.setattr(heartbeat, "INTERVAL_S", 3600.0)  # step 2 is within the interval, however slow the machine
    path = str(tmp_path / "heartbeat-rank0")
    plugin = Heartbeat(path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # the third attempt of a launch
    plugin.accelport_step_end(StepRecord(1, "cpu", False, 0.01, 0.0, None, {}, 1.0, {}))
    assert read(path) == {"pid": os.getpid(), "step": 1, "time": read(path)["time"],  # type: ignore[index]
                          "attempt": 2}
    plugin.accelport_step_end(StepRecord(2, "cpu", False, 0.01, 0.0, None, {}, 1.0, {}))
    assert read(path)["step"] == 1  # type: ignore[index]  # within the interval: no write
    plugin._next = 0.0  # the interval has passed
    plugin.accelport_step_end(StepRecord(3, "cpu", False, 0.01, 0.0, None, {}, 1.0, {}))
    assert read(path)["step"] == 3  # type: ignore[index]
    assert not hasattr(create_plugin({}), "accelport_step_end")  # outside a launched worker: no hook at all
    assert isinstance(create_plugin({"ACCELPORT_HEARTBEAT": path}), Heartbeat)
