"""The job's rules on ranks' summaries (no process started): straggler, rank divergence, ranks' findings said once."""

from __future__ import annotations

import pytest

from accelport.diagnose.job import JobPlace, judge
from accelport.diagnose.rule import JobView, RankRun


def _rank(rank: int, backward: float = 0.01, steps: int = 20, findings: tuple = (), compilations: int = 0,
          **per_step: float) -> RankRun:
    parts = {"device": 0.02 + backward, "other": 0.001, **per_step}
    return RankRun(rank=rank, host=f"h{rank // 2}", pid=100 + rank, steps=steps, exit_status=0, per_step=parts,
                   backward=backward, findings=list(findings), compilations=compilations)


def test_the_rank_that_arrives_last_at_the_all_reduce_is_the_straggler_and_the_others_wait():
    # Rank 2's data takes 0.1 s more per step; ranks 0, 1 and 3 wait that long inside their backward.
    runs = [_rank(0, backward=0.11), _rank(1, backward=0.11), _rank(2, data=0.1), _rank(3, backward=0.11)]
    view = JobView(4, runs)
    assert view.meeting == "backward"
    assert view.waits() == pytest.approx({0: 0.1, 1: 0.1, 2: 0.0, 3: 0.1})
    parts = view.breakdown()
    assert parts[0]["collective"] == pytest.approx(0.1) and parts[0]["device"] == pytest.approx(0.03)
    assert "collective" not in parts[2]
    job = judge(runs, 4)
    found = {f.kind: f for f in job.findings}
    assert job.straggler == 2
    evidence = found["straggler"].evidence
    assert evidence["rank"] == 2 and evidence["host"] == "h1" and evidence["category"] == "data"
    assert evidence["extra_seconds_per_step"] == pytest.approx(0.1)
    assert evidence["others_wait_share"] == pytest.approx(0.1 / 0.131, rel=1e-3)
    assert "rank 2 (host h1)" in found["straggler"].message and "num_workers" in found["straggler"].fix


def test_a_balanced_job_has_no_straggler():
    runs = [_rank(0, backward=0.0105), _rank(1, backward=0.01), _rank(2, backward=0.0102)]
    job = judge(runs, 3)
    assert job.findings == [] and job.straggler is None


def test_timed_collectives_are_where_the_ranks_meet_in_a_ported_loop():
    runs = [_rank(0, backward=0.0, collective=0.08), _rank(1, backward=0.0, collective=0.001, other=0.08)]
    job = judge(runs, 2)
    (found,) = [f for f in job.findings if f.kind == "straggler"]
    assert found.evidence["rank"] == 1 and found.evidence["category"] == "other"
    assert "in the collectives" in found.message



def test_with_timed_collectives_extra_work_before_the_backward_is_the_forward_and_in_it_the_device():
    # FSDP2 (its all-gathers and reduce-scatters timed): rank 1's extra 0.1 s is in the category holding the
    # forward and backward passes on an eager backend. Its backward is no longer than the others': it is before it.
    ahead = judge([_rank(0, collective=0.1), _rank(1, device=0.13, collective=0.002)], 2)
    (found,) = [f for f in ahead.findings if f.kind == "straggler"]
    assert found.evidence["rank"] == 1 and found.evidence["category"] == "forward"
    # Its backward pass is the one that takes 0.1 s longer: its device is slower for the same work.
    inside = judge([_rank(0, collective=0.1), _rank(1, backward=0.11, collective=0.002)], 2)
    (found,) = [f for f in inside.findings if f.kind == "straggler"]
    assert found.evidence["rank"] == 1 and found.evidence["category"] == "device"
    assert "device takes longer for the same work" in found.fix

