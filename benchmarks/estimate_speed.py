"""How long the instant estimate takes: import fitburst.memory and plan Llama-3.1-70B (batch 4 x 4096 tokens) on an
RTX 4090, in a fresh process, CPU seconds (a loaded machine stretches the wall clock, not the work). Target: under
1.0 s. Each repetition is a new interpreter, so imports are paid every time, as a user's CLI call pays them.

    python benchmarks/estimate_speed.py [--reps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CODE = (
    "import time; t=time.process_time(); import fitburst.memory as m; "
    "m.plan_fit(m.load_shape('Llama-3.1-70B'), m.RunSettings(micro_batch_size=4, seq_len=4096), "
    "m.resolve_device('RTX4090')); "
    "print(time.process_time()-t)"
)
TARGET_S = 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    reps = ap.parse_args().reps
    seconds = [float(subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
                     .stdout) for _ in range(reps)]
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    print("| runs | CPU s median | min | max | target | met |")
    print("|---:|---:|---:|---:|---:|---|")
    print(f"| {reps} | {statistics.median(seconds):.3f} | {min(seconds):.3f} | {max(seconds):.3f} | < {TARGET_S} "
          f"| {'yes' if max(seconds) < TARGET_S else 'no'} |")


if __name__ == "__main__":
    main()
