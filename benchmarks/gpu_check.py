"""The check to run the day a CUDA GPU is at hand: fitburst's own training runs on the GPU, measured at each stage,
against the preflight's estimates of the same runs.

    python benchmarks/gpu_check.py [--steps 4] [--out benchmarks/results]

Configurations: the demo (tiny Llama, LoRA); a QLoRA nf4 run of a wider demo model (bitsandbytes on the GPU); with
two or more visible GPUs an FSDP run over all of them (torchrun, NCCL). Each single-GPU run goes through
``fitburst.train.train`` itself, with the loop's own functions wrapped to take memory readings: after the model
loads (``fitburst.train.load_pipeline_model``), after k-bit preparation and LoRA (``prepare_for_training``),
after the warm-up step and at the measured steps' peak (``optimizer_step``): ``torch.cuda.memory._snapshot()``
(pickled beside the CSV, the allocator's history recorded from the start, so the peak's state can be rebuilt),
``max_memory_allocated`` / ``max_memory_reserved`` (reset after the warm-up step, as the estimate's measured step
is) and ``mem_get_info`` (device total in use, CUDA context included). The estimates are the preflight's: the
analytic and the traced estimate of the settings the run trains with (``fitburst.data.run_settings`` on the
probed GPU). One CSV row per configuration and stage goes to ``benchmarks/results/gpu_check-<gpu>.csv``; a table is
printed. On a machine without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
FIELDS = ["config", "stage", "gpu", "world_size", "allocated", "reserved", "max_allocated", "max_reserved",
          "device_used", "est_method", "est_allocated", "est_reserved", "est_device_total", "alloc_ratio",
          "reserved_ratio", "device_ratio", "snapshot"]


def cuda_or_exit() -> int:
    """The number of visible CUDA GPUs; a plain message and exit status 2 where there is none."""
    try:
        import torch
    except ImportError:
        print("gpu_check needs torch with CUDA; torch is not installed here", file=sys.stderr)
        raise SystemExit(2) from None
    if not torch.cuda.is_available():
        print(f"gpu_check needs a CUDA GPU: torch {torch.__version__} sees none on this machine (CUDA build: "
              f"{torch.version.cuda or 'no'}). Run it where `nvidia-smi` lists a GPU.", file=sys.stderr)
        raise SystemExit(2)
    return torch.cuda.device_count()


def fixed_length_data(dest: Path, n: int = 64) -> Path:
    """Records far longer than any max_seq_len here: every sample is cut to exactly max_seq_len tokens, so each
    batch has the length the estimate plans for."""
    text = " ".join(f"word{i % 97}" for i in range(4000))
    with dest.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"instruction": f"Repeat {i}.", "input": "", "output": text}) + "\n")
    return dest


def configs(data: Path, steps: int) -> dict[str, dict]:
    """name -> overrides of pipelines.yaml's demo pipeline."""
    from fitburst.demo_models import demo_model_dir

    common = {"data.path": str(data), "data.val_split": 0.0, "eval.enabled": False, "training.max_steps": steps,
              "training.checkpoint_every": 10_000, "training.log_every": 1, "preflight.device": "cuda",
              "training.micro_batch_size": 1, "training.grad_accum": 2, "burst.policy": "never"}
    wide = str(demo_model_dir(hidden_size=1024, num_hidden_layers=8))
    return {
        "demo-lora": {**common, "data.max_seq_len": 128},
        "demo-qlora-nf4": {**common, "model.name": wide, "data.max_seq_len": 512, "method.type": "qlora",
                           "method.quant": "nf4", "method.double_quant": True, "method.target_modules": "all-linear"},
    }


class Readings:
    """Memory readings at the loop's stages, taken by wrapping fitburst.train's own functions."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.rows: dict[str, dict] = {}
        self.steps = 0

    def take(self, stage: str) -> None:
        import torch

        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        snap = self.folder / f"{stage}.pickle"
        with snap.open("wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        self.rows[stage] = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                            "max_allocated": torch.cuda.max_memory_allocated(),
                            "max_reserved": torch.cuda.max_memory_reserved(), "device_used": total - free,
                            "snapshot": str(snap.relative_to(REPO) if snap.is_relative_to(REPO) else snap)}

    @contextlib.contextmanager
    def around_training(self):
        """fitburst.train's load, preparation and step, each followed by a reading."""
        from unittest import mock

        import torch

        import fitburst.train as loop

        load, prepare, step = loop.load_pipeline_model, loop.prepare_for_training, loop.optimizer_step

        def loaded(*a, **k):
            model = load(*a, **k)
            self.take("after_load")
            return model

        def prepared(*a, **k):
            model = prepare(*a, **k)
            self.take("after_kbit_prep_and_lora")
            return model

        def stepped(*a, **k):
            loss = step(*a, **k)
            self.steps += 1
            if self.steps == 1:
                self.take("after_warmup_step")
                torch.cuda.reset_peak_memory_stats()  # the estimate's peak is the measured step's
            return loss

        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        with (mock.patch.object(loop, "load_pipeline_model", loaded),
              mock.patch.object(loop, "prepare_for_training", prepared),
              mock.patch.object(loop, "optimizer_step", stepped)):
            yield
        self.take("peak")
        torch.cuda.memory._record_memory_history(enabled=None)


