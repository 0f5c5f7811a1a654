"""How much of the chip a step uses: its model FLOPs, counted once per step signature, and the MFU.

A :class:`FlopWatch` counts the FLOPs of one sampled step per batch signature (a new input shape
is counted again; at most :attr:`FlopWatch.MAX_SIGNATURES` of them), never every step. The count
starts when the step's batch arrives (or, in a loop without a loader accelport sees, at the end of
the step before) and ends at the end of its optimizer step, in the training loop's thread.

The count is a pass-through dispatch mode that runs every operator as it is and adds its FLOPs by
``torch.utils.flop_counter``'s formulas (FlopCounterMode's registry), with formulas of its own for the
operators the registry does not know (CPU's ``_scaled_dot_product_flash_attention_for_cpu``, which
``F.scaled_dot_product_attention`` runs on the host, is counted 0 by FlopCounterMode of torch 2.9 to 2.13).
FlopCounterMode itself is not used, for what it does to the run it counts:

- under ``torch.compile`` a dispatch mode on the stack makes dynamo skip the frame and run it eagerly
  (``convert_frame``: "non-infra torch dispatch mode present"), so the counted step would neither compile
  nor recompile, and its ModuleTracker sets global module hooks that torch warns about. This mode says
  ``ignore_compile_internals``: dynamo compiles as in any run, and the compiled code's matmuls and
  convolutions (inductor's extern kernels: ``aten.addmm.out``, ``aten.mm.out``) still dispatch through
  it, so a compiled step counts the FLOPs its eager twin does (measured on cpu, torch 2.13);
- on XLA it decomposes the operators it has no formula for, which changes the traced graph (one more
  compilation per counted signature, measured on XLA:CPU). Nothing in torch_xla counts the FLOPs of a
  lowered graph (its Python bindings, 2.9, offer the HLO text and the runtime's counters, no cost
  analysis), so the count is of the operators as they are traced (source ``"flop_counter:xla_trace"``).

With the matmuls it also notes, for the step's forward pass, the dtype they run in and their
dimensions, so that :func:`efficiency` can say why the MFU is low. Nothing here imports torch
until a step is counted (torch is imported by then).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FlopWatch", "StepCount", "efficiency", "EFFICIENCY_KEYS", "SOURCE_EAGER", "SOURCE_LAZY"]

SOURCE_EAGER = "flop_counter"
SOURCE_LAZY = "flop_counter:xla_trace"
#: The keys of diagnose --output's ``efficiency`` object (``accelport compare`` reads them).
EFFICIENCY_KEYS = ("flops_per_step", "achieved_flops", "mfu", "peak_flops", "peak_dtype", "chip", "flops_source",
                   "causes")

#: torch dtype name -> the matrix's dtype key for peaks.
_DTYPE_KEYS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8",
               "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8", "int8": "int8"}
#: Operators whose forward calls show the model's dimensions: (the packet's name, where its operands are).
_MATMULS = ("mm", "addmm", "convolution", "_convolution", "convolution_overrideable", "_slow_conv2d_forward",
            "cudnn_convolution")
#: Below these a cause is not worth a line: the share of matmul FLOPs in float32, the share of the tiled
#: work that is padding, the share of a batch's positions that are padding.
FLOAT32_SHARE = 0.5
TILE_WASTE = 0.10
PAD_SHARE = 0.20


@dataclass
class StepCount:
    """What one counted step did: its FLOPs, its matmul FLOPs by dtype, its forward matmuls' dimensions."""

    flops: int = 0
    #: Matmul and convolution FLOPs (forward and backward) by dtype key ("fp32", "bf16").
    by_dtype: dict[str, int] = field(default_factory=dict)
    #: The forward pass's matmuls and convolutions: (rows, inner, cols, flops), rows being batch x positions
    #: (a convolution's output pixels), inner and cols the model's dimensions (features, channels).
    forward: list[tuple[int, int, int, int]] = field(default_factory=list)
    #: The share of the batch's positions that are padding, as its attention mask says (None: no mask seen).
    padding: float | None = None
    source: str = SOURCE_EAGER


