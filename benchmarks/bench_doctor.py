"""How long `accelport doctor` takes, next to `python -c "import torch"`, in one run.

    python benchmarks/bench_doctor.py [--runs 7]

Both are run as fresh processes, interleaved, so machine noise hits both alike.
Target: doctor finishes faster than importing torch, and under 1.5 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    doctor = [sys.executable, "-m", "accelport", "doctor", "--json"]
    torch = [sys.executable, "-c", "import torch"]
    wall(doctor), wall(torch)  # warm the page cache for both
    d, t = [], []
    for _ in range(runs):
        d.append(wall(doctor))
        t.append(wall(torch))
    md, mt = statistics.median(d), statistics.median(t)
    print(f"accelport doctor --json  median {md:.3f} s  (runs: {', '.join(f'{x:.3f}' for x in d)})")
    print(f"python -c 'import torch' median {mt:.3f} s  (runs: {', '.join(f'{x:.3f}' for x in t)})")
    print(f"ratio doctor / import torch: {md / mt:.2f}  (target < 1; doctor < 1.5 s: {'yes' if md < 1.5 else 'NO'})")


if __name__ == "__main__":
    main()
