"""Less memory per token: the standard loss against the fused one (and activation offloading in the plans).

Part 1, measured on this machine's CPU: real peaks and tokens/s of fitburst's own optimizer step
(:func:`fitburst.train.optimizer_step`) with the standard loss and with the fused kernel the CPU runs (CCE's
torch_compile path; ``--chunked`` adds fitburst's own chunked loss), on the demo model's shape and on a tiny model
with Qwen2.5's 151,936-token vocabulary, LoRA and full fine-tuning, 512 and 2048 tokens; each configuration in a
fresh process with glibc's mmap threshold pinned, its peak the VmHWM growth over three steps after a warm-up step
(fitburst.meter's measure), beside the analytic and traced estimates of the same step.

Part 2, planned: the plan (rungs, peak, slowdown) before (``training.loss: standard``, no offloading rung) and after
(``auto``, every rung allowed) for the issue's four runs, and the loss term's share of the planned peak.

    python benchmarks/lean_memory.py [--part 1|2|both] [--chunked] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
MODELS = {  # llama-shaped, tiny; "demo": the demo model's vocabulary, "152k": Qwen2.5's
    "demo": dict(vocab_size=2048, hidden_size=128, intermediate_size=344, num_hidden_layers=2),
    "152k": dict(vocab_size=151936, hidden_size=128, intermediate_size=344, num_hidden_layers=2),
}
CHILD = r"""
import json, sys, time, torch
from fitburst.memory import TrainSettings
from fitburst.runconfig import spec_with_settings
from fitburst.spec import PipelineSpec
from fitburst.train import make_optimizer, optimizer_step, prepare_for_training
from transformers import AutoConfig, AutoModelForCausalLM
cfg, method, seq, kernel, steps = json.loads(sys.argv[1])
def status(k):
    for line in open("/proc/self/status"):
        if line.startswith(k):
            return int(line.split()[1]) * 1024
torch.manual_seed(0)
c = dict(cfg); config = AutoConfig.for_model(c.pop("model_type"), **c)
spec = PipelineSpec.model_validate(dict(name="b", model=dict(name="x"), data=dict(path="x.jsonl")))
s = TrainSettings(method=method, batch=1, seq_len=seq, dtype="fp32", dropout=0.0)
model = prepare_for_training(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"),
                             spec_with_settings(spec, s))
model.train()
params = [p for p in model.parameters() if p.requires_grad]
opt = make_optimizer("adamw", params, 1e-4, 0.0)
ids = torch.randint(3, cfg["vocab_size"], (1, seq))
batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
optimizer_step(model, opt, params, [batch], device="cpu", max_grad_norm=1.0, loss=kernel)  # warm-up, compile
base = status("VmRSS"); open("/proc/self/clear_refs", "w").write("5")
t0 = time.perf_counter()
for _ in range(steps):
    optimizer_step(model, opt, params, [batch], device="cpu", max_grad_norm=1.0, loss=kernel)
