"""The check to run the day a CUDA GPU is at hand: fitburst's own training runs on the GPU, measured at each stage,
against the preflight's estimates of the same runs.

    python benchmarks/gpu_check.py [--steps 4] [--out benchmarks/results]     # on a CUDA machine
    python benchmarks/gpu_check.py --replay benchmarks/results/gpu_check-NVIDIA_H100_80GB_HBM3.csv   # anywhere

Configurations (:func:`configs`): the demo (tiny Llama, LoRA); a QLoRA nf4 run of a wider demo model (bitsandbytes
on the GPU); that model with LoRA at micro-batch 2 x 1024 tokens, QLoRA with gradient checkpointing at 2048 tokens,
and a full fine-tune at 512 (these five are ``fit``: the first H100 run's figures chose the CUDA rules they
check); held-out ones on other widths, ranks, micro-batches, precisions and an 8-bit optimizer, scored once. With
two or more visible GPUs, a full fine-tune of the wider model with FSDP over all of them, through the product's own
multi-GPU path (``fitburst.ranks.Ranks``: torchrun, NCCL), each rank's peak as the loop records it.

Each single-GPU configuration trains in a process of its own (a fresh CUDA context, as a user's run), through
``fitburst.recipe.train`` itself, with the loop's own functions wrapped to take memory readings: after the model
loads (``fitburst.builders.load_pipeline_model``), after k-bit preparation and LoRA (``prepare_for_training``), after
the warm-up step and at the measured steps' peak (``optimizer_step``): ``torch.cuda.memory._snapshot()`` (pickled
beside the CSV, the allocator's history recorded from the start of a run that keeps a snapshot, so the peak's state
can be rebuilt),
``max_memory_allocated`` / ``max_memory_reserved`` (reset after the warm-up step, as the estimate's measured step
is) and ``mem_get_info`` (device memory in use, CUDA context included). The estimates are the preflight's: the
analytic and the traced estimate of the settings the run trains with (``fitburst.settings.settings_from_spec``
on the probed GPU). One CSV row per configuration and stage goes to ``benchmarks/results/gpu_check-<gpu>.csv``,
with the GPU's facts (memory, context after initialisation, compute capability); a table is printed. Without CUDA it
says so and exits 2.

``--at-scale``: real-size models on one H100 or H200, in one device run of at most 8 minutes (``--budget`` seconds, 450
by default, builds included; the configurations in priority order, those out of time named as such): Qwen2.5-7B LoRA r16
all-linear bf16 at 1,024 and 2,048 tokens with checkpointing off and on, Llama-3.1-8B QLoRA nf4 + double quant +
checkpointing at 2,048, Llama-3.1-8B QLoRA r32 as fitburst plans it for a 24 GB card at its planned longest length on
the GPU capped to 24 GiB (``set_per_process_memory_fraction``; issue 35's 24 GB row), Llama-3.2-1B full at 2 x 1,024,
Gemma-3-1B LoRA at 2 x 2,048 with the standard and the fused loss, then Liger's fused loss, paged AdamW8bit, fp16 +
GradScaler, activation offloading and a save + resume (:data:`_at_scale.CASES`). Each model is built once with random
weights from fitburst's bundled config (memory does not depend on the values) and saved (``--models``, not the
repository), so fitburst's own loading path is measured; each configuration trains through ``fitburst.recipe.train``
with the readings above (an allocator snapshot at the peak only, for the first five configurations), its tokens/s and
MFU after the warm-up step, the SDPA backend that ran and how AdamW stepped; the speed configurations also through
Hugging Face's Trainer + peft on the same settings. ``--out`` gets ``at_scale.csv`` and ``at_scale.json`` (library
versions, each configuration's status) after every configuration, and at most 5 ``snap-<config>.pickle.gz``: with the
log, the 8 files a device run brings back. No estimate is computed on the GPU: ``--replay at_scale.csv`` computes the
traced and analytic ones here.
``--dry-run`` runs all of it on a CPU with tiny stand-ins of the models (tests/test_gpu_check_at_scale.py).

On the device machine (its image lacks some packages): first, here, ``benchmarks/at_scale_carry.sh`` (wheels into
the git-ignored ``.whl/``, 9 MB, bitsandbytes trimmed to its CUDA 13.0 library), then one call of the tool ``run``
with ``carry: [".whl"]``, ``timeout_s: 600`` and this command::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 && python3 benchmarks/gpu_check.py --at-scale \
      --budget 450 --out $OUT --models /tmp/models 2>&1 | tee $OUT/at_scale.log

then, here, copy ``at_scale.csv``, ``at_scale.json`` and the log to ``benchmarks/results/at_scale-<gpu>.*`` and run
``--replay`` on the CSV (its output beside it).

``--replay CSV`` needs no GPU: today's estimates of a CSV's configurations on the GPU it records, against what was
measured there (measured / estimate - 1 per configuration, then the range per role and method). A row's
``others_bytes``, where set, is device memory other processes held while it was measured (``mem_get_info`` counts
every process): it is taken off ``device_used``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import pickle
import sys
import tempfile
import traceback
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import _at_scale as at_scale  # noqa: E402  (beside this file)

MiB = 1 << 20
FIELDS = ["config", "role", "stage", "gpu", "world_size", "seq_len", "device_total_bytes", "context_bytes",
          "capability", "allocated", "reserved", "max_allocated", "max_reserved", "device_used", "est_method",
          "est_allocated", "est_reserved", "est_device_total", "alloc_ratio", "reserved_ratio", "device_ratio",
          "snapshot", "others_bytes", "adamw"]


def cuda_or_exit() -> int:
    """The number of visible CUDA GPUs; a plain message and exit status 2 where there is none."""
    try:
        import torch
    except ImportError:
        print("gpu_check needs torch with CUDA; torch is not installed here", file=sys.stderr)
        raise SystemExit(2) from None
    if not torch.cuda.is_available():  # NVML's count where PYTORCH_NVML_BASED_CUDA_CHECK is set: no CUDA context
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
    qlora = {"method.type": "qlora", "method.quant": "nf4", "method.double_quant": True,
             "method.target_modules": "all-linear"}
    return {
        "demo-lora": {**common, "data.max_seq_len": 128},
        "demo-qlora-nf4": {**common, "model.name": wide, "data.max_seq_len": 512, **qlora},
        "wide-lora-b2-1024": {**common, "model.name": wide, "data.max_seq_len": 1024, "training.micro_batch_size": 2,
                              "method.target_modules": "all-linear"},
        "wide-qlora-nf4-gc-2048": {**common, "model.name": wide, "data.max_seq_len": 2048, **qlora,
                                   "training.gradient_checkpointing": True},
        "wide-full-512": {**common, "model.name": wide, "data.max_seq_len": 512, "method.type": "full"},
        # held out: widths, ranks, targets, micro-batches, precisions and an optimizer the five above do not have
        "ho-lora-r64-b4-512": {**common, "model.name": wide, "data.max_seq_len": 512, "training.micro_batch_size": 4,
                               "method.rank": 64, "method.alpha": 128, "method.target_modules": "all-linear"},
        "ho-qlora-nf4-qv-b2-1024": {**common, "model.name": wide, "data.max_seq_len": 1024,
                                    "training.micro_batch_size": 2, **qlora, "method.double_quant": False,
                                    "method.target_modules": ["q_proj", "v_proj"]},
        "ho-h2048-lora-gc-4096": {**common, "model.name": str(demo_model_dir(hidden_size=2048, num_hidden_layers=4)),
                                  "data.max_seq_len": 4096, "training.gradient_checkpointing": True,
                                  "method.target_modules": "all-linear"},
        "ho-h1536-full-adamw8bit-1024": {**common, "data.max_seq_len": 1024, "method.type": "full",
                                         "model.name": str(demo_model_dir(hidden_size=1536, num_hidden_layers=4)),
                                         "training.optimizer": "adamw8bit"},
        "ho-h1536-lora-fp32-768": {**common, "data.max_seq_len": 768, "training.precision": "fp32",
                                   "model.name": str(demo_model_dir(hidden_size=1536, num_hidden_layers=4)),
                                   "method.target_modules": "all-linear"},
    }


FIT = ("demo-lora", "demo-qlora-nf4", "wide-lora-b2-1024", "wide-qlora-nf4-gc-2048", "wide-full-512")


def role(name: str) -> str:
    """fit: the first H100 run's configurations, whose figures chose the CUDA rules (the cuBLAS workspace's size
    by capability, CUDA_RUNTIME); held-out: the others, which chose nothing."""
    return "fit" if name in FIT else "held-out"


def device_facts(device) -> dict:
    """What the replay needs of the GPU a row was measured on."""
    cap = device.capability
    return {"device_total_bytes": device.total_bytes, "context_bytes": device.context_bytes,
            "capability": f"{cap[0]}.{cap[1]}" if cap else ""}


class Readings:
    """Memory readings at the loop's stages, taken by wrapping the recipe's own functions. ``snapshots``: the
    stages whose allocator snapshot is pickled (None: every stage). Without CUDA (a dry run) no reading is taken:
    each stage's row is empty."""

    def __init__(self, folder: Path, snapshots: set[str] | None = None, history: int = 1_000_000):
        self.folder = folder
        self.rows: dict[str, dict] = {}
        self.steps = 0
        self.snapshots = snapshots
        self.history = history  # allocator events kept for the snapshots (their Python stacks only, below 1M)

    def restart(self) -> None:
        """A second training in the same process (a resume): its first step is a warm-up again."""
        self.steps = 0

    def take(self, stage: str) -> None:
        import torch

        if not torch.cuda.is_available():
            self.rows[stage] = {}
            return
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        snap = self.folder / f"{stage}.pickle"
        if self.snapshots is None or stage in self.snapshots:
            with snap.open("wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
        self.rows[stage] = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                            "max_allocated": torch.cuda.max_memory_allocated(),
                            "max_reserved": torch.cuda.max_memory_reserved(), "device_used": total - free,
                            "snapshot": (str(snap.relative_to(REPO) if snap.is_relative_to(REPO) else snap)
                                         if snap.exists() else "")}

    @contextlib.contextmanager
    def around_training(self):
        """The recipe's load and preparation (fitburst.builders) and step, each followed by a reading."""
        from unittest import mock

        import torch

        import fitburst.builders as builders
        import fitburst.recipe as loop

        load, prepare, step = builders.load_pipeline_model, builders.prepare_for_training, loop.optimizer_step

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
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()  # the estimate's peak is the measured step's
            return loss

        # the allocator's history only for a snapshot: while it records, torch 2.11 raises a SystemError when a
        # checkpoint's recompute runs inside a custom autograd Function's backward (pytorch/pytorch#179536)
        recording = torch.cuda.is_available() and (self.snapshots is None or bool(self.snapshots))
        if recording:
            torch.cuda.memory._record_memory_history(stacks="all" if self.history >= 1_000_000 else "python",
                                                     max_entries=self.history)
        try:
            with (mock.patch.object(builders, "load_pipeline_model", loaded),
                  mock.patch.object(builders, "prepare_for_training", prepared),
                  mock.patch.object(loop, "optimizer_step", stepped)):
                yield
            self.take("peak")
        finally:
            if recording:
                torch.cuda.memory._record_memory_history(enabled=None)


