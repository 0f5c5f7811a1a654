"""The search for the operation that made the first NaN or Inf (``accelport diagnose --find-nan``,
``ACCELPORT_FIND_NAN`` for a ported script).

:class:`NanSearch` checks every operation of the steps it is asked to check, as it runs:
a ``TorchDispatchMode`` sees each aten op of the forward pass, of the backward pass (run
by the autograd engine, with the node it runs for) and of the optimizer's update (for-loop,
foreach and fused kernels alike), and looks at its outputs. Where one holds a NaN that
none of its inputs held, or an Inf from inputs that were all finite (and no infinite
constant among its arguments: ``masked_fill(mask, -inf)`` is meant), the op *made* it.
That op is a candidate: the first one whose NaN or Inf reaches the weights in that step
(followed from op to op, output to input) is the origin; one whose NaN is masked away
or whose step is skipped (a loss scaler) is not, and the search goes on. A NaN that no
checked op made (the weights were NaN before the first checked step, or a tensor the
loop reads itself holds one) is said so; one already in the input batch is named as the
input and its sample, and no op is searched.

Where it is: the module path from global module hooks (``register_module_forward_pre_hook``),
the user's line from the stack (:func:`accelport.observe.frames.user_site`). A backward
op's forward op and line come from the autograd node it runs for: a ``TorchFunctionMode``
writes the forward call's site into the metadata of the nodes each torch call creates.

Cost: nothing while no step is checked (no mode, no hook but torch's optimizer step hook,
which counts steps); a checked step reads every floating output once (``isfinite().all()``),
and copies what an in-place op is about to overwrite (for the repro), about 8-10 times a
step's time on cpu. Inside a checked step torch.compile'd functions run eagerly (torch
skips compiled code while a dispatch mode is active). On a lazy backend (XLA) each read is
a sync: a checked step runs op by op, and the first compiles a small graph per check.

Steps are counted as accelport counts them: each optimizer step ends one (torch's global
optimizer step hook), and checking starts at a step boundary, so step N's forward pass is
checked: ``first_step`` 1 checks from the moment torch is available.
"""

from __future__ import annotations

import functools
import io
import keyword
import math
import os
import re
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from accelport.observe.frames import running_in, user_site

if TYPE_CHECKING:
    from accelport.redact import Redactor

__all__ = ["NanSearch", "Origin", "TensorFacts", "parse_first_step", "reproducibility", "ENV", "ENV_DIR",
           "COPY_MAX", "REPRO_MAX_BYTES", "REPRO_NAMES"]

#: The setting that asks a ported script for the search: 1 (or true, on, yes) from the first step, or the step.
ENV = "ACCELPORT_FIND_NAN"
#: Where the repro is written (default: beside ACCELPORT_METRICS_FILE, else the working directory).
ENV_DIR = "ACCELPORT_FIND_NAN_DIR"
#: An in-place op's written tensors are copied before it runs (the repro needs them as they were) up to
#: this many elements; a larger update has no repro.
COPY_MAX = 1 << 26
#: The most the repro's tensors may hold.
REPRO_MAX_BYTES = 1 << 28
#: The names a repro may take in its directory: ``accelport-nan-stepN.py``, then ``-2`` up to this (never over a file).
REPRO_NAMES = 100
#: Candidates kept per step (ops that made a NaN or Inf); later ones are followed as the last one's.
MAX_CANDIDATES = 8
MAX_FACTS = 6  # inputs described per op
_TAG = "accelport_nan_site"  # the key of a forward call's site in an autograd node's metadata
#: Host reads of device tensors the search has made in this process (each one transfer): the backend is told
#: of them (``Backend.own_reads``), so that the script's host reads are counted without the search's.
_READS = [0]
_HERE = frozenset({__name__})

#: Ops whose output is uninitialized memory (garbage may be NaN: never a finding), and profiler markers.
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                            "empty_permuted", "resize_", "resize_as_", "set_", "_empty_affine_quantized"})
#: In-place ops whose result does not depend on what they overwrite.
_OVERWRITE = frozenset({"fill_", "zero_", "uniform_", "normal_", "random_", "bernoulli_", "exponential_",
                        "geometric_", "log_normal_", "cauchy_", "copy_", "_copy_from"})
#: Ops whose cuda kernels are nondeterministic unless torch.use_deterministic_algorithms(True).
_NONDETERMINISTIC = frozenset({"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
                               "scatter_reduce_", "index_put_", "_index_put_impl_", "put_", "index_reduce",
                               "embedding_dense_backward", "_embedding_bag_backward",
                               "_embedding_bag_dense_backward", "nll_loss2d_backward", "grid_sampler_2d_backward",
                               "adaptive_avg_pool2d_backward", "adaptive_avg_pool3d_backward",
                               "max_pool3d_with_indices_backward", "upsample_bilinear2d_backward",
                               "upsample_linear1d_backward", "upsample_trilinear3d_backward", "_ctc_loss_backward",
                               "histc", "bincount", "cumsum", "kthvalue", "median"})


def parse_first_step(value: str | None) -> int | None:
    """The first step to check for ``ACCELPORT_FIND_NAN``'s value: 1 for ``1``, ``true``, ``on``, ``yes``; a
    step number as itself; None when unset or off. ValueError (saying what is expected) for anything else."""
    from accelport.settings import FALSE_VALUES, TRUE_VALUES

    text = (value or "").strip().lower()
    if text in FALSE_VALUES:
        return None
    if text in TRUE_VALUES:
        return 1
    try:
        step = int(text)
    except ValueError:
        raise ValueError("not a step number: give 1 to check from the first step, or the step the non-finite "
                         "finding named (steps count from 1)") from None
    if step < 1:
        raise ValueError("steps count from 1: give 1 to check from the first step, or the step the non-finite "
                         "finding named")
    return step


