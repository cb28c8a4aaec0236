"""The analytic estimate against the traced one on CUDA, at full size: where the constants of the analytic reserved
term (fitburst.memory.estimator.RESERVED_FACTOR / RESERVED_PER_LOGITS / RESERVED_FLOOR) come from.

A seeded grid of configurations (10 bundled models; T4 / L4 / A100; LoRA / QLoRA, eager / SDPA, padded or not,
checkpointing or not, 256-2048 tokens) is traced (FakeTensorMode, CUDA rules, caching-allocator replay) and
estimated analytically. Prints per configuration and per group traced / analytic - 1 for allocated and reserved,
then the least-squares fit of reserved - allocated = a x allocated + b x fp32 logits + c on the traced replays of
the FIT models, scored on the others (held out). Nothing here is a measurement of a GPU.

With ``--mps`` the same grid runs on a 64 GB Apple MPS device (bf16 LoRA, no 4-bit: bitsandbytes' 4-bit layers
need CUDA): SDPA as MPS runs it for training (its math composite) and MPS's autocast, allocated figures only (MPS
has no allocator model to fit).

Usage: python benchmarks/analytic_vs_traced.py [--n 100] [--seed 1] [--mps]   (about 8 minutes on the 2-core box)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitburst.memory import RunSettings, estimate, load_shape, resolve_device  # noqa: E402
from fitburst.memory.estimator import RESERVED_FACTOR, RESERVED_FLOOR, RESERVED_PER_LOGITS  # noqa: E402
from fitburst.memory.trace import TraceUnsupported, traced_estimate  # noqa: E402
from fitburst.spec import PipelineSpec  # noqa: E402

FIT = ["Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.2-1B", "google/gemma-3-270m", "Qwen/Qwen2.5-1.5B"]
HELD_OUT = ["HuggingFaceTB/SmolLM2-135M", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "Qwen/Qwen2.5-3B",
            "meta-llama/Llama-3.2-3B", "microsoft/phi-1_5"]
MiB = 1 << 20
# Seeds already printed while the analytic terms were being changed: their rows are looked-at, never held-out
# (seed 1: two of its configurations were read to find the k-bit terms; seed 2: its phi-1.5 row showed the MLP
# term; seeds 3 and 4 (--mps): the MPS math-attention terms were re-scored on them; seed 5 was scored once as
# held-out, --n 40, figures in fitburst/memory/calibration.py). A seed not listed here is held-out the first time it
# is scored; add it here once it has been.
LOOKED_AT_SEEDS = {1, 2, 3, 4, 5}


def grid(n: int, seed: int, mps: bool = False) -> list[tuple[str, str, RunSettings]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        model = rnd.choice(FIT if i % 5 < 3 else HELD_OUT)
        dev = rnd.choice(["T4", "T4", "A100-40GB", "L4"])
        quant, b = rnd.choice(["none", "nf4"]), rnd.choice([1, 2, 4])
        if mps:
            dev, quant = "mps:64GiB", "none"
        out.append((model, dev, RunSettings(
            method="qlora" if quant == "nf4" else "lora", quant=quant, double_quant=rnd.choice([True, False]),
            rank=rnd.choice([8, 16, 32]), target_modules=rnd.choice([["q_proj", "v_proj"],
                                                                     "all-linear"]), micro_batch_size=b,
            seq_len=rnd.choice([256, 512, 1024, 2048]), gradient_checkpointing=rnd.choice([True, False]),
            precision="fp16" if dev == "T4" else "bf16", attention=rnd.choice(["eager", "sdpa"]), keep_logits=False,
            dropout=rnd.choice([0.0, 0.05]), padded=rnd.choice([False, True]) if b > 1 else False)))
    return out


def _range(errs: list[float]) -> str:
    return (f"n={len(errs)}: {min(errs):+.1%} .. {max(errs):+.1%}, median |error| "
            f"{statistics.median(abs(e) for e in errs):.1%}") if errs else "n=0"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mps", action="store_true", help="an Apple MPS device instead of the CUDA GPUs")
    args = ap.parse_args()
    seen = "looked-at" if args.seed in LOOKED_AT_SEEDS else "held-out"
    rows = []
    print(f"seed {args.seed}: rows of FIT models are fit rows (the reserved term's least squares below); the others "
          f"are {seen}")
    print("| model | row | device | settings | traced alloc / reserved MiB | analytic alloc / reserved MiB | "
          "reserved: traced / analytic - 1 |")
    print("|---|---|---|---|---:|---:|---:|")
    for model, dev, s in grid(args.n, args.seed, args.mps):
        device = resolve_device(dev)
        spec = PipelineSpec.model_validate(dict(name="g", model=dict(name=model), data=dict(path="x.jsonl")))
        try:
            t = traced_estimate(spec, s, device, seq_len=s.seq_len)
        except TraceUnsupported as e:
            print(f"| {model} | | {dev} | {s.describe()} | refused: {e} | | |")
            continue
        shape = load_shape(model)
        a = estimate(shape, s, device, calibrate=False)
        rows.append(dict(model=model, role="fit" if model in FIT else seen, ckpt=s.gradient_checkpointing,
                         t_alloc=t.allocated_peak_bytes, t_res=t.reserved_peak_bytes,
                         a_alloc=a.allocated_peak_bytes, a_res=a.reserved_peak_bytes,
                         logits=4 * s.micro_batch_size * s.seq_len * shape.vocab))
        r = rows[-1]
        print(f"| {model.split('/')[1]} | {r['role']} | {dev} | {s.describe()} | {r['t_alloc'] / MiB:,.0f} / "
              f"{r['t_res'] / MiB:,.0f} | {r['a_alloc'] / MiB:,.0f} / {r['a_res'] / MiB:,.0f} | "
              f"{r['t_res'] / r['a_res'] - 1:+.1%} |")
    print("\ntraced / analytic - 1 (the scale of calibration's analytic-vs-traced band):")
    for role in ("fit", seen):
        for name, sel in (("with checkpointing", True), ("without", False)):
            rr = [r for r in rows if r["ckpt"] == sel and r["role"] == role]
            print(f"  {role} rows, {name}: allocated {_range([r['t_alloc'] / r['a_alloc'] - 1 for r in rr])}; "
                  f"reserved {_range([r['t_res'] / r['a_res'] - 1 for r in rr])}")
    if args.mps:
        return
    fit = np.array([r["model"] in FIT for r in rows])
    x = np.array([[r["t_alloc"], r["logits"], 1.0] for r in rows])
    y = np.array([r["t_res"] - r["t_alloc"] for r in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(x[fit], y[fit], rcond=None)
    kept = np.array([RESERVED_FACTOR["cuda"] - 1, RESERVED_PER_LOGITS["cuda"], RESERVED_FLOOR["cuda"]])
    print(f"\nreserved - allocated on the traced replays = a x allocated + b x fp32 logits + c, least squares on "
          f"{fit.sum()} configurations of the fit models: a {coef[0]:.3f}, b {coef[1]:.3f}, c {coef[2] / MiB:.0f} MiB "
          f"(the estimator has {kept[0]:.3f}, {kept[1]:.3f}, {kept[2] / MiB:.0f} MiB)")
    for label, c in (("this fit", coef), ("the estimator's", kept), ("x 1.06 + 64 MiB", [0.06, 0.0, 64 * MiB])):
        for name, sel in (("fit models", fit), ("held-out models", ~fit)):
            pred = x[sel] @ np.asarray(c) + x[sel, 0]
            print(f"  {label}, {name}: reserved from the traced allocated "
                  f"{_range(list(pred / (y[sel] + x[sel, 0]) - 1))}")


if __name__ == "__main__":
    main()
