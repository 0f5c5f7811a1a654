"""A whole job under ``accelport diagnose``: every rank's result gathered on rank 0 and judged together.

Each rank of a job started by torchrun (``torchrun ... -m accelport diagnose train.py``, or
``accelport diagnose -m torch.distributed.run ...``, which starts exactly that) watches itself as one
process does. When its script ends, it hands a small summary of its run (:class:`RankRun`: steps,
exit status, where a step's time went, what its rules found) to rank 0 through the job's own
rendezvous: the c10d store torchrun's agent already hosts at ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE``, the store every rank's process group joins; see
torch/distributed/rendezvous.py, ``_create_c10d_store``). Nothing travels during the run, and no
shared filesystem is needed. Rank 0 waits for the others' summaries (``ACCELPORT_JOB_WAIT`` seconds,
default 120, after its own script ended), runs the job's rules on them
(:data:`JOB_RULES`: a straggler, ranks that do different work) and says one verdict for the job.

Waiting is never the device's work: a rank that waits for a slower peer in the gradient all-reduce
spends that time inside its backward pass (DDP's reducer), which one process alone cannot tell from
its own compute. Across ranks it can: the ranks run the same program, so the part of that phase a
rank spends beyond the rank that waits least in it is waiting, and is charged to ``collective``
(:meth:`JobView.breakdown`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from accelport.diagnose.rule import Diagnosis, JobView, RankRun
from accelport.settings import job_wait

__all__ = ["JobPlace", "RankRun", "RankStore", "JobView", "JobResult", "judge", "publish", "gather",
           "ProgressReporter", "progress_of", "job_rank"]

#: After a SIGTERM (the scheduler's or torchrun's stop), the others are given this long at most.
STOPPED_WAIT = 5.0


@dataclass(frozen=True)
class JobPlace:
    """Where this process stands in a job torchrun started: its rank, and the store its agent hosts."""

    rank: int
    world_size: int
    store_host: str
    store_port: int
    #: One job's attempt: a restart of the job (--max-restarts) gathers its own ranks, not the last attempt's.
    key: str

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> JobPlace | None:
        """The place of a rank of a torchrun job of more than one process; None for anything else (one
        process, or ranks started without torchrun's agent, which hosts no store once the script ends)."""
        ranked = job_rank(environ)
        try:
            host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
        except (KeyError, ValueError):
            return None
        if ranked is None or environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        rank, world = ranked
        run = environ.get("TORCHELASTIC_RUN_ID", "job")
        attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(rank, world, host, port, f"accelport/diagnose/{run}/{attempt}/")


def job_rank(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(rank, world size) of a process of a job of several (RANK and WORLD_SIZE, as torchrun, srun wrappers and
    launchers set them); None for one process, or values that are no rank of a job."""
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (rank, world) if world > 1 and 0 <= rank < world else None


def _store(place: JobPlace, timeout: float) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    client = dist.TCPStore(place.store_host, place.store_port, is_master=False,
                           timeout=timedelta(seconds=max(timeout, 1.0)))
    return dist.PrefixStore(place.key, client)


class RankStore:
    """Ranks a scheduler starts itself (``srun``, a Kubernetes job's pods), each under ``accelport diagnose``,
    meeting at ``MASTER_ADDR:MASTER_PORT`` with no torchrun agent to host a store that outlives their scripts.

    Each rank's diagnose then does what the agent does: it sets ``TORCHELASTIC_USE_AGENT_STORE=True`` for its
    script, so the script's process group joins the store at that address as a client (torch's
    ``_create_c10d_store``), and rank 0's diagnose hosts that store itself, started once the script imports
    ``torch.distributed`` (never before the script's own imports). The store lives as long as rank 0's
    diagnose, so the ranks' summaries travel through it after the scripts end, as under torchrun
    (:class:`JobPlace`). Where rank 0 cannot host it (the port taken), its script hosts its own as it would
    have, and each rank says its own run."""

    def __init__(self, environ: Any, rank: int, world: int, host: str, port: int) -> None:
        self._environ = environ
        self.rank, self.world, self.host, self.port = rank, world, host, port
        self.server: Any = None
        self.problem: str | None = None
        environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")  # (read by torch releases that prefix attempts)

    @classmethod
    def for_environ(cls, environ: Any) -> RankStore | None:
        """The ranks' store for a rank of a job started without torchrun's agent; None for anything else."""
        ranked = job_rank(environ)
        if ranked is None or environ.get("TORCHELASTIC_USE_AGENT_STORE") is not None:
            return None
        try:
            host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
        except (KeyError, ValueError):
            return None
        return cls(environ, ranked[0], ranked[1], host, port)

    def imports(self) -> dict[str, Callable[[Any], None]]:
        """The watcher's callback: rank 0 hosts the store once the script has imported torch.distributed."""
        return {"torch.distributed": self._host} if self.rank == 0 else {}

    def _host(self, module: Any) -> None:
        if self.server is not None:
            return
        from datetime import timedelta

        try:
            self.server = module.TCPStore(self.host, self.port, self.world, True, timedelta(seconds=300),
                                          wait_for_workers=False)
        except Exception as exc:  # the port taken: the script hosts its own store, as without diagnose
            self.problem = f"{type(exc).__name__}: {exc}"
            self._environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def publish(place: JobPlace, run: RankRun, timeout: float = 30.0) -> str | None:
    """Hand this rank's summary to rank 0; why it could not be (None when it was)."""
    try:
        _store(place, timeout).set(f"rank/{run.rank}", json.dumps(asdict(run), default=str))
    except Exception as exc:  # the agent gone (the job is being torn down), or no store at that address
        return f"{type(exc).__name__}: {exc}"
    return None


def wait_seconds(environ: Mapping[str, str], stopped: bool) -> tuple[float, str | None]:
    """How long rank 0 waits for the others: ACCELPORT_JOB_WAIT (:func:`accelport.settings.job_wait`), at most
    :data:`STOPPED_WAIT` after a stop request; and why a value given was not taken, or None."""
    wait, problem = job_wait(environ)
    return (min(wait, STOPPED_WAIT) if stopped else wait), problem


def gather(place: JobPlace, own: RankRun, wait: float, stopped: Callable[[], bool] = lambda: False
           ) -> tuple[list[RankRun], list[int], str | None]:
    """Rank 0: every rank's summary that arrives within ``wait`` seconds (at most :data:`STOPPED_WAIT` more once
    ``stopped()`` says a stop was asked: torchrun kills what does not end soon after its SIGTERM), in rank
    order; the ranks whose did not; why none could be read (the store cannot be reached), or None."""
    runs = {own.rank: own}
    try:
        store = _store(place, wait + 5.0)
    except Exception as exc:
        return [own], [r for r in range(place.world_size) if r != own.rank], f"{type(exc).__name__}: {exc}"
    pending = [r for r in range(place.world_size) if r != own.rank]
    deadline = time.monotonic() + wait
    while pending:
        for r in list(pending):
            key = f"rank/{r}"
            try:
                if store.check([key]):
                    runs[r] = RankRun.from_dict(json.loads(store.get(key)))
                    pending.remove(r)
            except Exception:  # a value that is not one of ours: that rank is not judged
                pending.remove(r)
        now = time.monotonic()
        if stopped():
            deadline = min(deadline, now + STOPPED_WAIT)
        if not pending or now >= deadline:
            break
        time.sleep(0.2)
    return [runs[r] for r in sorted(runs)], pending, None


class ProgressReporter:
    """A rank's progress (its steps, and whether it is inside a backward pass) put in the job's store every
    :attr:`INTERVAL` seconds while it changes, from a thread: where a rank that never ends stands when rank 0
    stops waiting for it (the uneven-inputs hang: one rank inside its extra step's all-reduce)."""

    INTERVAL = 2.0

    def __init__(self, place: JobPlace, read: Callable[[], Mapping[str, Any]]) -> None:
        self._place = place
        self._read = read
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="accelport-job-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        store = None
        last: Mapping[str, Any] | None = None
        while not self._stopped.wait(self.INTERVAL):
            if store is None:
                # Not before the first step: then the script has imported torch whole. Imported from this thread
                # earlier, it would race the script's own import (and the watcher's hooks on it).
                if not self._read().get("steps") or "torch.distributed" not in sys.modules:
                    continue
                try:
                    store = _store(self._place, 10.0)
                except Exception:  # no store: nothing is said of this rank's progress
                    return
            try:
                now = dict(self._read())
                if now != last:
                    store.set(f"progress/{self._place.rank}", json.dumps(now))
                    last = now
            except Exception:  # the store gone (the job ends): stop saying
                return


def progress_of(place: JobPlace, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The last progress ``ranks`` put in the store (those that said none are left out)."""
    out: dict[int, dict[str, Any]] = {}
    if not ranks:
        return out
    try:
        store = _store(place, 5.0)
        for r in ranks:
            key = f"progress/{r}"
            if store.check([key]):
                value = json.loads(store.get(key))
                if isinstance(value, dict):
                    out[r] = value
    except Exception:  # what could be read is said
        pass
    return out


# -- judging the job ----------------------------------------------------------------------------


@dataclass
class JobResult:
    """What the job's judgement says: its findings (the job rules' and the ranks', each said once), the job's
    time per step by category, the straggler if there is one, and which ranks were judged."""

    world_size: int
    runs: list[RankRun]
    missing: list[int]
    findings: list[Diagnosis]
    breakdown: dict[str, float]
    by_rank: dict[int, dict[str, float]]
    straggler: int | None = None
    notes: list[str] = field(default_factory=list)
    #: Of the missing ranks, those that ran unwatched: a further device thread of a watched process.
    unwatched: list[int] = field(default_factory=list)
    #: Why a missing rank's run is not here, as the way the runs were gathered tells it.
    lost: str = ("no result reached rank 0: crashed, killed or still running when rank 0 stopped waiting, "
                 "ACCELPORT_JOB_WAIT")


def judge(runs: Sequence[RankRun], world_size: int, missing: Sequence[int] = (),
          progress: Mapping[int, Mapping[str, Any]] | None = None) -> JobResult:
    """The job's findings over the ranks' summaries: the job rules first, then what the ranks found, each kind
    once, naming the ranks that found it."""
    from accelport.diagnose.rules.rank_divergence import RankDivergenceRule
    from accelport.diagnose.rules.straggler import StragglerRule

    view = JobView(world_size=world_size, runs=tuple(runs), missing=tuple(missing), progress=dict(progress or {}))
    findings: list[Diagnosis] = []
    straggler = None
    for rule in (StragglerRule(), RankDivergenceRule()):
        found = rule.judge(view)
        if found is not None:
            findings.append(found)
            if found.kind == "straggler":
                straggler = int(found.evidence["rank"])
    findings += _ranks_findings(runs, world_size)
    by_rank = view.breakdown()
    stepping = [r for r in runs if r.steps > 1]
    mean: dict[str, float] = {}
    for run in stepping:
        for category, seconds in by_rank.get(run.rank, {}).items():
            mean[category] = mean.get(category, 0.0) + seconds / len(stepping)
    return JobResult(world_size, list(runs), list(missing), findings, mean, by_rank, straggler)


#: Where a rank's non-finite values came from, the origin first: a rank whose own input or loss was non-finite
#: made them; a rank whose gradients alone were got them from it through the all-reduce.
_SOURCES = {"input": 0, "loss": 1}


def _origin(pair: tuple[int, Mapping[str, Any]]) -> tuple[int, int, int]:
    rank, item = pair
    evidence = item.get("evidence") or {}
    searched = evidence.get("origin")
    if isinstance(searched, Mapping):
        # --find-nan found the op. At one step a forward pass's origin is upstream of a backward pass's (the
        # ranks exchange gradients, not activations), and one read from a collective came from another rank.
        if str(searched.get("op") or "").startswith("c10d."):
            return int(item.get("step") or 0), 3, rank
        return int(item.get("step") or 0), 1 if searched.get("direction") in ("backward", "optimizer") else 0, rank
    return int(item.get("step") or 0), _SOURCES.get(str(evidence.get("source")), 2), rank


def _first_because(item: Mapping[str, Any]) -> str:
    """Why a rank's non-finite values are its own, in a few words."""
    evidence = item.get("evidence") or {}
    searched = evidence.get("origin")
    if isinstance(searched, Mapping):
        op = str(searched.get("op") or "an operation")
        return (f"its own search found {op} first read it" if searched.get("kind") == "entered" else
                f"its own search found {op} made it")
    return {"input": "its own input batch held it", "loss": "its own loss was"}.get(str(evidence.get("source")), "")


def _ranks_findings(runs: Sequence[RankRun], world_size: int) -> list[Diagnosis]:
    """Each kind the ranks found, once: "on all 4 ranks" where every rank found it, else the ranks that did,
    with the first of them in ``evidence.rank`` (for non-finite values, the rank that went non-finite first)."""
    by_kind: dict[str, list[tuple[int, Mapping[str, Any]]]] = {}
    for run in runs:
        for item in run.findings:
            by_kind.setdefault(str(item.get("kind")), []).append((run.rank, item))
    out = []
    for kind, seen in by_kind.items():
        if kind == "non-finite":  # the rank that went non-finite first (the others got it from it)
            seen.sort(key=_origin)
        rank, first = seen[0]
        ranks = sorted({r for r, _ in seen})
        where = (f"on all {world_size} ranks" if len(ranks) == world_size else
                 f"on rank {rank}" if len(ranks) == 1 else "on ranks " + ", ".join(map(str, sorted(ranks))))
        message = f"{where}: {first.get('message', '')}"
        if kind == "non-finite" and len(ranks) > 1 and _origin(seen[0])[:2] < _origin(seen[1])[:2]:
            its = _first_because(first)
            message += (f" Rank {rank} went non-finite first (step {first.get('step')}{': ' + its if its else ''}); "
                        "the others got it through the gradient all-reduce: look at rank "
                        f"{rank}'s data and loss at that step.")
        evidence = {**dict(first.get("evidence") or {}), "rank": rank, "ranks": sorted(ranks)}
        out.append(replace(Diagnosis.from_dict({**first, "kind": kind}), message=message, evidence=evidence))
    return out