def _dims(name: str, args: tuple[Any, ...]) -> tuple[int, int, int] | None:
    """(rows, inner, cols) of a forward matmul or convolution from its operands, or None."""
    try:
        if name == "mm":
            a, b = args[0], args[1]
        elif name == "addmm":
            a, b = args[1], args[2]
        else:  # a convolution: (input, weight, ...): rows are the output positions, as the GEMM it lowers to
            x, w = args[0], args[1]
            cout, cin_g = int(w.shape[0]), int(w.shape[1])
            kernel = math.prod(int(d) for d in w.shape[2:])
            rows = int(x.shape[0]) * math.prod(int(d) for d in x.shape[2:])
            return rows, cin_g * kernel, cout
        if a.dim() != 2 or b.dim() != 2:
            return None
        return int(a.shape[0]), int(a.shape[1]), int(b.shape[1])
    except Exception:  # noqa: BLE001 - an operand of a kind not foreseen: no dimensions, still counted
        return None


class _Notes:
    """What the counting formulas saw besides the FLOPs: matmul FLOPs by dtype, the forward's dimensions."""

    def __init__(self, current_node: Callable[[], Any] | None) -> None:
        self.count = StepCount()
        self._node = current_node

    def saw(self, name: str, args: tuple[Any, ...], flops: int) -> None:
        a = args[1] if name == "addmm" else args[0]
        dtype = _DTYPE_KEYS.get(str(getattr(a, "dtype", "")).replace("torch.", ""), "other")
        by = self.count.by_dtype
        by[dtype] = by.get(dtype, 0) + flops
        if name in _MATMULS and (self._node is None or self._node() is None):  # (None: not in a backward)
            dims = _dims(name, args)
            if dims is not None:
                self.count.forward.append((*dims, flops))


def _cpu_sdpa_formulas(torch: Any, fc: Any) -> dict[Any, Callable[..., int]]:
    """Formulas for the host's attention kernels, which FlopCounterMode's registry leaves out."""
    out: dict[Any, Callable[..., int]] = {}
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    count, count_bw = getattr(fc, "sdpa_flop_count", None), getattr(fc, "sdpa_backward_flop_count", None)
    if fwd is not None and count is not None:
        out[fwd] = lambda q, k, v, *a, out_val=None, **kw: count(q.shape, k.shape, v.shape)
    if bwd is not None and count_bw is not None:
        out[bwd] = lambda g, q, k, v, *a, out_val=None, **kw: count_bw(g.shape, q.shape, k.shape, v.shape)
    return out


def _formulas(notes: _Notes) -> dict[Any, Callable[..., int]]:
    """Every formula, each taking the raw operands (the registry's are wrapped to pass shapes already);
    the matmuls' note what they saw."""
    import torch
    import torch.utils.flop_counter as fc

    registry: dict[Any, Callable[..., int]] = {**fc.flop_registry, **_cpu_sdpa_formulas(torch, fc)}
    noted = {getattr(torch.ops.aten, n, None) for n in (*_MATMULS, "bmm", "baddbmm")}
    out: dict[Any, Callable[..., int]] = {}
    for packet, formula in registry.items():
        if packet not in noted:
            out[packet] = formula
            continue
        name = getattr(packet, "__name__", str(packet)).split(".")[-1]

        def raw(*args: Any, _f: Callable[..., int] = formula, _n: str = name, out_val: Any = None,
                **kwargs: Any) -> int:
            flops = int(_f(*args, out_val=out_val, **kwargs))
            notes.saw(_n, args, flops)
            return flops

        out[packet] = raw
    return out


class _Counting:
    """One step being counted: the pass-through mode, entered in one thread."""

    def __init__(self, lazy: bool, signature: Any) -> None:
        import torch

        self.signature = signature
        self.thread = threading.get_ident()
        self.notes = _Notes(getattr(torch._C, "_current_autograd_node", None))
        self.notes.count.source = SOURCE_LAZY if lazy else SOURCE_EAGER
        self.mode = _trace_mode(_formulas(self.notes))
        self.mode.__enter__()

    def close(self) -> StepCount:
        self.mode.__exit__(None, None, None)
        count = self.notes.count
        count.flops = int(self.mode.total)
        return count