def _local_ref(spec):
    """``spec`` with its model named by the folder the loader reads (the trace builds the model from its config)."""
    from fitburst.models import resolve_model_ref

    return spec.model_copy(update={"model": spec.model.model_copy(update={"name": resolve_model_ref(spec.model.name)})})


def estimates(spec, seq_len: int, device, adamw: str = "auto") -> dict[str, object]:
    """The preflight's analytic and traced estimates of the run ``spec`` trains on ``device`` (one micro-batch of
    ``seq_len`` tokens, unpadded); ``adamw``: how the measured run's AdamW stepped, where not today's rule
    (:func:`fitburst.memory.cuda_kernels.adamw_impl`)."""
    from fitburst.data import images_per_record
    from fitburst.memory import Budget, estimate
    from fitburst.memory.trace import TraceUnsupported, traced_estimate
    from fitburst.models import model_family, spec_shape
    from fitburst.settings import settings_from_spec

    s = replace(settings_from_spec(spec, device, seq_len,
                                   images=images_per_record(spec),
                                   family=model_family(spec.model)), padded=False, adamw=adamw)
    out: dict[str, object] = {}
    shape = spec_shape(spec)
    if shape is not None:
        out["analytic"] = Budget(device).judge(estimate(shape, s, device))
    try:
        out["traced"] = Budget(device).judge(traced_estimate(_local_ref(spec), s, device, seq_len=seq_len))
    except TraceUnsupported as e:
        print(f"  traced estimate unavailable: {e}", file=sys.stderr)
    except Exception:  # the measured rows are kept: an estimate's failure is reported, not fatal
        traceback.print_exc()
    return out


