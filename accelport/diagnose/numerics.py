"""Training that goes wrong without being slow: gradients that turn NaN or Inf, updates that round away.

:class:`NumericsWatch` looks at the optimizer's parameters at the end of each
step (``ap.optimizer_step``), at a cost that stays out of the step:

- non-finite: one small gradient per step is the *canary* (the smallest of the
  last few parameters: next to the loss, so a NaN or Inf loss, or a NaN input,
  reaches it in the same step). Where the host is the device (``cpu``) it is
  checked at once; on accelerators and lazy backends a reference to it is kept
  (no device work, nothing added to a graph) and every :data:`CHECK_EVERY` steps
  the newest is read the way ``ap.after_step`` reads, when the step's values are
  ready anyway; only when it is bad are the others read, for the first bad step. On
  XLA only the newest is kept (each sync looks at every live tensor) and read every
  :data:`CHECK_EVERY_LAZY` steps and at the end of each loop, right after the loop's
  sync (a transfer, never an extra execution or compilation; left out of
  ``ap.metrics().device_to_host``): a bad input batch is still named at its step
  (the loader's thread checked it), a diverging loss between two reads. Input batches are checked on the host, in the
  loader's thread, before they go to the device. The first bad step found names
  its source: the input batch, the loss (every gradient non-finite) or one
  parameter's gradient (the first in module order). A gradient that turns NaN in
  one early layer only shows at the next step, as the loss.
- precision: parameters held in bf16 or fp16 are sampled at step
  :data:`PRECISION_FIRST` and every :data:`PRECISION_EVERY` steps after: a slice of
  each is read after that step and after the next, and the share of elements whose
  gradient was non-zero but whose value did not change is measured. Found in two
  samples in a row, the parameters are reported.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accelport.sharding import is_dtensor, local_shard

__all__ = ["NumericsWatch", "NonFinite", "Stalled", "Inspected", "check_batch", "param_names",
           "CHECK_EVERY", "PRECISION_FIRST", "PRECISION_EVERY", "PRECISION_STALLED"]

#: Steps between reads of the kept gradients on eager accelerators, and on lazy backends:
#: each read waits for the step it reads to finish executing, which on XLA costs the
#: overlap of host and device for one step, so there it comes seldom (and at the end of
#: each ap.loader loop, and at ap.diagnostics()).
CHECK_EVERY = 64
CHECK_EVERY_LAZY = 256
PRECISION_FIRST = 10
PRECISION_EVERY = 50
#: Share of elements with a non-zero gradient that did not move, for a parameter to count as stalled.
PRECISION_STALLED = 0.5
PRECISION_SAMPLES = 2  # samples in a row that must find it
PRECISION_MAX_PARAMS = 16
#: Elements read per parameter on eager backends (a slice, a view); lazy backends read whole
#: parameters up to PRECISION_LAZY_MAX elements (a slice would be a graph to compile).
PRECISION_SLICE = 1 << 16
PRECISION_LAZY_MAX = 1 << 20
PRECISION_MIN_ELEMENTS = 16  # with fewer non-zero gradients in the sample, no verdict
#: Input tensors larger than this are checked on a strided sample of this many elements.
INPUT_CHECK_MAX = 1 << 22
CANARY_FROM_LAST = 4
LOW_PRECISION = ("bfloat16", "float16")


@dataclass(frozen=True)
class NonFinite:
    """The first step whose gradients were NaN or Inf, and where it came from."""

    step: int  # the first bad step; where ``finite_at`` is set, the step it was found by
    #: "input", "loss" (every gradient non-finite), "gradient" (one parameter's first, in module
    #: order) or "gradients" (read later, on an accelerator or lazy backend: known as far as the inputs).
    source: str
    detail: str
    names: tuple[str, ...] = ()
    #: On lazy backends, where gradients are read far apart: the last step read and found finite.
    finite_at: int | None = None


@dataclass(frozen=True)
class Stalled:
    """Low-precision parameters whose updates round away: (name, dtype, share of elements unchanged)."""

    step: int
    params: tuple[tuple[str, str, float], ...]


@dataclass(frozen=True)
class Inspected:
    """A batch signature with what the loader's thread found in the host batch (see :func:`check_batch`)."""

    signature: Any
    info: Any  # a description of the batch's non-finite inputs