def test_on_a_lazy_backend_the_ranks_meet_where_their_hosts_wait_for_the_device():
    # torch_xla: xm.optimizer_step's all-reduce runs inside the step's graph. Rank 1 traces 0.1 s longer on the
    # host (other); rank 0 waits for it in its sync (device) and in a host read of the loss (host_sync).
    from dataclasses import replace

    def lazy(rank: int, **per_step: float) -> RankRun:
        return replace(_rank(rank, backward=0.0), per_step={"other": 0.01, **per_step}, lazy=True)

    runs = [lazy(0, device=0.09, host_sync=0.04), lazy(1, device=0.02, host_sync=0.01, other=0.11),
            lazy(2, device=0.10, host_sync=0.03)]
    view = JobView(3, runs)
    assert view.meeting == "device"
    assert view.waits() == pytest.approx({0: 0.10, 1: 0.0, 2: 0.10})
    parts = view.breakdown()
    assert parts[0] == pytest.approx({"other": 0.01, "host_sync": 0.03, "collective": 0.10})  # (largest first)
    (found,) = [f for f in judge(runs, 3).findings if f.kind == "straggler"]
    assert found.evidence["rank"] == 1 and found.evidence["category"] == "other"
    assert "inside its compiled graph" in found.message
    # The flag travels with the rank's summary.
    assert RankRun.from_dict({**runs[0].__dict__}).lazy is True


def test_uneven_steps_name_the_rank_with_the_extra_step():
    job = judge([_rank(0, steps=12), _rank(1, steps=13), _rank(2, steps=12)], 3)
    (found,) = job.findings
    assert found.kind == "rank-divergence" and found.severity == "problem"
    assert found.evidence["rank"] == 1 and found.evidence["steps_by_rank"] == {0: 12, 1: 13, 2: 12}


def test_one_rank_compiling_more_is_a_rank_divergence():
    job = judge([_rank(0, compilations=2), _rank(1, compilations=7)], 2)
    (found,) = job.findings
    assert found.kind == "rank-divergence" and found.evidence == {
        "rank": 1, "what": "compilations", "compilations_by_rank": {0: 2, 1: 7}}


def _finding(kind: str, step: int) -> dict:
    return {"kind": kind, "message": f"{kind} seen.", "fix": "do this.", "step": step, "evidence": {},
            "severity": "problem"}


def test_what_every_rank_found_is_said_once_and_what_one_found_names_it():
    runs = [_rank(0, findings=(_finding("host-sync", 3), _finding("non-finite", 9))),
            _rank(1, findings=(_finding("host-sync", 3), _finding("non-finite", 7)))]
    found = {f.kind: f for f in judge(runs, 2).findings}
    assert found["host-sync"].message.startswith("on all 2 ranks:")
    assert found["non-finite"].evidence["rank"] == 1 and found["non-finite"].step == 7
    assert "Rank 1 went non-finite first (step 7)" in found["non-finite"].message
    # At the same step, the rank whose own input held it is the origin, not the one whose gradients got it.
    same = [_rank(0, findings=({**_finding("non-finite", 5), "evidence": {"source": "loss"}},)),
            _rank(1, findings=({**_finding("non-finite", 5), "evidence": {"source": "input"}},))]
    (origin,) = judge(same, 2).findings
    assert origin.evidence["rank"] == 1 and "its own input batch held it" in origin.message
    only = judge([_rank(0), _rank(1, findings=(_finding("input-bound", 5),))], 2).findings
    assert [(f.kind, f.evidence["rank"], f.evidence["ranks"]) for f in only] == [("input-bound", 1, [1])]
    assert only[0].message.startswith("on rank 1:")


def test_a_rank_summary_that_is_not_one_is_a_value_error():
    with pytest.raises(ValueError, match="not a rank's summary"):
        RankRun.from_dict({"rank": "zero"})
    run = _rank(3, data=0.5)
    from dataclasses import asdict

    assert RankRun.from_dict(asdict(run)) == run


@pytest.mark.parametrize(("environ", "expected"), [
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500",
      "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "2"},
     JobPlace(1, 2, "h", 29500, "accelport/diagnose/r/2/")),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"},
     None),  # one process: no job
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, None),  # no agent's store
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"},
     None),
])
def test_a_job_place_is_a_torchrun_rank_of_several(environ, expected):
    assert JobPlace.from_environ(environ) == expected


def test_memory_held_on_one_rank_only_names_that_rank():
    from dataclasses import replace

    gib = 2**30
    runs = [replace(_rank(r), peak_memory_bytes=peak) for r, peak in enumerate((2 * gib, 2 * gib, 3 * gib))]
    (found,) = judge(runs, 3).findings
    assert found.kind == "rank-divergence" and found.evidence["rank"] == 2 and found.evidence["what"] == "memory"
    assert "1024 MiB more" in found.message
    # A few percent apart, or a small absolute difference: nothing.
    close = [replace(_rank(r), peak_memory_bytes=peak) for r, peak in enumerate((2 * gib, int(2.2 * gib)))]
    small = [replace(_rank(r), peak_memory_bytes=peak) for r, peak in enumerate((100 * 2**20, 300 * 2**20))]
    assert judge(close, 2).findings == [] and judge(small, 2).findings == []