def estimates(spec, seq_len: int, device) -> dict[str, object]:
    """The preflight's analytic and traced estimates of the run ``spec`` trains on ``device`` (one micro-batch of
    ``seq_len`` tokens, unpadded)."""
    from fitburst.data import run_settings
    from fitburst.memory import Budget, estimate
    from fitburst.memory.trace import TraceUnsupported, traced_estimate
    from fitburst.models import resolve_model_ref, spec_shape

    s = replace(run_settings(spec, device, seq_len), padded=False)
    out: dict[str, object] = {}
    shape = spec_shape(spec)
    if shape is not None:
        out["analytic"] = Budget(device).judge(estimate(shape, s, device))
    ref = resolve_model_ref(spec.model.name)
    local = spec.model_copy(update={"model": spec.model.model_copy(update={"name": ref})})
    try:
        out["traced"] = Budget(device).judge(traced_estimate(local, s, device, seq_len=seq_len))
    except TraceUnsupported as e:
        print(f"  traced estimate unavailable: {e}", file=sys.stderr)
    return out


def run_one(name: str, overrides: dict, results: Path, device) -> list[dict]:
    import torch

    from fitburst.data import prepare_pipeline
    from fitburst.spec import load_pipeline
    from fitburst.train import train

    spec = load_pipeline(REPO / "pipelines.yaml", "demo", overrides)
    prepared = prepare_pipeline(spec)
    seq = prepared.stats["max"]
    folder = results / "gpu_check" / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    readings = Readings(folder)
    with tempfile.TemporaryDirectory() as run_dir, readings.around_training():
        train(spec, prepared, run_dir, device="cuda", progress=False)
    ests = estimates(spec, seq, device)
    rows = []
    for stage, r in readings.rows.items():
        for method, e in ests.items() or [("none", None)]:
            row = {"config": name, "stage": stage, "gpu": device.name, "world_size": 1, **r, "est_method": method}
            if e is not None and stage == "peak":
                row.update(est_allocated=e.allocated_peak_bytes, est_reserved=e.reserved_peak_bytes,
                           est_device_total=e.device_total_bytes,
                           alloc_ratio=round(r["max_allocated"] / e.allocated_peak_bytes, 4),
                           reserved_ratio=round(r["max_reserved"] / e.reserved_peak_bytes, 4),
                           device_ratio=round(r["device_used"] / e.device_total_bytes, 4))
            rows.append(row)
    return rows


# --- FSDP over every visible GPU ------------------------------------------------------------------------------


