"""``rank-divergence``: the ranks of a job do different work.

A data-parallel job's ranks run the same program on their own share of the data. Where one rank takes
more optimizer steps than the others (uneven inputs), a collective of its extra step has no partner: DDP
hangs there, or the job ends with that rank's work unmatched. Where one rank compiles more programs than
the others (another batch shape there), on XLA it runs a different graph: it recompiles alone, and a
collective in that graph may wait for ever. Where one rank's memory peak is well above the others' (work
it does alone: evaluation, logging), it runs out of memory first. The finding names the rank that does
the odd work.
"""

from __future__ import annotations

from collections import Counter

from accelport.diagnose.rule import Diagnosis, JobRule, JobView, RankRun

__all__ = ["RankDivergenceRule"]


def _odd(values: dict[int, int]) -> int | None:
    """The rank whose value differs from the most common one (of a tie, the larger value's first rank)."""
    counts = Counter(values.values())
    if len(counts) < 2:
        return None
    common = max(counts, key=lambda v: (counts[v], -v))
    return min((r for r, v in values.items() if v != common), key=lambda r: (-values[r], r))


_UNEVEN_FIX = ("Give every rank the same number of batches: DistributedSampler(dataset, drop_last=True) (or "
               "ap.loader(..., shard=True), which shards evenly), or wrap the loop in DDP's model.join() to let "
               "ranks with fewer batches shadow the others' collectives.")

#: A collective that some ranks call and others do not.
_LONE_FIX = ("Call each collective on every rank, the same number of times: keep it out of `if rank == 0:` blocks "
             "(compute on every rank and use the result on rank 0), and give every rank the same number of batches "
             "(DistributedSampler(dataset, drop_last=True), or ap.loader(..., shard=True)).")