def test_a_rank_that_never_ended_is_placed_from_its_last_progress():
    ahead = judge([_rank(0, steps=6)], 2, missing=[1], progress={1: {"steps": 6, "in_backward": True}}).findings
    assert [(f.kind, f.evidence["rank"], f.evidence["what"]) for f in ahead] == [("rank-divergence", 1, "steps")]
    assert "inside the backward pass of its step 7" in ahead[0].message
    behind = judge([_rank(0, steps=6)], 2, missing=[1], progress={1: {"steps": 2, "in_backward": False}}).findings
    assert [(f.evidence["rank"], f.evidence["what"]) for f in behind] == [(1, "hang")]
    # A rank that was simply done with its steps and not yet inside another says nothing new.
    assert judge([_rank(0, steps=6)], 2, missing=[1], progress={1: {"steps": 6, "in_backward": False}}).findings == []


def test_a_rank_left_waiting_in_a_collective_the_others_never_called_is_named_with_it():
    waiting = "dist.all_reduce (called from train.py:57)"
    (lone,) = judge([_rank(0, steps=6)], 2, missing=[1],
                    progress={1: {"steps": 6, "in_backward": False, "in_collective": waiting}}).findings
    assert lone.kind == "rank-divergence" and lone.severity == "problem"
    assert lone.evidence == {"rank": 1, "what": "collective", "collective": waiting, "steps_by_rank": {0: 6, 1: 6},
                             "hung": True}
    assert f"waiting in {waiting} after 6 step(s), a collective the other ranks never called" in lone.message
    assert "if rank == 0:" in lone.fix and "drop_last=True" in lone.fix
    # Stopped before the others' end: the collective it waits in is said with where it stopped.
    (behind,) = judge([_rank(0, steps=6)], 2, missing=[1],
                      progress={1: {"steps": 2, "in_backward": False, "in_collective": waiting}}).findings
    assert behind.evidence["what"] == "hang" and f"when last seen, waiting in {waiting}," in behind.message


def test_a_rank_without_timed_steps_is_no_baseline_for_waiting_and_a_failed_rank_is_not_uneven():
    from dataclasses import replace

    failed = replace(_rank(2, backward=0.0, steps=1), exit_status=1, per_step={})
    runs = [_rank(0, backward=0.06), _rank(1, backward=0.06), failed]
    view = JobView(3, runs)
    assert view.waits() == {0: 0.0, 1: 0.0, 2: 0.0}
    assert "collective" not in view.breakdown()[0]
    assert [f.kind for f in judge(runs, 3).findings] == []  # rank 2's one step is its failure's, said by status


def test_nested_backward_passes_count_once_on_the_loop_thread():
    import torch

    from accelport.observe.steptime import StepClock, watch_backward

    clock = StepClock()
    watch_backward(clock)
    x = torch.ones(3, requires_grad=True)

    class Inner(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            with torch.enable_grad():
                y = torch.ones(2, requires_grad=True)
                torch.autograd.backward((y * 3).sum())  # a backward inside a backward, as reentrant checkpointing runs
            assert clock.in_backward
            return g * 2

    torch.autograd.backward(Inner.apply(x).sum())
    assert not clock.in_backward and clock.backward > 0


@pytest.mark.parametrize(("given", "seconds", "refused"), [
    (None, 120.0, False), ("", 120.0, False), ("20", 20.0, False), ("0", 0.0, False),
    ("soon", 120.0, True), ("-5", 120.0, True), ("nan", 120.0, True), ("inf", 120.0, True),
])
def test_the_job_wait_is_a_number_of_seconds_and_a_bad_one_is_said(given, seconds, refused):
    from accelport.settings import job_wait

    wait, problem = job_wait({} if given is None else {"ACCELPORT_JOB_WAIT": given})
    assert wait == seconds and (problem is not None) == refused
    if refused:
        assert f"ACCELPORT_JOB_WAIT={given} is not a number of seconds" in problem and "default 120 s" in problem
