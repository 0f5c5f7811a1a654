"""``non-finite`` (a problem): the loss or the gradients became NaN or Inf, with where it came from.

What was found, and where, comes from the step checks (:mod:`accelport.observe.numerics`);
this rule says it, with the fix for its source, and how to search for the operation that
made it. Where the run searched (:mod:`accelport.observe.nan_search`), it says the
operation, its pass, module and line, its inputs, the fix for that op's family and the repro.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

from accelport.contract import StepRecord
from accelport.diagnose import advice
from accelport.diagnose.rule import Rule
from accelport.errors import DiagnosticWarning

if TYPE_CHECKING:
    from accelport.observe.nan_search import NanSearch, Origin

__all__ = ["NonFiniteRule", "NonFiniteWarning", "fix", "op_fix"]


class NonFiniteWarning(DiagnosticWarning):
    """The loss or the gradients became NaN or Inf."""


def fix(source: str, style: str) -> str:
    """The fix for a non-finite value from ``source`` (see NonFinite.source), in the script's terms."""
    overflow = advice.overflow(style)
    return {
        "input": ("Bad data: check the dataset for NaN/Inf (torch.isfinite(x).all() per sample) and "
                  "drop or repair those samples."),
        "loss": f"A learning rate too high, or a loss that overflows. {overflow}",
        "gradient": ("An op whose backward is not finite at these values (sqrt, log or a division at 0: add an "
                     f"eps), or a learning rate too high. {overflow}"),
        "gradients": f"The inputs were finite, so the loss or a gradient overflowed. {overflow}",
        # The inputs were not looked at (no loader accelport sees brought them): they come first,
        # as likely as the loss and far cheaper to rule out.
        "unknown": ("Check the inputs first: torch.isfinite(x).all() on each batch (or load them through a "
                    f"DataLoader, or ap.loader, which accelport checks); if they are finite: {overflow}"),
        "update": ("The update overflowed the weight's dtype: lower the learning rate, keep the weights in fp32 "
                   "(autocast for the forward pass), and clip gradients."),
    }[source]


