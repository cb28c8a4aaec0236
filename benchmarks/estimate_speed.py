"""How long the estimates take, each in a fresh process, as a user's CLI call pays them (imports included).

1. The instant estimate: import fitburst.memory and plan Llama-3.1-70B (batch 4 x 4096 tokens) on an RTX 4090, CPU
   seconds (a loaded machine stretches the wall clock, not the work). Target: under 1.0 s.
2. ``fitburst estimate --exact`` (the traced step at full size), Qwen2.5-7B LoRA (rank 8, all-linear) at batch
   1 x 1024 tokens on an RTX 4090: cold (``FITBURST_CACHE`` a fresh empty folder: the trace runs) and warm (the same
   folder right after: the trace is read from its cache).
3. ``fitburst preflight qwen7b-lora`` (pipelines.yaml; no Prefect server: the CLI calls fitburst.preflight
   directly), on this machine's device (``auto``), cold and warm the same way: the data facts, the analytic search,
   the trace of the plan that runs and the cloud offers, then all of them from the cache.

Parts 2 and 3 print the wall clock and the CPU seconds of the child (user + system): on a shared machine the wall
clock stretches with the load, the CPU seconds much less. Each repetition of a cold run gets its own empty cache.

    python benchmarks/estimate_speed.py [--reps 10] [--exact-reps 3] [--preflight-reps 3]
                                        [--parts instant,exact,preflight]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CODE = (
    "import time; t=time.process_time(); import fitburst.memory as m; "
    "m.plan_fit(m.load_shape('Llama-3.1-70B'), m.RunSettings(micro_batch_size=4, seq_len=4096), "
    "m.resolve_device('RTX4090')); "
    "print(time.process_time()-t)"
)
TARGET_S = 1.0
ROOT = Path(__file__).resolve().parents[1]
EXACT = ["estimate", "--model", "Qwen2.5-7B", "--method", "lora", "--batch", "1", "--seq-len", "1024",
         "--device", "RTX4090", "--exact"]
PREFLIGHT = ["preflight", "qwen7b-lora"]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def timed_cli(args: list[str], cache: str) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of ``fitburst <args>`` in a fresh interpreter with FITBURST_CACHE=cache,
    run from the repository root (its pipelines.yaml), this checkout's code first on the path."""
    env = {**os.environ, "FITBURST_CACHE": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fitburst.cli", *args], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cold_and_warm(label: str, args: list[str], reps: int) -> list[str]:
    """Table rows: ``reps`` cold runs, each in a fresh cache folder, each followed by a warm run in that folder."""
    cold, warm = [], []
    for _ in range(reps):
        with tempfile.TemporaryDirectory(prefix="fb-cache-") as cache:
            cold.append(timed_cli(args, cache))
            warm.append(timed_cli(args, cache))

    def row(kind: str, runs: list[tuple[float, float]]) -> str:
        wall, cpu = [w for w, _ in runs], [c for _, c in runs]
        return (f"| {label} | {kind} | {len(runs)} | {statistics.median(wall):.1f} ({min(wall):.1f} .. "
                f"{max(wall):.1f}) | {statistics.median(cpu):.1f} ({min(cpu):.1f} .. {max(cpu):.1f}) |")
    return [row("cold", cold), row("warm", warm)]


def instant(reps: int) -> None:
    seconds = [float(subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
                     .stdout) for _ in range(reps)]
    print("the instant estimate (Llama-3.1-70B, batch 4 x 4096, RTX 4090), CPU seconds")
    print("| runs | CPU s median | min | max | target | met |")
    print("|---:|---:|---:|---:|---:|---|")
    print(f"| {reps} | {statistics.median(seconds):.3f} | {min(seconds):.3f} | {max(seconds):.3f} | < {TARGET_S} "
          f"| {'yes' if max(seconds) < TARGET_S else 'no'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10, help="runs of the instant estimate")
    ap.add_argument("--exact-reps", type=int, default=3, help="cold + warm pairs of estimate --exact")
    ap.add_argument("--preflight-reps", type=int, default=3, help="cold + warm pairs of the preflight")
    ap.add_argument("--parts", default="instant,exact,preflight")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",")]
    print(f"load average (1/5/15 min) at the start: {loadavg()}, {os.cpu_count()} CPUs")
    if "instant" in parts:
        instant(args.reps)
    rows = []
    if "exact" in parts:
        rows += cold_and_warm("`fitburst " + " ".join(EXACT) + "`", EXACT, args.exact_reps)
    if "preflight" in parts:
        rows += cold_and_warm("`fitburst " + " ".join(PREFLIGHT) + "` (device auto: this box's CPU)", PREFLIGHT,
                              args.preflight_reps)
    if rows:
        print("\nend to end in a fresh process (imports included); seconds, median (min .. max); cold: an empty "
              "FITBURST_CACHE, warm: the same cache right after")
        print("| command | cache | runs | wall s | CPU s (user + system) |")
        print("|---|---|---:|---:|---:|")
        print("\n".join(rows))
    print(f"load average (1/5/15 min) at the end: {loadavg()}")


if __name__ == "__main__":
    main()
