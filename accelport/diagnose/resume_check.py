"""``accelport verify-resume``: does a script's own resume continue the run it interrupted, bit for bit?

The script runs three ways, each in an empty working directory of its own: uninterrupted twice (a script
that differs from itself cannot be judged, and is never blamed on its resume), then killed at the end of a
step and started again with the same command in the same directory, where its checkpoint is. Each run is
watched as ``accelport diagnose`` watches it (:class:`accelport.runtime.watch.Watcher`), with a
:class:`StepRecorder` that writes one JSON line per optimizer step:

- ``batch``: a hash of what the step's forward saw (the arguments of the outermost module with parameters
  called with gradients on: the batch, not what the weights made of it);
- ``params_before``, ``optimizer_before``, ``lr`` (and the groups' other scalars), ``scaler`` and ``rng``:
  what the step started from (the random states as its first forward began);
- ``params`` and ``optimizer``: what it left.

:func:`compare` lines the resumed run up with the uninterrupted one (the first resumed step started from
the weights the uninterrupted run had after step k: it resumed at k + 1) and names the first state that
differs, in causal order: the batch, then the weights, the optimizer's state, the learning rate, the loss
scale and the random state entering the step, then what the step made. A random state that differs while
everything the step made is the same did not matter, and is a note.

The kill comes from inside the watched process, once step ``kill_at`` has ended and the next begins (its
next batch, its next forward with gradients or its next optimizer step, whichever comes first): after the
script's own code at the end of the step (a save every N steps) ran, at an exact step, without a race.

Nothing here imports torch at import time, nor the runtime: the watched process is started by the caller's
launcher (``accelport verify-resume``'s), which runs the script under a Watcher given a :class:`StepRecorder`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from accelport.errors import AccelportError, UsageError
from accelport.heap import live_instances

__all__ = ["StepRecorder", "Command", "Run", "Result", "Difference", "compare", "verify", "SIGNALS", "FACETS"]

#: The signals a run may be killed with.
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM} if hasattr(signal, "SIGKILL") else {
    "TERM": signal.SIGTERM}

#: What a step's record holds that is compared, in causal order: (key, what it is called when it differs).
#: What entered the step first (the batch, the weights, the optimizer's state, the learning rate, the loss
#: scale, the random state), then what the step made of them.
FACETS: tuple[tuple[str, str], ...] = (
    ("batch", "data order"),
    ("params_before", "parameters"),
    ("optimizer_before", "optimizer state"),
    ("lr", "learning rate"),
    ("hyper", "learning rate"),
    ("scaler", "gradient scaler"),
    ("rng", "rng"),
    ("params", "parameters"),
    ("optimizer", "optimizer state"),
)
_OUTPUTS = ("params", "optimizer")

#: How many lines of a failed run's stderr an error quotes.
_TAIL_LINES = 15


# -- hashing -------------------------------------------------------------------------------------------


def _tensor_bytes(t: Any) -> bytes:
    """A tensor's elements as bytes (on the host, contiguous); empty where it has no storage to read."""
    import ctypes

    t = t.detach()
    if t.layout != sys.modules["torch"].strided:  # sparse: its values as a dense tensor
        t = t.to_dense()
    if t.device.type == "meta":
        return b""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    size = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), size) if size else b""


def _feed(h: Any, obj: Any, torch: Any) -> None:
    """Feed ``obj`` to the hash ``h``: tensors by dtype, shape and bytes; containers in a fixed order (a dict's by
    its keys, sorted, so that a state restored in another order hashes the same); other objects by type only
    (never an address)."""
    if torch is not None and isinstance(obj, torch.Tensor):
        h.update(f"T{obj.dtype}{tuple(obj.shape)}".encode())
        h.update(_tensor_bytes(obj))
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for key in sorted(obj, key=lambda k: (type(k).__name__, repr(k))):
            h.update(repr(key).encode() + b":")
            _feed(h, obj[key], torch)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for item in obj:
            _feed(h, item, torch)
        h.update(b"]")
    elif obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        h.update(repr(obj).encode())
    else:
        h.update(f"<{type(obj).__name__}>".encode())


def digest(obj: Any) -> str:
    """A short hash of ``obj`` (see :func:`_feed`)."""
    h = hashlib.blake2b(digest_size=12)
    _feed(h, obj, sys.modules.get("torch"))
    return h.hexdigest()


# -- recording, in the watched process -----------------------------------------------------------------


def _params(optimizer: Any) -> list[Any]:
    return [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]


def _optimizer_state(optimizer: Any) -> Any:
    """The optimizer's per-parameter state (moments, step counts), by the parameter's place in its groups: what
    ``optimizer.load_state_dict`` restores besides the groups' settings (the learning rate is a facet of its own)."""
    index = {id(p): i for i, p in enumerate(_params(optimizer))}
    state = getattr(optimizer, "state", {}) or {}
    return {index.get(id(p), -1): dict(value) for p, value in state.items() if isinstance(value, Mapping)}