def _trace_mode(formulas: Mapping[Any, Callable[..., int]]) -> Any:
    """A dispatch mode that runs every operator as it is and adds its FLOPs by the formulas."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Trace(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            # (dynamo compiles with this mode on the stack, as without it: see the module's docstring)
            return True

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = formulas.get(getattr(func, "_overloadpacket", None))
            if formula is not None:
                try:
                    self.total += int(formula(*args, out_val=out, **kwargs))
                except Exception:  # noqa: BLE001 - an operand the formula cannot read: the op counts 0
                    pass
            return out

    return _Trace()


def _mask_padding(batch: Any) -> float | None:
    """The share of positions an attention mask in ``batch`` marks as padding; only a host tensor (reading a
    device tensor would make the step wait for the device)."""
    mask = None
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
    else:
        mask = getattr(batch, "attention_mask", None)
    if mask is None or getattr(getattr(mask, "device", None), "type", None) != "cpu" or mask.dim() < 2:
        return None
    total = mask.numel()
    if not total:
        return None
    return 1.0 - float((mask != 0).sum()) / total


class FlopWatch:
    """Counts a step's FLOPs once per batch signature; :meth:`summary` says the FLOPs per step of the run."""

    #: Signatures counted at most: a run whose every batch has a new shape is not counted every step.
    MAX_SIGNATURES = 16
    _NONE = ("no loader",)  # the signature of a loop whose batches accelport does not see

    def __init__(self, lazy: bool) -> None:
        self.lazy = lazy
        #: Each counted signature's step.
        self.counts: dict[Any, StepCount] = {}
        self._active: _Counting | None = None
        self._last: Any = None
        self._known = False  # the last signature has a count
        self._loader = False  # batches come through a loader accelport sees
        self._skip: set[Any] = set()  # signatures of batches no optimizer step followed (an evaluation's)
        self._broken = False  # a mode could not be entered or left: counting stops for the run
        #: Why no FLOPs were counted, when that is so (a mode that failed).
        self.problem: str | None = None

    # -- the tracker's boundaries (the training loop's thread) ----------------------------------------------
    def batch(self, signature: Any, batch: Any = None) -> bool:
        """A batch arrived: the step starts; count it if its signature is new.

        Returns whether the boundaries of steps with this signature need not be told until another signature
        comes or :meth:`pause` (no count is open and none will start for it): the tracker's hot path."""
        self._loader = True
        if self._active is not None:
            return False
        if (signature is self._last and self._known) or self._settled(signature):
            return True
        self._start(signature)
        if self._active is not None and batch is not None:
            try:
                self._active.notes.count.padding = _mask_padding(batch)
            except Exception:  # noqa: BLE001 - a mask of a kind not foreseen: no padding share
                pass
        return self._active is None

    def step_end(self, signature: Any) -> bool:
        """An optimizer step ended (its batch had ``signature``: None where no batch came through a loader).
        Returns what :meth:`batch` does."""
        if signature is not None:
            self._loader = True  # (the first batch may have come before this watch: the run starts at a step's end)
        active = self._active
        if active is not None:
            if threading.get_ident() != active.thread:
                return False
            self._active = None
            try:
                count = active.close()
            except Exception as exc:  # noqa: BLE001 - the mode stack was changed under it: stop counting
                self._stop(exc)
                return True
            if self._loader and active.signature != signature:
                # The count began with another batch (an evaluation's, between the steps): it is not a step's.
                self._skip.add(active.signature)
            else:
                self.counts[active.signature] = count
            self._last = None  # (its signature is known now: looked up again below)
        key = signature if self._loader else self._NONE
        if key is not self._last:  # (a loader hands equal signatures as one object: one lookup per change)
            self._last, self._known = key, key in self.counts
        if not self._loader and not self._broken and self._NONE not in self.counts and active is None:
            self._start(self._NONE)  # no batches seen: count the next step, from this step's end
        return self._active is None and (self._known or self._settled(key))

    def _settled(self, signature: Any) -> bool:
        """No count will start for ``signature``: counted, left out, or counting stopped."""
        return self._broken or signature in self.counts or len(self.counts) >= self.MAX_SIGNATURES \
            or signature in self._skip

    def pause(self) -> None:
        """The loop left its steps (its end, ap.diagnostics()): a partial count is dropped."""
        active = self._active
        if active is not None and threading.get_ident() == active.thread:
            self._active = None
            try:
                active.mode.__exit__(None, None, None)
            except Exception as exc:  # noqa: BLE001
                self._stop(exc)

    def _start(self, signature: Any) -> None:
        try:
            self._active = _Counting(self.lazy, signature)
        except Exception as exc:  # noqa: BLE001 - counting is a nicety: never in the way of a run
            self._stop(exc)

    def _stop(self, exc: BaseException) -> None:
        self._broken = True
        self._active = None
        self.problem = f"FLOPs not counted: {type(exc).__name__}: {exc}"[:300]

    # -- what the run's FLOPs were ------------------------------------------------------------------------
    def summary(self, steps: Mapping[Any, int] | None = None) -> StepCount | None:
        """The counted steps as one: FLOPs per step weighted by how many steps each signature ran (``steps``,
        by batch signature, None for steps without one: the tracker's ``steps_by_signature()``), the matmul
        dtypes and dimensions of the most common one; None before any step was counted."""
        if not self.counts:
            return None
        ran = steps or {}
        weights = {sig: max(ran.get(None if sig is self._NONE else sig, 1), 1) for sig in self.counts}
        common = max(self.counts, key=lambda s: weights[s])
        out = StepCount(source=self.counts[common].source)
        out.flops = round(sum(c.flops * weights[s] for s, c in self.counts.items()) / sum(weights.values()))
        out.by_dtype = dict(self.counts[common].by_dtype)
        out.forward = list(self.counts[common].forward)
        pads = [(c.padding, weights[s]) for s, c in self.counts.items() if c.padding is not None]
        if pads:
            out.padding = sum(p * w for p, w in pads) / sum(w for _, w in pads)
        return out