def run_one(name: str, overrides: dict, results: Path, device) -> list[dict]:
    import torch

    from fitburst.data import prepare_pipeline
    from fitburst.memory.cuda_kernels import adamw_impl
    from fitburst.recipe import train
    from fitburst.spec import load_pipeline

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
            row = {"config": name, "role": role(name), "stage": stage, "gpu": device.name, "world_size": 1,
                   "seq_len": seq, **device_facts(device), **r, "est_method": method, "adamw": adamw_impl("cuda")}
            if e is not None and stage == "peak":
                row.update(est_allocated=e.allocated_peak_bytes, est_reserved=e.reserved_peak_bytes,
                           est_device_total=e.device_total_bytes,
                           alloc_ratio=round(r["max_allocated"] / e.allocated_peak_bytes, 4),
                           reserved_ratio=round(r["max_reserved"] / e.reserved_peak_bytes, 4),
                           device_ratio=round(r["device_used"] / e.device_total_bytes, 4))
            rows.append(row)
    return rows


# --- FSDP over every visible GPU ------------------------------------------------------------------------------


def run_fsdp(n: int, data: Path, steps: int, results: Path, device) -> list[dict]:
    """A full fine-tune of the wider demo model sharded over ``n`` GPUs through the product's own multi-GPU path
    (:class:`fitburst.ranks.Ranks`: torchrun, one ``fitburst train`` per rank, NCCL), each rank's peak as
    the loop records it (``TrainResult.rank_peaks``: max_memory_allocated / reserved of the whole run), against the
    traced per-GPU estimate (rank 0 of ``n``) of the same settings."""
    from fitburst.data import images_per_record, prepare_pipeline
    from fitburst.memory import Budget
    from fitburst.memory.trace import traced_estimate
    from fitburst.models import model_family
    from fitburst.ranks import Ranks
    from fitburst.settings import settings_from_spec
    from fitburst.spec import load_pipeline
    from fitburst.train import TrainResult

    over = {**configs(data, steps)["demo-qlora-nf4"], "method.type": "full", "method.quant": "none",
            "training.distributed": "fsdp", "data.max_seq_len": 256}
    spec = load_pipeline(REPO / "pipelines.yaml", "demo", over)
    prepared = prepare_pipeline(spec)
    seq = prepared.stats["max"]
    run_dir = results / "gpu_check" / f"fsdp-{n}"
    Ranks(n).run(spec, prepared.dir, run_dir, device="cuda")
    peaks = TrainResult.load(run_dir).rank_peaks
    s = replace(settings_from_spec(spec, device, seq,
                                   images=images_per_record(spec),
                                   family=model_family(spec.model)), padded=False, world_size=n)
    e = Budget(device, gpus_per_node=n).judge(traced_estimate(_local_ref(spec), s, device, seq_len=seq))
    rows = []
    for rank, p in enumerate(peaks):
        rows.append({"config": f"fsdp-full-{n}gpus", "stage": "peak (whole run)", "gpu": device.name,
                     "world_size": n, "rank": rank, "max_allocated": p.allocated_bytes,
                     "max_reserved": p.reserved_bytes,
                     "est_method": "traced", "est_allocated": e.allocated_peak_bytes,
                     "est_reserved": e.reserved_peak_bytes, "est_device_total": e.device_total_bytes,
                     "alloc_ratio": round((p.allocated_bytes or 0) / e.allocated_peak_bytes, 4),
                     "reserved_ratio": round((p.reserved_bytes or 0) / e.reserved_peak_bytes, 4)})
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


