"""``straggler``: one rank makes the others wait.

The ranks of a data-parallel job meet once a step (the gradient all-reduce), so each step takes as long
as the slowest rank's. A rank's own work is its step less the time it waited for the others
(:meth:`JobView.waits`); the straggler is the rank with the most own work, by more than
:attr:`StragglerRule.SHARE` of the step, while the others spend at least that share waiting. The
finding names the category its extra time goes to (from its own breakdown against the others') and
that category's fix, said for the rank.
"""

from __future__ import annotations

import statistics

from accelport.diagnose.rule import Diagnosis, JobRule, JobView

__all__ = ["StragglerRule", "CATEGORY_WORDS"]

#: What each time category is, in a sentence about a rank's extra time.
CATEGORY_WORDS = {
    "data": "waiting for its next batch (its input pipeline)",
    "transfer": "copying its batches to the device",
    "other": "host work in the loop (the script's own code between the steps' work)",
    "device+other": "the forward pass and the loop's own code before it (augmentation, logging, metrics)",
    "host_sync": "reading device values on the host",
    "compile": "compiling",
    "device": "the device's own work",
    "between_steps": "work between the steps (evaluation, checkpoints)",
    "forward": ("the forward pass and the loop's code between its batch's arrival and its backward pass "
                "(augmentation, logging, metrics: on this backend they cannot be told from the forward's own work)"),
}


#: What makes the straggler's extra time go away, by where it goes ({rank}: the straggler's rank).
_FIXES = {
    "data": ("Rank {rank}'s input pipeline is slower than the others': give its DataLoader more workers "
             "(num_workers), check that its shard of the data is not larger or slower to read (another disk, larger "
             "files), and make each sample cheaper to load."),
    "transfer": ("Rank {rank}'s copies to its device take longer than the others': pin its loader's memory "
                 "(pin_memory=True) and check that its device sits on the same kind of link as the others'."),
    "compile": ("Rank {rank} compiles more than the others: give every rank batches of the same shapes (pad or "
                "bucket them the same way on every rank), so each compiles the same programs once."),
    "device": ("Rank {rank}'s device takes longer for the same work: check for another process on that chip, a "
               "throttled or different chip on its host, or more work given to that rank (a larger shard)."),
    "host_sync": ("Rank {rank} reads device values on the host that the others do not (logging or metrics on one "
                  "rank): read them every N steps, or on every rank at the same step."),
    "between_steps": ("Rank {rank} does work between steps that the others do not (evaluation, checkpoints, logging "
                      "on one rank): do it every N steps, on every rank, or in a background thread."),
    "forward": ("Rank {rank} runs more code before its backward pass than the others: look for work done on that "
                "rank alone, or with more work there (augmentation, logging, metrics, evaluation), give every rank "
                "the same work and move per-sample work into the DataLoader's workers; if the code is the same on "
                "every rank, rank {rank}'s device is slower for the same work (another process on that chip, a "
                "throttled or different chip)."),
}
#: Host code in the loop (``other``; ``{where}`` says where else it may be for a joined category).
_HOST_FIX = ("Rank {rank} runs more host code {where} than the others (augmentation, logging, metrics or evaluation "
             "done on that rank alone, or with more work there): give every rank the same work, move per-sample work "
             "into the DataLoader's workers, and do rank-0-only work every N steps.")


def _fix(category: str, rank: int) -> str:
    """What makes rank ``rank``'s extra time go away, by where it goes."""
    if category in _FIXES:
        return _FIXES[category].format(rank=rank)
    where = "in the loop" if category == "other" else "in the loop and the forward pass"
    return _HOST_FIX.format(rank=rank, where=where)


class StragglerRule(JobRule):
    kind = "straggler"
    #: The straggler's extra own work, and the others' waiting, as shares of the job's step.
    SHARE = 0.15
    #: Below this (seconds per step) a difference is noise.
    MIN_SECONDS = 0.005

    def judge(self, job: JobView) -> Diagnosis | None:
        runs = [r for r in job.runs if r.steps > 1 and r.step_seconds > 0]
        if len(runs) < 2:
            return None
        view = JobView(job.world_size, runs, job.missing)
        waited = view.waits()
        parts = view.breakdown()
        own = {r.rank: r.step_seconds - waited[r.rank] for r in runs}
        slow = max(runs, key=lambda r: (own[r.rank], -r.rank))
        others = [r for r in runs if r.rank != slow.rank]
        step = statistics.median(r.step_seconds for r in runs)
        extra = own[slow.rank] - statistics.median(own[r.rank] for r in others)
        share = statistics.mean(waited[r.rank] / r.step_seconds for r in others)
        if extra < max(self.SHARE * step, self.MIN_SECONDS) or share < self.SHARE:
            return None
        gaps = {c: v - statistics.median(parts[r.rank].get(c, 0.0) for r in others)
                for c, v in parts[slow.rank].items() if c != "collective"}
        category = max(gaps, key=lambda c: gaps[c]) if gaps else "other"
        if gaps.get(category, 0.0) <= 0:
            category = "other"
        sync = view.meeting
        if "device" in category.split("+") and (sync == "backward" or slow.backward > 0):
            # The category that holds the backward pass also holds the forward on an eager backend: where the
            # straggler's extra is not in its backward, it is before it (the forward and the loop's code there).
            # The others' backward holds their wait where the ranks meet there (DDP's all-reduce); timed
            # collectives (FSDP2's all-gathers and reduce-scatters) are already apart from it.
            theirs = [r.backward - (waited[r.rank] if sync == "backward" else 0.0) for r in others]
            if slow.backward - statistics.median(theirs) < 0.5 * extra:
                category = "forward"
        faster = extra / slow.step_seconds if slow.step_seconds > 0 else 0.0
        waiting = {"backward": "in the gradient all-reduce (inside backward)",
                   "device": "in the step's collectives, inside its compiled graph (where the host waits for the "
                             "device)"}.get(sync, "in the collectives")
        message = (f"rank {slow.rank} (host {slow.host}) holds the job back: each step it spends "
                   f"{extra * 1e3:.1f} ms more than the other ranks, in {CATEGORY_WORDS.get(category, category)}, and "
                   f"the other ranks spend {share:.0%} of their step waiting for it {waiting}. Without that the "
                   f"job's step would take about {(slow.step_seconds - extra) * 1e3:.1f} ms instead of "
                   f"{slow.step_seconds * 1e3:.1f} ms ({faster:.0%} less).")
        evidence = {"rank": slow.rank, "host": slow.host, "category": category,
                    "extra_seconds_per_step": round(extra, 6), "others_wait_share": round(share, 4),
                    "step_seconds": round(slow.step_seconds, 6)}
        return Diagnosis(kind=self.kind, message=message, step=2, evidence=evidence, severity="warning",
                         fix=_fix(category, slow.rank))