def fsdp_child(folder: str, settings_json: str, out: str) -> None:
    """One rank (torchrun, NCCL): the demo model sharded by fitburst.distributed.shard, the loop's
    optimizer_step, readings as above; rank 0 writes them to ``out``."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from fitburst.device import make_amp, weight_dtype
    from fitburst.distributed import shard
    from fitburst.memory.trace import _batch
    from fitburst.models import auto_model_class
    from fitburst.runconfig import TrainSettings, spec_with_settings
    from fitburst.spec import PipelineSpec
    from fitburst.train import make_optimizer, optimizer_step, prepare_for_training

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    s = TrainSettings(**json.loads(settings_json))
    config = AutoConfig.from_pretrained(folder)
    with torch.device("cuda"):
        model = auto_model_class(config).from_config(config, dtype=weight_dtype(s.dtype, s.method))
    readings = Readings(Path(out).parent)
    readings.take(f"after_load_rank{rank}")
    spec = spec_with_settings(PipelineSpec.model_validate(
        {"name": "fsdp", "model": {"name": folder}, "data": {"path": "unused.jsonl"}}), s)
    model = prepare_for_training(model, spec)
    shard(model, s.dtype, reshard_after_forward=s.reshard_after_forward)
    torch.cuda.empty_cache()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(s.optimizer, params, 1e-4, 0.0)
    amp = make_amp(s.dtype, "cuda")
    batch = {k: v.cuda() for k, v in _batch(s.batch, s.seq_len, False).items()}
    optimizer_step(model, opt, params, [batch], device="cuda", max_grad_norm=1.0, amp=amp)
    readings.take(f"after_warmup_step_rank{rank}")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        optimizer_step(model, opt, params, [batch], device="cuda", max_grad_norm=1.0, amp=amp)
    readings.take(f"peak_rank{rank}")
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, readings.rows)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_fsdp(n: int, results: Path, device) -> list[dict]:
    from fitburst.demo_models import demo_model_dir
    from fitburst.memory import Budget
    from fitburst.memory.trace import traced_estimate
    from fitburst.runconfig import TrainSettings
    from fitburst.spec import PipelineSpec

    folder = str(demo_model_dir(hidden_size=1024, num_hidden_layers=8))
    s = TrainSettings(method="full", batch=1, seq_len=512, dtype="bf16" if device.supports_bf16 else "fp16",
                      world_size=n, padded=False)
    out = results / "gpu_check" / f"fsdp-{n}" / "ranks.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                    __file__, "--fsdp-child", folder, json.dumps(s.__dict__), str(out)], check=True)
    spec = PipelineSpec.model_validate({"name": "fsdp", "model": {"name": folder}, "data": {"path": "x.jsonl"}})
    e = Budget(device, gpus_per_node=n).judge(traced_estimate(spec, s, device, seq_len=s.seq_len))
    rows = []
    for rank, readings in enumerate(json.loads(out.read_text())):
        for stage, r in readings.items():
            row = {"config": f"fsdp-full-{n}gpus", "stage": stage, "gpu": device.name, "world_size": n, **r,
                   "est_method": "traced"}
            if stage.startswith("peak"):
                row.update(est_allocated=e.allocated_peak_bytes, est_reserved=e.reserved_peak_bytes,
                           est_device_total=e.device_total_bytes,
                           alloc_ratio=round(r["max_allocated"] / e.allocated_peak_bytes, 4),
                           reserved_ratio=round(r["max_reserved"] / e.reserved_peak_bytes, 4),
                           device_ratio=round(r["device_used"] / e.device_total_bytes, 4))
            rows.append({**row, "rank": rank})
    return rows


def _mib(r: dict, k: str) -> str:
    return f"{r[k] / MiB:.0f}" if r.get(k) is not None else "-"


def print_table(rows: list[dict]) -> None:
    print(f"{'config':<22} {'stage':<26} {'est':<8} {'alloc MiB':>10} {'est':>9} {'x':>6} {'resv MiB':>9} "
          f"{'est':>9} {'x':>6} {'device MiB':>10} {'est':>9} {'x':>6}")
    for r in rows:
        alloc = "max_allocated" if r["stage"].startswith("peak") else "allocated"
        resv = "max_reserved" if r["stage"].startswith("peak") else "reserved"
        print(f"{r['config']:<22} {r['stage']:<26} {r['est_method']:<8} {_mib(r, alloc):>10} "
              f"{_mib(r, 'est_allocated'):>9} {r.get('alloc_ratio') or '-':>6} {_mib(r, resv):>9} "
              f"{_mib(r, 'est_reserved'):>9} {r.get('reserved_ratio') or '-':>6} {_mib(r, 'device_used'):>10} "
              f"{_mib(r, 'est_device_total'):>9} {r.get('device_ratio') or '-':>6}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is the warm-up)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--fsdp-child", nargs=3, metavar=("FOLDER", "SETTINGS", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fsdp_child:
        fsdp_child(*args.fsdp_child)
        return 0
    n = cuda_or_exit()
    os.environ.setdefault("FITBURST_TRACE_CACHE", "0")  # estimate afresh: the check is of today's code
    from fitburst.hardware import resolve_device

    device = resolve_device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        data = fixed_length_data(Path(d) / "long.jsonl")
        for name, overrides in configs(data, max(args.steps, 2)).items():
            print(f"== {name} on {device.name}", flush=True)
            rows += run_one(name, overrides, args.out, device)
    if n >= 2:
        print(f"== FSDP over {n} GPUs", flush=True)
        rows += run_fsdp(n, args.out, device)
    gpu = device.name.replace("cuda (", "").rstrip(")").replace(" ", "_")
    path = args.out / f"gpu_check-{gpu}.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS + ["rank"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print_table(rows)
    print(f"\nwritten: {path} (snapshots beside it in {args.out / 'gpu_check'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