def run_config(name: str, steps: int, out: Path) -> int:
    """One configuration, in this process (the parent starts one process per configuration): its rows as JSON."""
    cuda_or_exit()
    from fitburst.hardware import resolve_device

    device = resolve_device("cuda")  # probed first: the context this process's CUDA initialisation made
    with tempfile.TemporaryDirectory() as d:
        data = fixed_length_data(Path(d) / "long.jsonl")
        rows = run_one(name, configs(data, steps)[name], out, device)
    (out / "gpu_check" / name / "rows.json").write_text(json.dumps(rows))
    return 0


def run_all(args: argparse.Namespace, n: int) -> int:
    """Every configuration in a process of its own, then FSDP over all GPUs; the CSV is rewritten after each. This
    process makes no CUDA context while the configurations run: ``mem_get_info`` counts every process's memory, so a
    context here would be read as the child's (the GPU's name, for the CSV's, comes from the children's rows)."""
    import subprocess

    rows: list[dict] = []
    failed: list[str] = []

    def write() -> None:
        if not rows:
            return
        gpu = rows[0]["gpu"].replace("cuda (", "").rstrip(")").replace(" ", "_")
        with (args.out / f"gpu_check-{gpu}.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS + ["rank"], extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    with tempfile.TemporaryDirectory() as d:
        data = fixed_length_data(Path(d) / "long.jsonl")
        table = configs(data, args.steps)
        names = args.only or list(table)
        if unknown := [c for c in names if c not in table]:
            print(f"unknown configuration(s) {', '.join(unknown)}: choose from {', '.join(table)}", file=sys.stderr)
            return 2
        for name in names:
            print(f"== {name}", flush=True)
            cmd = [sys.executable, __file__, "--config", name, "--steps", str(args.steps), "--out", str(args.out)]
            try:
                rc = subprocess.run(cmd, timeout=args.config_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = -1
                print(f"  {name}: over {args.config_timeout} s, stopped", file=sys.stderr)
            done = args.out / "gpu_check" / name / "rows.json"
            if rc == 0 and done.exists():
                rows.extend(json.loads(done.read_text()))
            else:
                failed.append(name)
            write()
        if n >= 2:
            from fitburst.hardware import resolve_device

            print(f"== FSDP over {n} GPUs", flush=True)
            try:
                rows.extend(run_fsdp(n, data, args.steps, args.out, resolve_device("cuda")))
            except Exception:
                traceback.print_exc()
                failed.append("fsdp")
            write()
    print_table(rows)
    print(f"\nwritten: gpu_check-<gpu>.csv in {args.out} (snapshots beside it in {args.out / 'gpu_check'})")
    if failed:
        print(f"failed: {', '.join(failed)} (their output above)", file=sys.stderr)
    return 1 if failed else 0


def replay(csv_path: Path) -> int:
    """Today's estimates of ``csv_path``'s single-GPU configurations on the GPU it records, against its peaks."""
    os.environ.setdefault("FITBURST_TRACE_CACHE", "0")
    from fitburst.data import prepare_pipeline
    from fitburst.hardware import cuda_gpu
    from fitburst.spec import load_pipeline

    with csv_path.open() as f:
        peaks = {r["config"]: r for r in csv.DictReader(f) if r["stage"] == "peak" and r["world_size"] == "1"}
    errors: dict[tuple[str, str, str], list[float]] = {}
    print(f"{'config':<30} {'role':<9} {'est':<9} {'alloc MiB':>9} {'est':>8} {'err':>7} {'resv MiB':>9} {'est':>8} "
          f"{'err':>7} {'device MiB':>10} {'est':>8} {'err':>7}")
    with tempfile.TemporaryDirectory() as d:
        data = fixed_length_data(Path(d) / "long.jsonl")
        table = configs(data, 4)
        for name, r in peaks.items():
            cap = tuple(int(x) for x in r["capability"].split(".")) if r["capability"] else None
            device = cuda_gpu(r["gpu"], int(r["device_total_bytes"] or 0), int(r["context_bytes"]),
                              (cap[0], cap[1]) if cap else None)
            spec = load_pipeline(REPO / "pipelines.yaml", "demo", {**table[name], "preflight.device": "cpu"})
            seq = prepare_pipeline(spec).stats["max"]
            measured = {"alloc": int(r["max_allocated"]), "resv": int(r["max_reserved"]),
                        "device": int(r["device_used"]) - int(r.get("others_bytes") or 0)}
            # a row without the column was measured before the loop fused AdamW: torch's CUDA default, foreach, ran
            for method, e in estimates(spec, seq, device, adamw=r.get("adamw") or "foreach").items():
                est = {"alloc": e.allocated_peak_bytes, "resv": e.reserved_peak_bytes, "device": e.device_total_bytes}
                err = {k: measured[k] / est[k] - 1 for k in est}
                for k, v in err.items():
                    errors.setdefault((r["role"], method, k), []).append(v)
                print(f"{name:<30} {r['role']:<9} {method:<9} " + " ".join(
                    f"{measured[k] / MiB:>9.0f} {est[k] / MiB:>8.0f} {err[k]:>+7.1%}" for k in est))
    print("\nmeasured / estimate - 1 (positive: the run needed more than estimated)")
    for (rl, method, k), v in sorted(errors.items()):
        print(f"  {rl:<9} {method:<9} {k:<7} {min(v):+.2%} .. {max(v):+.2%}  ({len(v)} configurations)")
    return 0


def is_at_scale(csv_path: Path) -> bool:
    """Whether ``csv_path`` was written by --at-scale (its rows say which loop ran)."""
    with csv_path.open() as f:
        return "loop" in (csv.DictReader(f).fieldnames or [])


def run_at_scale(args: argparse.Namespace) -> int:
    """--at-scale (--dry-run: on the CPU with tiny stand-ins): the parent, or one of its child processes."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the parent makes no CUDA context
    if not args.dry_run:
        cuda_or_exit()
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in ("build", "case", "trainer"):
        if name := getattr(args, kind):
            return at_scale.child_main(kind, name, args.out, args.models, args.steps, args.dry_run, args.snapshot)
    return at_scale.run_all(args.out, args.models, args.budget, args.steps, args.dry_run, args.only)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, help="optimizer steps per run, the first the warm-up (4; --at-scale: 6)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--only", nargs="*", help="these configurations only, in this order")
    p.add_argument("--config-timeout", type=int, default=240, help="seconds one configuration may take")
    p.add_argument("--config", help=argparse.SUPPRESS)  # the child process of one configuration
    p.add_argument("--replay", type=Path, help="no GPU: today's estimates against a CSV this check wrote")
    p.add_argument("--at-scale", action="store_true", help="real-size models on one GPU (the module's docstring)")
    p.add_argument("--dry-run", action="store_true", help="--at-scale on the CPU with tiny stand-ins of the models")
    p.add_argument("--budget", type=float, default=450, help="--at-scale: seconds for everything, builds included")
    p.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "fitburst-at-scale",
                   help="--at-scale: where the models are built (GBs: not the repository)")
    for child in ("--build", "--case", "--trainer"):  # --at-scale's child processes
        p.add_argument(child, help=argparse.SUPPRESS)
    p.add_argument("--snapshot", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.steps = max(args.steps or (6 if args.at_scale or args.dry_run else 4), 2)
    if args.replay:
        return at_scale.replay(args.replay) if is_at_scale(args.replay) else replay(args.replay)
    if args.at_scale or args.dry_run or args.build or args.case or args.trainer:
        return run_at_scale(args)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # counting the GPUs makes no CUDA context
    n = cuda_or_exit()
    os.environ.setdefault("FITBURST_TRACE_CACHE", "0")  # estimate afresh: the check is of today's code
    args.out.mkdir(parents=True, exist_ok=True)
    if args.config:
        return run_config(args.config, args.steps, args.out)
    return run_all(args, n)


if __name__ == "__main__":
    raise SystemExit(main())
