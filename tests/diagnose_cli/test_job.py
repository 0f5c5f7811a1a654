"""``accelport diagnose`` over a whole torchrun job (cpu, gloo): every rank watched, one summary, one verdict.

Each fault is built large against its threshold: a straggler's extra 0.15 s of host work (or 0.2 s of
data loading) per step against a 0.05 s step, so two CPU-bound processes beside the suite cannot change
which rank is named; a balanced job's ranks do the same 0.05 s of work per step.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import pytest

from tests.diagnose_cli.runs import SCRIPTS, child_env, default_signals, run

pytest.importorskip("torch.distributed")

JOB = str(SCRIPTS / "ddp_job.py")
TORCHRUN = ("-m", "torch.distributed.run", "--nproc-per-node", "2")


def _summaries(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("accelport diagnose:")]


def _line_of(text: str) -> int:
    """The number of the job script's first line that holds ``text``."""
    return 1 + next(i for i, line in enumerate(pathlib.Path(JOB).read_text().splitlines()) if text in line)


def _job(tmp_path: pathlib.Path, *script_args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "job.json"
    proc = run("--output", str(out), *TORCHRUN, JOB, *script_args, cwd=tmp_path)
    assert out.is_file(), proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_a_rank_with_extra_host_work_is_named_the_straggler_and_the_others_wait_in_collective(tmp_path):
    proc, result = _job(tmp_path, "--slow-rank", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = _summaries(proc.stderr)
    assert len(summaries) == 1 and "a job of 2 ranks" in summaries[0], proc.stderr[-3000:]
    straggler = [f for f in result["findings"] if f["kind"] == "straggler"]
    assert len(straggler) == 1, result["findings"]
    evidence = straggler[0]["evidence"]
    assert evidence["rank"] == 1 and evidence["category"] == "forward"
    assert evidence["extra_seconds_per_step"] > 0.1 and evidence["others_wait_share"] > 0.4
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert set(ranks) == {0, 1} and ranks[1]["straggler"] and not ranks[0]["straggler"]
    # Rank 0 only waits: that time is the collective's, not its device's.
    rank0 = ranks[0]["time_breakdown"]
    assert rank0["collective"] > 0.1 and rank0["collective"] > rank0.get("device", 0.0)
    assert result["job"]["time_verdict"].startswith("straggler-bound: rank 1")
    said = " ".join(proc.stderr.split())
    assert "rank 1 (host" in said and "<- straggler" in said
    assert not any("device-bound" in line for line in proc.stderr.splitlines() if "rank 0" in line)


def test_an_fsdp2_straggler_is_named_and_the_others_wait_in_its_all_gathers(tmp_path):
    # FSDP2 meets in all-gathers (forward and backward) and reduce-scatters, not in DDP's reducer: those are timed.
    proc, result = _job(tmp_path, "--fsdp", "--slow-rank", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (straggler,) = [f for f in result["findings"] if f["kind"] == "straggler"]
    evidence = straggler["evidence"]
    assert evidence["rank"] == 1 and evidence["category"] == "forward", evidence
    assert evidence["extra_seconds_per_step"] > 0.1 and evidence["others_wait_share"] > 0.4
    ranks = {r["rank"]: r for r in result["ranks"]}
    rank0 = ranks[0]["time_breakdown"]
    assert rank0["collective"] > 0.1 and rank0["collective"] > rank0.get("device", 0.0)
    assert result["job"]["time_verdict"].startswith("straggler-bound: rank 1")
    assert not any("device-bound" in line for line in proc.stderr.splitlines() if "rank 0" in line)


def test_a_rank_with_a_slow_dataset_is_named_with_its_input_pipeline(tmp_path):
    out, page, steps = tmp_path / "job.json", tmp_path / "job.html", tmp_path / "steps.jsonl"
    proc = run("--output", str(out), "--report", str(page), "--metrics-file", str(steps), *TORCHRUN, JOB,
               "--slow-data-rank", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # The page has a row per rank, the straggler marked, beside rank 0's steps and the job's findings: that of
    # --report, and that accelport report draws later from rank 0's metrics file and the job's --output.
    later = subprocess.run([sys.executable, "-m", "accelport", "report", str(steps), "--job", str(out), "-o",
                            str(tmp_path / "later.html")], capture_output=True, text=True, timeout=600)
    assert later.returncode == 0, later.stderr
    for html in (page.read_text(), (tmp_path / "later.html").read_text()):
        rows = html.split("<tr class=rank>")[1:]
        assert len(rows) == 2 and "straggler" not in rows[0] and "<span class=badge>straggler</span>" in rows[1]
        assert "straggler" in html.split("<h2>Diagnoses</h2>")[1]
    # The --output given where the metrics file goes is said as such.
    mixed = subprocess.run([sys.executable, "-m", "accelport", "report", str(out)], capture_output=True, text=True,
                           timeout=600)
    assert mixed.returncode != 0 and "is the --output of accelport diagnose, not a metrics file" in mixed.stderr
    assert "Traceback" not in mixed.stderr
    kinds = {f["kind"]: f for f in result["findings"]}
    assert kinds["straggler"]["evidence"]["rank"] == 1
    assert kinds["straggler"]["evidence"]["category"] == "data"
    assert "num_workers" in kinds["straggler"]["fix"]
    # The input-bound finding was rank 1's alone, and says so.
    assert kinds["input-bound"]["evidence"]["rank"] == 1 and kinds["input-bound"]["evidence"]["ranks"] == [1]
    assert kinds["input-bound"]["message"].startswith("on rank 1:")


def test_memory_one_rank_holds_alone_names_that_rank(tmp_path):  # (silent on the balanced job below)
    # Rank 1 keeps 64 MiB of tensors a step (768 MiB by the end); on cpu a rank's memory is its process's resident
    # memory (the host is the device).
    proc, result = _job(tmp_path, "--memory-rank", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (found,) = [f for f in result["findings"] if f["kind"] == "rank-divergence"]
    evidence = found["evidence"]
    assert (evidence["rank"], evidence["what"]) == (1, "memory"), found
    by_rank = {int(r): v for r, v in evidence["peak_memory_bytes_by_rank"].items()}
    assert by_rank[1] - by_rank[0] > 600 * 2**20, by_rank
    assert "rank 1 peaked at" in " ".join(proc.stderr.split())


def test_a_rank_that_recompiles_is_the_straggler_by_compiling_and_a_rank_divergence(tmp_path):
    # Every rank compiles its model; rank 1's batch grows a row each step, so it compiles a program per step.
    proc, result = _job(tmp_path, "--manual", "--recompile-rank", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds = {f["kind"]: f for f in result["findings"]}
    assert kinds["straggler"]["evidence"]["rank"] == 1 and kinds["straggler"]["evidence"]["category"] == "compile"
    assert "same shapes" in kinds["straggler"]["fix"]
    divergence = kinds["rank-divergence"]["evidence"]
    assert divergence["rank"] == 1 and divergence["what"] == "compilations"
    compiled = divergence["compilations_by_rank"]
    assert compiled["0"] == 1 and compiled["1"] >= 8, compiled  # (8: dynamo's recompile limit)
    # The recompilation itself is rank 1's alone, and says so.
    assert kinds["recompilation"]["evidence"]["ranks"] == [1]


def test_a_balanced_job_has_no_straggler_and_one_verdict(tmp_path):
    out = tmp_path / "job.json"
    proc = run("--output", str(out), *TORCHRUN, JOB, cwd=tmp_path, env={"ACCELPORT_JOB_WAIT": "soon"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # A wait that is no number is said (and the default taken), not silently replaced.
    assert "ACCELPORT_JOB_WAIT=soon is not a number of seconds" in " ".join(proc.stderr.split())
    assert [f["kind"] for f in result["findings"]] == []
    assert result["job"]["straggler"] is None and result["job"]["ranks_missing"] == []
    assert [r["steps"] for r in result["ranks"]] == [12, 12]
    # 12 steps leave memory-growth unjudged (it needs 30): said, so the job is not called "ok".
    said = " ".join(proc.stderr.split())
    assert "no finding on any of the 2 ranks; not judged: memory-growth (needs 30 steps)" in said
    assert "[ok ]" not in said and result["verdict"]["not_judged"] == {"memory-growth": "needs 30 steps"}
    assert len(_summaries(proc.stderr)) == 1


def test_uneven_inputs_are_a_rank_divergence_naming_the_rank_with_more_steps(tmp_path):
    proc, result = _job(tmp_path, "--extra-step-rank", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [f for f in result["findings"] if f["kind"] == "rank-divergence"]
    assert len(found) == 1 and found[0]["severity"] == "problem"
    assert found[0]["evidence"]["rank"] == 1 and found[0]["evidence"]["steps_by_rank"] == {"0": 12, "1": 13}
    assert "drop_last=True" in found[0]["fix"] and "join()" in found[0]["fix"]


def test_a_rank_that_fails_is_said_and_the_job_is_not_called_ok(tmp_path):
    proc, result = _job(tmp_path, "--fail-rank", "1")
    assert proc.returncode != 0
    assert {r["rank"]: r["exit_status"] for r in result["ranks"]} == {0: 0, 1: 1}
    assert result["verdict"]["judged_every_step"] is False
    assert "rank 1 exited with status 1" in result["verdict"]["text"]
    assert "[ok  ]" not in proc.stderr


def test_torchrun_running_accelport_diagnose_on_each_rank_gives_the_same_job_summary(tmp_path):
    out = tmp_path / "job.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "accelport", "diagnose",
               "--output", str(out), JOB, "--slow-rank", "0"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=child_env(),
                          preexec_fn=default_signals)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_summaries(proc.stderr)) == 1
    result = json.loads(out.read_text())
    assert [f["evidence"]["rank"] for f in result["findings"] if f["kind"] == "straggler"] == [0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def test_two_nodes_on_localhost_gather_on_node_0(tmp_path):
    """Two launchers (--nnodes 2, one rank each) meeting at a c10d rendezvous: node 0's rank 0 says the job."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        out = tmp_path / f"node{node}.json"
        command = [sys.executable, "-m", "accelport", "diagnose", "--output", str(out), "-m",
                   "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "accelport-test", JOB, "--slow-rank", "1"]
        procs.append(subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=child_env(), preexec_fn=default_signals))
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outputs]
    written = [p for p in (tmp_path / "node0.json", tmp_path / "node1.json") if p.is_file()]
    assert len(written) == 1  # the node that ran rank 0
    result = json.loads(written[0].read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert [f["evidence"]["rank"] for f in result["findings"] if f["kind"] == "straggler"] == [1]
    assert sum(len(_summaries(e)) for _, e in outputs) == 1


def test_torchrun_no_python_is_refused_with_what_to_do(tmp_path):
    proc = run(*TORCHRUN, "--no-python", "echo", cwd=tmp_path)
    assert proc.returncode == 2 and "--no-python" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "said"), [
    ((), "the following arguments are required: training_script"),
    (("--bogus", JOB), "unrecognized arguments: --bogus"),
])
def test_torchrun_arguments_it_refuses_are_one_specific_error(tmp_path, args, said):
    proc = run(*TORCHRUN, *args, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "usage:" not in proc.stderr
    assert proc.stderr.count("error:") == 1 and said in proc.stderr and "torch.distributed.run --help" in proc.stderr


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_workers_a_script_starts_itself_are_each_watched_and_judged_as_one_job(tmp_path, start_method):
    out, page, steps = tmp_path / "job.json", tmp_path / "job.html", tmp_path / "steps.jsonl"
    proc = run("--output", str(out), "--report", str(page), "--metrics-file", str(steps),
               str(SCRIPTS / "spawn_job.py"), str(_free_port()), "--slow-rank", "1", "--start-method", start_method,
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all workers done" in proc.stdout
    summaries = _summaries(proc.stderr)
    assert len(summaries) == 1 and "a job of 2 ranks" in summaries[0] and "on cpu" in summaries[0]
    assert "not watched" not in proc.stderr
    result = json.loads(out.read_text())
    assert [(r["rank"], r["steps"]) for r in result["ranks"]] == [(0, 12), (1, 12)]
    assert len({r["pid"] for r in result["ranks"]}) == 2
    assert [f["evidence"]["rank"] for f in result["findings"] if f["kind"] == "straggler"] == [1]
    # The parent trained nothing: the page and the metrics file are rank 0's steps (a worker's), with the job's
    # rows and findings, as under torchrun.
    assert f"wrote {out}, {page}, {steps} (rank 0's steps)" in " ".join(proc.stderr.split()), proc.stderr[-2000:]
    lines = [json.loads(line) for line in steps.read_text().splitlines()]
    assert sum(1 for line in lines if "step" in line) == 12, lines[:2]
    html = page.read_text()
    rows = html.split("<tr class=rank>")[1:]
    assert len(rows) == 2 and "straggler" not in rows[0] and "<span class=badge>straggler</span>" in rows[1]
    assert "rank 0&#x27;s steps; the job&#x27;s findings" in html


def test_a_killed_worker_is_named_not_judged_and_the_one_spawn_then_stops_still_is(tmp_path):
    """Rank 1 is killed (SIGKILL) at its 6th step: it leaves no run. torch's spawn then stops rank 0 with SIGTERM
    (or its all-reduce fails first): rank 0 writes its run either way, and the parent says the job."""
    out = tmp_path / "job.json"
    proc = run("--output", str(out), str(SCRIPTS / "spawn_job.py"), str(_free_port()), "--kill-rank", "1",
               cwd=tmp_path)
    assert proc.returncode == 1 and "all workers done" not in proc.stdout, proc.stderr[-3000:]
    assert len(_summaries(proc.stderr)) == 1 and "a job of 2 ranks" in _summaries(proc.stderr)[0], proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (rank0,) = result["ranks"]
    assert rank0["rank"] == 0 and rank0["exit_status"] in (1, 143) and 5 <= rank0["steps"] <= 6, rank0
    assert result["job"]["ranks_missing"] == [1]
    said = " ".join(proc.stderr.split())
    assert "not judged: rank(s) 1 (no run came back from its worker: killed before its function ended" in said
    assert "[ok ]" not in said


def test_a_script_that_starts_workers_again_to_evaluate_is_judged_on_its_training_workers(tmp_path):
    out = tmp_path / "job.json"
    proc = run("--output", str(out), str(SCRIPTS / "spawn_job.py"), str(_free_port()), "--slow-rank", "1",
               "--evaluate", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["rank"], r["steps"]) for r in result["ranks"]] == [(0, 12), (1, 12)]
    assert [f["evidence"]["rank"] for f in result["findings"] if f["kind"] == "straggler"] == [1]
    (note,) = [n for n in result["notes"] if "started workers 2 times" in n]
    assert "the job judged is torch.multiprocessing.start_processes at " in note and "(1st start)" in note
    assert note.endswith("(2nd start): 2 worker(s), 0 optimizer step(s)"), note
    assert "started workers 2 times" in " ".join(proc.stderr.split())


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_process_targets_that_train_are_ranks_and_a_helper_process_is_not(tmp_path, start_method):
    out = tmp_path / "job.json"
    proc = run("--output", str(out), "--report", str(tmp_path / "job.html"), str(SCRIPTS / "spawn_job.py"),
               str(_free_port()), "--slow-rank", "1", "--start-method", start_method, "--process", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all workers done" in proc.stdout
    summaries = _summaries(proc.stderr)
    assert len(summaries) == 1 and "a job of 2 ranks" in summaries[0]
    result = json.loads(out.read_text())
    assert [(r["rank"], r["steps"]) for r in result["ranks"]] == [(0, 12), (1, 12)]  # the helper is no rank
    # (the page is drawn from the first training process's steps, rank 0's, however many helpers came before)
    assert len((tmp_path / "job.html").read_text().split("<tr class=rank>")[1:]) == 2
    assert [f["evidence"]["rank"] for f in result["findings"] if f["kind"] == "straggler"] == [1]


def test_collectives_the_script_calls_itself_are_timed_as_collective(tmp_path):
    """No DDP: the script averages its gradients with dist.all_reduce; rank 0's slow Dataset makes rank 1 wait."""
    proc, result = _job(tmp_path, "--manual", "--slow-data-rank", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (found,) = [f for f in result["findings"] if f["kind"] == "straggler"]
    assert found["evidence"]["rank"] == 0 and found["evidence"]["category"] == "data"
    assert "in the collectives" in found["message"]
    ranks = {r["rank"]: r["time_breakdown"] for r in result["ranks"]}
    assert ranks[1]["collective"] > 0.1 and ranks[1]["collective"] > 5 * ranks[0].get("collective", 0.0)


def test_ranks_a_scheduler_starts_without_torchrun_gather_through_rank_0s_store(tmp_path):
    """srun-style ranks: each its own `accelport diagnose`, meeting at MASTER_ADDR:MASTER_PORT (env://), with no
    torchrun agent. Rank 0's diagnose hosts the store there, the scripts join it, and rank 0 says the job."""
    port = _free_port()
    procs = []
    for rank in (1, 0):  # (rank 1 first: its script waits for the store rank 0 hosts)
        env = child_env({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": str(port)})
        command = [sys.executable, "-m", "accelport", "diagnose", "--output", str(tmp_path / f"rank{rank}.json"), JOB,
                   "--slow-rank", "1"]
        procs.append(subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env, preexec_fn=default_signals))
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outputs]
    assert not (tmp_path / "rank1.json").exists() and not _summaries(outputs[0][1])  # rank 1 says nothing
    (summary,) = _summaries(outputs[1][1])
    assert "a job of 2 ranks" in summary
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert [f["evidence"]["rank"] for f in result["findings"] if f["kind"] == "straggler"] == [1]


def test_a_rank_started_without_torchrun_says_its_own_run_labelled_with_its_rank(tmp_path):
    """srun-style ranks with no address to meet at (RANK and WORLD_SIZE alone): each says its own, labelled."""
    out = tmp_path / "job.json"
    proc = run("--output", str(out), str(SCRIPTS / "cpu_healthy.py"), cwd=tmp_path,
               env={"RANK": "1", "WORLD_SIZE": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (first,) = _summaries(proc.stderr)
    assert "cpu_healthy.py (rank 1 of 2) took" in first
    # The job's outputs are rank 0's to write: rank 1 writes none (it would overwrite rank 0's).
    assert not out.exists() and "are rank 0's to write" in " ".join(proc.stderr.split())


def test_a_nan_in_one_ranks_batch_names_that_rank_as_where_it_came_from(tmp_path):
    proc, result = _job(tmp_path, "--nan-rank", "1")
    (found,) = [f for f in result["findings"] if f["kind"] == "non-finite"]
    assert found["step"] == 5 and found["evidence"]["rank"] == 1 and found["evidence"]["ranks"] == [0, 1]
    assert "Rank 1 went non-finite first (step 5: its own input batch held it)" in found["message"]


def test_find_nan_on_the_ranks_named_searches_there_alone_and_names_the_rank_it_came_from(tmp_path):
    out = tmp_path / "job.json"
    proc = run("--output", str(out), "--find-nan", "--ranks", "1", *TORCHRUN, JOB, "--nan-rank", "1", cwd=tmp_path)
    result = json.loads(out.read_text())
    searched = {r["rank"]: "origin" in r["findings"][0]["evidence"] for r in result["ranks"]}
    assert searched == {0: False, 1: True}, proc.stderr[-3000:]  # rank 0 ran unchecked
    (found,) = [f for f in result["findings"] if f["kind"] == "non-finite"]
    made = _line_of('float("nan")')  # the line that wrote it
    assert found["evidence"]["rank"] == 1 and found["evidence"]["origin"]["where"].endswith(f"ddp_job.py:{made}")
    assert "Rank 1 went non-finite first (step 5: its own search found" in found["message"]


def test_ranks_is_checked_before_anything_runs(tmp_path):
    proc = run("--find-nan", "--ranks", "one", *TORCHRUN, JOB, cwd=tmp_path)
    assert proc.returncode == 2 and "--ranks one: give rank numbers from 0, separated by commas" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_rank_killed_mid_run_is_named_as_not_judged_and_the_summary_still_comes(tmp_path):
    proc, result = _job(tmp_path, "--kill-rank", "1")
    assert proc.returncode != 0
    assert result["job"]["ranks_missing"] == [1] and [r["rank"] for r in result["ranks"]] == [0]
    assert result["verdict"]["judged_every_step"] is False
    said = " ".join(proc.stderr.split())
    assert "not judged: rank(s) 1" in said and "[ok ]" not in said
    assert len(_summaries(proc.stderr)) == 1


def test_the_ddp_hang_of_uneven_inputs_ends_and_names_the_rank_inside_its_extra_step(tmp_path):
    """Rank 1 has one batch more under DDP: it waits for ever in that step's all-reduce. Rank 0 stops waiting for
    it after ACCELPORT_JOB_WAIT seconds and names it from the progress it last put in the store."""
    out = tmp_path / "job.json"
    proc = run("--output", str(out), *TORCHRUN, JOB, "--extra-step-rank", "1", "--ddp-uneven", cwd=tmp_path,
               env={"ACCELPORT_JOB_WAIT": "20"})
    assert out.is_file(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (found,) = [f for f in result["findings"] if f["kind"] == "rank-divergence"]
    assert found["evidence"]["rank"] == 1 and found["evidence"]["hung"] is True
    assert found["evidence"]["steps_by_rank"] == {"0": 12, "1": 13}
    assert "inside the backward pass of its step 13" in found["message"] and "join()" in found["fix"]
    assert result["job"]["ranks_missing"] == [1]


@pytest.mark.parametrize("fault, collective, line", [
    (("--lone-collective-rank", "1"), "dist.all_reduce", "dist.all_reduce(torch.ones(1))"),
    (("--fsdp", "--extra-step-rank", "1", "--ddp-uneven"), "dist.all_gather_single", "mse_loss(model(x), y)"),
], ids=["a-collective-on-one-rank", "fsdp2-uneven-inputs"])
def test_a_rank_left_waiting_in_a_collective_the_others_never_called_is_named_with_its_line(tmp_path, fault,
                                                                                           collective, line):
    """Rank 1 calls dist.all_reduce alone after its steps, or (FSDP2) starts a 13th step whose forward all-gathers
    with no one: rank 0 ends, and names rank 1 with the collective and the script's line it waits at."""
    out = tmp_path / "job.json"
    proc = run("--output", str(out), *TORCHRUN, JOB, *fault, cwd=tmp_path, env={"ACCELPORT_JOB_WAIT": "20"})
    assert out.is_file(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (found,) = [f for f in result["findings"] if f["kind"] == "rank-divergence"]
    evidence = found["evidence"]
    assert evidence["rank"] == 1 and evidence["what"] == "collective" and evidence["hung"] is True, found
    assert evidence["collective"] == f"{collective} (called from ddp_job.py:{_line_of(line)})"
    assert "a collective the other ranks never called" in found["message"]
    assert result["job"]["ranks_missing"] == [1] and "[ok" not in proc.stderr


def test_rank_0_stopped_while_it_waits_for_the_others_still_says_the_job(tmp_path):
    """Rank 1 dies after rank 0 ended its script: torchrun stops rank 0 (SIGTERM) while it waits for rank 1's
    summary. Rank 0 stops waiting and says what it has, before torchrun would kill it."""
    proc, result = _job(tmp_path, "--die-after-rank", "1")
    assert proc.returncode != 0
    assert result["job"]["ranks_missing"] == [1] and [r["steps"] for r in result["ranks"]] == [12]
    assert len(_summaries(proc.stderr)) == 1
