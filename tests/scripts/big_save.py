"""Write a large checkpoint with ap.save; tests/test_checkpoint.py kills this process mid-write."""

import sys

import torch

import accelport as ap

# About 400 MB in 100 tensors: writing it takes long enough to be interrupted.
state = {f"layer{i}.weight": torch.full((1024, 1024), float(i)) for i in range(100)}
state["version"] = 2
print("saving", flush=True)
ap.save(state, sys.argv[1])
print("saved", flush=True)
