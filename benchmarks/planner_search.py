"""What the fit planner chooses for a few full-size runs on CUDA cards: with the analytic estimate alone, and with
the traced estimate verifying its choice (what ``fitburst preflight`` does), how many traces that took and how
long. The traced plan is the one a user would run; nothing here is a measurement of a GPU.

Usage: python benchmarks/planner_search.py   (about a minute on the 2-core box)
"""

from __future__ import annotations

import time

from fitburst.memory import RunSettings, load_shape, plan_fit, resolve_device
from fitburst.preflight import exact_estimate
from fitburst.spec import PipelineSpec

QV = ["q_proj", "v_proj"]  # the targets these figures were taken with (the default was q_proj, v_proj then)
CASES = [
    ("Qwen/Qwen2.5-7B-Instruct", RunSettings(method="lora", rank=16, micro_batch_size=4, seq_len=2048,
                                             target_modules=QV), "A6000"),
    # a T4 has no bf16: fp16 there (what fitburst's precision resolution picks)
    ("Qwen/Qwen2.5-7B-Instruct",
     RunSettings(method="qlora", quant="nf4", rank=16, micro_batch_size=4, seq_len=1024, precision="fp16",
                 target_modules=QV), "T4"),
    ("Qwen/Qwen2.5-1.5B-Instruct",
     RunSettings(method="lora", rank=16, micro_batch_size=8, seq_len=1024, precision="fp16", target_modules=QV), "T4"),
    ("TinyLlama/TinyLlama-1.1B-Chat-v1.0",
     RunSettings(method="qlora", quant="nf4", rank=32, micro_batch_size=8, seq_len=1024, precision="fp16",
                 target_modules=QV), "T4"),
]


def _said(plan) -> str:
    return ("; ".join(plan.changes) or "as configured") if plan.fits else "nothing fits"


def main() -> None:
    print("| model | settings | device | analytic alone | traced check | traces | seconds |")
    print("|---|---|---|---|---|---:|---:|")
    for model, s, name in CASES:
        shape, device = load_shape(model), resolve_device(name)
        spec = PipelineSpec.model_validate(dict(name="bench", model=dict(name=model), data=dict(path="unused.jsonl")))
        traced, calls = exact_estimate(spec, s.seq_len), []  # the preflight's own check (one trace per settings)

        def exact(x, d, traced=traced, calls=calls):
            calls.append(x)
            return traced(x, d)

        t0 = time.perf_counter()
        traced = plan_fit(shape, s, device, exact=exact)
        seconds = time.perf_counter() - t0
        print(f"| {model.split('/')[1]} | {s.describe()} | {name} | {_said(plan_fit(shape, s, device))} "
              f"| {_said(traced)} | {len(calls)} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