# -- efficiency: achieved FLOP/s, MFU and why it is low ---------------------------------------------------

def device_seconds(total: Mapping[str, float], steps: int, first: Mapping[str, float] | None = None) -> float | None:
    """Seconds of device time per step (after the first step where there are more): the ``device`` category,
    or a joined one holding it where the backend cannot tell it apart (then an upper bound)."""
    if steps <= 0:
        return None
    after = dict(total)
    judged = steps
    if first and steps > 1:
        for key, value in first.items():
            after[key] = max(after.get(key, 0.0) - value, 0.0)
        judged = steps - 1
    seconds = sum(v for k, v in after.items() if "device" in k.split("+"))
    return seconds / judged if seconds > 0 else None


def rate(value: float) -> str:
    """FLOP/s in the unit that reads best: ``5.3 MFLOP/s``, ``18.2 TFLOP/s``."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}FLOP/s"
    return f"{value:.3g} FLOP/s"


def efficiency(count: StepCount | None, seconds: float | None, peak: Any = None, *, chip: str | None = None,
               devices: int = 1) -> dict[str, Any]:
    """The ``efficiency`` object: FLOPs per step, achieved FLOP/s over ``seconds`` of device time per step,
    and with ``peak`` (a :class:`~accelport.compat.schema.PeakFact`, or None) the MFU and its causes.

    A step is one device's (one process's): where torch sees ``devices`` devices per chip (two NeuronCores
    of a Trainium, the two halves of a TPU7x), each has that share of the chip's peak."""
    out: dict[str, Any] = dict.fromkeys(EFFICIENCY_KEYS)
    out["causes"] = []
    out["chip"] = chip
    if count is None:
        return out
    out["flops_per_step"] = count.flops
    out["flops_source"] = count.source
    achieved = count.flops / seconds if seconds and count.flops else None
    out["achieved_flops"] = achieved
    if peak is None:
        return out
    out["chip"] = peak.title
    matmul = sum(count.by_dtype.values())
    dtype = max(count.by_dtype, key=lambda d: count.by_dtype[d]) if matmul else None
    peak_dtype = dtype if dtype in peak.tflops else peak.headline
    if peak_dtype is not None and peak_dtype in peak.tflops:
        out["peak_dtype"] = peak_dtype
        out["peak_flops"] = peak.tflops[peak_dtype] * 1e12 / max(devices, 1)
        if achieved is not None:
            out["mfu"] = achieved / out["peak_flops"]
    out["causes"] = causes(count, peak, dtype)
    return out