def reproducibility(device_type: str | None, seen: Iterable[str] = ()) -> tuple[str, ...]:
    """Why a rerun of this script may not follow the same steps (empty: nothing known against it).

    Read when a finding is made (torch is imported by then; nothing is imported here):
    torch's seed (a process that never called ``torch.manual_seed`` has a random 64-bit
    one), whether deterministic algorithms are on where some kernels are not (cuda), and
    the nondeterministic ops ``seen`` in checked steps.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    reasons = []
    try:
        if torch.initial_seed() >= 1 << 32:
            reasons.append("torch's random seed was never set (torch.manual_seed), so the initial weights, "
                           "dropout and a shuffled DataLoader's order (one without a generator of its own) "
                           "change from run to run")
        if device_type == "cuda" and not torch.are_deterministic_algorithms_enabled():
            ops = ", ".join(sorted(seen)[:4]) or "index_add_, scatter_add_, an embedding's backward"
            reasons.append(f"on cuda some kernels ({ops}) add in a different order each run unless "
                           "torch.use_deterministic_algorithms(True) is set")
    except Exception:  # noqa: BLE001 - a partial torch: nothing said
        return tuple(reasons)
    return tuple(reasons)


@dataclass(frozen=True)
class TensorFacts:
    """What a tensor held: dtype, shape, and its extremes and counts."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zeros: int = 0
    negatives: int = 0
    #: Over its finite values (None: it has none).
    min: float | None = None
    max: float | None = None

    def describe(self) -> str:
        parts = [f"{self.name}: {self.dtype} {tuple(self.shape)}"]
        if self.min is not None and self.max is not None:
            parts.append(f"min {self.min:.4g}, max {self.max:.4g}")
        parts.append(f"{self.zeros} zero{'' if self.zeros == 1 else 's'}, {self.negatives} negative")
        for count, what in ((self.nan, "NaN"), (self.posinf, "+Inf"), (self.neginf, "-Inf")):
            if count:
                parts.append(f"{count} {what}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "numel": self.numel,
                "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf, "zeros": self.zeros,
                "negatives": self.negatives, "min": self.min, "max": self.max}


@dataclass(frozen=True)
class Origin:
    """Where the first NaN or Inf of the run came from, as the search found it."""

    step: int
    #: "op": an op made it (a NaN from inputs without one, an Inf from finite inputs); "entered": the
    #: checked ops did not make it (the weights held it before the first checked step, or a tensor the
    #: loop read); "input": the input batch held it (no op was searched).
    kind: str
    op: str = ""  # "aten.log.default"
    #: "forward", "backward", "optimizer", "gradient clipping" or "data loading".
    direction: str = ""
    node: str = ""  # backward: the autograd node the op ran for ("SqrtBackward0")
    forward_op: str = ""  # backward: the forward op it belongs to ("sqrt")
    forward_call: str = ""  # backward: the torch call that made the node ("torch.sqrt"), where known
    module: str = ""  # "model.blocks.3.attn (Attention)"; "" outside any module
    site: tuple[str, int] | None = None
    made: str = ""  # "NaN", "Inf", "NaN and Inf"
    inputs: tuple[TensorFacts, ...] = ()
    outputs: tuple[TensorFacts, ...] = ()
    params: tuple[str, ...] = ()  # the parameters it wrote (optimizer) or read (entered)
    optimizer: str = ""  # the optimizer's class
    dtype: str = ""  # the dtype of its first non-finite output
    detail: str = ""  # input: what the batch held; entered: what held the NaN
    repro: tuple[str, str] | None = None  # (the script, the tensors it loads)
    repro_problem: str | None = None
    #: True: the weights turned non-finite in that step. False: the run ended before its update.
    confirmed: bool = True

    @property
    def op_name(self) -> str:
        """``aten::log`` for ``aten.log.default``."""
        namespace, _, rest = self.op.partition(".")
        return f"{namespace}::{rest.partition('.')[0]}" if rest else self.op

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "kind": self.kind, "op": self.op, "direction": self.direction,
                "node": self.node or None, "forward_op": self.forward_op or None,
                "forward_call": self.forward_call or None, "module": self.module or None,
                "where": f"{self.site[0]}:{self.site[1]}" if self.site else None, "made": self.made or None,
                "inputs": [f.to_dict() for f in self.inputs], "outputs": [f.to_dict() for f in self.outputs],
                "params": list(self.params), "optimizer": self.optimizer or None, "dtype": self.dtype or None,
                "detail": self.detail or None, "repro": list(self.repro) if self.repro else None,
                "repro_problem": self.repro_problem, "confirmed": self.confirmed}


@dataclass
class _Candidate:
    origin: Origin
    tensors: list[Any] | None = None  # the repro's inputs, on the host
    call: str = ""  # the repro's call: "torch.ops.aten.log.default(t[0])"
    results: str = ""  # what it looks at afterwards where the op returns nothing ("[t[0], t[1]]")
    problem: str | None = None  # why there is no repro


@dataclass
class _OpInfo:
    """What the search needs to know of an op, worked out once from its schema."""

    name: str  # "aten.log.default"
    base: str  # "log"
    skip: bool
    names: tuple[str, ...]  # the schema's argument names, in order
    writes: tuple[tuple[int, str], ...]  # (position, name) of the arguments it writes
    reads_written: bool  # an in-place op whose result depends on what it overwrites
    nondeterministic: bool = False
    out_args: frozenset[str] = field(default_factory=frozenset)


def _op_info(func: Any) -> _OpInfo:
    schema = func._schema
    namespace, _, base = schema.name.partition("::")
    names, writes, outs = [], [], set()
    for i, arg in enumerate(schema.arguments):
        names.append(arg.name)
        alias = arg.alias_info
        if alias is not None and alias.is_write:
            writes.append((i, arg.name))
            if getattr(arg, "is_out", False):
                outs.add(arg.name)
    reads = bool(writes) and base not in _OVERWRITE and len(outs) < len(writes)
    return _OpInfo(str(func), base, namespace == "profiler" or base in _UNINITIALIZED, tuple(names), tuple(writes),
                   reads, base in _NONDETERMINISTIC, frozenset(outs))


