"""Which frame is the user's: the line a finding points at is never inside torch, torch_xla or accelport.

Shared by ``accelport diagnose`` (where a finding is shown) and ``accelport launch``'s
probe (where a worker's script is), so both name the same line.
"""

from __future__ import annotations

import os
import sys
import types
from typing import NamedTuple

__all__ = ["LIBRARIES", "FRAMEWORKS", "FORWARDING", "Site", "user_site", "library_file", "library_of", "running_in"]

#: Top-level packages of the frameworks a training loop may live in: their frames are never "the user's
#: line" either (a finding points at the user's dataset, collator or call instead), and a cause inside
#: one of them is said to be that library's.
FRAMEWORKS = frozenset({
    "transformers", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities",
    "torchmetrics", "datasets", "peft", "trl", "deepspeed", "torchvision", "torchaudio", "torchtext", "timm",
})
#: Top-level packages whose frames are never "the user's line".
LIBRARIES = frozenset({
    "accelport", "torch", "torch_xla", "torch_neuronx", "torch_tpu", "typing_extensions", "runpy", "threading",
    "warnings", "contextlib", "functools", "importlib", "_weakrefset", *FRAMEWORKS,
})


class Site(NamedTuple):
    """A line of the script's, and what it is ("the training loop"); empty where the finding itself says it."""

    file: str
    line: int
    label: str = ""


#: accelport's own directory: ``python -m accelport`` runs its ``__main__.py`` as ``__main__``, as a script's is.
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def user_site(frame: types.FrameType | None = None, also: frozenset[str] = frozenset()) -> tuple[str, int] | None:
    """(file, line) of the innermost frame outside torch, torch_xla, accelport and the import machinery;
    ``also``: files skipped too (a plugin's rules)."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        filename = frame.f_code.co_filename
        if module.partition(".")[0] not in LIBRARIES and not filename.startswith("<frozen ") and filename not in also \
                and not (module == "__main__" and filename.startswith(_OWN)):
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


#: Packages of torch's whose frames say what a running op is part of, for :func:`running_in`.
_PARTS = (("torch.utils.data", "data"), ("torch.optim", "optimizer"), ("torch.nn.utils.clip_grad", "clipping"))


#: accelport's modules whose wrappers of torch's calls only pass the script's own call on (the step clock's
#: and diagnose's watcher's ``torch.autograd.backward``): what runs under them is the script's, not accelport's.
FORWARDING = frozenset({"accelport.observe.steptime", "accelport.runtime.watch"})


def running_in(frame: types.FrameType | None = None, skip: frozenset[str] = frozenset()) -> str:
    """What the code running at ``frame`` (and the frames that called it) is part of: "data" (torch's data
    loading), "optimizer" (a torch.optim optimizer's step), "clipping" (torch.nn.utils' gradient clipping),
    "accelport" (accelport's own code, as a step check) or "user" (the user's code: the first frame outside
    torch and accelport is reached first). ``skip``: modules passed over (the caller's own)."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module not in skip and module not in FORWARDING:
            for prefix, part in _PARTS:
                if module == prefix or module.startswith(prefix + "."):
                    return part
            top = module.partition(".")[0]
            if top == "accelport":
                return "accelport"
            if top not in LIBRARIES and not frame.f_code.co_filename.startswith("<frozen "):
                return "user"
        frame = frame.f_back
    return "user"


def library_of(path: str) -> str | None:
    """The library (top-level package: ``torch``, ``transformers``) that file ``path`` belongs to, or None.

    Only libraries imported in this process are known (a file of one that is not imported is
    not part of the run).
    """
    path = os.path.abspath(path)
    for name in LIBRARIES:
        module = sys.modules.get(name)
        # A package's directory; a single-file module (threading) is its file alone: its
        # directory is the standard library's, and may hold site-packages, the script's too.
        for root in getattr(module, "__path__", None) or ():
            if path.startswith(os.path.abspath(root) + os.sep):
                return name
        origin = getattr(module, "__file__", None)
        if origin and path == os.path.abspath(origin):
            return name
    return None


def library_file(path: str) -> bool:
    """Whether ``path`` is a file of torch, torch_xla, accelport or another library user_site skips."""
    return library_of(path) is not None
