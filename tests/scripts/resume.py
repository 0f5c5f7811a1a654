"""Train, checkpoint, resume in a new process (tests/test_checkpoint.py).

    python resume.py full-and-part OUT_DIR   # N steps uninterrupted -> full.pt; then K steps -> ckpt.pt
    python resume.py resume OUT_DIR          # a new process: load ckpt.pt, run to N -> resumed.pt
"""

from __future__ import annotations

import sys

import torch

import accelport as ap

N, K = 12, 5


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 1)).to(ap.device())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    # Data and dropout both draw from the global RNG: resuming must restore it.
    x = torch.randn(16, 8)
    y = x.sum(dim=1, keepdim=True)
    x, y = x.to(ap.device()), y.to(ap.device())
    torch.nn.functional.mse_loss(model(x), y).backward()
    ap.optimizer_step(opt)
    opt.zero_grad()


def main(mode: str, out: str) -> None:
    torch.set_num_threads(1)
    model, opt = build()
    if mode == "full-and-part":
        for _ in range(N):
            step(model, opt)
        torch.save(model.state_dict(), f"{out}/full.pt")
        model, opt = build()
        for _ in range(K):
            step(model, opt)
        ap.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
                 "step": K}, f"{out}/ckpt.pt")
    elif mode == "resume":
        state = ap.load(f"{out}/ckpt.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"].cpu())
        for _ in range(state["step"], N):
            step(model, opt)
        torch.save(model.state_dict(), f"{out}/resumed.pt")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
