"""What does fitburst's training recipe cost over a bare peft + torch loop?

Both train the same model (the demo architecture scaled up), on the same prepared batches, with the same LoRA,
optimizer, scheduler and clipping, for the same number of steps, each timed after its warm-up step; repetitions
interleave the two so drift on a shared machine hits both. Prints steps/s of each and ``ratio`` = fitburst / bare
(target >= 0.97 at the larger size, where a bare step takes >= 0.2 s so the figure measures what fitburst adds, not
Python's per-step cost).
The ``bf16`` rows compare the mixed-precision path (bf16 base, fp32 adapters, ``torch.autocast``) with a bare
autocast peft loop.

    python benchmarks/train_overhead.py [--reps 3] [--steps 20] [--rows demo,scaled,scaled-bf16]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from fitburst.cache import cache_root
from fitburst.data import load_split, prepare
from fitburst.demo_models import demo_model_dir
from fitburst.models import load_model, load_tokenizer
from fitburst.recipe import train
from fitburst.spec import load_pipeline
from fitburst.train import batches

ROOT = Path(__file__).resolve().parents[1]


def bare_loop(spec, prepared, steps: int) -> float:
    """The reference: from_pretrained + get_peft_model + AdamW + the same batches, nothing else (under
    ``torch.autocast`` with a bf16 base when the spec says bf16)."""
    import contextlib

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import get_scheduler

    m, tr = spec.method, spec.training
    torch.manual_seed(tr.seed)
    tok = load_tokenizer(spec.model.name)
    low = tr.precision == "bf16"
    model = load_model(spec.model.name, dtype=torch.bfloat16 if low else torch.float32, device="cpu")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=m.rank, lora_alpha=m.alpha, lora_dropout=m.dropout,
                                             target_modules=m.target_modules, task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tr.learning_rate)
    sched = get_scheduler(tr.lr_scheduler, opt, num_warmup_steps=tr.warmup_steps, num_training_steps=steps)
    stream = batches(load_split(prepared, "train").to_list(), tr.micro_batch_size, tok.pad_token_id, tr.seed, 0)
    model.train()
    t0 = time.perf_counter()
    for i in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16) if low else contextlib.nullcontext():
            loss = model(**next(stream)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tr.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i == 0:  # timed from the end of the warm-up step, as fitburst's steps/s is (fitburst.pace.Pace)
            t0 = time.perf_counter()
    return (steps - 1) / (time.perf_counter() - t0)


def fitburst_loop(spec, prepared, steps: int) -> float:
    run_dir = Path(tempfile.mkdtemp(prefix="fb-bench-"))
    try:
        return train(spec, prepared, run_dir, progress=True).steps_per_sec
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def measure(label: str, model_dir: Path, steps: int, reps: int, batch: int, precision: str = "fp32") -> dict:
    overrides = {"model.name": str(model_dir), "training.max_steps": steps, "training.micro_batch_size": batch,
                 "training.grad_accum": 1, "training.checkpoint_every": 10**6, "training.log_every": 10,
                 "training.precision": precision, "method.dropout": 0.0}
    spec = load_pipeline(ROOT / "pipelines.yaml", "demo", overrides)
    tok = load_tokenizer(spec.model.name)
    prepared = prepare(spec.data, spec.data_path(), tok, cache_root() / "data")
    # warm-up (allocator, kernels) for both
    bare_loop(spec, prepared, 3)
    fitburst_loop(spec.model_copy(update={"training": spec.training.model_copy(update={"max_steps": 3})}), prepared, 3)
    fb, bare = [], []
    for rep in range(reps):  # alternate which goes first, so order effects cancel
        first, second = (fitburst_loop, bare_loop) if rep % 2 == 0 else (bare_loop, fitburst_loop)
        a, b = first(spec, prepared, steps), second(spec, prepared, steps)
        fb.append(a if first is fitburst_loop else b)
        bare.append(b if first is fitburst_loop else a)
    print(f"{label}: fitburst steps/s per rep {[round(x, 3) for x in fb]}, bare {[round(x, 3) for x in bare]}")
    return {"size": label, "fitburst": statistics.median(fb), "bare": statistics.median(bare),
            "ratio": statistics.median(fb) / statistics.median(bare), "bare_step_s": 1 / statistics.median(bare)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", default="demo,scaled,scaled-bf16", help="comma-separated: demo, scaled, scaled-bf16")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cases = {
        "demo": lambda: measure("demo (0.6M params)", demo_model_dir(), args.steps * 5, args.reps, 8),
        "scaled": lambda: measure("scaled (h768 x 12 layers)", demo_model_dir(hidden_size=768, num_hidden_layers=12),
                                  args.steps, args.reps, 16),
        "scaled-bf16": lambda: measure("scaled, bf16 autocast", demo_model_dir(hidden_size=768, num_hidden_layers=12),
                                       args.steps, args.reps, 16, precision="bf16"),
    }
    rows = [cases[name.strip()]() for name in args.rows.split(",")]
    print(f"\n{'size':<28}{'fitburst steps/s':>18}{'bare steps/s':>15}{'bare s/step':>13}{'ratio':>8}")
    for r in rows:
        print(f"{r['size']:<28}{r['fitburst']:>18.3f}{r['bare']:>15.3f}{r['bare_step_s']:>13.3f}{r['ratio']:>8.3f}")
    for r in rows:
        print(f"{r['size']}: ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
