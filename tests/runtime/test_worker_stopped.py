"""A watched worker stopped by SIGTERM (a launcher's stop, torch's spawn ending the others after one failed)
writes its run before it ends, as the function's end would: the parent then judges it instead of losing it.

Each case runs in a process of its own (the worker ends by the signal), with SIGTERM at its default there.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.diagnose_cli.runs import REPO, child_env, default_signals

_WORKER = textwrap.dedent("""
    import os, signal, sys, threading, time
    import torch
    from accelport.runtime.workers import WatchedWorker, read_workers

    def train(index):
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            if step == 3:
                # Hung in step 4, where the launcher's stop finds it. (In a thread, the function would otherwise
                # run on and end before the main thread is scheduled to take the signal: its run, rightly, then
                # says it ended well.)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(120)
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    worker = WatchedWorker(train, sys.argv[1], "cpu")
    if sys.argv[2] == "thread":
        # As torch_xla's replicas: the function runs in a thread of a process whose main thread unpickled it.
        import pickle
        worker = pickle.loads(pickle.dumps(worker))
        thread = threading.Thread(target=worker, args=(0,))
        thread.start()
        thread.join()
    else:
        worker(0)
    print("not reached")
""")


def _stopped(tmp_path: Path, how: str) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), how], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=child_env(), preexec_fn=default_signals)
    assert done.returncode == -signal.SIGTERM and "not reached" not in done.stdout, done.stderr[-3000:]
    return json.loads((tmp_path / "rank-0-0.json").read_text())


def test_a_worker_stopped_by_sigterm_writes_its_run_then_ends_by_the_signal(tmp_path: Path) -> None:
    run = _stopped(tmp_path, "main")
    assert (run["rank"], run["steps"], run["exit_status"]) == (0, 3, 128 + signal.SIGTERM)


def test_a_worker_whose_function_runs_in_another_thread_is_stopped_the_same(tmp_path: Path) -> None:
    run = _stopped(tmp_path, "thread")
    assert (run["rank"], run["steps"], run["exit_status"]) == (0, 3, 128 + signal.SIGTERM)