class NonFiniteRule(Rule):
    """Says what the step checks found, on the records whose counters were read and when the run settles."""

    kind = "non-finite"
    severity = "problem"
    warning = NonFiniteWarning
    needs = frozenset({"numerics", "nan-search"})

    def start(self) -> None:
        self._last_step = 0

    def unjudged(self, steps: int) -> str | None:
        watch = self.run.numerics
        if watch is not None and steps and watch.low_precision_params is None:
            return "no optimizer step: the gradients were not checked"
        return None

    def step(self, record: StepRecord) -> None:
        self._last_step = record.step
        search = self.run.nan_search
        if record.delta or (search is not None and search.found is not None):
            self.settle()

    def totals(self) -> dict[str, Any]:
        watch = self.run.numerics
        found = watch.nonfinite if watch is not None else None
        if found is None:
            return {}
        return {"steps": self._last_step, "steps_after_it": max(self._last_step - found.step, 0)}

    def settle(self) -> None:
        watch = self.run.numerics
        found = watch.nonfinite if watch is not None else None
        if self.reported:
            return
        search = self.run.nan_search
        if search is not None:
            if found is not None and search.checking and found.step > search.step:
                return  # a step the search has not judged yet (its hook runs after diagnose's): said at the next
            origin = search.found
            if origin is None and found is not None:
                origin = search.transient_at(found.step)  # the op the search saw where the step checks found it
            # (an exact earlier step from the step checks: the search began after it)
            if origin is not None and (found is None or found.finite_at is not None or origin.step <= found.step):
                self._origin(origin, search)
                return
        if found is None or watch is None:
            return
        from accelport.observe.numerics import CHECK_EVERY_LAZY

        source = {"input": "it came from the input batch", "loss": "it came from the loss",
                  "gradient": "it came from a parameter's gradient",
                  "gradients": f"it showed in the {found.found_in}",
                  "update": "it came from the optimizer's update",
                  "unknown": f"it showed in the {found.found_in}, from an unknown source"}[found.source]
        if found.finite_at is None:
            when = f"at step {found.step}"
        else:  # accelerators and lazy backends read them apart, to keep the reads out of the steps
            if watch.every >= CHECK_EVERY_LAZY:  # (a pass's end reads there at most every few seconds)
                every = "every few hundred steps and at the end of a loop"
            else:
                every = f"every {watch.every} steps and at the end of each loop"
            when = (f"after step {found.finite_at} and by step {found.step} (on {watch.backend_name} they are "
                    f"read {every})")
        hint = self._search_hint(found.step, found.finite_at, found.source)
        self.report(
            f"the {found.found_in} became NaN or Inf {when}: {source} ({found.detail}). Every step "
            "after it trains on NaN.",
            found.step, fix=fix(found.source, self.run.style) + hint,
            first_step=found.step if found.finite_at is None else None, source=found.source,
            names=list(found.names), finite_at_step=found.finite_at, found_by_step=found.step,
        )

    # -- the search for the op ----------------------------------------------------------------------
    def _search_hint(self, step: int, finite_at: int | None, source: str) -> str:
        """How to find the op that made it: the rerun that searches (or why this run's search missed it)."""
        if source == "input":
            return ""  # nothing made it: the data held it
        first = finite_at + 1 if finite_at is not None else step
        search = self.run.nan_search
        if search is not None and search.problem:
            return f" The search for the operation that made it did not finish: {search.problem}."
        if search is not None and search.first_checked is not None and search.first_checked <= step:
            return (f" The search checked every operation from step {search.first_checked} and none made it: it "
                    "came from work torch does not dispatch in this thread (another thread, a DataLoader worker, a "
                    "C++ extension), so check those.")
        if self.run.command is not None:
            how = f"accelport diagnose --find-nan-from {first} {shlex.join(self.run.command)}"
        else:
            how = f"the script again with ACCELPORT_FIND_NAN={first} in its environment"
        began = f" (this run's search began at step {search.first_step}, after it)" if search is not None else ""
        return (f" To find the operation that made it, with its line and a repro, run {how}{began}: it checks every "
                f"operation from step {first}, about 10 times slower.{self._rerun()}")

    def _rerun(self) -> str:
        from accelport.observe.nan_search import reproducibility

        search = self.run.nan_search
        reasons = reproducibility(self.run.device_type, search.nondeterministic if search is not None else ())
        return f" A rerun may go wrong at another step: {'; '.join(reasons)}." if reasons else ""

    def _origin(self, origin: Origin, search: NanSearch) -> None:
        """Say what the search found: the op, its pass, module and line, its inputs, the fix and the repro."""
        at = f" at {origin.site[0]}:{origin.site[1]}" if origin.site else ""
        evidence = {"first_step": origin.step, "source": origin.kind, "names": list(origin.params),
                    "origin": origin.to_dict(), "checked_from": search.first_checked,
                    "sites": [f"{origin.site[0]}:{origin.site[1]}"] if origin.site else []}
        if origin.kind == "input":
            self.report(f"the first NaN or Inf was already in the input batch of step {origin.step}{at}: "
                        f"{origin.detail}. No operation made it, so none was searched.",
                        origin.step, fix=fix("input", self.run.style), **evidence)
            return
        if origin.kind == "entered":
            self.report(f"a NaN came into step {origin.step} from outside the checked operations, first read by "
                        f"{origin.op_name} in the {origin.direction} pass{at}: {origin.detail}.{self._rerun()}",
                        origin.step, fix=_entered_fix(origin, search), **evidence)
            return
        inputs = "; ".join(f.describe() for f in origin.inputs) or "no tensor inputs"
        made = {"Inf": "an Inf from finite inputs", "NaN": "a NaN from inputs without one",
                "NaN and Inf": "NaN and Inf from inputs without NaN"}.get(origin.made, origin.made)
        ended = "" if origin.confirmed else " (the run ended before that step's update)"
        self.report(
            f"{origin.op_name} made the first NaN or Inf at step {origin.step}, {_place(origin)}{at}: it made "
            f"{made}{ended} ({inputs}). Every step after it trains on NaN.{self._rerun()}{_lazy(search)}",
            origin.step, fix=f"{op_fix(origin, self.run.style)} {_repro(origin)}", **evidence)


def _place(origin: Origin) -> str:
    """'in the forward pass, in model.fc (Linear)', 'in the backward pass of sqrt (torch.sqrt, in model (Net))'."""
    module = f", in {origin.module}" if origin.module else ""
    if origin.direction == "backward":
        call = f"{origin.forward_call}, " if origin.forward_call else ""
        inside = f" ({call}in {origin.module})" if origin.module else (f" ({origin.forward_call})" if call else "")
        return f"in the backward pass of {origin.forward_op or origin.node}{inside}"
    if origin.direction == "optimizer":
        names = f" of {', '.join(origin.params)}" if origin.params else ""
        return f"in the optimizer's update{names}{f' ({origin.optimizer})' if origin.optimizer else ''}"
    if origin.direction == "data loading":
        return f"while the data was loaded{module}"
    if origin.direction == "gradient clipping":
        return "in gradient clipping"
    return f"in the forward pass{module}"