class RankDivergenceRule(JobRule):
    kind = "rank-divergence"
    #: One rank's memory peak above the others' (their median) by this share and at least this many bytes.
    MEMORY_SHARE = 0.25
    MEMORY_BYTES = 256 * 2**20

    def _hang(self, job: JobView, steps: dict[int, int]) -> Diagnosis | None:
        """A rank that never ended while the others did: where it stood (from its last progress)."""
        # Only where the others ended well: a rank that failed (or one killed, whose last progress is stale)
        # takes the others down with it, and is said by its status, not placed.
        if not job.progress or not steps or any(r.exit_status != 0 for r in job.runs):
            return None
        done = max(steps.values())
        for rank in sorted(job.progress):
            seen = job.progress[rank]
            at = int(seen.get("steps") or 0)
            inside = bool(seen.get("in_backward"))
            waiting = seen.get("in_collective")
            if waiting and at >= done:
                # A collective the others never called: its partners are gone. (Inside a backward pass, FSDP2's
                # reduce-scatter of an extra step; elsewhere a collective called on some ranks only, or an extra
                # step's forward all-gather: one process cannot tell those apart, so both are said.)
                message = (f"rank {rank} never ended: it was waiting in {waiting}"
                           f"{' inside the backward pass' if inside else ''} after {at} step(s), a collective the "
                           f"other ranks never called: they took {done} step(s) and ended. Either it had more "
                           "batches than they did (uneven inputs) or the script calls that collective on some "
                           "ranks only (under an `if rank == ...`, or after a loop whose length differs by rank).")
                return Diagnosis(kind=self.kind, message=message, step=at + 1, severity="problem",
                                 evidence={"rank": rank, "what": "collective", "collective": str(waiting),
                                           "steps_by_rank": {**steps, rank: at + (1 if inside else 0)},
                                           "hung": True},
                                 fix=_LONE_FIX)
            if at >= done and (at > done or inside):
                message = (f"rank {rank} never ended: it was inside the backward pass of its step {at + 1} when "
                           f"last seen, after the other ranks took {done} step(s) and ended. Its gradient "
                           "all-reduce waits for ranks that are gone: it had more batches than they did (uneven "
                           "inputs), the DDP hang." if inside else
                           f"rank {rank} never ended: it had taken {at} step(s) when last seen, more than the "
                           f"{done} the other ranks took before they ended (uneven inputs).")
                return Diagnosis(kind=self.kind, message=message, step=done + 1, severity="problem",
                                 evidence={"rank": rank, "what": "steps",
                                           "steps_by_rank": {**steps, rank: at + (1 if inside else 0)},
                                           "hung": True}, fix=_UNEVEN_FIX)
            if at < done:
                where = (f", waiting in {waiting}" if waiting else "") + (", inside a backward pass" if inside else "")
                message = (f"rank {rank} never ended: it had taken {at} step(s) when last seen{where}, while the "
                           f"other ranks took {done} and ended. It stopped (a hang in its own code or data, or a "
                           "collective the others never called), not the others.")
                fix = ("Run it again with `accelport launch --timeout SECONDS --diagnose`: the launch names the line "
                       "each rank is stuck at and the collective it waits in.")
                return Diagnosis(kind=self.kind, message=message, step=at + 1, severity="problem",
                                 evidence={"rank": rank, "what": "hang", "steps_by_rank": {**steps, rank: at},
                                           "hung": True}, fix=fix)
        return None

    def judge(self, job: JobView) -> Diagnosis | None:
        runs: list[RankRun] = list(job.runs)
        steps = {r.rank: r.steps for r in runs}
        hung = self._hang(job, steps)
        if hung is not None:
            return hung
        # A rank that failed or was stopped took fewer steps for that reason: said by its status, not as uneven.
        runs = [r for r in runs if r.exit_status == 0]
        if len(runs) < 2:
            return None
        steps = {r.rank: r.steps for r in runs}
        odd = _odd(steps)
        if odd is not None:
            others = sorted({v for r, v in steps.items() if r != odd})
            said = " or ".join(map(str, others))
            more = steps[odd] > max(others)
            message = (f"rank {odd} took {steps[odd]} optimizer step(s) and the other ranks {said}: the ranks had "
                       f"{'uneven inputs' if more else 'different amounts of work'}. In a DDP or FSDP job the "
                       f"extra step's gradient all-reduce has no partner: the job hangs there (or, where the "
                       "collectives do not meet each step, rank "
                       f"{odd}'s extra updates are not matched on the others).")
            fix = _UNEVEN_FIX
            return Diagnosis(kind=self.kind, message=message, step=min(steps.values()) + 1, severity="problem",
                             evidence={"rank": odd, "what": "steps", "steps_by_rank": steps}, fix=fix)
        compiles = {r.rank: r.compilations for r in runs}
        odd = _odd(compiles)
        if odd is not None and compiles[odd] > 0:
            others = sorted({v for r, v in compiles.items() if r != odd})
            message = (f"rank {odd} compiled {compiles[odd]} time(s) and the other ranks "
                       f"{' or '.join(map(str, others))}: it runs programs the others do not (another batch shape "
                       f"or a different branch on that rank). It spends that time compiling alone while the others "
                       "wait, and on XLA a collective in a graph only one rank runs can wait for ever.")
            fix = ("Give every rank batches of the same shapes (the same padding or buckets on every rank, "
                   "drop_last=True) and the same branches in the step (no `if rank == 0` inside it).")
            return Diagnosis(kind=self.kind, message=message, step=1, severity="warning",
                             evidence={"rank": odd, "what": "compilations", "compilations_by_rank": compiles},
                             fix=fix)
        memory = {r.rank: r.peak_memory_bytes for r in runs if r.peak_memory_bytes}
        if len(memory) == len(runs):
            high = max(memory, key=lambda r: (memory[r], -r))
            rest = sorted(v for r, v in memory.items() if r != high)
            typical = rest[len(rest) // 2]
            extra = memory[high] - typical
            if extra > self.MEMORY_SHARE * typical and extra >= self.MEMORY_BYTES:
                message = (f"rank {high} peaked at {memory[high] / 2**20:.0f} MiB of memory and the other ranks at "
                           f"about {typical / 2**20:.0f} MiB: {extra / 2**20:.0f} MiB more, held by work that rank "
                           "does alone (evaluation, logging or metrics kept on that rank, a larger shard of the "
                           "data). The job's batch and model size are capped by that rank: it runs out of memory "
                           "first.")
                fix = ("Do rank-0-only work (evaluation, metric buffers, a copy of the model for saving) in small "
                       "pieces or on every rank's share, free it after use (del, and no tensors kept in lists), and "
                       "give every rank the same shard size.")
                return Diagnosis(kind=self.kind, message=message, step=1, severity="warning",
                                 evidence={"rank": high, "what": "memory", "peak_memory_bytes_by_rank": memory},
                                 fix=fix)
        return None