def _leaves(value: Any) -> list[Any]:
    """The tensors of an op's argument or result: a tensor, or a list or tuple of them (one level down too)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(x for x in v if isinstance(x, torch.Tensor))
        return out
    return []


def _checked(t: Any) -> bool:
    """Whether ``t`` is a tensor whose values can hold NaN or Inf and can be read here."""
    import torch

    try:
        return (t.is_floating_point() or t.is_complex()) and t.layout is torch.strided and t.device.type != "meta"
    except Exception:  # noqa: BLE001 - a tensor subclass that cannot say
        return False


def _finite(t: Any) -> bool:
    """Whether every value of ``t`` is finite (a tensor that cannot be read counts as finite)."""
    import torch

    if not _checked(t):
        return True
    try:
        return _host(torch.isfinite(t).all(), bool)
    except Exception:  # noqa: BLE001 - a subclass without isfinite
        return True


def _host(value: Any, convert: Any) -> Any:
    """``convert(value)`` (bool, int, float; or a copy to the host) of a tensor, counted as one of the search's own
    host reads where ``value`` is on a device."""
    if value.device.type != "cpu":
        _READS[0] += 1
    return convert(value)


def _counts(t: Any) -> tuple[bool, bool]:
    """(holds a NaN, holds an Inf) for a tensor found not finite."""
    import torch

    if not _checked(t):
        return False, False
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    return _host(torch.isnan(x).any(), bool), _host(torch.isinf(x).any(), bool)


def facts(name: str, t: Any) -> TensorFacts:
    """What ``t`` holds: dtype, shape, extremes of its finite values, zeros, negatives, NaN and Inf counts."""
    import torch

    x = t.detach()
    dtype = str(x.dtype).replace("torch.", "")
    shape = tuple(int(d) for d in x.shape)
    if not (x.is_floating_point() or x.is_complex() or x.dtype in (torch.int8, torch.int16, torch.int32,
                                                                     torch.int64, torch.uint8)):
        return TensorFacts(name, dtype, shape, x.numel())
    if x.is_complex():
        x = x.abs()
    if x.numel() == 0:
        return TensorFacts(name, dtype, shape, 0)
    y = x.float() if x.is_floating_point() else x.double()
    finite = torch.isfinite(y)
    some = _host(finite.any(), bool)
    inf = float("inf")
    return TensorFacts(
        name, dtype, shape, x.numel(), nan=_host(torch.isnan(y).sum(), int), posinf=_host((y == inf).sum(), int),
        neginf=_host((y == -inf).sum(), int), zeros=_host((y == 0).sum(), int), negatives=_host((y < 0).sum(), int),
        min=_host(torch.where(finite, y, inf).min(), float) if some else None,
        max=_host(torch.where(finite, y, -inf).max(), float) if some else None)


def _snake(name: str) -> str:
    """``linalg_vector_norm`` for the node ``LinalgVectorNormBackward0``."""
    stem = re.sub(r"Backward\d*$", "", name.rpartition("::")[2])
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", stem).lower()


def _module_path(stack: Sequence[Any]) -> str:
    """``model.blocks.3.attn (Attention)`` for a stack of running modules, outermost first ("" for none).

    The outermost module is named as the script's ``__main__`` names it where it does
    (else by its class); torch.compile's ``_orig_mod.`` is left out.
    """
    # torch.compile's wrapper (OptimizedModule) runs its model inside: the model is the one named.
    if not stack:
        return ""
    stack = [m for m, inner in zip(stack, [*stack[1:], None], strict=True)
             if inner is None or getattr(m, "_orig_mod", None) is not inner]
    root, inner = stack[0], stack[-1]
    main = sys.modules.get("__main__")
    label = next((k for k, v in vars(main).items() if not k.startswith("_") and
                  (v is root or getattr(v, "_orig_mod", None) is root)), None) if main else None
    if label is None and inner is root:
        return type(root).__name__
    label = label or type(root).__name__
    path = ""
    if inner is not root:
        try:
            path = next((n for n, m in root.named_modules() if m is inner), "")
        except Exception:  # noqa: BLE001 - a module whose named_modules fails
            path = ""
    path = path.replace("_orig_mod.", "").replace("_orig_mod", "")
    full = f"{label}.{path}" if path else label
    return f"{full} ({type(inner).__name__})"


def _literal(value: Any, refs: dict[int, int], tensors: list[Any]) -> str:
    """Python source for an op's argument, its tensors as ``t[i]`` (each kept, on the host, in ``tensors``)."""
    import torch

    if isinstance(value, torch.Tensor):
        key = id(value)
        if key not in refs:
            refs[key] = len(tensors)
            tensors.append(value)
        return f"t[{refs[key]}]"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_literal(v, refs, tensors) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, complex):
        return f"complex({_literal(value.real, refs, tensors)}, {_literal(value.imag, refs, tensors)})"
    if isinstance(value, torch.device):
        return "'cpu'"  # the repro runs on the host
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, torch.Generator):
        return "None"
    raise TypeError(f"an argument of type {type(value).__name__} cannot be written in a script")


def _host_copy(t: Any) -> Any:
    """A copy of ``t`` on the host, detached (its own storage: the op may change ``t`` afterwards)."""
    return _host(t.detach(), _to_host)


def _to_host(t: Any) -> Any:
    return t.to("cpu", copy=True)


