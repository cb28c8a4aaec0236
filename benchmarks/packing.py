"""Packed (padding-free) vs padded batches on the demo pipeline: tokens/s and peak tensor memory.

Both arms run fitburst's own optimizer step (:func:`fitburst.train.optimizer_step`) on the same shuffled micro-batches
of the demo data (the tiny demo model, LoRA as in pipelines.yaml, fp32 on the CPU), after warm-up steps;
repetitions interleave the arms so drift on a shared machine hits both. ``tokens/s`` counts real (non-padding)
tokens; ``computed`` is the tokens the model ran (padding included); the peak is live tensor bytes counted by the
probe's dispatch tracker (:class:`fitburst.probe.TensorTracker`, exact on the CPU) in a second pass over the same
steps, the model, optimizer state and the batch in use counted.

    python benchmarks/packing.py [--steps 30] [--reps 2] [--batches 8,32] [--attention sdpa]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from fitburst.builders import build_model, make_optimizer
from fitburst.cache import cache_root
from fitburst.data import batch_tokens, load_split, prepare
from fitburst.models import load_tokenizer
from fitburst.probe import TensorTracker
from fitburst.spec import load_pipeline
from fitburst.train import batches, optimizer_step

ROOT = Path(__file__).resolve().parents[1]


def run(spec, rows: list[dict], pad_id: int, packed: bool, steps: int, warmup: int = 3) -> dict:
    import torch

    tr = spec.training
    torch.manual_seed(tr.seed)
    model, _ = build_model(spec, "cpu", "fp32")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(tr.optimizer, params, tr.learning_rate, tr.weight_decay)
    stream = batches(rows, tr.micro_batch_size, pad_id, tr.seed, 0, packed)
    model.train()
    for _ in range(warmup):
        optimizer_step(model, opt, params, [next(stream)], device="cpu", max_grad_norm=tr.max_grad_norm)
    micro = [next(stream) for _ in range(steps)]
    t0 = time.perf_counter()
    losses = [optimizer_step(model, opt, params, [b], device="cpu", max_grad_norm=tr.max_grad_norm) for b in micro]
    seconds = time.perf_counter() - t0
    real = sum(batch_tokens(b) for b in micro)
    computed = sum(b["input_ids"].numel() for b in micro)
    # peak live tensor bytes over the same steps, in a second pass (the tracker slows the step): model, optimizer
    # state, and only the batch in use
    tracker = TensorTracker()
    state = [v for st in opt.state.values() for v in st.values()]
    tracker.add(list(model.parameters()) + list(model.buffers()) + state)
    with tracker:
        while micro:
            b = micro.pop(0)
            tracker.add(list(b.values()))
            optimizer_step(model, opt, params, [b], device="cpu", max_grad_norm=tr.max_grad_norm)
            del b
    return {"tokens_per_s": real / seconds, "computed": computed, "real": real, "peak": tracker.peak,
            "loss": statistics.mean(losses)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    args = ap.parse_args()
    base = load_pipeline(ROOT / "pipelines.yaml", "demo")
    tok = load_tokenizer(base.model.name)
    prepared = prepare(base.data, base.data_path(), tok, cache_root() / "data")
    rows = load_split(prepared, "train").to_list()
    print(f"demo data: {len(rows)} train samples, length p50 {prepared.stats['p50']}, max {prepared.stats['max']}; "
          f"demo model, LoRA, fp32, CPU, attention {args.attention}, {args.steps} steps x {args.reps} reps")
    print(f"{'micro batch':>11} {'packing':>8} {'tokens/s':>9} {'real/computed':>14} {'peak tensor MiB':>16} "
          f"{'mean loss':>9}")
    for b in (int(x) for x in args.batches.split(",")):
        spec = base.model_copy(update={"training": base.training.model_copy(update={
            "micro_batch_size": b, "attention": args.attention})})
        got: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.reps):
            for packed in (False, True):
                got[packed].append(run(spec, rows, tok.pad_token_id, packed, args.steps))
        for packed, rs in got.items():
            r = rs[-1]
            print(f"{b:>11} {'on' if packed else 'off':>8} {statistics.median(x['tokens_per_s'] for x in rs):>9.0f} "
                  f"{r['real'] / r['computed']:>14.2f} {max(x['peak'] for x in rs) / 2**20:>16.2f} "
                  f"{r['loss']:>9.4f}")


if __name__ == "__main__":
    main()
