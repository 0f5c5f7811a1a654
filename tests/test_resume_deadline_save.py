"""The stop deadline passing during a save: said as such, and the save's temporary file removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import DEFAULT_SIGNALS


def test_a_save_cut_short_by_the_deadline_is_named_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "slow_save.py"
    # A save that outlasts any deadline (storage that stops answering): torch.save writes 1 MB, then waits forever.
    script.write_text(
        "import threading, time, torch\nimport accelport as ap\n"
        "def stuck_save(obj, f, *args, **kwargs):\n"
        "    f.write(bytes(1 << 20)); f.flush()\n"
        "    threading.Event().wait()\n"
        "torch.save = stuck_save\n"
        f"ckpt = ap.Checkpointer({str(ckpt)!r})\n"
        "ckpt.restore(model=torch.nn.Linear(2, 2))\n"
        "print('ready', flush=True)\n"
        "while True:\n    time.sleep(0.05)\n    ckpt.step()  # saves at the step after the stop request\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELPORT_")} | {"ACCELPORT_STOP_DEADLINE_S": "1"}
    proc = subprocess.Popen([sys.executable, "-c", DEFAULT_SIGNALS, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "1 s deadline passed; exiting without a checkpoint: the deadline cut short the save of step 1" in err
    assert "no step boundary reached" not in err
    assert not [p for p in ckpt.rglob("*") if p.name.endswith(".tmp")]  # the 1 MB written so far is gone