class NanSearch:
    """Checks every op of the steps from ``first_step`` on, until the first op that made a NaN or Inf is found.

    ``directory``: where the repro is written (absolute; created if missing); ``option``: the
    setting that names it, for the message when it cannot be written; ``steps_before``: steps
    the run took before this search was built (a ported script's steps before the first ``ap.*``);
    ``redactor``: the pass the repro's comments go through (default: one over ``os.environ``).
    :meth:`attach` starts it once torch is imported; the result is :attr:`found`.
    """

    def __init__(self, first_step: int, directory: str, *, option: str = ENV_DIR, steps_before: int = 0,
                 redactor: Redactor | None = None) -> None:
        self.first_step = first_step
        self.redactor = redactor
        self.directory = directory
        self.option = option
        #: Optimizer steps ended so far, counted as accelport counts them.
        self.step = steps_before
        self.found: Origin | None = None
        #: Ops that made a NaN or Inf that never reached the weights (masked, or a step that was skipped).
        self.transient: list[Origin] = []
        #: The first and the last step checked (None: none yet).
        self.first_checked: int | None = None
        self.last_checked: int | None = None
        self.lazy = False
        self.backend_name = ""
        self.device_type: str | None = None
        #: Why the search stopped before finding anything (an error of its own; the script ran on).
        self.problem: str | None = None
        #: Nondeterministic ops seen on cuda in checked steps.
        self.nondeterministic: set[str] = set()
        self.checking = False
        self._attached = False
        self._finished = False
        self._thread = threading.get_ident()
        self._modes: list[Any] = []
        self._handles: list[Any] = []  # torch's optimizer step hook: for the whole run
        self._window_handles: list[Any] = []  # the module hooks: while steps are checked
        self._modules: list[Any] = []
        self._info: dict[Any, _OpInfo] = {}
        self._candidates: list[_Candidate] = []
        self._taint: Any = None  # tensor -> index of the candidate whose NaN or Inf it holds
        self._bad_input: str | None = None  # what the loader's thread found in this step's batch
        self._bad_loss = False  # this step's loss was not finite
        self._reached: set[int] = set()  # candidates whose NaN or Inf reached the loss
        self._own_reads: Any = None  # the backend's Backend.own_reads, told of the search's host reads
        self._reads_told = _READS[0]

    # -- the run -------------------------------------------------------------------------------
    def bind(self, backend: Any) -> None:
        """The backend the run uses: on a lazy one each check is a sync (said in the notes)."""
        self.lazy = bool(getattr(backend, "lazy", False))
        self.backend_name = str(getattr(backend, "name", ""))
        self.device_type = getattr(backend, "device_type", None)
        # Each check reads a device value: the script's host reads are counted without them.
        self._own_reads = getattr(backend, "own_reads", None)
        self._tell()

    def _tell(self) -> None:
        """Tell the backend of the host reads the search made since it last did (see :data:`_READS`); those made
        before it was bound are told once it is (under diagnose its counters count from the process's start)."""
        made = _READS[0] - self._reads_told
        if made and self._own_reads is not None:
            self._reads_told += made
            self._own_reads(made)

    def attach(self) -> None:
        """Start: torch is imported. Counts steps through torch's optimizer step hook, and checks at once if due."""
        if self._attached or self._finished:
            return
        import torch.optim.optimizer as optimizer_module

        self._attached = True
        self._thread = threading.get_ident()
        self._handles.append(optimizer_module.register_optimizer_step_post_hook(self._stepped))
        if hasattr(os, "register_at_fork"):  # (weakly: the registration outlives the search)
            os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))
        if self.step + 1 >= self.first_step:
            self._open()

    def batch(self, batch: Any) -> None:
        """A batch reached the loop: the host batch itself, or what the loader's thread found in it (a string)."""
        if not self.checking or self.found is not None:
            return
        try:
            if isinstance(batch, str):
                self._bad_input = batch
            elif batch is not None and not _nan_free(batch):
                self._input(batch)
        except Exception as exc:  # never into the script's loop
            self._fail(exc)
        self._tell()

    def finish(self) -> None:
        """The run ended: an op found in a step whose update never came is the answer; every hook comes out."""
        if self._finished:
            return
        self._finished = True
        try:
            if self.found is None and self._candidates:
                self._settle(self._candidates[0], confirmed=False)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        self._tell()
        self._close()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def notes(self) -> list[str]:
        """What to say besides a finding: what was checked, and how."""
        out = []
        if self.problem:
            out.append(self.problem)
        if self.first_checked is None:
            if self.found is None and not self.problem:
                out.append(f"no step was checked for the operation that made a NaN or Inf: the run ended at step "
                           f"{self.step}, before step {self.first_step}, where the checks were to begin")
            return out
        last = self.last_checked if self.last_checked is not None else self.first_checked
        steps = f"step {self.first_checked}" if last <= self.first_checked else \
            f"steps {self.first_checked} to {last}"
        if self.found is None:
            out.append(f"{steps} were checked op by op: no operation made a NaN or Inf that reached the weights"
                       if last > self.first_checked else
                       f"{steps} was checked op by op: no operation made a NaN or Inf that reached the weights")
        for t in [t for t in self.transient if t.kind == "op" and not t.op.startswith("aten.lift")][:1]:
            where = f" at {t.site[0]}:{t.site[1]}" if t.site else ""
            out.append(f"at step {t.step} {t.op} ({t.direction}{where}) made {t.made}, which did not reach the "
                       "weights (masked, or the step was skipped): not a finding")
        if self.lazy:
            out.append(f"on {self.backend_name or 'a lazy backend'} each checked step ran op by op, a sync per "
                       "checked tensor (the first one also compiles a small graph per check)")
        return out

    def transient_at(self, step: int) -> Origin | None:
        """The op that made a NaN or Inf at ``step`` that did not reach the weights (the step checks may disagree)."""
        return next((t for t in self.transient if t.step == step), None)

    # -- the window of checked steps -------------------------------------------------------------
    def _open(self) -> None:
        if self.checking or self.found is not None or self._finished:
            return
        if threading.get_ident() != self._thread:
            return  # (an optimizer stepped in another thread: the modes are per thread)
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        search = self

        backward = (torch.Tensor.backward, torch.autograd.backward)

        class _Tagger(TorchFunctionMode):  # writes each torch call's site into the autograd nodes it made
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if search.checking and func in backward and args:
                    search._loss(args[0])
                out = func(*args, **(kwargs or {}))
                if search.checking:
                    search._tag(func, out)
                return out

        class _Checker(TorchDispatchMode):  # looks at every aten op's outputs
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if not search.checking:
                    return func(*args, **(kwargs or {}))
                return search._op(func, args, kwargs or {})

        self._taint = WeakIdKeyDictionary()
        modules = self._modules
        modules.clear()

        def pre(module: Any, args: Any) -> None:
            modules.append(module)

        def post(module: Any, args: Any, output: Any) -> None:
            while modules:
                if modules.pop() is module:
                    break

        hooks = torch.nn.modules.module
        self._window_handles = [hooks.register_module_forward_pre_hook(pre),
                                hooks.register_module_forward_hook(post, always_call=True)]
        self._modes = [_Tagger(), _Checker()]
        for mode in self._modes:
            mode.__enter__()
        self.checking = True
        self.first_checked = self.step + 1 if self.first_checked is None else self.first_checked

    def _close(self) -> None:
        """Stop checking; the modes come off where they are on top (else they stay, passing every op on)."""
        self.checking = False
        if not self._modes:
            return
        if threading.get_ident() == self._thread:
            from torch.overrides import _get_current_function_mode_stack
            from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

            tagger, checker = self._modes
            dispatch = _get_current_dispatch_mode_stack()
            if dispatch and dispatch[-1] is checker:
                checker.__exit__(None, None, None)
            function = _get_current_function_mode_stack()
            if function and function[-1] is tagger:
                tagger.__exit__(None, None, None)
            self._modes = []
        for handle in self._window_handles:
            handle.remove()
        self._window_handles = []
        self._modules.clear()
        self._candidates = []
        if self._taint is not None:
            self._taint.clear()

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's optimizer step hook: a step ended. Judge what was found in it, and check the next if due."""
        try:
            self.step += 1
            if self.checking:
                self.last_checked = self.step
                if self._candidates:
                    self._judge(optimizer)
                self._candidates = []
                self._bad_input = None
                self._bad_loss = False
                self._reached.clear()
                self._taint.clear()
                if self.found is not None:
                    self._close()
                    return
            if not self.checking and self.found is None and not self._finished and self.step + 1 >= self.first_step:
                self._open()
        except Exception as exc:  # never into the script's optimizer.step()
            self._fail(exc)
        self._tell()

    def _loss(self, loss: Any) -> None:
        """``loss.backward()`` is called: a NaN or Inf in the loss is one of the step's, whatever the update does."""
        try:
            for t in _leaves(loss):
                if not _finite(t):
                    self._bad_loss = True
                    if t in self._taint:
                        self._reached.add(self._taint[t])
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        self._tell()

    def _judge(self, optimizer: Any) -> None:
        """The step's update ran: the first candidate whose NaN or Inf reached the loss or the weights is the
        origin (the loss: a log of 0 in the forward pass, whose backward makes its own Inf from the saved 0)."""
        params = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
        bad = [p for p in params if not _finite(p)]
        if bad or self._bad_loss:
            reached = sorted(self._reached | {self._taint[p] for p in bad if p in self._taint})
            self._settle(self._candidates[reached[0] if reached else 0], confirmed=True)
        elif len(self.transient) < 3:
            self.transient.append(self._candidates[0].origin)

    def _settle(self, candidate: _Candidate, *, confirmed: bool) -> None:
        origin = replace(candidate.origin, confirmed=confirmed)
        if origin.kind == "op":
            origin = self._write_repro(origin, candidate)
        self.found = origin

    def _fail(self, exc: BaseException) -> None:
        if self.problem is None:
            self.problem = (f"the search for the operation that made a NaN or Inf stopped at step {self.step + 1}: "
                            f"{type(exc).__name__}: {exc}")
        self.checking = False

    # -- each op -----------------------------------------------------------------------------------
    def _op(self, func: Any, args: Any, kwargs: Mapping[str, Any]) -> Any:
        try:
            return self._check(func, args, kwargs)
        finally:
            if _READS[0] != self._reads_told:
                self._tell()

    def _check(self, func: Any, args: Any, kwargs: Mapping[str, Any]) -> Any:
        """Run the op, and look at its outputs (and at what an in-place op overwrites)."""
        info = self._info.get(func)
        if info is None:
            try:
                info = self._info[func] = _op_info(func)
            except Exception:  # noqa: BLE001 - an op without a schema: passed on
                return func(*args, **kwargs)
        if info.skip:
            return func(*args, **kwargs)
        before: list[tuple[Any, Any, Any]] | None = None
        if info.reads_written:
            try:
                before = self._before(info, args, kwargs)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        out = func(*args, **kwargs)
        if not self.checking:
            return out
        try:
            outs = _leaves(out)
            if info.writes:
                seen = {id(t) for t in outs}
                outs += [t for t in self._written(info, args, kwargs) if id(t) not in seen]
            if info.nondeterministic and outs and outs[0].device.type == "cuda":
                self.nondeterministic.add(info.base)
            bad = [t for t in outs if not _finite(t)]
            if bad:
                self._event(func, info, args, kwargs, outs, bad, before)
        except Exception as exc:  # noqa: BLE001 - the op ran; the search stops, the script goes on
            self._fail(exc)
        return out

    def _written(self, info: _OpInfo, args: Any, kwargs: Mapping[str, Any]) -> list[Any]:
        out = []
        for i, name in info.writes:
            out += _leaves(args[i] if i < len(args) else kwargs.get(name))
        return out

    def _before(self, info: _OpInfo, args: Any, kwargs: Mapping[str, Any]) -> list[tuple[Any, Any, Any]]:
        """What an in-place op is about to overwrite: (tensor, (NaN, Inf) it holds or None where finite, a host
        copy where it is small enough)."""
        written = [t for i, name in info.writes if name not in info.out_args
                   for t in _leaves(args[i] if i < len(args) else kwargs.get(name))]
        total = sum(t.numel() for t in written)
        out = []
        for t in written:
            ok = _finite(t)
            out.append((t, None if ok else _counts(t),
                        _host_copy(t) if total <= COPY_MAX and _checked(t) else None))
        return out

    def _event(self, func: Any, info: _OpInfo, args: Any, kwargs: Mapping[str, Any], outs: list[Any],
               bad: list[Any], before: list[tuple[Any, Any, Any]] | None) -> None:
        """An op's output holds a NaN or Inf: made here, followed from an input, or come from outside."""
        part = running_in(sys._getframe(1), skip=_HERE)
        if part == "accelport":
            return  # accelport's own reads (the step checks): not the script's
        overwritten = {id(t): held for t, held, _ in before or ()}
        # What an op overwrites whole (copy_, fill_, an out= tensor) is none of its inputs.
        replaced = set() if info.reads_written else {id(t) for t in self._written(info, args, kwargs)}
        inputs = [t for t in self._inputs(info, args, kwargs) if id(t) not in replaced]
        in_nan = in_inf = False
        taints = []
        for t in inputs:
            if id(t) in overwritten:
                held = overwritten[id(t)]
                if held is None:
                    continue  # it was finite before the op wrote it
                has_nan, has_inf = held
            elif _finite(t):
                continue
            else:
                has_nan, has_inf = _counts(t)
            in_nan, in_inf = in_nan or has_nan, in_inf or has_inf
            if t in self._taint:
                taints.append(self._taint[t])
        scalar_nan, scalar_inf = _scalars(args, kwargs)
        out_nan = out_inf = False
        for t in bad:
            has_nan, has_inf = _counts(t)
            out_nan, out_inf = out_nan or has_nan, out_inf or has_inf
        if taints:
            index = min(taints)  # what an earlier op made, carried on (a NaN made of its Inf too)
        elif out_nan and not in_nan:
            made = "NaN and Inf" if out_inf and not (in_inf or scalar_inf) else "NaN"
            index = self._candidate("op", func, info, args, kwargs, bad, before, made, part)
        elif out_inf and not out_nan and not (in_nan or in_inf or scalar_inf):
            index = self._candidate("op", func, info, args, kwargs, bad, before, "Inf", part)
        elif out_nan and in_nan:
            nan_made = [i for i, c in enumerate(self._candidates) if "NaN" in c.origin.made]
            if nan_made:
                index = nan_made[0]  # a NaN the checks lost track of: the step's first NaN
            elif part == "data":
                return  # the batch being loaded: the check of the batch names it
            else:
                index = self._candidate("input" if self._bad_input else "entered", func, info, args, kwargs, bad,
                                        before, "NaN", part, inputs=inputs)
        else:
            return  # an Inf from an Inf (a -inf mask, meant): followed only where a NaN is made of it
        for t in bad:
            self._taint[t] = index

    def _inputs(self, info: _OpInfo, args: Any, kwargs: Mapping[str, Any]) -> list[Any]:
        out = []
        for value in args:
            out += _leaves(value)
        for name, value in kwargs.items():
            if name not in info.out_args:
                out += _leaves(value)
        return out

    def _candidate(self, kind: str, func: Any, info: _OpInfo, args: Any, kwargs: Mapping[str, Any],
                   bad: list[Any], before: list[tuple[Any, Any, Any]] | None, made: str, part: str,
                   inputs: Sequence[Any] = ()) -> int:
        """Keep an op that made (or first met) a NaN or Inf; its index among this step's candidates."""
        if len(self._candidates) >= MAX_CANDIDATES:
            return len(self._candidates) - 1
        import torch

        frame = sys._getframe(2)
        node: Any = torch._C._current_autograd_node()
        tag = node.metadata.get(_TAG) if node is not None else None
        direction = {"data": "data loading", "optimizer": "optimizer", "clipping": "gradient clipping"}.get(part)
        direction = "backward" if node is not None else direction or "forward"
        site = user_site(frame)
        module = _module_path(self._modules) if direction in ("forward", "data loading") else ""
        node_name = forward_op = forward_call = ""
        if node is not None:
            node_name = node.name().rpartition("::")[2]
            forward_op = _snake(node_name)
            if tag is not None:
                forward_call, tag_site, stack = tag
                site = tag_site or site
                module = _module_path(stack)
        index_in_list = self._bad_index(info, args, kwargs, bad)
        params: tuple[str, ...] = ()
        optimizer = ""
        if direction == "optimizer":
            written = self._written(info, args, kwargs)
            touched = [t for t in written if any(t is b for b in bad)] or bad
            params = _names(touched)
            optimizer = _optimizer_class(frame)
        detail = ""
        if kind == "input":
            detail = self._bad_input or ""
        elif kind == "entered":
            held = [t for t in inputs if not _finite(t)]
            params = _names(held) if any(isinstance(t, torch.nn.Parameter) for t in held) else ()
            if params:
                detail = f"the weights {', '.join(params)} held NaN when step {self.step + 1} began"
            elif held:
                detail = (f"a tensor of shape {tuple(held[0].shape)} that no checked operation made held NaN "
                          "(data the loop read itself, or a tensor made before the checked steps)")
        origin = Origin(
            self.step + 1, kind, info.name, direction, node_name, forward_op, forward_call, module, site, made,
            self._facts(info, args, kwargs, before, index_in_list), tuple(facts(f"output {i}", t)
                                                                         for i, t in enumerate(bad[:2])),
            params, optimizer, str(bad[0].dtype).replace("torch.", ""), detail)
        candidate = _Candidate(origin)
        if kind == "op":
            self._keep_inputs(candidate, func, info, args, kwargs, before, index_in_list)
        self._candidates.append(candidate)
        return len(self._candidates) - 1

    def _bad_index(self, info: _OpInfo, args: Any, kwargs: Mapping[str, Any], bad: list[Any]) -> int | None:
        """For a foreach op (lists of tensors): the place in its lists of the first non-finite output."""
        if not info.base.startswith(("_foreach_", "_fused_")):
            return None
        lists = [v for v in (*args, *kwargs.values()) if isinstance(v, (list, tuple)) and v]
        results = _leaves(list(self._written(info, args, kwargs))) if info.writes else []
        for candidates in (results, *lists):
            for i, t in enumerate(candidates):
                if any(t is b for b in bad):
                    return i
        return None

    def _narrow(self, value: Any, index: int | None, length: int | None) -> Any:
        if index is not None and isinstance(value, (list, tuple)) and len(value) == length:
            return [value[index]]
        return value

    def _facts(self, info: _OpInfo, args: Any, kwargs: Mapping[str, Any],
               before: list[tuple[Any, Any, Any]] | None, index: int | None) -> tuple[TensorFacts, ...]:
        """Its tensor inputs as they were when it ran (an overwritten one from its copy)."""
        import torch

        copies = {id(t): copy for t, _, copy in before or ()}
        length = self._list_length(args, kwargs, index)
        out: list[TensorFacts] = []
        named = [*zip(info.names, args, strict=False), *((k, v) for k, v in kwargs.items() if k not in info.out_args)]
        for name, value in named:
            value = self._narrow(value, index, length)
            items = [(name, value)] if isinstance(value, torch.Tensor) else \
                [(f"{name}[{index if index is not None else i}]", v) for i, v in enumerate(value)
                 if isinstance(v, torch.Tensor)] if isinstance(value, (list, tuple)) else []
            for label, t in items:
                if len(out) >= MAX_FACTS:
                    return tuple(out)
                copy = copies.get(id(t))
                out.append(facts(label, copy if copy is not None else t))
        return tuple(out)

    def _list_length(self, args: Any, kwargs: Mapping[str, Any], index: int | None) -> int | None:
        if index is None:
            return None
        lengths = [len(v) for v in (*args, *kwargs.values()) if isinstance(v, (list, tuple)) and len(v) > index]
        return max(lengths) if lengths else None

    def _keep_inputs(self, candidate: _Candidate, func: Any, info: _OpInfo, args: Any, kwargs: Mapping[str, Any],
                     before: list[tuple[Any, Any, Any]] | None, index: int | None) -> None:
        """The repro's call and its tensors, copied to the host as they were when the op ran."""
        copies = {id(t): copy for t, _, copy in before or () if copy is not None or _checked(t)}
        length = self._list_length(args, kwargs, index)
        refs: dict[int, int] = {}
        tensors: list[Any] = []
        try:
            positional = [_literal(self._narrow(v, index, length), refs, tensors) for v in args]
            named = [f"{k}={_literal(self._narrow(v, index, length), refs, tensors)}" for k, v in kwargs.items()]
            results = ""
            if info.writes:
                written = [self._narrow(args[i] if i < len(args) else kwargs.get(name), index, length)
                           for i, name in info.writes]
                results = ", ".join(("*" if isinstance(w, (list, tuple)) else "") + _literal(w, refs, tensors)
                                    for w in written)
        except TypeError as exc:
            candidate.problem = str(exc)
            return
        missing = [t for t in tensors if id(t) in copies and copies[id(t)] is None]
        if missing:
            candidate.problem = (f"it overwrote {sum(t.numel() for t in missing)} values in place, more than the "
                                 f"{COPY_MAX} a checked step copies before an in-place op")
            return
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size > REPRO_MAX_BYTES:
            candidate.problem = (f"its inputs hold {size >> 20} MiB, more than the {REPRO_MAX_BYTES >> 20} MiB a "
                                 "repro keeps")
            return
        names = [*info.name.split("."), *kwargs]
        if not all(isinstance(n, str) and n.isidentifier() and not keyword.iskeyword(n) for n in names):
            candidate.problem = f"its name or an argument's ({info.name!r}) cannot be written in a script"
            return
        candidate.tensors = [copies[id(t)] if id(t) in copies else _host_copy(t) for t in tensors]
        candidate.call = f"torch.ops.{info.name}({', '.join([*positional, *named])})"
        candidate.results = results

    def _input(self, batch: Any) -> None:
        """The input batch holds a NaN or Inf: a candidate of its own, the tensors that hold it followed."""
        import torch

        from accelport.observe.numerics import batch_tensors

        described = []
        held = []
        for name, t in batch_tensors(batch):
            if not _checked(t) or t.device.type != "cpu" or _finite(t):
                continue
            bad = ~torch.isfinite(t.detach())
            rows = bad.reshape(bad.shape[0], -1).any(1).nonzero() if t.dim() else None
            sample = f", sample {int(rows[0])} of {t.shape[0]}" if rows is not None and len(rows) else ""
            described.append(f"{name}{sample}: {int(bad.sum())} of {t.numel()} values are NaN or Inf")
            held.append(t)
        if not held or len(self._candidates) >= MAX_CANDIDATES:
            return
        self._bad_input = "; ".join(described)
        origin = Origin(self.step + 1, "input", made="NaN or Inf", site=user_site(sys._getframe(1)),
                        detail=self._bad_input)
        self._candidates.append(_Candidate(origin))
        for t in held:
            self._taint[t] = len(self._candidates) - 1

    def _tag(self, func: Any, out: Any) -> None:
        """Write this torch call's site (its name, the user's line, the running modules) into the autograd nodes
        its outputs hold that no earlier call tagged (a backward op is then placed by the node it runs for)."""
        try:
            nodes = [t.grad_fn for t in _leaves(out) if t.grad_fn is not None]
            tag = None
            while nodes:
                node = nodes.pop()
                metadata = node.metadata
                if _TAG in metadata or "AccumulateGrad" in node.name():
                    continue
                if tag is None:
                    tag = (_call_name(func), user_site(sys._getframe(1)), tuple(self._modules))
                metadata[_TAG] = tag
                nodes.extend(n for n, _ in node.next_functions if n is not None)
        except Exception:  # noqa: BLE001 - a subclass without grad_fn or metadata: that call is not placed
            return

    # -- the repro ------------------------------------------------------------------------------------
    def _write_repro(self, origin: Origin, candidate: _Candidate) -> Origin:
        """Write the op's inputs (torch.save) and a script that runs the op on them on cpu.

        Both are new files: a name that is taken (a file of the user's, an earlier repro, a symlink
        planted there) is left as it is and the next name is tried (``accelport-nan-step7-2.py``).
        """
        if candidate.tensors is None:
            return replace(origin, repro_problem=f"no repro: {candidate.problem or 'its inputs were not kept'}")
        import torch

        from accelport.errors import AccelportError
        from accelport.safe_io import write_new

        base = f"accelport-nan-step{origin.step}"
        try:
            os.makedirs(self.directory, exist_ok=True)
            buffer = io.BytesIO()
            torch.save(candidate.tensors, buffer)
            tensors = buffer.getvalue()
            for n in range(1, REPRO_NAMES + 1):
                stem = base if n == 1 else f"{base}-{n}"
                script = os.path.join(self.directory, stem + ".py")
                data = os.path.join(self.directory, stem + ".pt")
                if not write_new(data, tensors, what="the repro's tensors"):
                    continue
                source = _script(origin, candidate, os.path.basename(data), self._redactor()).encode("utf-8")
                if write_new(script, source, what="the repro"):
                    return replace(origin, repro=(script, data))
                os.unlink(data)  # (written here a moment ago: its script's name is taken)
        except (OSError, AccelportError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return replace(origin, repro_problem=(f"the repro could not be written in {self.directory} ({why}); "
                                                  f"give {self.option} a directory that can be written"))
        return replace(origin, repro_problem=(f"no repro: {self.directory} already holds {base}.py to "
                                              f"{base}-{REPRO_NAMES}.py (a repro is never written over a file); "
                                              f"remove those or give {self.option} another directory"))

    def _redactor(self) -> Redactor:
        from accelport.redact import Redactor

        return self.redactor if self.redactor is not None else Redactor(os.environ)


def _forked(ref: weakref.ReferenceType[NanSearch]) -> None:
    """In a process the script forked (a DataLoader worker): its copy of the modes passes every op on."""
    search = ref()
    if search is not None:
        search.checking = False
        search._finished = True


def _nan_free(batch: Any) -> bool:
    from accelport.observe.numerics import check_batch

    return check_batch(batch) is None


def _scalars(args: Any, kwargs: Mapping[str, Any]) -> tuple[bool, bool]:
    """(a NaN, an infinity) among an op's number arguments (``masked_fill(mask, -inf)``'s value)."""
    nan = inf = False
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for v in items:
            if isinstance(v, float) and not math.isfinite(v):
                nan, inf = nan or math.isnan(v), inf or math.isinf(v)
    return nan, inf


def _names(tensors: Sequence[Any]) -> tuple[str, ...]:
    """The parameters' names among ``tensors`` (their module paths), the first three."""
    from accelport.observe.numerics import param_names

    names = param_names(tensors)
    return tuple(names[id(t)] for t in tensors if id(t) in names)[:3]


def _call_name(func: Any) -> str:
    """``torch.sqrt`` or ``Tensor.norm``: the torch call a TorchFunctionMode was handed."""
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    name = qualname.rpartition(".")[2]
    if qualname.startswith(("Tensor.", "TensorBase.")):
        return f"Tensor.{name}"
    if qualname.startswith("_VariableFunctionsClass."):
        return f"torch.{name}"
    module = getattr(func, "__module__", None) or "torch"
    for private, public in (("torch._C._nn", "torch.nn.functional"), ("torch._C._linalg", "torch.linalg"),
                            ("torch._C._special", "torch.special"), ("torch._C._fft", "torch.fft")):
        if module == private:
            module = public
    return f"{module}.{qualname}" if module.startswith("torch") else qualname


def _optimizer_class(frame: Any) -> str:
    """The class of the optimizer whose step is running (from its ``step`` frame)."""
    while frame is not None:
        if (frame.f_globals.get("__name__") or "").startswith("torch.optim") and "self" in frame.f_locals:
            owner = frame.f_locals["self"]
            if hasattr(owner, "param_groups"):
                return type(owner).__name__
        frame = frame.f_back
    return ""


def _script(origin: Origin, candidate: _Candidate, data: str, redactor: Redactor) -> str:
    """The repro: a few lines of plain Python and torch that run the op on its saved inputs on cpu.

    What the run named (the op, the module path and class, the script's path) is only in comments,
    through ``redactor``: no credential (a token in the script's path) and no line break or control
    character (a class named with a newline) that would end the comment and start code. Strings in
    the code are ``repr()``'s; the op's call is made of names checked to be identifiers.
    """
    text = redactor.text
    where = f", {origin.site[0]}:{origin.site[1]}" if origin.site else ""
    module = f", {origin.module}" if origin.module else ""
    backward = f" of {origin.forward_op}" if origin.forward_op else ""
    after = f"out = [{candidate.results}]\n" if candidate.results else ""
    return (
        f"# The first operation that made a NaN or Inf, found by accelport's --find-nan: {text(origin.op)}"
        f" at step\n# {origin.step} ({text(f'{origin.direction}{backward}{module}{where}')}).\n"
        f"# Its inputs, as they were, are in {text(data)}; this runs it on cpu: "
        f"python {text(data[:-3])}.py\n"
        "import os\n\nimport torch\n\n"
        f"t = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), {data!r}), weights_only=True)\n"
        "print(f\"inputs: {sum(int(x.isnan().sum()) for x in t)} NaN, {sum(int(x.isinf().sum()) for x in t)} Inf\")\n"
        f"out = {candidate.call}\n"
        f"{after}"
        "for i, x in enumerate(out if isinstance(out, (list, tuple)) else [out]):\n"
        "    if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):\n"
        "        bad = \"finite\" if bool(x.isfinite().all()) else \"NOT FINITE\"\n"
        "        print(f\"output {i} {tuple(x.shape)} {x.dtype}: {int(x.isnan().sum())} NaN, \"\n"
        "              f\"{int(x.isinf().sum())} Inf of {x.numel()} values: {bad}\")\n"
    )
