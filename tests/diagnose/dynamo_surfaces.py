"""What each dynamo surface the diagnosis reads gives, pinned per torch version.

The diagnosis of compiled functions reads dynamo's own records (see
accelport/observe/dynamo.py). A torch upgrade that changes one of them must fail
here, not silence a diagnosis: each check runs a tiny compiled function (backend
"eager": the records are dynamo's, whatever compiles the graphs) and asserts what
the surface holds. The default environment runs them on torch 2.13
(tests/diagnose/test_dynamo_surfaces.py), the xla one on torch 2.9
(tests/xla/test_dynamo_surfaces_torch29.py).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
import torch._dynamo

#: Versions whose surfaces were read and pinned here; a new one fails until checked.
PINNED = {(2, 9), (2, 13)}
#: A compiled function called with 1 + LIMIT new lengths, dynamic=False: compilations before the cliff.
LIMIT = 3


def version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def fresh() -> Any:
    import torch._dynamo.utils as du

    torch._dynamo.reset()
    du.counters.clear()
    return du


def check_version_is_pinned() -> None:
    assert version() in PINNED, (
        f"torch {torch.__version__}: the dynamo surfaces accelport reads were pinned for {sorted(PINNED)}; run "
        "these checks, adjust accelport/observe/dynamo.py if one changed, and add the version")


def check_guard_failures_and_compilation_metrics() -> None:
    du = fresh()

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    f = torch.compile(scaled, backend="eager", dynamic=False)
    for n in (4, 5, 6):
        f(torch.randn(n))
    # guard_failures: {code object: [reason, ...]}, filled with no logging configured.
    codes = [c for c in du.guard_failures if c.co_name == "scaled"]
    assert codes == [scaled.__code__]
    reasons = du.guard_failures[scaled.__code__]
    assert isinstance(reasons, list) and reasons
    pattern = re.compile(r"^\d+/\d+: tensor 'x' size mismatch at index 0\. expected (\d+), actual (\d+)$")
    assert all(pattern.match(r.splitlines()[0]) for r in reasons), reasons
    seen = {int(n) for r in reasons for n in pattern.match(r.splitlines()[0]).groups()}  # type: ignore[union-attr]
    assert seen == {4, 5, 6}
    # Compilation metrics: a list (a copy of a 64-long ring), with these fields.
    metrics = [m for m in du.get_compilation_metrics() if m.co_name == "scaled"]
    assert isinstance(du.get_compilation_metrics(), list) and len(metrics) == 3
    for m in metrics:
        assert m.co_filename == __file__ and m.co_firstlineno == scaled.__code__.co_firstlineno
        assert m.fail_type is None and isinstance(m.entire_frame_compile_time_s, float)
        assert re.match(r"^\d+/\d+$", str(m.compile_id))
    assert metrics[0].recompile_reason is None and "size mismatch" in metrics[-1].recompile_reason
    assert du.counters["stats"]["unique_graphs"] == 3
    # torch._dynamo.reset() empties the failures (the observer's marks allow for it).
    torch._dynamo.reset()
    assert scaled.__code__ not in du.guard_failures


def check_dynamic_default_compiles_twice() -> None:
    du = fresh()

    def shifted(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    f = torch.compile(shifted, backend="eager")  # dynamic=None: the second shape marks the dim dynamic
    # (Without the profile dynamo keeps on disk from earlier runs, which would make it dynamic at once.)
    automatic = torch._dynamo.config.automatic_dynamic_shapes  # importing torch_xla turns it off
    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        for n in range(4, 12):
            f(torch.randn(n))
    assert du.counters["stats"]["unique_graphs"] == (2 if automatic else 8)


def check_torch_xla_turns_automatic_dynamic_off() -> None:
    """In a process that imported torch_xla, the default torch.compile compiles each new shape."""
    import torch_xla  # noqa: F401

    assert torch._dynamo.config.automatic_dynamic_shapes is False


def check_recompile_limit_warning() -> None:
    du = fresh()
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("torch._dynamo.convert_frame")
    logger.addHandler(handler)

    def tripled(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    old = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = LIMIT
    try:
        f = torch.compile(tripled, backend="eager", dynamic=False)
        for n in range(1, LIMIT + 4):
            f(torch.randn(n))
    finally:
        torch._dynamo.config.recompile_limit = old
        logger.removeHandler(handler)
    hits = [r for r in got if isinstance(r.msg, str) and r.msg.startswith("torch._dynamo hit config.")]
    assert len(hits) == 1  # once: the function then runs eagerly for new shapes, silently
    args = hits[0].args
    assert isinstance(args, tuple) and len(args) == 5
    assert args[0] == "recompile_limit" and args[1] == LIMIT
    assert args[2] == f"'tripled' ({__file__}:{tripled.__code__.co_firstlineno})"
    assert re.match(r"^\d+/\d+: tensor 'x' size mismatch at index 0", args[3])
    assert du.counters["stats"]["unique_graphs"] == LIMIT


def check_graph_break_reasons() -> None:
    du = fresh()

    def branchy(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        if h.sum().item() > 0:
            h = h + 1
        return h

    f = torch.compile(branchy, backend="eager")
    for _ in range(6):
        f(torch.randn(4))
    breaks = du.graph_break_reasons
    assert isinstance(breaks, list) and len(breaks) == 1  # one entry per compilation that broke
    b = breaks[0]
    assert b.reason.splitlines()[0] == "Unsupported Tensor.item() call with capture_scalar_outputs=False"
    frame = b.user_stack[-1]
    assert (frame.filename, frame.name, frame.line.strip()) == (__file__, "branchy", "if h.sum().item() > 0:")
    assert frame.lineno == branchy.__code__.co_firstlineno + 2
    assert sum(du.counters["graph_break"].values()) == 1
    # The code after the break is its own compiled function, named after the one it resumes.
    resumed = {m.co_name for m in du.get_compilation_metrics()}
    assert f"torch_dynamo_resume_in_branchy_at_{frame.lineno}" in resumed


def check_hooks_the_tracer_needs() -> None:
    import torch._dynamo.callback as callback
    import torch._dynamo.eval_frame as eval_frame

    handler = callback.callback_handler
    assert isinstance(handler.start_callbacks, list) and callable(handler.register_start_callback)
    assert callable(handler.register_end_callback) and callable(eval_frame.skip_code)
    assert callable(torch.compiler.is_compiling)


def check_the_observer_reads_them_all() -> None:
    """accelport's observer, end to end on the surfaces above."""
    from accelport.observe.dynamo import CompileObserver

    fresh()
    obs = CompileObserver()
    obs.arm()
    mark = obs.mark()

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(1)

    old = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = LIMIT
    try:
        net = torch.compile(Net(), backend="eager", dynamic=False)
        for n in range(1, LIMIT + 3):
            net(torch.randn(2, n))
    finally:
        torch._dynamo.config.recompile_limit = old
    (hit,) = obs.limit_hits(mark)
    where = f"{__file__}:{Net.forward.__code__.co_firstlineno}"
    assert (hit.function, hit.limit, hit.where) == ("forward", LIMIT, where)
    (fn,) = obs.functions(mark)
    assert fn.name.endswith("Net.forward") and fn.compilations == LIMIT
    (change,) = fn.size_changes
    assert (change.arg, change.dim) == ("x", 1) and change.sizes == tuple(range(1, LIMIT + 2))
    assert obs.limit_hit_count(mark) == 1 and obs.limit_hit_count(obs.mark()) == 0


#: The checks every torch environment runs (the torch_xla one only where torch_xla is installed).
CHECKS = ("check_version_is_pinned", "check_guard_failures_and_compilation_metrics",
          "check_dynamic_default_compiles_twice", "check_recompile_limit_warning", "check_graph_break_reasons",
          "check_hooks_the_tracer_needs", "check_the_observer_reads_them_all")
