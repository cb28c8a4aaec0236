"""The sliced estimate (one- and two-block models traced, scaled to the depth) against the full trace.

Architectures the analytic estimate does not model (GPT-NeoX, OLMo 2, StarCoder2, Granite; configs with the
proportions of Pythia-1.4B, OLMo-2-1B, StarCoder2-3B and Granite-3.0-2B) and two it does (Llama-3.2-1B,
Qwen2.5-0.5B), on CPU, a T4 and an A100; LoRA (all-linear), QLoRA nf4 and full fine-tuning. A seeded grid; each row
prints the reserved figure of both and ``sliced / traced - 1``, and the trace times. The band of the "sliced" method
in fitburst/memory/calibration.py comes from this table (seed 1: printed once, then the band was set: in-sample
for seed 1; a new seed is held-out the first time it is scored). Nothing here is a measurement of a device.

Usage: python benchmarks/sliced_vs_traced.py [--n 12] [--seed 1]   (about 15 minutes on the 2-core box)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitburst.memory import RunSettings, resolve_device  # noqa: E402
from fitburst.memory.sliced import sliced_estimate  # noqa: E402
from fitburst.memory.trace import TraceUnsupported, traced_estimate  # noqa: E402
from fitburst.spec import PipelineSpec  # noqa: E402

UNMODELLED = {
    "gpt_neox (Pythia-1.4B)": dict(model_type="gpt_neox", hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=24, num_attention_heads=16, vocab_size=50304, rotary_pct=0.25,
                                   max_position_embeddings=2048, tie_word_embeddings=False),
    "olmo2 (OLMo-2-1B)": dict(model_type="olmo2", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                              num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
                              max_position_embeddings=4096, tie_word_embeddings=False),
    "starcoder2 (StarCoder2-3B)": dict(model_type="starcoder2", hidden_size=3072, intermediate_size=12288,
                                       num_hidden_layers=30, num_attention_heads=24, num_key_value_heads=2,
                                       vocab_size=49152, max_position_embeddings=16384, tie_word_embeddings=True),
    "granite (Granite-3.0-2B)": dict(model_type="granite", hidden_size=2048, intermediate_size=8192,
                                     num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                                     vocab_size=49155, max_position_embeddings=4096, tie_word_embeddings=True),
}
MODELLED = ["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"]
MiB = 1 << 20


def grid(n: int, seed: int, folders: dict[str, str]) -> list[tuple[str, str, str, RunSettings]]:
    rnd = random.Random(seed)
    names = list(folders) + MODELLED
    out = []
    for i in range(n):
        name = names[i % len(names)] if i < len(names) else rnd.choice(names)
        dev = rnd.choice(["cpu:64GiB", "T4", "A100-40GB"])
        method = rnd.choice(["lora", "lora", "full"] + (["qlora"] if dev != "cpu:64GiB" else []))
        dtype = "fp32" if dev.startswith("cpu") else "fp16" if dev == "T4" else "bf16"
        out.append((name, folders.get(name, name), dev, RunSettings(
            method=method, quant="nf4" if method == "qlora" else "none", rank=16, target_modules="all-linear",
            micro_batch_size=rnd.choice([1, 2]), grad_accum=2, seq_len=rnd.choice([256, 512]),
            gradient_checkpointing=rnd.choice([True, False]), precision=dtype, attention="sdpa", dropout=0.0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    folders = {}
    for name, cfg in UNMODELLED.items():
        d = tmp / name.split()[0]
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        folders[name] = str(d)
    print(f"{'model':28} {'device':10} {'method':6} {'b':2} {'seq':4} {'ckpt':5} {'traced MiB':>11} "
          f"{'sliced MiB':>11} {'error':>8} {'s traced':>8} {'s sliced':>8}")
    errs = []
    for name, ref, dev, s in grid(args.n, args.seed, folders):
        spec = PipelineSpec.model_validate({"name": "x", "model": {"name": ref}, "data": {"path": "x.jsonl"}})
        device = resolve_device(dev)
        try:
            t0 = time.perf_counter()
            full = traced_estimate(spec, s, device, seq_len=s.seq_len)
            t1 = time.perf_counter()
            cut = sliced_estimate(spec, s, device, seq_len=s.seq_len)
            t2 = time.perf_counter()
        except TraceUnsupported as e:
            print(f"{name:28} {dev:10} skipped: {e}")
            continue
        err = cut.reserved_peak_bytes / full.reserved_peak_bytes - 1
        errs.append(err)
        print(f"{name:28} {dev:10} {s.method:6} {s.micro_batch_size:<2} {s.seq_len:<4} "
              f"{str(s.gradient_checkpointing):5} "
              f"{full.reserved_peak_bytes / MiB:11.1f} {cut.reserved_peak_bytes / MiB:11.1f} {err:+8.2%} "
              f"{t1 - t0:8.1f} {t2 - t1:8.1f}")
    if errs:
        errs.sort()
        print(f"sliced / traced - 1, reserved: {errs[0]:+.2%} .. {errs[-1]:+.2%}, median {errs[len(errs) // 2]:+.2%} "
              f"({len(errs)} configurations, seed {args.seed})")


if __name__ == "__main__":
    main()
