"""Soak: the CLI paths a user runs, each many times in fresh processes. Each row gets a fresh HOME and project
folder: its first run is a new user's (nothing cached), the others a returning user's (caches, mlflow.db and
Prefect's database kept). Offline, with CI markers removed, so libraries behave as on a user's machine (MLflow's
telemetry, for one, is on unless fitburst turns it off). Prints a table of runs, failures and
the first line of each distinct failure, and the machine's load.

    python benchmarks/soak.py [--scale 1.0] [--only validate,dry-run]

``--scale 0.1`` runs a tenth of each count (at least one run each). Target: 0 failures on every row.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FITBURST = [sys.executable, "-m", "fitburst.cli"]
# what turns telemetry off by itself or marks a test run: removed, so the soak sees what a user's shell sees
NOT_A_USERS = ("CI", "GITHUB_ACTIONS", "PYTEST_CURRENT_TEST", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK",
               "PREFECT_SERVER_ANALYTICS_ENABLED", "SKYPILOT_DISABLE_USAGE_COLLECTION", "HF_HUB_DISABLE_TELEMETRY",
               "PREFECT_HOME", "MLFLOW_TRACKING_URI", "FITBURST_CACHE", "FITBURST_RUNS_DIR")


@dataclass
class Row:
    name: str
    argv: list[str]
    runs: int
    failures: Counter[str] = field(default_factory=Counter)
    seconds: list[float] = field(default_factory=list)


def rows(scale: float) -> list[Row]:
    def n(count: int) -> int:
        return max(1, round(count * scale))

    return [
        Row("fitburst validate", ["validate"], n(20)),
        Row("fitburst preflight demo", ["preflight", "demo"], n(10)),
        Row("fitburst preflight t5-demo", ["preflight", "t5-demo"], n(10)),
        Row("fitburst preflight qwen7b-lora", ["preflight", "qwen7b-lora"], n(10)),
        Row("fitburst run qwen7b-lora --dry-run", ["run", "qwen7b-lora", "--dry-run"], n(20)),
        Row("fitburst run demo", ["run", "demo"], n(10)),
    ]


def fresh_project(tmp: Path) -> dict[str, str]:
    """A project folder holding pipelines.yaml and the demo data, and the environment of a new user."""
    shutil.copy(ROOT / "pipelines.yaml", tmp / "pipelines.yaml")
    shutil.copytree(ROOT / "fitburst" / "demo", tmp / "fitburst" / "demo")
    (tmp / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in NOT_A_USERS}
    return {**env, "HOME": str(tmp / "home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def first_line(output: str) -> str:
    """The line that says what went wrong: a traceback's last line, else the first line of output."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    if not lines:
        return "(no output)"
    return lines[-1] if any(line.startswith("Traceback") for line in lines) else lines[0]


def soak(row: Row, timeout_s: float) -> None:
    with tempfile.TemporaryDirectory(prefix="fitburst-soak-") as tmp:
        env = fresh_project(Path(tmp))
        for _ in range(row.runs):
            t0 = time.monotonic()
            try:
                p = subprocess.run(FITBURST + row.argv, cwd=tmp, env=env, capture_output=True, text=True,
                                   timeout=timeout_s)
                if p.returncode != 0:
                    row.failures[f"exit {p.returncode}: {first_line(p.stderr or p.stdout)[:160]}"] += 1
            except subprocess.TimeoutExpired:
                row.failures[f"timed out after {timeout_s:.0f} s"] += 1
            row.seconds.append(time.monotonic() - t0)


def table(done: list[Row]) -> str:
    out = ["| command | runs | failures | median s | first line of each distinct failure |",
           "|---|---:|---:|---:|---|"]
    for r in done:
        median = sorted(r.seconds)[len(r.seconds) // 2]
        failures = "; ".join(f"{k} (x{c})" for k, c in r.failures.items()) or "-"
        out.append(f"| {r.name} | {r.runs} | {sum(r.failures.values())} | {median:.1f} | {failures} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every row's count (default 1)")
    ap.add_argument("--only", help="comma-separated substrings of the rows to run")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    args = ap.parse_args()
    chosen = [r for r in rows(args.scale) if not args.only or any(s in r.name for s in args.only.split(","))]
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    for r in chosen:
        soak(r, args.timeout)
        print(f"  {r.name}: {r.runs} runs, {sum(r.failures.values())} failed", flush=True)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(table(chosen))
    return 1 if any(r.failures for r in chosen) else 0


if __name__ == "__main__":
    raise SystemExit(main())
