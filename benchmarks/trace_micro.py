"""The traced step with its first TRACED_MICRO micro-batches against the trace of every micro-batch: same peak?

The preflight traces at most ``fitburst.memory.trace.TRACED_MICRO`` micro-batches of each accumulation window and
keeps the others as the input tensors the loop's list holds (see that constant). A seeded grid of configurations
(bundled models; CPU, T4, A100; LoRA / QLoRA / full; grad_accum 3-8; checkpointing or not) is traced both ways;
the table prints allocated and reserved of each and the trace time. Nothing here is a measurement of a device.

Usage: python benchmarks/trace_micro.py [--n 12] [--seed 1]   (about 6 minutes on the 2-core box)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitburst.memory import RunSettings, resolve_device, trace  # noqa: E402
from fitburst.spec import PipelineSpec  # noqa: E402

MODELS = ["Qwen/Qwen2.5-0.5B", "HuggingFaceTB/SmolLM2-135M", "google/gemma-3-270m", "meta-llama/Llama-3.2-1B",
          "microsoft/phi-1_5"]
MiB = 1 << 20


def grid(n: int, seed: int) -> list[tuple[str, str, RunSettings]]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        dev = rnd.choice(["cpu:64GiB", "T4", "A100-40GB"])
        method = rnd.choice(["lora", "qlora", "full"] if dev != "cpu:64GiB" else ["lora", "full"])
        dtype = "fp32" if dev.startswith("cpu") else "fp16" if dev == "T4" else "bf16"
        out.append((rnd.choice(MODELS), dev, RunSettings(
            method=method, quant="nf4" if method == "qlora" else "none", rank=16, target_modules="all-linear",
            micro_batch_size=rnd.choice([1, 2]), grad_accum=rnd.choice([3, 4, 8]), seq_len=rnd.choice([128, 256, 512]),
            gradient_checkpointing=rnd.choice([True, False]), precision=dtype, attention="sdpa", keep_logits=False,
            dropout=0.0, optimizer=rnd.choice(["adamw", "adamw8bit"]) if dev != "cpu:64GiB" else "adamw")))
    return out


def traced(model: str, dev: str, s: RunSettings, micro: int | None) -> tuple[int, int, float]:
    spec = PipelineSpec.model_validate({"name": "x", "model": {"name": model}, "data": {"path": "x.jsonl"}})
    step = trace.trace_step
    trace.trace_step = lambda *a, **k: step(*a, **{**k, "traced_micro": micro})  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        est = trace._traced_estimate(spec, s, resolve_device(dev), seq_len=s.seq_len, cache=None)
        return est.allocated_peak_bytes, est.reserved_peak_bytes, time.perf_counter() - t0
    finally:
        trace.trace_step = step  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(f"{'model':28} {'device':10} {'method':6} {'b x acc':8} {'seq':5} {'ckpt':5} "
          f"{'alloc full':>11} {'capped':>11} {'reserved full':>13} {'capped':>11} {'s full':>7} {'s capped':>8}")
    worst = 0.0
    for model, dev, s in grid(args.n, args.seed):
        try:
            fa, fr, ft = traced(model, dev, s, None)
            ca, cr, ct = traced(model, dev, s, trace.TRACED_MICRO)
        except trace.TraceUnsupported as e:
            print(f"{model:28} {dev:10} skipped: {e}")
            continue
        worst = max(worst, abs(ca / fa - 1), abs(cr / fr - 1))
        print(f"{model:28} {dev:10} {s.method:6} {f'{s.micro_batch_size} x {s.grad_accum}':8} {s.seq_len:<5} "
              f"{str(s.gradient_checkpointing):5} {fa / MiB:11.2f} {ca / MiB:11.2f} {fr / MiB:13.2f} {cr / MiB:11.2f} "
              f"{ft:7.1f} {ct:8.1f}")
    print(f"worst relative difference (allocated or reserved): {worst:.4%}")


if __name__ == "__main__":
    main()