def _tensors(batch: Any) -> Iterable[tuple[str, Any]]:
    """(name, tensor) of every tensor in a nested batch: "input 0", "input 'x'", ..."""
    import torch

    def walk(x: Any, name: str) -> Iterable[tuple[str, Any]]:
        if isinstance(x, torch.Tensor):
            yield name, x
        elif isinstance(x, Mapping):
            for k, v in x.items():
                yield from walk(v, f"input {k!r}" if name == "input" else f"{name}[{k!r}]")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                yield from walk(v, f"input {i}" if name == "input" else f"{name}[{i}]")

    return walk(batch, "input")


def check_batch(batch: Any) -> str | None:
    """What is non-finite in a host batch ("input 0: 3 of 2048 values are NaN or Inf"), or None.

    It runs on every batch in the loader's thread (on accelerators and XLA; under
    ``accelport diagnose``, in the loop's), so each floating tensor is first summed (a
    NaN or Inf survives the sum; a third of the cost of isfinite().all()), and looked at
    element by element only when the sum is not finite. A tensor of more than
    INPUT_CHECK_MAX elements is looked at through an evenly strided sample of that many.
    """
    import torch

    tensor, strided = torch.Tensor, torch.strided
    items = enumerate(batch) if type(batch) in (tuple, list) and all(type(t) is tensor for t in batch) else None
    for name, t in ((f"input {i}", t) for i, t in items) if items is not None else _tensors(batch):
        # Host tensors only: a batch already on a device would be read back (a host sync
        # per step). Sparse and nested layouts have no cheap sum: not looked at.
        if not (t.is_floating_point() or t.is_complex()) or t.device.type != "cpu" or t.layout is not strided:
            continue
        try:
            if t.numel() > INPUT_CHECK_MAX:
                flat = t.detach().reshape(-1)
                t = flat[:: -(-flat.numel() // INPUT_CHECK_MAX)]
            total = t.sum().item()
            if math.isfinite(abs(total)):  # (a sum that overflows is looked at closely)
                continue
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                return f"{name}: {int((~finite).sum())} of {t.numel()} values are NaN or Inf"
        except (RuntimeError, TypeError, ValueError):  # a tensor subclass without these ops: not looked at
            continue
    return None


def param_names(params: Iterable[Any]) -> dict[int, str]:
    """Names of ``params`` by id, from the module that holds most of them (module order kept).

    Run once, when a finding names parameters: the optimizer knows its parameters but
    not their names, so the live modules are searched (``torch.compile``'s wrapper
    prefix ``_orig_mod.`` removed).
    """
    import torch

    wanted = {id(p) for p in params}
    best: dict[int, str] = {}
    module = torch.nn.Module
    with warnings.catch_warnings():  # isinstance on deprecated proxies in the heap warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, module):
                    continue
                names = {id(p): n.replace("_orig_mod.", "") for n, p in obj.named_parameters() if id(p) in wanted}
            except Exception:  # noqa: BLE001 - a half-built module in the heap
                continue
            if len(names) > len(best):
                best = names
    return best


def _namer(params: list[Any]) -> Any:
    """A function naming each of ``params``: its module path, or its place in the optimizer."""
    names = param_names(params)
    places = {id(p): i for i, p in enumerate(params)}

    def name(p: Any) -> str:
        return names.get(id(p)) or f"parameter {places.get(id(p), '?')} of the optimizer"

    name.order = list(names)  # type: ignore[attr-defined]
    return name


def _finite(value: Any) -> bool:
    """Whether a host value (a number, or a CPU tensor) is all finite."""
    if isinstance(value, (int, float)):
        return math.isfinite(value)
    import torch

    return bool(torch.isfinite(value).all())


def _dtype(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _to_cpu_clone(v: Any) -> Any:
    # Where the host is the device, after_step hands back the tensor itself (a view of the
    # parameter, which the next update changes in place): keep a copy.
    return v.clone() if hasattr(v, "clone") else v


@dataclass
class _Sample:
    step: int
    params: list[Any]
    before: list[Any] = field(default_factory=list)


class NumericsWatch:
    """Checks at the end of each step; findings appear in :attr:`nonfinite` and :attr:`stalled`."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        #: False where the host is the device (cpu): checked at once. True on accelerators and
        #: lazy backends: read every CHECK_EVERY (CHECK_EVERY_LAZY) steps, through diagnostic_read.
        self.deferred = bool(getattr(backend, "lazy", False)) or getattr(backend, "sync_api", "none") != "none"
        self._lazy = bool(getattr(backend, "lazy", False))
        self._every = CHECK_EVERY_LAZY if self._lazy else CHECK_EVERY
        self.nonfinite: NonFinite | None = None
        self.stalled: Stalled | None = None
        self._optimizer: Any = None
        self._params: list[Any] = []
        self._canary: Any = None
        self._small = False  # a short 1-d canary: read as a Python list, cheaper than a torch sum
        self._sharded = False  # the canary is a DTensor: its local shard is read
        self._last_grad: Any = None
        self._clone = False  # gradients accumulated in place (zero_grad(set_to_none=False)): copy them
        self._kept: list[tuple[int, Any]] = []
        self._unread = 0  # steps since the last read
        self._finite_at = 0  # the last step read and found finite (lazy: reads are far apart)
        self._bad_inputs: dict[int, str] = {}
        self._batch: Any = None  # host mode: this step's batch; deferred: what check_batch said
        self._step_batches = 0  # batches since the last step (more than one: gradient accumulation)
        self._accumulated = 0  # ...as the step that ended last had them
        self._low: list[Any] | None = None  # low-precision parameters (None: not looked yet)
        self._sample: _Sample | None = None
        self._next_sample = PRECISION_FIRST  # the next step _precision has anything to do at
        self._stalled_runs: dict[int, int] = {}  # id(param) -> samples in a row that found it stalled
        self._last_shares: dict[int, float] = {}
        #: Reads handed to after_step that have not run yet (lazy: they run after the next sync).
        self.pending = 0

    def _after(self, fn: Any, tensors: tuple[Any, ...]) -> None:
        def run(*values: Any) -> None:
            self.pending -= 1
            fn(*values)

        self.pending += 1
        self._backend.diagnostic_read(run, tensors)

    # -- what the loader saw ----------------------------------------------------------------
    def inspect(self, batch: Any, signature: Any) -> Any:
        """Called in the loader's thread for each host batch where the device is not the host
        (deferred mode); what it returns travels with the signature."""
        found = check_batch(batch)
        return signature if found is None else Inspected(signature, found)

    def batch(self, info: Any) -> None:
        """The loop got a batch: on cpu the batch itself, else what :meth:`inspect` found in it."""
        self._batch = info
        self._step_batches += 1

    # -- each step ------------------------------------------------------------------------------
    def step_end(self, step: int, optimizer: Any) -> None:
        batch, self._batch = self._batch, None
        self._accumulated, self._step_batches = self._step_batches, 0
        if self.nonfinite is not None:
            return
        if optimizer is not self._optimizer:
            self._select(optimizer)
        canary = self._canary
        grad = canary.grad if canary is not None else None
        if grad is None and self._params:
            self._select(optimizer)
            canary = self._canary
            grad = canary.grad if canary is not None else None
        if self.deferred:
            if isinstance(batch, str):
                self._bad_inputs[step] = batch
            if grad is not None:
                if self._lazy:
                    # Only the newest: every live XLA tensor is looked at by each sync, so
                    # keeping hundreds would slow every step (and a copy would be a graph op).
                    self._kept[:] = [(step, local_shard(grad) if self._sharded else grad)]
                else:
                    # The same gradient object as last step: accumulated in place
                    # (zero_grad(set_to_none=False)), so each kept one must be a copy. The
                    # first is copied anyway, before that can be told. (Compared before
                    # to_local(), which hands out a new object on every call.)
                    if grad is self._last_grad:
                        self._clone = True
                    clone = self._clone or self._last_grad is None
                    self._last_grad = grad
                    if self._sharded:
                        grad = grad.to_local()
                    self._kept.append((step, grad.detach().clone() if clone else grad))
            self._unread += 1
            if self._unread >= self._every:
                self.read()
        elif grad is not None:
            if self._sharded:
                grad = grad.to_local()
            # A NaN or Inf survives the sum (0.5 us through a short list, 2 us through torch,
            # against 11 for isfinite().all()); a sum that overflows on its own is told apart
            # by the exact check.
            if not math.isfinite(abs(sum(grad.tolist()) if self._small else grad.sum().item())):
                import torch

                if not bool(torch.isfinite(grad).all()):
                    self._found(step, batch)
        if step >= self._next_sample:
            self._precision(step, optimizer)

    def _select(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        with_grad = [p for p in self._params if getattr(p, "grad", None) is not None]
        tail = with_grad[-CANARY_FROM_LAST:]
        # The smallest, and of equals the last: nearest the loss.
        self._canary = min(reversed(tail), key=lambda p: p.numel()) if tail else None
        canary = self._canary
        # The checks look at each rank's own shard: reading a DTensor whole is a collective,
        # which would add communication to a step and hang if only some ranks made it. A NaN
        # on one shard reaches every rank's weights with the next update.
        self._sharded = is_dtensor(canary)
        self._small = canary is not None and canary.dim() == 1 and canary.numel() <= 64 and \
            not canary.is_complex()
        self._last_grad = None
        self._low = None

    def read(self) -> None:
        """Read the kept gradients (deferred mode), the way after_step reads: when the step's values are ready.

        Only the newest is read (one transfer per CHECK_EVERY steps: on XLA each tensor read
        is a transfer of its own). Gradients that turn NaN or Inf stay so (the update makes
        the weights non-finite, and every later gradient with them), so a finite newest one
        means the block was finite; a bad one has all of the block read, for the first step.
        A NaN that goes away by itself (a step a loss scaler skipped) is not reported.
        """
        kept, self._kept = self._kept, []
        self._unread = 0
        if not kept or self.nonfinite is not None:
            return
        steps = [s for s, _ in kept]
        last = steps[-1]
        since = self._finite_at

        def newest(value: Any) -> None:
            if self.nonfinite is not None:
                return
            if _finite(value):
                self._finite_at = max(self._finite_at, last)
            elif len(kept) > 1:
                self._after(lambda *values: self._check_values(steps, values), tuple(t for _, t in kept))
            else:  # lazy: only the newest was kept; the inputs were checked step by step
                bad = sorted(s for s in self._bad_inputs if since < s <= last)
                if bad:
                    self._found(bad[0], self._bad_inputs[bad[0]])
                else:
                    self._found(last, None, finite_at=since)

        self._after(newest, (kept[-1][1],))

    def _check_values(self, steps: list[int], values: tuple[Any, ...]) -> None:
        for step, v in zip(steps, values, strict=False):
            if not _finite(v):
                if self.nonfinite is None:
                    self._found(step, self._bad_inputs.get(step))
                return

    # -- the finding -------------------------------------------------------------------------------
    def _found(self, step: int, batch: Any, finite_at: int | None = None) -> None:
        import torch

        params = self._params
        name = _namer(params)

        if self.deferred:
            if isinstance(batch, str):
                self.nonfinite = NonFinite(step, "input", batch)
            else:
                where = f" (seen in {name(self._canary)})" if self._canary is not None else ""
                self.nonfinite = NonFinite(step, "gradients", f"the gradients{where}",
                                           (name(self._canary),) if self._canary is not None else (),
                                           finite_at if finite_at is not None and finite_at < step - 1 else None)
            return
        found = check_batch(batch) if batch is not None else None
        if found is not None:
            self.nonfinite = NonFinite(step, "input", found)
            return
        # Module order where the names are known, the optimizer's otherwise. The update of
        # this step has run already, so the gradients tell the story, not the values.
        position = {pid: i for i, pid in enumerate(name.order)}
        ordered = sorted(params, key=lambda p: position.get(id(p), len(position)))
        grads = [p for p in ordered if p.grad is not None]
        bad = [p for p in grads if not bool(torch.isfinite(local_shard(p.grad)).all())]
        if bad and len(bad) == len(grads):
            detail = "every gradient is NaN or Inf, so the loss was"
            if self._accumulated > 1:  # only the last batch is kept: an earlier one may be the source
                detail += (f", or an earlier one of the {self._accumulated} batches accumulated into this "
                           "step held NaN or Inf (the last was finite)")
            self.nonfinite = NonFinite(step, "loss", detail)
        elif bad:
            self.nonfinite = NonFinite(step, "gradient", f"the gradient of {name(bad[0])}",
                                       tuple(name(p) for p in bad[:3]))
        else:
            self.nonfinite = NonFinite(step, "gradients", "the gradients")

    # -- precision (sampled) -------------------------------------------------------------------------
    def _precision(self, step: int, optimizer: Any) -> None:
        sample = self._sample
        if sample is not None and step == sample.step + 1:
            self._sample = None
            self._next_sample = sample.step + PRECISION_EVERY
            self._compare(sample, step)
            return
        self._sample = None
        # Samples at PRECISION_FIRST, then every PRECISION_EVERY steps.
        due = step >= PRECISION_FIRST and (step - PRECISION_FIRST) % PRECISION_EVERY == 0
        self._next_sample = step + 1 if due else PRECISION_FIRST + (
            (step - PRECISION_FIRST) // PRECISION_EVERY + 1) * PRECISION_EVERY
        if not due:
            return
        if self._low is None:
            low = [p for p in self._params if _dtype(p) in LOW_PRECISION and p.requires_grad]
            if self._lazy:
                low = [p for p in low if p.numel() <= PRECISION_LAZY_MAX]
            self._low = low[:PRECISION_MAX_PARAMS]
        params = [p for p in self._low if p.grad is not None]
        if not params:
            self._next_sample = step + PRECISION_EVERY
            return
        sample = _Sample(step, params)
        self._sample = sample

        def keep(*values: Any) -> None:
            sample.before = [_to_cpu_clone(v) for v in values]

        self._after(keep, tuple(self._view(p) for p in params))

    def _view(self, t: Any) -> Any:
        t = local_shard(t)
        if self._lazy:
            return t  # whole (a slice on XLA is a graph to compile); to_host detaches it
        return t.detach().reshape(-1)[:PRECISION_SLICE]

    def _compare(self, sample: _Sample, step: int) -> None:
        params = [p for p in sample.params if p.grad is not None]
        if len(params) != len(sample.params):
            return
        n = len(params)
        tensors = tuple(self._view(p) for p in params) + tuple(self._view(p.grad) for p in params)

        def judge(*values: Any) -> None:
            import torch

            if len(sample.before) != n:
                return  # the first read never came (a run that ended between the two)
            stalled = []
            for p, old, new, grad in zip(params, sample.before, values[:n], values[n:], strict=False):
                if not isinstance(new, torch.Tensor):
                    continue
                moving = grad.reshape(-1) != 0
                pushed = int(moving.sum())
                if pushed < PRECISION_MIN_ELEMENTS:
                    continue
                still = int(((new.reshape(-1) == old.reshape(-1)) & moving).sum())
                share = still / pushed
                self._last_shares[id(p)] = share
                if share >= PRECISION_STALLED:
                    runs = self._stalled_runs.get(id(p), 0) + 1
                    self._stalled_runs[id(p)] = runs
                    if runs >= PRECISION_SAMPLES:
                        stalled.append((p, share))
                else:
                    self._stalled_runs[id(p)] = 0
            if stalled and self.stalled is None:
                name = _namer(self._params)
                self.stalled = Stalled(step, tuple((name(p), _dtype(p), share) for p, share in stalled))

        self._after(judge, tensors)