def causes(count: StepCount, peak: Any, dtype: str | None) -> list[dict[str, Any]]:
    """Why the step uses little of the chip, as far as the step shows: each with its number and its fix."""
    found: list[dict[str, Any]] = []
    matmul = sum(count.by_dtype.values())
    best = peak.headline
    fp32 = count.by_dtype.get("fp32", 0)
    if matmul and best and best != "fp32" and fp32 / matmul >= FLOAT32_SHARE:
        high, low = peak.tflops.get(best), peak.tflops.get("fp32")
        than = (f"{high / low:.0f}x its float32 peak ({low:g})" if high and low else
                "float32 has no published peak of its own")
        found.append({
            "kind": "float32", "share": fp32 / matmul,
            "text": f"the matmuls run in float32 ({fp32 / matmul:.0%} of their FLOPs) on a chip whose peak is "
                    f"{best}'s ({high:g} TFLOP/s, {than})",
            "fix": "run the forward pass in bfloat16: with ap.autocast(torch.bfloat16): loss = ... "
                   "(or torch.autocast(device_type, dtype=torch.bfloat16))"})
    tile = peak.tile
    forward = count.forward
    if tile and forward:
        work = sum(f for *_, f in forward)
        waste = 0.0
        odd: dict[int, None] = {}
        for _rows, inner, cols, flops in forward:
            padded = math.ceil(inner / tile) * tile * math.ceil(cols / tile) * tile
            share = 1.0 - inner * cols / padded
            if share > 0:
                waste += flops * share
                for d in (inner, cols):
                    if d % tile:
                        odd.setdefault(d)
        if work and waste / work >= TILE_WASTE:
            dims = sorted(odd)[:4]
            said = ", ".join(f"{d} (-> {math.ceil(d / tile) * tile})" for d in dims)
            found.append({
                "kind": "tile", "share": waste / work, "dims": dims, "tile": tile,
                "text": (f"matmul dimension {dims[0]} is not a multiple" if len(dims) == 1 else
                         f"matmul dimensions {', '.join(map(str, dims))} are not multiples")
                        + f" of {tile}, the {peak.tile_unit}'s tile: {waste / work:.0%} of the matmul work is padding",
                "fix": f"make hidden sizes, heads x head size and vocabulary multiples of {tile}: {said}"})
    if count.padding is not None and count.padding >= PAD_SHARE:
        found.append({
            "kind": "padding", "share": count.padding,
            "text": f"{count.padding:.0%} of the batch's positions are padding (its attention mask)",
            "fix": "batch samples of similar length (ap.data.LengthGroupedBatchSampler) and pad to a few bucket "
                   "lengths (ap.data.BucketCollate), or pack sequences"})
    if tile and forward:
        rows = max(r for r, *_ in forward)
        if rows < tile:
            found.append({
                "kind": "small-batch", "rows": rows, "tile": tile,
                "text": f"the batch is too small to fill the chip: the matmuls have {rows} rows (batch x positions) "
                        f"per device, fewer than the {peak.tile_unit}'s {tile}",
                "fix": f"give each device at least {tile} rows per step (a larger batch, scaling the learning rate), "
                       "or fewer devices"})
    return found


def verdict_text(eff: Mapping[str, Any]) -> str:
    """``at 9% of the TPU v5e's bf16 peak (18 of 197 TFLOP/s)``, or the achieved FLOP/s alone; "" if unknown."""
    achieved = eff.get("achieved_flops")
    if not achieved:
        return ""
    if eff.get("mfu") is not None:
        mfu = eff["mfu"]
        share = f"{mfu:.0%}" if mfu >= 0.01 else f"{mfu * 100:.1g}%"
        return (f"at {share} of the {eff['chip']}'s {eff['peak_dtype']} peak "
                f"({rate(achieved)} of {rate(eff['peak_flops'])})")
    return f"at {rate(achieved)}" + (f" (no published peak for {eff['chip']})" if eff.get("chip") else "")
