"""Liger Kernel's model kernels (training.liger_kernels) in both estimates at full size, without and with the rung.

Usage: PYTHONPATH=$PWD python benchmarks/liger_kernels.py > benchmarks/results/liger_kernels.txt

Each row: one run on a ``cuda:24GiB`` card (fused loss, gradient checkpointing), traced (the stand-ins for Liger's
Functions, fitburst/memory/model_kernels.py) and analytic, allocated and reserved peaks, Liger off and on; the
saving is the allocated peak's drop. Nothing here runs on a GPU: both figures are estimates (tests/test_liger_kernels.py
checks the stand-ins against Liger's own Functions and the real CPU step).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import replace

from fitburst.hardware import GiB, resolve_device
from fitburst.memory.estimator import estimate
from fitburst.memory.shapes import load_shape
from fitburst.memory.trace import traced_estimate
from fitburst.settings import RunSettings
from fitburst.spec import PipelineSpec

RUNS = (("meta-llama/llama-3.1-8b", "qlora", 8192), ("meta-llama/llama-3.1-8b", "qlora", 32768),
        ("qwen2.5-7b", "lora", 8192))


def settings(method: str, seq: int) -> RunSettings:
    quant = "nf4" if method == "qlora" else "none"
    return RunSettings(method=method, quant=quant, double_quant=True, rank=32, alpha=16.0, dropout=0.0,
                       target_modules="all-linear", micro_batch_size=1, seq_len=seq, gradient_checkpointing=True,
                       precision="bf16", attention="sdpa", keep_logits=False, loss="fused", frozen_fp32=False,
                       optimizer="adamw8bit")


def main() -> int:
    os.environ["FITBURST_TRACE_CACHE"] = "0"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# liger_kernels: commit {commit}, load average {os.getloadavg()[0]:.2f} (2-core box, shared), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("\n| model | method | tokens | Liger | traced alloc GiB | traced reserved | analytic alloc | "
          "analytic reserved | analytic / traced reserved | saving traced / analytic GiB |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    dev = resolve_device("cuda:24GiB")
    t0 = time.perf_counter()
    for model, method, seq in RUNS:
        shape = load_shape(model)
        spec = PipelineSpec.model_validate(dict(name="b", model=dict(name=model), data=dict(path="x.jsonl")))
        alloc = {}
        for on in (False, True):
            s = replace(settings(method, seq), liger_kernels=on)
            t = traced_estimate(spec, s, dev, seq_len=seq)
            a = estimate(shape, s, dev, calibrate=False)
            alloc[on] = (t.allocated_peak_bytes, a.allocated_peak_bytes)
            saving = (f"{(alloc[False][0] - alloc[True][0]) / GiB:.3f} / {(alloc[False][1] - alloc[True][1]) / GiB:.3f}"
                      if on else "")
            print(f"| {shape.name} | {method} r32 | {seq:,} | {'on' if on else 'off'} | "
                  f"{t.allocated_peak_bytes / GiB:.3f} | {t.reserved_peak_bytes / GiB:.3f} | "
                  f"{a.allocated_peak_bytes / GiB:.3f} | {a.reserved_peak_bytes / GiB:.3f} | "
                  f"{a.reserved_peak_bytes / t.reserved_peak_bytes - 1:+.1%} | {saving} |", flush=True)
    print(f"\n# {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
