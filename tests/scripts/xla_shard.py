"""ap.shard on XLA:CPU with several host devices (SPMD), for tests/xla/test_xla_sharding.py.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 [ACCELPORT_SPMD=1] python xla_shard.py OUT device|host|late

A fresh process: SPMD and the device count are fixed when torch_xla's runtime
starts. Trains a small model sharded over the host's XLA devices, saves and loads
a checkpoint, and writes what it saw to OUT/result.pt (the test trains the same
model eagerly to compare).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import accelport as ap


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 16))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 16, (8,), generator=g)) for _ in range(4)]


def main(out: str, mode: str) -> None:
    import torch_xla

    result: dict[str, object] = {}
    ap.use("xla")
    if mode == "late":  # on the device before ap.shard, without ACCELPORT_SPMD=1: refused
        try:
            ap.shard(make().to(ap.device()))
            result["late"] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["late"] = f"{type(exc).__name__}: {exc}"
        torch.save(result, f"{out}/result.pt")
        return
    # "device": ACCELPORT_SPMD=1 started torch_xla in SPMD mode; "host": ap.shard places the model.
    model = ap.shard(make().to(ap.device()) if mode == "device" else make())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result["wrapper"] = type(model).__name__
    result["units"] = sorted({type(m).__name__ for m in model.modules()})
    result["specs"] = {n: torch_xla._XLAC._get_xla_sharding_spec(p) for n, p in model.named_parameters()}
    result["losses"] = []
    for x, y in ap.loader(batches()):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        ap.optimizer_step(opt)
        opt.zero_grad()
        ap.after_step(result["losses"].append, loss)  # type: ignore[attr-defined]
    ap.sync()
    m = ap.metrics()
    result["parameter_bytes"], result["optimizer_state_bytes"] = m.parameter_bytes, m.optimizer_state_bytes
    result["full_parameter_bytes"] = sum(p.numel() * p.element_size() for p in make().parameters())
    result["input_spec"] = _input_spec(model)

    ap.save({"model": model, "opt": opt, "step": 4}, f"{out}/ckpt.pt")
    saved = torch.load(f"{out}/ckpt.pt", weights_only=True)
    result["saved_keys"] = sorted(saved["model"])
    fresh = ap.shard(make())
    opt_fresh = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    result["plain"] = ap.load(f"{out}/ckpt.pt", into={"model": fresh, "opt": opt_fresh})
    result["reloaded_equal"] = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(fresh.parameters(),
                                                                                   model.parameters(), strict=True))
    # The eager model loads the same file: the wrapper's "_orig_module." names were taken out.
    plain_model = make()
    plain_model.load_state_dict(saved["model"])
    result["portable"] = True
    result["errors"] = {}
    for name, fn in {
        "twice": lambda: ap.shard(model),
        "bf16": lambda: ap.shard(make(), mixed_precision="bf16"),
    }.items():
        try:
            fn()
            result["errors"][name] = "no error"  # type: ignore[index]
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result["errors"][name] = f"{type(exc).__name__}: {exc}"  # type: ignore[index]
    torch.save(result, f"{out}/result.pt")


def _input_spec(model: torch.nn.Module) -> str:
    """The sharding the forward pre-hook gives an input batch."""
    import torch_xla

    seen: list[str] = []
    handle = model.register_forward_pre_hook(
        lambda module, args: seen.append(torch_xla._XLAC._get_xla_sharding_spec(args[0])))
    model(torch.randn(8, 32).to(ap.device()))
    handle.remove()
    return seen[0]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
