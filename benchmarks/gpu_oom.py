"""A real CUDA out-of-memory error and the step-down that follows it, on the day a GPU is at hand.

    python benchmarks/gpu_oom.py [--cap-gib 2.5] [--out benchmarks/results]

The GPU is capped with ``torch.cuda.set_per_process_memory_fraction``: past the cap the caching allocator raises
``torch.OutOfMemoryError`` from wherever the step asked for memory (forward, the autograd thread's backward, the
optimizer), as on a card of that size. The run (the wider demo model of ``gpu_check.py``, LoRA on every linear
layer, micro-batch 16 x 1024 tokens) goes through ``fitburst.supervisor.train_stepping_down`` itself: each OOM takes the
ladder's next mid-run rung (activation offloading is left out: TRL is not on every GPU image) and the run starts
again in the same process, which only works if the failed attempt's memory was let go. Printed: each step-down
(the error's first line, the rung, the measured peak), then the run that completed, its peak under the cap. A JSON
record goes to ``<out>/gpu_oom-<gpu>.json``. Without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from gpu_check import REPO, cuda_or_exit, fixed_length_data

GiB = 1 << 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap-gib", type=float, default=2.5, help="the memory this process may use on the GPU")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    cuda_or_exit()
    import torch

    from fitburst.data import prepare_pipeline
    from fitburst.demo_models import demo_model_dir
    from fitburst.spec import load_pipeline
    from fitburst.supervisor import StepDown, train_stepping_down

    free, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction(args.cap_gib * GiB / total)
    gpu = torch.cuda.get_device_name()
    records: list[StepDown] = []
    with tempfile.TemporaryDirectory() as d:
        data = fixed_length_data(Path(d) / "long.jsonl", n=64)
        over = {"data.path": str(data), "data.val_split": 0.0, "eval.enabled": False, "training.max_steps": 4,
                "training.checkpoint_every": 2, "training.log_every": 1, "preflight.device": "cuda",
                "burst.policy": "never", "model.name": str(demo_model_dir(hidden_size=1024, num_hidden_layers=8)),
                "data.max_seq_len": 1024, "training.micro_batch_size": 16, "training.grad_accum": 1,
                "method.target_modules": "all-linear", "preflight.allow.activation_offloading": False}
        spec = load_pipeline(REPO / "pipelines.yaml", "demo", over)
        prepared = prepare_pipeline(spec)
        t0 = time.time()
        result = train_stepping_down(spec, prepared, Path(d) / "run", device="cuda", on_stepdown=records.append,
                                     progress=False)
        seconds = time.time() - t0
        stepdowns = json.loads((Path(d) / "run" / "stepdown.json").read_text()) if records else {}
    print(f"{gpu}, capped at {args.cap_gib} GiB of {total / GiB:.1f}: micro-batch 16 x 1024, LoRA all-linear")
    for r in records:
        peak = f"{r.measured_peak_bytes / GiB:.2f} GiB" if r.measured_peak_bytes else "-"
        print(f"  OOM at step {r.step} (peak {peak}): {r.error[:110]}\n    -> {r.rung}: {r.change}")
    settings = stepdowns.get("settings", {})
    print(f"completed {result.steps}/{result.total_steps} steps in {seconds:.0f} s with micro-batch "
          f"{settings.get('batch')} x grad_accum {settings.get('grad_accum')}, optimizer "
          f"{settings.get('optimizer')}, checkpointing {settings.get('grad_checkpointing')}; peak allocated "
          f"{(result.peak.allocated_bytes or 0) / GiB:.2f} GiB, reserved {(result.peak.reserved_bytes or 0) / GiB:.2f} "
          f"GiB (cap {args.cap_gib} GiB)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_oom-{gpu.replace(' ', '_')}.json"
    path.write_text(json.dumps({"gpu": gpu, "cap_bytes": int(args.cap_gib * GiB), "total_bytes": total,
                                "stepdowns": [r.to_dict() for r in records], "final_settings": settings,
                                "steps": result.steps, "total_steps": result.total_steps, "seconds": round(seconds, 1),
                                "peak": {"allocated": result.peak.allocated_bytes,
                                         "reserved": result.peak.reserved_bytes},
                                "torch": torch.__version__, "cuda": torch.version.cuda}, indent=2))
    print(f"written: {path}")
    return 0 if records and result.steps == result.total_steps else 1


if __name__ == "__main__":
    os.environ.setdefault("FITBURST_TRACE_CACHE", "0")
    raise SystemExit(main())