def _group_settings(optimizer: Any) -> tuple[list[float | None], str]:
    """Each param group's learning rate (as a float, exactly), and a hash of its other settings (momentum and betas,
    which a one-cycle scheduler changes too)."""
    lrs: list[float | None] = []
    others = []
    for group in getattr(optimizer, "param_groups", ()):
        lr = group.get("lr")
        try:
            lrs.append(float(lr) if lr is not None else None)
        except (TypeError, ValueError, RuntimeError):
            lrs.append(None)
        others.append({k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")})
    return lrs, digest(others)


def _rng_states() -> dict[str, str]:
    """A hash of each random state a step can draw from: torch's CPU generator, the device's (where it has
    started), Python's ``random`` and numpy's global one (where the script imported them)."""
    out: dict[str, str] = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = digest(torch.get_rng_state())
        cuda = getattr(torch, "cuda", None)
        try:
            if cuda is not None and cuda.is_initialized():
                out["cuda"] = digest(cuda.get_rng_state_all())
        except Exception:  # noqa: BLE001 - a device that cannot say: left out, in every run alike
            pass
    rand = sys.modules.get("random")
    if rand is not None and hasattr(rand, "getstate"):
        out["random"] = digest(rand.getstate())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            kind, keys, *rest = numpy.random.get_state()
            out["numpy"] = digest([kind, keys.tobytes(), *rest])
        except Exception:  # noqa: BLE001 - a numpy without the legacy global state: left out, in every run alike
            pass
    return out


def _scaler_state(frame: Any) -> str | None:
    """The loss scaler's state when this optimizer step runs inside ``GradScaler.step`` (its scale and growth
    tracker), found among the frames that called it; None without one."""
    for _ in range(12):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == "GradScaler" and callable(getattr(owner, "state_dict", None)):
            try:
                return digest(owner.state_dict())
            except Exception:  # noqa: BLE001
                return None
        frame = frame.f_back
    return None


def _schedulers(optimizer: Any) -> list[str]:
    """The class names of the learning-rate schedulers that drive ``optimizer`` (asked once per run)."""
    module = sys.modules.get("torch.optim.lr_scheduler")
    kinds = [c for c in (getattr(module, "LRScheduler", None), getattr(module, "ReduceLROnPlateau", None))
             if isinstance(c, type)]
    # (ReduceLROnPlateau is an LRScheduler since torch 2.2, not before: each class searched for is no other's.)
    kinds = [c for c in kinds if not any(c is not k and issubclass(c, k) for k in kinds)]
    return sorted({type(o).__name__ for kind in kinds for o in live_instances(kind)
                   if getattr(o, "optimizer", None) is optimizer})


def _loader_facts(iterator: Any) -> dict[str, Any]:
    """How a DataLoader orders its batches: its sampler's class and whether a generator of its own draws the order."""
    batches = getattr(iterator, "_index_sampler", None)
    sampler = getattr(batches, "sampler", batches)
    return {"sampler": type(sampler).__name__, "generator": getattr(sampler, "generator", None) is not None}


class StepRecorder:
    """Writes one JSON line per optimizer step of the watched script to ``path`` (see the module's docstring), and
    ends the process with ``signum`` once step ``kill_at`` has ended and the next begins.

    :class:`~accelport.runtime.watch.Watcher` calls :meth:`before_step`, :meth:`after_step` and :meth:`next_batch`
    from its own hooks, installs the callbacks of :meth:`imports` as the script imports their modules, and calls
    :meth:`close` when it is taken out. Nothing it does raises into the script: a failure is written to the
    file, and the recording stops.
    """

    def __init__(self, path: str, *, kill_at: int | None = None, signum: int | None = None) -> None:
        self.path = path
        self.kill_at = kill_at
        self.signum = signum
        self.steps = 0
        self._pid = os.getpid()
        self._main = threading.main_thread().ident
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._handles: list[Any] = []
        self._depth = 0
        self._pending: dict[str, Any] = {}  # what the step in progress started from
        self._killed = False
        self._said: dict[str, Any] = {}  # what is written once (the schedulers, the loader)
        self._write({"kind": "start", "pid": self._pid})

    # -- the file
    def _write(self, record: Mapping[str, Any]) -> None:
        if self._fd is None:
            return
        try:  # one write per line, unbuffered: a SIGKILL right after it loses nothing
            os.write(self._fd, (json.dumps(record, allow_nan=True) + "\n").encode())
        except OSError:
            self._fd = None

    def _failed(self, exc: BaseException) -> None:
        self._write({"kind": "error", "step": self.steps, "error": f"{type(exc).__name__}: {exc}"})
        self._release()
        self._fd = None

    def _ours(self) -> bool:
        return self._fd is not None and os.getpid() == self._pid and threading.get_ident() == self._main

    # -- the watcher's hooks
    def imports(self) -> dict[str, Callable[[Any], None]]:
        """Module name -> what to do once the script has imported it."""
        return {"torch.nn.modules.module": self._on_module}

    def _on_module(self, module: Any) -> None:
        self._handles.append(module.register_module_forward_pre_hook(self._pre_forward))
        self._handles.append(module.register_module_forward_hook(self._post_forward, with_kwargs=True,
                                                                 always_call=True))

    def _training(self) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and bool(torch.is_grad_enabled())

    def _pre_forward(self, module: Any, args: Any) -> None:
        if not self._ours():
            return
        self._depth += 1
        if self._depth == 1 and self._training():
            self._boundary()
            if "rng" not in self._pending:
                try:
                    self._pending["rng"] = _rng_states()
                except Exception as exc:  # noqa: BLE001 - never into the script's forward
                    self._failed(exc)

    def _post_forward(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if not self._ours():
            return
        self._depth = max(0, self._depth - 1)
        if self._depth or "batch" in self._pending or not self._training():
            return
        try:
            if next(module.parameters(), None) is not None:  # a loss module's inputs are the model's outputs
                self._pending["batch"] = digest([list(args), dict(kwargs or {})])
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def next_batch(self, iterator: Any) -> None:
        """The script asks a DataLoader for its next batch (in the thread that trains)."""
        if not self._ours() or not self._training():
            return
        self._boundary()
        if "loader" not in self._said:
            try:
                self._said["loader"] = _loader_facts(iterator)
            except Exception:  # noqa: BLE001 - a loader of another shape: nothing said of it
                self._said["loader"] = {}

    def before_step(self, optimizer: Any) -> None:
        if not self._ours():
            return
        self._boundary()
        try:
            lrs, hyper = _group_settings(optimizer)
            self._pending.update(params_before=digest(_params(optimizer)),
                                 optimizer_before=digest(_optimizer_state(optimizer)), lr=lrs, hyper=hyper,
                                 scaler=_scaler_state(sys._getframe(1)))
            self._pending.setdefault("rng", _rng_states())  # no forward seen: the state as the update begins
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def after_step(self, optimizer: Any, step: int) -> None:
        if not self._ours():
            return
        self.steps = step
        pending, self._pending = self._pending, {}
        try:
            record = {"kind": "step", "step": step, "batch": pending.get("batch"),
                      "params_before": pending.get("params_before"),
                      "optimizer_before": pending.get("optimizer_before"), "lr": pending.get("lr"),
                      "hyper": pending.get("hyper"), "scaler": pending.get("scaler"), "rng": pending.get("rng"),
                      "params": digest(_params(optimizer)), "optimizer": digest(_optimizer_state(optimizer))}
            if "optimizer" not in self._said:
                self._said["optimizer"] = type(optimizer).__name__
                record["optimizer_class"] = type(optimizer).__name__
                record["schedulers"] = _schedulers(optimizer)
                record["loader"] = self._said.get("loader")
            self._write(record)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def _boundary(self) -> None:
        """A new step begins: after step ``kill_at``, the process ends here, by the signal asked for."""
        if self._killed or self.kill_at is None or self.signum is None or self.steps < self.kill_at:
            return
        self._killed = True
        self._write({"kind": "killed", "step": self.steps, "signal": signal.Signals(self.signum).name})
        os.kill(os.getpid(), self.signum)  # SIGTERM: the script's own handler (a save) runs next, as it would

    def close(self, steps: int) -> None:
        """The script has ended (it was not killed mid-step): say how many steps it took."""
        if self._fd is not None and os.getpid() == self._pid:
            self._write({"kind": "end", "steps": steps})
        self._release()

    def _release(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        fd, self._fd = self._fd, None
        if fd is not None and os.getpid() == self._pid:
            os.close(fd)


# -- running the command, in the parent ----------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """What to run: a script (an absolute path) or a module, and its arguments as typed."""

    script: str | None
    module: str | None
    args: tuple[str, ...]
    #: Where a module is imported from (the directory verify-resume was started in, as ``python -m`` would).
    origin: str
    #: The script as typed, for what is said (None: the path).
    typed: str | None = None

    @property
    def shown(self) -> str:
        return f"-m {self.module}" if self.module is not None else str(self.typed or self.script)

    def argv(self) -> list[str]:
        return ["-m", str(self.module), *self.args] if self.module is not None else [str(self.script), *self.args]


@dataclass
class Run:
    """One watched process: its step records and how it ended."""

    label: str
    records: list[dict[str, Any]]
    exit_status: int
    killed_at: int | None  # the step it was killed after (None: it was not)
    ended: bool  # it ran to its end (no kill ended it)
    error: str | None  # the recording's own failure, if any
    stderr_tail: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == "step"]


class RunFailed(AccelportError):
    """A run of the script failed by itself: nothing about its resume can be said."""


def _tail(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="backslashreplace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_TAIL_LINES:])


#: Which rank kills itself at the kill step, for a run of several ranks (the child reads it; default 0).
KILL_RANK_ENV = "ACCELPORT_VERIFY_KILL_RANK"


def record_path(record: str, environ: Mapping[str, str]) -> str:
    """Where a watched process writes its records: ``record``, or ``record.rank<R>`` in a job of several ranks."""
    try:
        world = int(environ.get("WORLD_SIZE") or 1)
    except ValueError:
        world = 1
    return f"{record}.rank{environ.get('RANK', '0')}" if world > 1 else record


def _run(command: Command, label: str, workdir: str, logs: str, *, kill_at: int | None, signame: str,
         launcher: Sequence[str], nprocs: int = 1, kill_rank: int = 0) -> list[Run]:
    """One run of ``command`` (``nprocs`` ranks under the launcher), one :class:`Run` per rank."""
    record = os.path.join(logs, f"{label}.jsonl")
    err = os.path.join(logs, f"{label}.stderr")
    env = dict(os.environ)
    if command.module is not None:  # python -m imports from the directory it starts in: the caller's
        env["PYTHONPATH"] = os.pathsep.join(p for p in (command.origin, env.get("PYTHONPATH", "")) if p)
    env[KILL_RANK_ENV] = str(kill_rank)
    argv = [*launcher, record, str(kill_at or 0), signame, *command.argv()]
    with open(os.path.join(logs, f"{label}.stdout"), "wb") as out, open(err, "wb") as errors:
        done = subprocess.run(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=errors,
                              check=False)
    status = done.returncode if done.returncode >= 0 else 128 - done.returncode
    if nprocs == 1:
        return [_read_run(record, label, status, _tail(err))]
    return [_read_run(f"{record}.rank{r}", f"{label} rank {r}", status, _tail(err)) for r in range(nprocs)]


def _read_run(record: str, label: str, status: int, stderr_tail: str) -> Run:
    records: list[dict[str, Any]] = []
    try:
        with open(record, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:  # a line cut by the kill: the last one, never a step's whole record
                    pass
    except OSError:
        pass
    killed = next((int(r["step"]) for r in records if r.get("kind") == "killed"), None)
    error = next((str(r["error"]) for r in records if r.get("kind") == "error"), None)
    meta: dict[str, Any] = {}
    for r in records:
        for key in ("optimizer_class", "schedulers", "loader"):
            if key in r and r[key] is not None:
                meta[key] = r[key]
    return Run(label, records, status, killed, any(r.get("kind") == "end" for r in records), error, stderr_tail,
               meta)


# -- comparing -----------------------------------------------------------------------------------------


@dataclass
class Difference:
    """The first state that differs: at which step (as the uninterrupted run counts), what, and how."""

    step: int
    what: str
    detail: str
    #: The other states that differ at that step too (their names).
    also: list[str] = field(default_factory=list)
    #: The rank it was found on, in a job of several ranks (None: one process).
    rank: int | None = None


@dataclass
class Result:
    verdict: str  # "identical", "differs", "nondeterministic" or "not resumed"
    steps: int  # the uninterrupted run's optimizer steps
    kill_at: int
    signal: str
    restarts: int
    first_difference: Difference | None = None
    fix: str | None = None
    resumed_at: int | None = None
    resumes: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Ranks of the job (1: one process), the rank killed, and each rank's own verdict.
    ranks: int = 1
    kill_rank: int = 0
    per_rank: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {"verdict": out.pop("verdict"), "first_difference": out.pop("first_difference"),
                "fix": out.pop("fix"), "resumed_at": out.pop("resumed_at"), **out}


def _rng_names(a: Mapping[str, str] | None, b: Mapping[str, str] | None, ignore: frozenset[str] = frozenset()
               ) -> list[str]:
    a, b = a or {}, b or {}
    return [name for name in ("torch", "cuda", "random", "numpy") if name not in ignore and a.get(name) != b.get(name)]


def unseeded(first: Sequence[Mapping[str, Any]], second: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The random generators two uninterrupted runs start differently (the script never seeds them: Python seeds
    them from the system at start). Where nothing the steps made differs, nothing drew from them: left out."""
    pairs = zip(first, second, strict=False)  # (a run of another length is said as such elsewhere)
    return frozenset(name for a, b in pairs for name in _rng_names(a.get("rng"), b.get("rng")))


_RNG_SPELLED = {"torch": "torch's CPU generator", "cuda": "the CUDA generators", "random": "Python's random",
                "numpy": "numpy's global generator"}


def _differing(ref: Mapping[str, Any], got: Mapping[str, Any], ignore: frozenset[str]) -> list[str]:
    """The facets (record keys) of one step that differ, in causal order; a facet one run did not record is
    not compared (a step with no forward seen has no batch)."""
    keys = []
    for key, _ in FACETS:
        a, b = ref.get(key), got.get(key)
        if a is None or b is None:
            continue
        if key == "rng":
            if _rng_names(a, b, ignore):
                keys.append(key)
        elif a != b:
            keys.append(key)
    return keys


def _names(keys: Sequence[str]) -> list[str]:
    named = dict(FACETS)
    out: list[str] = []
    for key in keys:
        if named[key] not in out:
            out.append(named[key])
    return out


def scan(ref: Sequence[Mapping[str, Any]], got: Sequence[Mapping[str, Any]], first: int, notes: list[str],
         ignore: frozenset[str] = frozenset()) -> tuple[int, list[str]] | None:
    """Compare ``got`` (steps ``first``, ``first`` + 1, ... as ``ref`` counts them) with ``ref`` (steps 1..N):
    the first step whose records differ and the facets that do. A random state that differs while what the
    step made is the same did not change the run: a note, and the scan goes on."""
    said_rng = False
    for i, record in enumerate(got):
        step = first + i
        if step > len(ref):
            break
        keys = _differing(ref[step - 1], record, ignore)
        if not keys:
            continue
        if keys == ["rng"]:
            if not said_rng:
                said_rng = True
                which = ", ".join(_RNG_SPELLED[n] for n in _rng_names(ref[step - 1].get("rng"),
                                                                       record.get("rng"), ignore))
                note = (f"the random state ({which}) differs from step {step} on, but nothing recorded depended on "
                        "it (no step drew from it)")
                if note not in notes:
                    notes.append(note)
            continue
        return step, keys
    return None


def _batch_detail(ref: Sequence[Mapping[str, Any]], step: int, batch: Any) -> tuple[str, str]:
    """(what, detail) for a step that saw another batch: which of the uninterrupted run's it was."""
    seen = [i + 1 for i, r in enumerate(ref) if r.get("batch") == batch]
    if step + 1 in seen:
        return "batch skipped", (f"step {step} got the batch the uninterrupted run had at step {step + 1}: the batch "
                                 f"of step {step} was skipped")
    if step - 1 in seen:
        return "batch repeated", (f"step {step} got the batch the uninterrupted run had at step {step - 1}, again: "
                                  f"a batch already trained on before the checkpoint was repeated")
    if seen:
        near = min(seen, key=lambda s: abs(s - step))
        return "data order", (f"step {step} got the batch the uninterrupted run had at step {near}: the batches "
                              "come in another order after the resume")
    return "data order", f"step {step} got a batch the uninterrupted run never had: the batches come in another order"


def _describe(ref: Sequence[Mapping[str, Any]], step: int, keys: Sequence[str], got: Mapping[str, Any],
              meta: Mapping[str, Any], ignore: frozenset[str] = frozenset()) -> Difference:
    key = keys[0]
    want = ref[step - 1]
    what = dict(FACETS)[key]
    also = [n for n in _names(keys[1:]) if n != what]
    optimizer = meta.get("optimizer_class") or "optimizer"
    if key == "batch":
        what, detail = _batch_detail(ref, step, got.get("batch"))
    elif key == "params_before":
        detail = (f"step {step} started from other weights than the uninterrupted run had after step {step - 1}: "
                  "the model's state was not restored as it was saved")
    elif key == "optimizer_before":
        detail = (f"step {step} started from another {optimizer} state (its per-parameter buffers: moments, step "
                  f"counts) than the uninterrupted run had after step {step - 1}")
    elif key == "lr":
        detail = (f"step {step} used learning rate {_lrs(got.get('lr'))} where the uninterrupted run used "
                  f"{_lrs(want.get('lr'))}")
        schedulers = meta.get("schedulers") or []
        if schedulers:
            detail += f" (set by {', '.join(schedulers)})"
    elif key == "hyper":
        detail = (f"step {step} used other settings of the {optimizer}'s param groups (momentum, betas, weight "
                  "decay) than the uninterrupted run")
    elif key == "scaler":
        detail = f"step {step} ran with another loss scale (GradScaler state) than the uninterrupted run"
    elif key == "rng":
        which = ", ".join(_RNG_SPELLED[n] for n in _rng_names(want.get("rng"), got.get("rng"), ignore))
        detail = (f"step {step} drew from another random state ({which}) than the uninterrupted run, and computed "
                  "other weights from it (dropout, random augmentation)")
    elif key == "params":
        detail = (f"step {step} started from the same weights, {optimizer} state, batch, learning rate and random "
                  "state, and computed other weights: state the records do not cover differs (a buffer such as "
                  "BatchNorm's running statistics, gradients accumulated before the checkpoint, a module's own "
                  "attribute), or the step is not deterministic")
    else:
        detail = (f"step {step} made the same weights but another {optimizer} state from the same start: state the "
                  "records do not cover differs")
    return Difference(step, what, detail, also)


def _repeat_detail(key: str, step: int, want: Mapping[str, Any], got: Mapping[str, Any], ignore: frozenset[str]
                   ) -> str:
    """What differs between two runs of the same command, said as such (nothing was restored, or not)."""
    if key == "rng":
        which = ", ".join(_RNG_SPELLED[n] for n in _rng_names(want.get("rng"), got.get("rng"), ignore))
        return f"the random state the step drew from ({which})"
    return {"batch": "the batch the step saw",
            "params_before": "the initial weights" if step == 1 else "the weights the step started from",
            "optimizer_before": "the optimizer state the step started from", "lr": "the learning rate",
            "hyper": "the param groups' settings", "scaler": "the loss scale",
            "params": "the weights the step computed from the same batch, weights and random state",
            "optimizer": "the optimizer state the step computed"}[key]


def _lrs(values: Any) -> str:
    if not isinstance(values, list):
        return str(values)
    shown = [repr(v) for v in values]
    return shown[0] if len(shown) == 1 else "[" + ", ".join(shown) + "]"


def _fix(diff: Difference, meta: Mapping[str, Any], rng: Sequence[str]) -> str:
    """The line the script's checkpoint code lacks, in its own terms, and what ap.Checkpointer keeps instead."""
    optimizer = meta.get("optimizer_class") or "optimizer"
    schedulers = meta.get("schedulers") or []
    loader = meta.get("loader") or {}
    keeper = "ap.Checkpointer(...).restore(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)"
    if diff.what == "learning rate":
        name = schedulers[0] if schedulers else "learning-rate scheduler"
        return (f"save the {name}'s scheduler.state_dict() in the checkpoint and call scheduler.load_state_dict(...) "
                f"after loading it (after optimizer.load_state_dict); {keeper} keeps it")
    if diff.what == "optimizer state":
        return (f"save optimizer.state_dict() in the checkpoint and call optimizer.load_state_dict(...) after loading "
                f"it ({optimizer}'s moments and step counts); {keeper} keeps it")
    if diff.what == "parameters" and diff.step and "started from other weights" in diff.detail:
        return ("save model.state_dict() of the step the checkpoint is named for, and call "
                f"model.load_state_dict(...) before the first resumed step; {keeper} keeps it")
    if diff.what == "parameters":
        return ("save what else the step reads with the checkpoint (model.state_dict() holds the buffers; gradients "
                "accumulated over several batches must be saved at an optimizer step, not between); or make the step "
                "deterministic (torch.use_deterministic_algorithms(True))")
    if diff.what == "rng":
        calls = {"torch": "torch.set_rng_state(saved) with torch.get_rng_state() saved",
                 "cuda": "torch.cuda.set_rng_state_all(saved) with torch.cuda.get_rng_state_all() saved",
                 "random": "random.setstate(saved) with random.getstate() saved",
                 "numpy": "np.random.set_state(saved) with np.random.get_state() saved"}
        lines = "; ".join(calls[n] for n in rng) or "the random states saved with the checkpoint, set again"
        return (f"restore the random state the step draws from: {lines} at the checkpoint, set after everything "
                f"else that draws on resume (building the model, iter(loader)); ap.Checkpointer keeps every RNG state")
    if diff.what in ("batch skipped", "batch repeated"):
        more = "one batch too many" if diff.what == "batch skipped" else "one batch too few"
        return (f"the resumed loop skips {more}: a checkpoint saved after step k has consumed k batches (of the pass "
                f"in progress), so skip exactly those; {keeper} with the loop over ap.loader(loader) keeps the "
                "position")
    if diff.what == "data order":
        if loader.get("sampler") == "RandomSampler" and loader.get("generator"):
            how = ("save the DataLoader generator's state taken at the start of the pass (loader.generator.get_state() "
                   "before iter(loader)) and set it again (loader.generator.set_state(...)) before iterating on "
                   "resume, then skip the batches already done")
        elif loader.get("sampler") == "RandomSampler":
            how = ("the shuffle order is drawn from torch's global generator when the pass starts: give the "
                   "DataLoader a generator=torch.Generator() of its own, save its state at the start of the pass and "
                   "set it again before iter(loader) on resume")
        else:
            how = "restore the data's position and order (what shuffles it, and the batches already done)"
        return f"{how}; {keeper} with the loop over ap.loader(loader) keeps the order and the position"
    if diff.what == "gradient scaler":
        return ("save scaler.state_dict() in the checkpoint and call scaler.load_state_dict(...) on resume (the "
                "loss scale and its growth tracker)")
    return ""


def _resumed_at(ref: Sequence[Mapping[str, Any]], first: Mapping[str, Any]) -> tuple[int | None, bool]:
    """Where a restarted run resumed (the uninterrupted run's step its first step is): the step after the one
    whose weights it started from; else whose optimizer state it started from (the weights were not restored).
    (1, False) where it started from the initial weights and optimizer state (it never resumed); (None, False)
    where nothing matches."""
    start, opt = first.get("params_before"), first.get("optimizer_before")
    for i in range(len(ref), 0, -1):
        if ref[i - 1].get("params") == start:
            return i + 1, True
    fresh = ref[0].get("optimizer_before") if ref else None
    for i in range(len(ref), 0, -1):
        if opt != fresh and ref[i - 1].get("optimizer") == opt:
            return i + 1, True
    if ref and ref[0].get("params_before") == start:
        return 1, False
    return None, False


def compare(reference: Run, again: Run, chain: Sequence[Run], *, kill_at: int, signame: str) -> Result:
    """The verdict: ``again`` (a second uninterrupted run) and the killed run's steps must match ``reference``, or
    the script is nondeterministic; then each restarted run of ``chain`` is lined up with ``reference`` and
    scanned."""
    ref = reference.steps
    result = Result("identical", len(ref), kill_at, signame, max(0, len(chain) - 1))
    meta = {**reference.meta}
    ignore = unseeded(ref, again.steps)
    for label, other in (("a second uninterrupted run", again),
                         ("the run killed at the end of step %d, before it was killed" % kill_at, chain[0])):
        found = scan(ref, other.steps, 1, result.notes, ignore) if other is not None else None
        if found is not None:
            step, keys = found
            diff = _describe(ref, step, keys, other.steps[step - 1], meta, ignore)
            diff.detail = (f"{label} differs from the first at step {step}, before any resume: "
                           f"{_repeat_detail(keys[0], step, ref[step - 1], other.steps[step - 1], ignore)}. The "
                           "script is not deterministic (a seed from the time or os.urandom, a nondeterministic "
                           "kernel: torch.use_deterministic_algorithms(True) says which), so its resume cannot be "
                           "checked bit for bit")
            result.verdict, result.first_difference = "nondeterministic", diff
            result.fix = ("seed every generator with a fixed value (torch.manual_seed, random.seed, np.random.seed) "
                          "and use deterministic kernels, then check again")
            return result
        if other is not None and len(other.steps) != len(ref) and other is again:
            result.verdict = "nondeterministic"
            result.first_difference = Difference(min(len(ref), len(other.steps)) + 1, "batch skipped" if len(
                other.steps) < len(ref) else "batch repeated", f"a second uninterrupted run took {len(other.steps)} "
                f"steps where the first took {len(ref)}: the script is not deterministic")
            return result
    first_resume: int | None = None
    for n, run in enumerate(chain[1:], 1):
        steps = run.steps
        if not steps:
            result.notes.append(f"restart {n} took no optimizer step (status {run.exit_status}): it found the run "
                                "finished, or ended before training")
            continue
        at, resumed = _resumed_at(ref, steps[0])
        result.resumes.append({"restart": n, "resumed_at": at, "resumed": resumed, "steps": len(steps),
                               "killed_at": run.killed_at, "exit_status": run.exit_status})
        if first_resume is None:
            first_resume = at
        if at == 1 and not resumed:
            result.verdict = "not resumed"
            result.resumed_at = 1
            prior = chain[n - 1].killed_at
            result.notes.append(
                f"restart {n} never resumed: it started from step 1 again, from the initial weights (the run before "
                f"it was killed after step {prior}): no checkpoint was written before the kill (save before step "
                f"{prior}, or give a later --kill-at), or the restarted script did not find or load it")
            return result
        if at is None:
            at = kill_at + 1 if n == 1 else (result.resumes[-2]["resumed_at"] or 1)
            result.notes.append(f"restart {n}'s first step started from weights and an optimizer state the "
                                f"uninterrupted run never had; it is compared as if it resumed at step {at}")
        found = scan(ref, steps, at, result.notes, ignore)
        last = n == len(chain) - 1  # (a run killed again ends early by design)
        if found is None and last and at + len(steps) - 1 != len(ref):
            ended = at + len(steps) - 1
            what = "batch skipped" if ended < len(ref) else "batch repeated"
            result.first_difference = Difference(min(ended, len(ref)) + 1, what,
                                                 f"the resumed run ended after step {ended}, the uninterrupted run "
                                                 f"after step {len(ref)}: the resumed run "
                                                 + ("skipped batches" if ended < len(ref) else "repeated batches"))
            result.verdict = "differs"
            result.fix = _fix(result.first_difference, meta, [])
            break
        if found is not None:
            step, keys = found
            got = steps[step - at]
            diff = _describe(ref, step, keys, got, meta, ignore)
            if n > 1:
                diff.detail += f" (after restart {n})"
            result.verdict, result.first_difference = "differs", diff
            result.fix = _fix(diff, meta, _rng_names(ref[step - 1].get("rng"), got.get("rng"), ignore))
            break
    result.resumed_at = first_resume
    if result.resumed_at is None and result.verdict == "identical":
        result.verdict = "not resumed"
        result.notes.append("no restarted run took a step: nothing was resumed")
    return result


def verify(command: Command, launcher: Sequence[str], *, kill_at: int | None, signame: str, restarts: int,
           say: Callable[[str], None] = lambda line: None, nprocs: int = 1, kill_rank: int = 0) -> Result:
    """Run ``command`` with ``launcher`` (the argv that starts a watched process, given ``RECORD KILL_AT SIGNAL``
    and the command; KILL_AT 0: no kill) uninterrupted twice, then killed with ``signame`` after step ``kill_at``
    (default: half the uninterrupted run's steps) and restarted ``restarts`` times, each restart but the last
    killed again after as many steps; compare (see :func:`compare`). ``say`` hears what is being run. RunFailed
    where a run failed by itself; UsageError where ``kill_at`` is past the run's end.

    ``nprocs`` above 1: the launcher starts that many ranks (each writes its own records, :func:`record_path`),
    rank ``kill_rank`` is the one killed, each rank is compared with its own uninterrupted run, and the job's
    verdict is its rank's whose resume went wrong first (:func:`job_result`)."""
    if signame not in SIGNALS:
        raise UsageError(f"--signal {signame}: give one of {', '.join(SIGNALS)}")
    root = tempfile.mkdtemp(prefix="accelport-verify-resume-")
    try:
        def fresh(name: str) -> str:
            path = os.path.join(root, name)
            os.mkdir(path)
            return path

        logs = fresh("logs")

        def run(label: str, workdir: str, kill: int | None) -> list[Run]:
            return _run(command, label, workdir, logs, kill_at=kill, signame=signame, launcher=launcher,
                        nprocs=nprocs, kill_rank=kill_rank)

        ranks = f" on {nprocs} ranks" if nprocs > 1 else ""
        say(f"running {command.shown} uninterrupted{ranks}")
        reference = run("uninterrupted", fresh("uninterrupted"), None)
        for each in reference:
            _check_whole(each, _label("the uninterrupted run", each, nprocs))
        total = len(reference[kill_rank].steps)
        if kill_at is None:
            kill_at = max(1, total // 2)
        if kill_at >= total:
            raise UsageError(f"--kill-at {kill_at} is past the run's end: the uninterrupted run took {total} optimizer "
                             f"step(s), and a kill must leave steps to resume; give --kill-at between 1 and "
                             f"{total - 1}" if total > 1 else
                             f"--kill-at {kill_at}: the uninterrupted run took {total} optimizer step; a resume "
                             "needs a run of 2 steps or more (give the script more steps)")
        say(f"running {command.shown} uninterrupted again (a run that differs from itself cannot be judged)")
        again = run("again", fresh("again"), None)
        for each in again:
            _check_whole(each, _label("the second uninterrupted run", each, nprocs))
        chain_dir = fresh("resumed")
        chain: list[list[Run]] = []
        who = f"rank {kill_rank} " if nprocs > 1 else ""
        for n in range(restarts + 1):
            kill = kill_at if n < restarts else None
            if n == 0:
                say(f"running it with {who}killed with SIG{signame} at the end of step {kill_at}" if who else
                    f"running it killed with SIG{signame} at the end of step {kill_at}")
            else:
                say(f"restart {n}: the same command, in the same directory")
            runs = run(f"run-{n}", chain_dir, kill)
            killer = runs[kill_rank]
            for each in runs:
                if each.error:
                    raise RunFailed(f"the recording of {command.shown} failed in restart {n}"
                                    f"{f' on rank {runs.index(each)}' if nprocs > 1 else ''}: {each.error}")
            if kill is None and not (all(each.ended for each in runs) and killer.exit_status == 0):
                failed = next((each for each in runs if not each.ended), killer)
                raise RunFailed(_failure(command, _label(f"restart {n}" if n else "the run", failed, nprocs), failed))
            chain.append(runs)
            if kill is not None and killer.killed_at is None:
                if n == 0:
                    if killer.exit_status:
                        raise RunFailed(_failure(command, "the run to be killed", killer))
                    raise RunFailed(f"{command.shown} ended before the end of step {kill_at} this time, so it was not "
                                    "killed: it differs from its uninterrupted run; make its steps deterministic")
                say(f"restart {n} ran to its end before step {kill_at} ended: no further restart")
                break
        results = [compare(reference[r], again[r], [runs[r] for runs in chain], kill_at=kill_at, signame=signame)
                   for r in range(nprocs)]
        result = job_result(results, kill_rank) if nprocs > 1 else results[0]
        killed = chain[0][kill_rank]
        if signame == "TERM" and killed.killed_at is not None and killed.ended:
            result.notes.append(f"the script went on after SIGTERM and ended by itself (status {killed.exit_status}); "
                                "its resume was checked from the checkpoint it left")
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _label(what: str, run: Run, nprocs: int) -> str:
    """``what``, with the rank of ``run`` (labelled "... rank R") in a job of several ranks."""
    return f"{what} ({' '.join(run.label.split()[-2:])})" if nprocs > 1 else what


#: Which verdict is said first for a job: a rank that differs from itself, then one that never resumed, then one
#: whose resume differs.
_GRAVITY = {"nondeterministic": 0, "not resumed": 1, "differs": 2, "identical": 3}


def job_result(results: Sequence[Result], kill_rank: int) -> Result:
    """One verdict for a job from each rank's own: the rank whose resume went wrong first (the gravest verdict,
    then the earliest step, then the lowest rank), named in its first difference; every rank's verdict listed."""
    per_rank = [{"rank": r, "verdict": res.verdict,
                 "first_difference_step": res.first_difference.step if res.first_difference else None,
                 "what": res.first_difference.what if res.first_difference else None}
                for r, res in enumerate(results)]

    def key(r: int) -> tuple[int, int, int, int]:
        res = results[r]
        step = res.first_difference.step if res.first_difference is not None else 1 << 30
        # At one step, weights that differ from the same inputs are an effect: the ranks average their gradients,
        # so the rank whose own inputs (random state, batch, rate, optimizer state) differ is the cause.
        effect = int(res.first_difference is not None and res.first_difference.what == "parameters")
        return _GRAVITY.get(res.verdict, 2), step, effect, r

    chosen = min(range(len(results)), key=key)
    result = dataclasses.replace(results[chosen], notes=list(results[chosen].notes))
    result.ranks, result.kill_rank, result.per_rank = len(results), kill_rank, per_rank
    if result.first_difference is not None:
        result.first_difference = dataclasses.replace(result.first_difference, rank=chosen)
    if result.verdict == "identical":
        result.resumed_at = results[kill_rank].resumed_at
    others = [f"rank {p['rank']}: {p['verdict']}" + (f" (step {p['first_difference_step']}, {p['what']})"
                                                    if p["what"] else "") for p in per_rank if p["rank"] != chosen]
    if others and result.verdict != "identical":
        result.notes.append("the other ranks: " + "; ".join(others))
    step = result.first_difference.step if result.first_difference is not None else None
    followers = [p["rank"] for p in per_rank if p["rank"] != chosen and p["what"] == "parameters"
                 and p["first_difference_step"] == step]
    if result.first_difference is not None and result.first_difference.what == "rng" and result.fix:
        result.fix += (f"; with several ranks, each its own: rank {chosen} restored a random state that is not the one "
                       "it saved (save torch.get_rng_state() per rank, as rng-rank<R>.pt, and load that rank's file)")
    if followers and result.first_difference is not None and result.first_difference.what != "parameters":
        result.notes.append(f"rank{'s' if len(followers) > 1 else ''} {', '.join(map(str, followers))} computed other "
                            f"weights at step {step} from the same inputs: the ranks average their gradients, so "
                            f"rank {chosen}'s difference reaches every rank's weights")
    return result


def _check_whole(run: Run, label: str) -> None:
    if run.error:
        raise RunFailed(f"the recording of {label} failed: {run.error}")
    if run.exit_status != 0 or not run.ended:
        raise RunFailed(_failure(None, label, run))
    if not run.steps:
        raise RunFailed(f"{label} took no optimizer step: verify-resume follows optimizer.step() of torch.optim "
                        "optimizers; a script that trains in processes of its own (torch.multiprocessing.spawn) is "
                        "checked in one process")


def _failure(command: Command | None, label: str, run: Run) -> str:
    how = f"was ended by signal {run.exit_status - 128}" if run.exit_status > 128 else \
        f"exited with status {run.exit_status}"
    tail = f"; the end of its stderr:\n{run.stderr_tail}" if run.stderr_tail else ""
    return f"{label} of the script {how} by itself, so its resume cannot be checked{tail}"
