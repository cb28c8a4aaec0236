"""What does fitburst's training loop cost over a bare peft + torch loop?

Both train the same model (the demo architecture, and it scaled up), on the same prepared batches in the same
order, with the same LoRA, optimizer, scheduler and clipping. They run **interleaved step by step in one process**:
fitburst's ``train`` calls back after every optimizer step (``training.log_every: 1``), and the callback runs one
step of the bare loop. Each fitburst step is timed from the end of one callback to the start of the next (the
whole of its loop iteration: the batch, the step, the scheduler, the pace and memory readings, the loss read, the
metrics row written to metrics.jsonl and the progress bar; logging every step is more than the default of every
10, so the figure errs against fitburst), each bare step inside the callback. A pair is a fitburst step and the bare
step right after it, seconds apart: load from other processes on a shared machine moves both alike, so the ratio of
a pair (bare seconds / fitburst seconds = fitburst steps/s / bare steps/s) cancels it where the ratio of two
separately timed runs does not. The first ``--warmup`` pairs are left out (allocator, kernels, first launches).

Prints per row, for the wall clock and for the process's CPU seconds, the median of the paired ratios with a 95 %
confidence interval of that median (order statistics, no distribution assumed), their 10th-90th percentiles, and
each loop's median steps/s. The CPU seconds count the work each step does, not the time it waited for a core (both
loops run the same torch threads), so a shared machine's load stretches them less than the clock.

Target: ratio >= 0.97 at the larger size, where a bare step takes >= 0.2 s so the figure measures what fitburst
adds, not Python's per-step cost. The ``bf16`` row compares the mixed-precision path (bf16 base, fp32 adapters,
``torch.autocast``) with a bare autocast peft loop.

    python benchmarks/train_overhead.py [--pairs 40] [--warmup 2] [--rows demo,scaled,scaled-bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fitburst.cache import cache_root
from fitburst.data import load_split, prepare
from fitburst.demo_models import demo_model_dir
from fitburst.models import load_model, load_tokenizer
from fitburst.spec import load_pipeline
from fitburst.train import batches, train

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.97


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class BareLoop:
    """The reference: from_pretrained + get_peft_model + AdamW + the same batches, nothing else (under
    ``torch.autocast`` with a bf16 base when the spec says bf16), one optimizer step per :meth:`step`."""

    def __init__(self, spec, prepared, steps: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import get_scheduler

        m, tr = spec.method, spec.training
        torch.manual_seed(tr.seed)
        tok = load_tokenizer(spec.model.name)
        self.low = tr.precision == "bf16"
        model = load_model(spec.model.name, dtype=torch.bfloat16 if self.low else torch.float32, device="cpu")
        model.config.use_cache = False
        self.model = get_peft_model(model, LoraConfig(r=m.rank, lora_alpha=m.alpha, lora_dropout=m.dropout,
                                                      target_modules=m.target_modules, task_type="CAUSAL_LM"))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=tr.learning_rate)
        self.sched = get_scheduler(tr.lr_scheduler, self.opt, num_warmup_steps=tr.warmup_steps,
                                   num_training_steps=steps)
        self.stream = batches(load_split(prepared, "train").to_list(), tr.micro_batch_size, tok.pad_token_id,
                              tr.seed, 0)
        self.max_grad_norm = tr.max_grad_norm
        self.model.train()

    def step(self) -> float:
        """One optimizer step; returns its loss (read on the host, as fitburst's loop reads it every step here)."""
        import torch

        with torch.autocast("cpu", dtype=torch.bfloat16) if self.low else contextlib.nullcontext():
            loss = self.model(**next(self.stream)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


@dataclass
class Interleave:
    """fitburst's ``on_metrics`` callback: times the fitburst step that just ended, then runs and times one bare
    step."""

    bare: BareLoop
    fitburst_s: list[float] = field(default_factory=list)
    bare_s: list[float] = field(default_factory=list)
    fitburst_cpu: list[float] = field(default_factory=list)
    bare_cpu: list[float] = field(default_factory=list)
    last_end: tuple[float, float] | None = None

    def __call__(self, row: dict, step: int) -> None:
        now = time.perf_counter(), time.process_time()
        if self.last_end is not None:
            self.fitburst_s.append(now[0] - self.last_end[0])
            self.fitburst_cpu.append(now[1] - self.last_end[1])
            self.bare.step()
            end = time.perf_counter(), time.process_time()
            self.bare_s.append(end[0] - now[0])
            self.bare_cpu.append(end[1] - now[1])
        self.last_end = time.perf_counter(), time.process_time()


def median_ci(xs: list[float]) -> tuple[float, float]:
    """A 95 % confidence interval of the median of ``xs`` from order statistics (the binomial's normal
    approximation): valid for any distribution of independent pairs."""
    s, n = sorted(xs), len(xs)
    half = 1.96 * math.sqrt(n) / 2
    return s[max(0, math.floor(n / 2 - half))], s[min(n - 1, math.ceil(n / 2 + half) - 1)]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(label: str, model_dir: Path, pairs: int, warmup: int, batch: int, precision: str = "fp32") -> dict:
    steps = pairs + warmup + 1  # the first fitburst step has no bare step before it to pair with
    overrides = {"model.name": str(model_dir), "training.max_steps": steps, "training.micro_batch_size": batch,
                 "training.grad_accum": 1, "training.checkpoint_every": 10**6, "training.log_every": 1,
                 "training.precision": precision, "method.dropout": 0.0}
    spec = load_pipeline(ROOT / "pipelines.yaml", "demo", overrides)
    tok = load_tokenizer(spec.model.name)
    prepared = prepare(spec.data, spec.data_path(), tok, cache_root() / "data")
    load_start = loadavg()
    clock = Interleave(BareLoop(spec, prepared, steps))
    run_dir = Path(tempfile.mkdtemp(prefix="fb-bench-"))
    try:
        train(spec, prepared, run_dir, progress=False, on_metrics=clock)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    load = f"{load_start} -> {loadavg()}"
    return {"size": label, "load": load, "wall": paired(clock.fitburst_s[warmup:], clock.bare_s[warmup:]),
            "cpu": paired(clock.fitburst_cpu[warmup:], clock.bare_cpu[warmup:])}


def paired(fb: list[float], bare: list[float]) -> dict:
    """The paired ratios' summary (bare seconds / fitburst seconds of each pair)."""
    ratios = [b / f for f, b in zip(fb, bare, strict=True)]
    return {"pairs": len(ratios), "ratio": statistics.median(ratios), "ci": median_ci(ratios),
            "p10": percentile(ratios, 0.1), "p90": percentile(ratios, 0.9), "total": sum(bare) / sum(fb),
            "fitburst": 1 / statistics.median(fb), "bare": 1 / statistics.median(bare),
            "bare_step_s": statistics.median(bare)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=40, help="timed pairs of the scaled rows (the demo row: 5x)")
    ap.add_argument("--warmup", type=int, default=2, help="pairs left out at the start")
    ap.add_argument("--rows", default="demo,scaled,scaled-bf16", help="comma-separated: demo, scaled, scaled-bf16")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    big = {"hidden_size": 768, "num_hidden_layers": 12}
    cases = {
        "demo": lambda: measure("demo (0.6M params)", demo_model_dir(), args.pairs * 5, args.warmup, 8),
        "scaled": lambda: measure("scaled (h768 x 12 layers)", demo_model_dir(**big), args.pairs, args.warmup, 16),
        "scaled-bf16": lambda: measure("scaled, bf16 autocast", demo_model_dir(**big), args.pairs, args.warmup, 16,
                                       precision="bf16"),
    }
    rows = [cases[name.strip()]() for name in args.rows.split(",")]
    print("fitburst / bare, paired step by step (ratio = bare s / fitburst s of adjacent steps; > 1: fitburst faster). "
          "wall: the clock; CPU: the process's CPU seconds (all its threads), which a shared machine's load stretches "
          "far less (it counts the work, not the waiting for a core)")
    print("| row | clock | pairs | median ratio | 95 % CI of the median | p10 .. p90 | total time ratio | fitburst "
          "steps/s | bare steps/s | bare s/step | target >= 0.97 | load average (1/5/15 min) start -> end |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        for clock in ("wall", "cpu"):
            m = r[clock]
            met = "yes" if m["ci"][0] >= TARGET else ("no" if m["ci"][1] < TARGET else "not resolved")
            print(f"| {r['size']} | {clock} | {m['pairs']} | {m['ratio']:.3f} | {m['ci'][0]:.3f} .. {m['ci'][1]:.3f} "
                  f"| {m['p10']:.3f} .. {m['p90']:.3f} | {m['total']:.3f} | {m['fitburst']:.3f} | {m['bare']:.3f} | "
                  f"{m['bare_step_s']:.3f} | {met} | {r['load']} |")


if __name__ == "__main__":
    main()