dt = time.perf_counter() - t0
print(json.dumps({"peak": status("VmHWM") - base, "tokens_per_s": steps * seq / dt}))
"""


def measured(cfg: dict, method: str, seq: int, kernel: str, steps: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps([cfg, method, seq, kernel, steps])],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def part1(kernels: list[str], steps: int) -> None:
    from fitburst.memory import TrainSettings, estimate, load_shape, resolve_device
    from fitburst.memory.trace import traced_estimate
    from fitburst.spec import PipelineSpec

    dev = resolve_device("cpu:16GiB")
    print("| model | method | tokens | loss | measured peak MiB | tokens/s | analytic MiB | traced MiB |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for name, arch in MODELS.items():
        cfg = dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   tie_word_embeddings=True, max_position_embeddings=4096, **arch)
        d = Path(tempfile.mkdtemp()) / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        spec = PipelineSpec.model_validate(dict(name="b", model=dict(name=str(d)), data=dict(path="x.jsonl")))
        for method in ("lora", "full"):
            for seq in (512, 2048):
                for kernel in ["standard", *kernels]:
                    m = measured(cfg, method, seq, kernel, steps)
                    s = TrainSettings(method=method, batch=1, seq_len=seq, dtype="fp32", dropout=0.0,
                                      keep_logits=False, loss="standard" if kernel == "standard" else "fused")
                    a = estimate(load_shape(str(d)), s, dev, calibrate=False).reserved_peak_bytes
                    t = traced_estimate(spec, s, dev, seq_len=seq).reserved_peak_bytes
                    print(f"| {name} | {method} | {seq} | {kernel} | {m['peak'] / 2**20:,.0f} | "
                          f"{m['tokens_per_s']:,.0f} | {a / 2**20:,.0f} | {t / 2**20:,.0f} |", flush=True)


RUNS = (  # the four runs: model config, device, settings
    ("qwen2.5-7b", "RTX4090", dict(method="lora", rank=16, batch=4, seq_len=2048)),
    ("llama-3.1-8b", "A6000", dict(method="lora", rank=16, batch=1, seq_len=8192)),
    ("qwen2.5-1.5b", "T4", dict(method="full", batch=1, seq_len=2048, dtype="fp16")),
    ("gemma-3-1b", "M2-Max-32GB", dict(method="lora", rank=16, batch=4, seq_len=2048)),
)


def part2() -> None:
    from fitburst.memory import TrainSettings, estimate, load_shape, plan_fit, resolve_device
    from fitburst.memory.estimator import fused_loss_terms, loss_kernel_of
    from fitburst.memory.ladder import LADDER

    print("| run | device | plan | peak GiB | slowdown | loss term GiB | loss term / peak |")
    print("|---|---|---|---:|---:|---:|---:|")
    for model, dev_name, kw in RUNS:
        shape = load_shape(str(ROOT / "fitburst" / "configs" / f"{model}.json"))
        dev = resolve_device(dev_name)
        s = TrainSettings(keep_logits=False, **kw)
        for label, loss, allow in (("before", "standard", {"activation_offloading": False, "fused_loss": False}),
                                   ("after", "auto", {})):
            plan = plan_fit(shape, replace(s, loss=loss), dev, allow=allow)
            e = estimate(shape, plan.settings, dev)
            keys = [c.split(":")[0].split(" (")[0] for c in plan.changes] if plan.fits else ["nothing fits"]
            ps = plan.settings
            halvings = round(math.log2(s.batch / ps.batch)) if ps.batch < s.batch else 0
            cost = math.prod(r.cost for r in LADDER if _taken(r.key, s, ps)) * 1.12 ** halvings
            n, a = ps.batch * ps.seq_len, 2 if ps.dtype != "fp32" else 4
            if ps.fused_loss:  # the loss's own bytes: its kernel's rule, or logits + fp32 copies + grads
                term = fused_loss_terms(loss_kernel_of(ps, dev), n, shape.hidden, shape.vocab, a).peak
            else:
                term = (a + 4 + 4 + 8) * n * shape.vocab
            print(f"| {model} {label} | {dev_name} | {'; '.join(keys) or 'as configured'} | "
                  f"{e.device_total_bytes / GiB:.2f} | x{cost:.2f} | {term / GiB:.2f} | "
                  f"{term / e.allocated_peak_bytes:.1%} |", flush=True)


def _taken(key: str, before, after) -> bool:
    return {"fused_loss": after.loss == "fused" and before.loss != "fused",
            "activation_offloading": after.offload and not before.offload,
            "gradient_checkpointing": after.grad_checkpointing and not before.grad_checkpointing,
            "optimizer_8bit": after.optimizer != before.optimizer,
            "quantize": after.quant != before.quant,
            "dropout": after.dropout != before.dropout,
            "reduce_batch": after.batch != before.batch,
            "attention": after.attention != before.attention}.get(key, False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["1", "2", "both"], default="both")
    p.add_argument("--chunked", action="store_true", help="measure fitburst's chunked loss too")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    if args.part in ("2", "both"):
        part2()
    if args.part in ("1", "both"):
        part1(["cce_compile"] + (["chunked"] if args.chunked else []), args.steps)


if __name__ == "__main__":
    main()