def _repro(origin: Origin) -> str:
    if origin.repro:
        return f"A repro (plain python and torch, on cpu): python {origin.repro[0]}."
    return (origin.repro_problem or "No repro.").rstrip(".") + "."


def _lazy(search: NanSearch) -> str:
    if not search.lazy:
        return ""
    return (f" On {search.backend_name or 'this backend'} the checked steps ran op by op, a sync per checked "
            "tensor.")


def _entered_fix(origin: Origin, search: NanSearch) -> str:
    if origin.params:
        return (f"The weights were already NaN when the checks began at step {search.first_checked}: the first NaN "
                "came earlier; search from an earlier step (the step the non-finite finding names without the "
                "search).")
    return ("Check what the loop reads that no DataLoader brings (torch.isfinite(x).all()), and the tensors it "
            "made before the checked steps.")


#: The fix for each op family: (op names, the fix). A backward op is judged by its forward op.
_FAMILIES: tuple[tuple[frozenset[str], str], ...] = (
    (frozenset({"log", "log2", "log10", "log1p", "xlogy", "special_xlog1py", "special_entr", "logit",
                "binary_cross_entropy"}),
     "Clamp before log: torch.log(x.clamp_min(1e-6)); better, the fused form: F.log_softmax instead of "
     "log(softmax), F.logsigmoid instead of log(sigmoid), F.binary_cross_entropy_with_logits on the logits."),
    (frozenset({"sqrt", "rsqrt"}),
     "sqrt of a negative, or of 0 in the backward pass (its gradient there is 1/(2*sqrt(0)) = Inf): "
     "torch.sqrt(x.clamp_min(1e-12)) or torch.sqrt(x + 1e-12); for a norm, torch.linalg.vector_norm (its "
     "gradient at 0 is 0) or F.normalize(x, eps=1e-12)."),
    (frozenset({"div", "div_", "reciprocal", "remainder", "fmod", "floor_divide", "linalg_vector_norm", "norm",
                "renorm", "cdist", "cosine_similarity", "std", "var"}),
     "A division by 0 (a norm or a count that reached 0): an eps in the norm, x / (x.norm(dim=-1, keepdim=True) "
     "+ 1e-6) or F.normalize(x, eps=1e-12); count.clamp_min(1) before dividing by a count."),
    (frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "logsumexp",
                "_scaled_dot_product_attention_math", "scaled_dot_product_attention",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"}),
     "A row whose every entry is masked with -inf (softmax over all -inf is 0/0): fill the mask with "
     "torch.finfo(scores.dtype).min instead of float('-inf'), or keep one position of each row unmasked; "
     "compute the attention scores in fp32 with ap.autocast."),
    (frozenset({"acos", "asin", "atanh", "acosh", "erfinv", "lgamma", "digamma", "polygamma", "pow"}),
     "An input outside the op's domain: clamp it first (x.clamp(-1 + 1e-6, 1 - 1e-6) for acos, asin and atanh; "
     "x.clamp_min(eps) before a fractional power)."),
)
_LOW = ("bfloat16", "float16")


def op_fix(origin: Origin, style: str = "accelport") -> str:
    """The fix for the family of the op that made the first NaN or Inf (a backward op: its forward op's), with
    autocast spelled as the script (``style``) would."""
    autocast = "ap.autocast" if style == "accelport" else "torch.autocast"
    if origin.direction == "optimizer":
        return ("The update itself overflowed: lower the learning rate (or warm it up), clip gradients with "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) before the step, and keep the weights "
                "and the optimizer's state in fp32.")
    name = origin.forward_op if origin.direction == "backward" and origin.forward_op else origin.op_name
    base = name.rpartition("::")[2].rstrip("_") if not name.endswith("__") else name
    for family, family_fix in _FAMILIES:
        if base in family or base.lstrip("_") in family:
            return family_fix.replace("ap.autocast", autocast)
    if origin.dtype in _LOW or any(f.dtype in _LOW for f in origin.inputs):
        return (f"An overflow of {origin.dtype} (its largest value is 65504 in float16): compute this in fp32 with "
                f"{autocast} (autocast keeps softmax, losses and reductions in fp32), scale before the matmul "
                "(q * d ** -0.5 before q @ k.T), or use bfloat16 instead of float16.")
    if origin.made == "Inf":
        return ("An overflow: the values grew out of range: lower the learning rate, clip gradients "
                "(torch.nn.utils.clip_grad_norm_), normalise the activations (LayerNorm), subtract the max before "
                "exp (torch.logsumexp and softmax do).")
    return ("The op is undefined at these inputs (see their range above): keep its inputs in its domain (clamp), "
            "or add an eps where it divides.")
