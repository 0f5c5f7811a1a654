"""Training that goes wrong without being slow: gradients that turn NaN or Inf, updates that round away.

:class:`NumericsWatch` looks at the optimizer's parameters at the end of each
step (``ap.optimizer_step``), at a cost that stays out of the step:

- non-finite: two small samples per step. The *canary* gradient (the smallest of the
  last few parameters: next to the loss, so a NaN or Inf loss, or a NaN input,
  reaches it in the same step); and the values of one *weight* (the smallest of the
  last few parameters of two or more dimensions, other than the canary; a slice of
  its first rows). The weight is there for a loss linear in the model's output
  (``out.sum()``, a WGAN critic): there the last bias's gradient is constant, NaN
  weights or not, while a weight's gradient carries the activations that feed it,
  so a NaN input or a NaN anywhere upstream turns it, and with the update its
  values, non-finite. Its values, not its gradient: the parameter is live anyway
  (nothing more kept, no copy), and a non-finite weight stays so, so the newest read
  tells. Where the host is the device (``cpu``) both are checked at once; on
  eager accelerators a reference to the canary's gradient is kept (no device work,
  nothing added to a graph) and every :data:`CHECK_EVERY` steps the
  newest is read with the weight the way ``ap.after_step`` reads, when the step's
  values are ready anyway; only when the gradient is bad are the others read, for
  the first bad step. On XLA no gradient is kept (a tensor live at the loop's sync
  is an output of the step's graph, made and let go each step): the canary's values
  are read instead of its gradient (with torch's optimizers a NaN or Inf gradient
  makes the values it updates NaN or Inf, and they stay so), with the weight's, both
  read whole (a slice would be
  a graph to compile), so only one of at most :data:`WEIGHT_LAZY_MAX` elements is
  chosen as the weight; they are read every
  :data:`CHECK_EVERY_LAZY` steps and at the end of a loop (at most once per
  :data:`PASS_END_READ_SECONDS`), at the next sync (the
  loop's; a later step's where a step syncs before it ends, and then said of that
  step: a transfer, never an extra execution or compilation; left out of
  ``ap.metrics().device_to_host``): a bad input batch is still named at its step
  (the loader's thread checked it), a diverging loss between two reads. Input
  batches are checked on the host, in the loader's thread, before they go to the
  device. The first bad step found names its source: the input batch, the loss
  (every gradient non-finite) or one parameter's gradient (the first in module
  order); where the step's inputs were not seen (they came neither through
  ``ap.loader`` nor through a DataLoader under ``accelport diagnose``, or were on a
  device already) the source is "unknown", the inputs as likely as the loss. A
  gradient that turns NaN in one early layer only shows at the next step, as the loss.
- precision: parameters held in bf16 or fp16 are sampled at step
  :data:`PRECISION_FIRST` and every :data:`PRECISION_EVERY` steps after: a slice of
  each is read after that step and after the next, and the share of elements whose
  gradient was non-zero but whose value did not change is measured. Found in two
  samples in a row, the parameters are reported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from accelport.heap import live_instances
from accelport.sharding import is_dtensor, local_shard

__all__ = ["NumericsWatch", "NonFinite", "Stalled", "Inspected", "check_batch", "batch_tensors", "param_names",
           "CHECK_EVERY", "PRECISION_FIRST", "PRECISION_EVERY", "PRECISION_STALLED"]

#: Steps between reads of the kept gradients on eager accelerators, and of the parameters' values
#: on lazy backends: each read waits for the step it reads to finish executing, which on XLA costs the
#: overlap of host and device for one step, so there it comes seldom (and at the end of
#: an ap.loader loop, on lazy backends at most once per PASS_END_READ_SECONDS, and at ap.diagnostics()).
CHECK_EVERY = 64
CHECK_EVERY_LAZY = 256
#: On lazy backends a loader's pass that ends reads the kept values at most once per this many seconds. There a
#: read at a pass's end is a sync of its own (about 0.7 ms on XLA:CPU: 0.7% of a pass of 100 steps of 1 ms),
#: where the reads inside a pass go with the loop's own sync; a loop of short passes is read every
#: CHECK_EVERY_LAZY steps, at ``ap.diagnostics()`` and at the run's end, as inside a pass.
PASS_END_READ_SECONDS = 10.0
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
_UNSEEN = ("; the inputs of {} were not seen: they came neither through ap.loader nor through a DataLoader, "
           "or were on a device already, so they may be the source as well as the loss")
#: Elements of the weight whose values are read every CHECK_EVERY steps on eager accelerators (its
#: first rows, a view), and checked every step where the host is the device (the first few).
WEIGHT_SAMPLE = 4096
WEIGHT_HOST = 16
#: On lazy backends the weight is read whole: the most elements it may have.
WEIGHT_LAZY_MAX = 1 << 20
LOW_PRECISION = ("bfloat16", "float16")


@dataclass(frozen=True)
class NonFinite:
    """The first step whose gradients were NaN or Inf, and where it came from."""

    step: int  # the first bad step; where ``finite_at`` is set, the step it was found by
    #: "input", "loss" (every gradient non-finite), "gradient" (one parameter's first, in module
    #: order), "gradients" (read later, on an accelerator or lazy backend: known as far as the
    #: inputs), "update" (a weight turned non-finite with finite gradients) or "unknown" (the
    #: step's inputs were not seen: they may be the source as well as the loss).
    source: str
    detail: str
    names: tuple[str, ...] = ()
    #: Where gradients are read far apart (accelerators, lazy backends): the last step read and found finite.
    finite_at: int | None = None
    #: What was found non-finite: "gradients", or "weights" (parameter values: the checked weight's, or on
    #: lazy backends the canary's).
    found_in: str = "gradients"


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


def batch_tensors(batch: Any) -> Iterable[tuple[str, Any]]:
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
    return _check_batch(batch)[0]


def _plain(t: Any, torch: Any) -> bool:
    """Whether ``t`` is a host tensor of a usual size whose values a sum can look at (the common case)."""
    return type(t) is torch.Tensor and t.is_cpu and t.layout is torch.strided and not t.is_complex() and \
        t.numel() <= INPUT_CHECK_MAX


def _plain_finite(batch: tuple[Any, ...] | list[Any], torch: Any) -> bool:
    """Whether ``batch`` is host tensors of a usual size whose sums are all finite: the common case, said
    without naming anything (this runs in the loader's thread for every batch, holding the GIL the loop needs).
    False where :func:`_check_batch`'s full look must decide."""
    for t in batch:
        if not _plain(t, torch):
            return False
        try:
            if t.is_floating_point() and not math.isfinite(t.sum().item()):
                return False
        except (RuntimeError, TypeError, ValueError):  # a dtype without a sum (float8): the full look decides
            return False
    return bool(batch)


def _all_finite(batches: list[Any], torch: Any) -> bool:
    """Whether ``batches`` are all tuples or lists of host tensors of a usual size, their floating ones of one dtype
    and all finite: :func:`_plain_finite` for batches read together, in four torch ops for all of them (in the
    thread that reads the source, each op hands the GIL to the training loop and back). False where each batch
    must be looked at on its own."""
    floats = []
    for batch in batches:
        if type(batch) not in (tuple, list) or not batch:
            return False
        for t in batch:
            if not _plain(t, torch):
                return False
            if t.is_floating_point() and t.numel():
                floats.append(t)
    if not floats:
        return True  # (integer ids hold no NaN)
    dtype = floats[0].dtype
    if any(t.dtype != dtype for t in floats):
        return False
    try:
        # The largest magnitude of all of them: NaN or Inf where any value is (it never overflows).
        return math.isfinite(torch.stack(torch._foreach_norm(floats, math.inf)).max().item())
    except (RuntimeError, TypeError, AttributeError):  # a torch without the fused norm: one batch at a time
        return False


def _check_batch(batch: Any) -> tuple[str | None, bool]:
    """:func:`check_batch`'s answer, and whether it covers the batch: False where no tensor was
    found in it, or a floating one was passed over (on a device, another layout, no sum), so
    that a NaN in the inputs is not ruled out."""
    import torch

    if type(batch) in (tuple, list) and _plain_finite(batch, torch):
        return None, True
    tensor, strided = torch.Tensor, torch.strided
    items = enumerate(batch) if type(batch) in (tuple, list) and all(type(t) is tensor for t in batch) else None
    covered = None  # no tensor yet
    for name, t in ((f"input {i}", t) for i, t in items) if items is not None else batch_tensors(batch):
        if not (t.is_floating_point() or t.is_complex()):
            covered = covered is not False  # integer ids hold no NaN
            continue
        # Host tensors only: a batch already on a device would be read back (a host sync
        # per step). Sparse and nested layouts have no cheap sum: not looked at.
        if t.device.type != "cpu" or t.layout is not strided:
            covered = False
            continue
        try:
            if t.numel() > INPUT_CHECK_MAX:
                flat = t.detach().reshape(-1)
                t = flat[:: -(-flat.numel() // INPUT_CHECK_MAX)]
            total = t.sum().item()
            covered = covered is not False
            if math.isfinite(abs(total)):  # (a sum that overflows is looked at closely)
                continue
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                return f"{name}: {int((~finite).sum())} of {t.numel()} values are NaN or Inf", True
        except (RuntimeError, TypeError, ValueError):  # a tensor subclass without these ops: not looked at
            covered = False
            continue
    return None, bool(covered)


def param_names(params: Iterable[Any]) -> dict[int, str]:
    """Names of ``params`` by id, from the module that holds most of them (module order kept).

    Run once, when a finding names parameters: the optimizer knows its parameters but
    not their names, so the live modules are searched (``torch.compile``'s wrapper
    prefix ``_orig_mod.`` removed).
    """
    import torch

    wanted = {id(p) for p in params}
    best: dict[int, str] = {}
    for obj in live_instances(torch.nn.Module):
        try:
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
        #: Steps between reads in deferred mode (the rules say it where a finding is a range of steps).
        self.every = CHECK_EVERY_LAZY if self._lazy else CHECK_EVERY
        self.backend_name = str(getattr(backend, "name", "this backend"))
        self.nonfinite: NonFinite | None = None
        self.stalled: Stalled | None = None
        self._optimizer: Any = None
        self._params: list[Any] = []
        self._canary: Any = None
        self._small = False  # a short 1-d canary: read as a Python list, cheaper than a torch sum
        self._sharded = False  # the canary is a DTensor: its local shard is read
        self._last_grad: Any = None
        self._weight: Any = None  # the weight whose values are checked (see the module's docstring)
        self._weight_view: Any = None  # cpu: its sample, a view kept from step to step...
        self._weight_ptr = 0  # ...while the weight keeps the storage it was taken from
        self._weight_sharded = False
        self._clone = False  # gradients accumulated in place (zero_grad(set_to_none=False)): copy them
        self._kept: list[tuple[int, Any]] = []
        self._step = 0  # lazy: the last step seen...
        self._read_step = 0  # ...and the last one read
        self._unread = 0  # steps since the last read
        self._finite_at = 0  # the last step read and found finite (lazy: reads are far apart)
        self._bad_inputs: dict[int, str] = {}
        #: Deferred mode: host batches the loader's thread looked at in full, in all and at the last
        #: read. The same count at two reads: the inputs of the steps between were not seen.
        self._inspected = 0
        self._inspected_read = 0
        self._batch: Any = None  # host mode: this step's batch; deferred: what check_batch said
        # Host mode: the batch of this step and of the one before (a loader that reads ahead hands a step's
        # batch over during the step before it).
        self._current: Any = None
        self._previous: Any = None
        self._step_batches = 0  # batches since the last step (more than one: gradient accumulation)
        self._accumulated = 0  # ...as the step that ended last had them
        self._low: list[Any] | None = None  # low-precision parameters (None: not looked yet)
        self._sample: _Sample | None = None
        self._next_sample = PRECISION_FIRST  # the next step _precision has anything to do at
        self._stalled_runs: dict[int, int] = {}  # id(param) -> samples in a row that found it stalled
        self._last_shares: dict[int, float] = {}
        #: Reads handed to after_step that have not run yet (lazy: they run after the next sync).
        self.pending = 0
        self._read_at = -math.inf  # time.monotonic() at the last read
        #: Optimizer steps started (the step tracker counts them as each starts, before its update runs).
        self.started = 0

    @property
    def low_precision_params(self) -> int | None:
        """How many of the stepped parameters are bf16 or fp16 (None before the first step is seen)."""
        if self._optimizer is None:
            return None
        return sum(1 for p in self._params if _dtype(p) in LOW_PRECISION)

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
        found, covered = _check_batch(batch)
        if covered:
            self._inspected += 1  # (only this thread writes it)
        return signature if found is None else Inspected(signature, found)

    def inspect_many(self, batches: list[Any], signatures: list[Any]) -> list[Any]:
        """:meth:`inspect` of batches read together: the common case (plain host tensors, all finite) is one check
        of all of them; otherwise each batch is looked at on its own, so a bad one is named as before."""
        import torch

        if _all_finite(batches, torch):
            self._inspected += len(batches)  # (only this thread writes it)
            return list(signatures)
        return [self.inspect(batch, signature) for batch, signature in zip(batches, signatures, strict=True)]

    def read_at_pass_end(self) -> bool:
        """Whether a loader's pass that ends now reads the kept values (:meth:`read`): always, but on lazy backends
        only if nothing was read yet or the last read is PASS_END_READ_SECONDS old, since there it is a sync of its
        own. (What is left is read every CHECK_EVERY_LAZY steps, by ``ap.diagnostics()`` and at the run's end.)"""
        return not self._lazy or time.monotonic() - self._read_at >= PASS_END_READ_SECONDS

    def batch(self, info: Any) -> None:
        """The loop got a batch: on cpu the batch itself, else what :meth:`inspect` found in it."""
        self._batch = info
        self._step_batches += 1

    # -- each step ------------------------------------------------------------------------------
    def step_end(self, step: int, optimizer: Any) -> None:
        batch, self._batch = self._batch, None
        if not self.deferred:
            self._previous, self._current = self._current, batch
        self._accumulated, self._step_batches = self._step_batches, 0
        if self.nonfinite is not None:
            return
        if optimizer is not self._optimizer:
            self._select(optimizer)
        canary = self._canary
        if self._lazy and canary is not None and self._unread + 1 < self.every:
            # No gradient is kept on lazy backends (below), and it is looked at only on the steps that read
            # (to choose another canary where this one stopped getting one): a property of the C++ tensor, a
            # cold lookup in the middle of every step.
            grad = None
        else:
            grad = canary.grad if canary is not None else None
            if grad is None and self._params:
                self._select(optimizer)
                canary = self._canary
                grad = canary.grad if canary is not None else None
        if self.deferred:
            if isinstance(batch, str):
                self._bad_inputs[step] = batch
            if self._lazy:
                # No gradient is kept: one live at the loop's sync is an output of the step's graph,
                # made and let go each step (the largest of the checks' costs on a small model), and
                # keeping it on some steps only would make a second graph to compile. The canary's
                # values are read instead, with the weight's (see read()).
                self._step = step
            elif grad is not None:
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
            if self._unread >= self.every:
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
            if self.nonfinite is None and self._weight is not None and not self._weight_finite():
                self._found(step, batch, weights=True)
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
        # The weight: of the parameters other than the canary, the smallest of the last few of
        # two or more dimensions (a weight's gradient carries its layer's input; a bias next to a
        # loss linear in the output has a constant one). On lazy backends it is read whole.
        others = [p for p in with_grad if p is not canary and (not self._lazy or p.numel() <= WEIGHT_LAZY_MAX)]
        pool = ([p for p in others if p.dim() >= 2] or others)[-CANARY_FROM_LAST:]
        self._weight = min(reversed(pool), key=lambda p: p.numel()) if pool else None
        self._weight_view = None
        self._weight_sharded = is_dtensor(self._weight)

    def _weight_sample(self) -> Any:
        """The checked weight's values to read: whole on lazy backends, else its first rows (a view)."""
        t = local_shard(self._weight).detach()
        if self._lazy:
            return t
        if t.dim() > 1 and t.numel() > WEIGHT_SAMPLE:
            # Whole rows (basic slicing: a view, never a copy): a NaN that reached one input
            # feature of the layer shows in every row's column of it.
            t = t[: max(1, WEIGHT_SAMPLE // (t.numel() // t.shape[0]))]
        return t.reshape(-1) if t.is_contiguous() else t

    def _weight_finite(self) -> bool:
        """Where the host is the device: whether the first WEIGHT_HOST values of the checked weight are finite.

        Read as a Python list (under a microsecond; a torch sum costs three), so only a few: a
        NaN input or a NaN upstream reaches every element of the weight's gradient at once, and
        a single bad element the whole layer's output at the next step.
        """
        weight = self._weight
        view = self._weight_view
        if self._weight_sharded or view is None or weight.data_ptr() != self._weight_ptr:
            # (The first step, a DTensor, whose to_local() hands out a new object each call, or
            # a weight whose storage was replaced.) A 1-d view, never a copy.
            t = local_shard(weight).detach()
            view = t.reshape(-1) if t.is_contiguous() else t[(0,) * (t.dim() - 1)] if t.dim() else t.reshape(1)
            view = self._weight_view = view[:WEIGHT_HOST]
            self._weight_ptr = 0 if self._weight_sharded else weight.data_ptr()
        return math.isfinite(abs(sum(view.tolist())))  # (float64 sums: no overflow of finite float32 values)

    def read(self) -> None:
        """Read the kept gradients (deferred mode), the way after_step reads: when the step's values are ready;
        on lazy backends the parameters' values instead (:meth:`_read_values`).

        Only the newest is read, with the checked weight (one transfer each per CHECK_EVERY
        steps: on XLA each tensor read is a transfer of its own). Gradients and weights that
        turn NaN or Inf stay so (the update makes the weights non-finite, and every later
        gradient with them), so a finite newest one means the block was finite; a bad
        gradient has all of the block read, for the first step. A NaN that goes away by
        itself (a step a loss scaler skipped) is not reported.
        """
        kept, self._kept = self._kept, []
        self._unread = 0
        self._read_at = time.monotonic()
        # Were this block's inputs looked at? Counted by the loader's thread, which reads ahead,
        # so told per block, not per step.
        seen, self._inspected_read = self._inspected != self._inspected_read, self._inspected
        if self._lazy and self.nonfinite is None:
            self._read_values(seen)
            return
        if not kept or self.nonfinite is not None:
            return
        steps = [s for s, _ in kept]
        last = steps[-1]
        since = self._finite_at

        def newest(value: Any, *weight: Any) -> None:
            if self.nonfinite is not None:
                return
            gradient_finite = _finite(value)
            if gradient_finite and (not weight or _finite(weight[0])):
                self._finite_at = max(self._finite_at, last)
            elif not gradient_finite and len(kept) > 1:
                self._after(lambda *values: self._check_values(steps, values, seen), tuple(t for _, t in kept))
            else:  # the weight alone: the inputs were checked step by step
                bad = sorted(s for s in self._bad_inputs if since < s <= last)
                if bad:
                    self._found(bad[0], self._bad_inputs[bad[0]])
                else:
                    self._found(last, None, finite_at=since, seen=seen, weights=gradient_finite)

        weight = (self._weight_sample(),) if self._weight is not None else ()
        self._after(newest, (kept[-1][1], *weight))

    def _read_values(self, seen: bool) -> None:
        """Lazy backends: read the canary's values and the checked weight's, as they are at the next sync.

        With torch's optimizers a NaN or Inf gradient makes the parameter it updates NaN or Inf,
        and it stays so; the parameters are outputs of every step's graph anyway, so this read
        adds nothing to a graph. (A step a loss scaler skipped leaves them finite: not reported,
        as in the other modes.) The read runs at the next sync and reads the parameters
        themselves, so it is of every step started by then: of the newest step at an
        ``ap.loader`` loop's sync or a loop's end, of a later one where the step syncs before it
        ends (``ap.optimizer_step`` outside ``ap.loader``, a script's own sync under diagnose).
        """
        last, since, started = self._step, self._finite_at, self.started
        probes = [p for p in (self._canary, self._weight) if p is not None]
        if last <= self._read_step or not probes:
            return  # no step since the last read
        self._read_step = last

        def judge(*values: Any) -> None:
            if self.nonfinite is not None:
                return
            # The values are after the update of every step started before the sync that runs this: counted
            # from here (a step that raised and was skipped does not shift later reads).
            by = last + max(self.started - started, 0)
            bad = next((p for p, v in zip(probes, values, strict=False) if not _finite(v)), None)
            if bad is None:
                self._finite_at = max(self._finite_at, by)
                return
            inputs = sorted(s for s in self._bad_inputs if since < s <= by)  # checked step by step
            if inputs:
                self._found(inputs[0], self._bad_inputs[inputs[0]])
            elif by > self._step and isinstance(self._batch, str):  # the step in progress, not ended yet
                self._found(self._step + 1, self._batch)
            else:
                self._found(by, None, finite_at=since, seen=seen, weights=True, probe=bad)

        self._after(judge, tuple(local_shard(p).detach() for p in probes))

    def _check_values(self, steps: list[int], values: tuple[Any, ...], seen: bool) -> None:
        for step, v in zip(steps, values, strict=False):
            if not _finite(v):
                if self.nonfinite is None:
                    self._found(step, self._bad_inputs.get(step), seen=seen)
                return

    # -- the finding -------------------------------------------------------------------------------
    def _found(self, step: int, batch: Any, finite_at: int | None = None, *, seen: bool = True,
               weights: bool = False, probe: Any = None) -> None:
        """Name the first bad step's source. ``batch``: on cpu the step's last batch (None: none
        came), deferred what the loader's thread said of it; ``seen``: deferred, whether the
        block's inputs were looked at; ``weights``: found in values (the checked weight's, or
        ``probe``'s), not in the canary's gradient."""
        import torch

        params = self._params
        name = _namer(params)

        if self.deferred:
            if isinstance(batch, str):
                self.nonfinite = NonFinite(step, "input", batch)
                return
            if probe is None:
                probe = self._weight if weights else self._canary
            found_in = "weights" if weights else "gradients"
            if weights:
                where = f"the values of {name(probe)}" if probe is not None else "the weights"
            else:
                where = "the gradients" + (f" (seen in {name(probe)})" if probe is not None else "")
            self.nonfinite = NonFinite(step, "gradients" if seen else "unknown",
                                       where + ("" if seen else _UNSEEN.format("these steps")),
                                       (name(probe),) if probe is not None else (),
                                       finite_at if finite_at is not None and finite_at < step - 1 else None,
                                       found_in)
            return
        found, covered = _check_batch(batch) if batch is not None else (None, False)
        if found is None and self._previous is not None:
            # A loader that reads one batch ahead (accelerate's, which the HuggingFace Trainer uses) hands
            # this step's batch over during the step before: it is the one kept from there.
            earlier, _ = _check_batch(self._previous)
            if earlier is not None:
                found = f"{earlier}, in the batch handed over just before this step's (the loader reads ahead)"
        if found is not None:
            self.nonfinite = NonFinite(step, "input", found)
            return
        unseen = "" if covered else _UNSEEN.format("this step")
        # Module order where the names are known, the optimizer's otherwise. The update of
        # this step has run already, so the gradients tell the story, not the values.
        position = {pid: i for i, pid in enumerate(name.order)}
        ordered = sorted(params, key=lambda p: position.get(id(p), len(position)))
        grads = [p for p in ordered if p.grad is not None]
        bad = [p for p in grads if not bool(torch.isfinite(local_shard(p.grad)).all())]
        if bad and len(bad) == len(grads):
            detail = "every gradient is NaN or Inf, so the loss was"
            if self._accumulated > 1 and covered:  # only the last batch is kept: an earlier one may be the source
                detail += (f", or an earlier one of the {self._accumulated} batches accumulated into this "
                           "step held NaN or Inf (the last was finite)")
            self.nonfinite = NonFinite(step, "loss" if covered else "unknown", detail + unseen)
        elif bad:
            self.nonfinite = NonFinite(step, "gradient" if covered else "unknown",
                                       f"the gradient of {name(bad[0])}{unseen}", tuple(name(p) for p in bad[:3]))
        elif weights:  # finite gradients, a non-finite weight: the update itself overflowed
            self.nonfinite = NonFinite(step, "update", f"{name(self._weight)} turned NaN or Inf in the update, "
                                       "its gradient finite", (name(self._weight),), found_in="weights")
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
