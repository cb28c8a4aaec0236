"""A training process for the fault tests (crash, OOM, outage): the flow's local path without Prefect.

    python tests/fault_child.py '<json>'   keys: pipelines_file, pipeline, overrides, step_sleep (seconds added to
                                           each optimizer step, so a test can act mid-run), mlflow (bool),
                                           device (default "cpu": the faults these tests cause are the CPU's,
                                           an address-space limit among them, on a GPU host too), nproc
                                           (processes to shard the run over, default one)

Prints one JSON line (the TrainResult plus the MLflow run id) on success. Environment as the test sets it
(FITBURST_RUNS_DIR, FITBURST_CACHE, MLFLOW_TRACKING_URI).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict


def main() -> int:
    cfg = json.loads(sys.argv[1])
    import fitburst.recipe as train_mod  # the loop looks its step up in the recipe
    from fitburst.cache import cache_root
    from fitburst.data import prepare
    from fitburst.models import tokenizer_for
    from fitburst.spec import load_pipeline
    from fitburst.supervisor import train_local_run
    from fitburst.tracking import Tracker

    spec = load_pipeline(cfg["pipelines_file"], cfg.get("pipeline", "demo"), cfg.get("overrides"))
    if cfg.get("step_sleep"):  # test instrumentation: slow each optimizer step down
        real = train_mod.optimizer_step

        def slow_step(*a, **k):
            time.sleep(cfg["step_sleep"])
            return real(*a, **k)

        train_mod.optimizer_step = slow_step
    prepared = prepare(spec.data, spec.data_path(), tokenizer_for(spec.model), cache_root() / "data")
    tracker = Tracker.start(spec) if cfg.get("mlflow") else None
    print(json.dumps({"mlflow_run_id": tracker.run_id if tracker else None}), flush=True)
    status = "FAILED"
    try:
        result = train_local_run(spec, prepared, tracker, device=cfg.get("device", "cpu"), progress=False,
                                 nproc=cfg.get("nproc"))
        status = "FINISHED"
    finally:
        if tracker is not None:
            tracker.end(status)
    status_lines = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    vm_peak = int(status_lines["VmPeak"].split()[0]) * 1024  # the address space a RLIMIT_AS must allow
    print(json.dumps({**asdict(result), "mlflow_run_id": tracker.run_id if tracker else None,
                      "vm_peak_bytes": vm_peak}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
