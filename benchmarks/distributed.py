"""FSDP runs planned per GPU: the per-GPU estimates against real multi-process runs, the trace's speed at 70B, and the
plans the preflight picks for three seeds.

    python benchmarks/distributed.py [--parts accuracy,speed,plans] [--out benchmarks/results/distributed.csv]

accuracy: small random models of four architectures (llama, qwen2 with tied embeddings, T5, Mixtral), LoRA, QLoRA
    and full fine-tuning at 2 and 4 ranks: each rank's measured step (real gloo processes, forked by torch's agent,
    tests/fsdp_child.py: the loop's own preparation, sharding and optimizer step, torch's MemTracker) against the
    traced per-GPU peak (rank 0 of N in a fake process group) and the analytic per-GPU estimate (allocated; on CPU
    the measured figure is live tensor bytes, gloo's own copy of the reduce-scatter input left out and shown apart,
    "+gloo copy": NCCL makes none). World size 8 is traced only (next to the analytic figure).
speed: the trace of Llama-3-70B QLoRA at 2048 tokens as rank 0 of 8 (wall and CPU seconds on this machine).
plans: the preflight's choice for Llama-3-70B QLoRA at 2048 tokens (burst GPUs A6000, T4, H100), a Qwen2.5-7B full
    bf16 fine-tune, and both on a local box with two RTX 4090s (128 GiB of RAM assumed): GPU type x count x nodes,
    per-GPU and total memory, hours (FSDP scaling included) and cost. Prices from fitburst's snapshot (SkyPilot's
    catalog cannot be fetched here), 20 M training tokens.
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

GiB = 1 << 30
TOKENS = 20_000_000

# (architecture, settings); padded=False: the measured batches hold no padding (tests/fsdp_child.py)
CASES: list[tuple[str, dict]] = [
    ("llama", dict(method="lora", rank=8, micro_batch_size=1, seq_len=64, precision="fp32", dropout=0.0, world_size=2)),
    ("llama", dict(method="lora", rank=8, micro_batch_size=1, seq_len=64, precision="bf16", world_size=4)),
    ("llama", dict(method="qlora", rank=8, micro_batch_size=1, seq_len=64, precision="bf16", dropout=0.0,
                   world_size=2)),
    ("llama", dict(method="qlora", rank=8, micro_batch_size=1, seq_len=64, precision="bf16", dropout=0.0,
                   world_size=4)),
    ("llama", dict(method="full", micro_batch_size=1, seq_len=64, precision="fp32", world_size=2)),
    ("llama", dict(method="full", micro_batch_size=1, seq_len=64, precision="bf16", world_size=4)),
    ("qwen2", dict(method="lora", rank=8, micro_batch_size=2, seq_len=48, precision="bf16", world_size=2,
                   padded=False)),
    ("qwen2", dict(method="lora", rank=8, micro_batch_size=1, seq_len=64, precision="fp32", world_size=4,
                   reshard_after_forward=False)),
    ("qwen2", dict(method="full", micro_batch_size=1, seq_len=64, precision="bf16", world_size=2)),
    ("t5", dict(method="lora", rank=8, micro_batch_size=2, seq_len=32, precision="fp32", world_size=2, padded=False)),
    ("t5", dict(method="lora", rank=8, micro_batch_size=2, seq_len=32, precision="bf16", world_size=4, padded=False)),
    ("mixtral", dict(method="lora", rank=8, micro_batch_size=2, seq_len=32, precision="bf16", dropout=0.0, world_size=2,
                     padded=False)),
    ("mixtral", dict(method="lora", rank=8, micro_batch_size=2, seq_len=32, precision="fp32", dropout=0.0, world_size=4,
                     padded=False)),
    ("mixtral", dict(method="full", micro_batch_size=2, seq_len=32, precision="fp32", world_size=4, padded=False)),
]
TRACED_ONLY = [  # world size 8
    ("llama", dict(method="lora", rank=8, micro_batch_size=1, seq_len=64, precision="bf16", world_size=8)),
    ("qwen2", dict(method="full", micro_batch_size=1, seq_len=64, precision="bf16", world_size=8)),
    ("mixtral", dict(method="lora", rank=8, micro_batch_size=2, seq_len=32, precision="fp32", dropout=0.0, world_size=8,
                     padded=False)),
]
QWEN2 = dict(model_type="qwen2", hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2000, max_position_embeddings=512, tie_word_embeddings=True)


def accuracy(out: Path) -> list[dict]:
    import test_sharded as t

    from fitburst.hardware import resolve_device
    from fitburst.memory import RunSettings, estimate
    from fitburst.memory.shapes import ModelShape
    from fitburst.memory.trace import trace_step

    t.CFGS.setdefault("qwen2", QWEN2)
    root = Path(tempfile.mkdtemp())
    dev = resolve_device("cpu:64GiB")
    rows = []
    for arch, kw in CASES + TRACED_ONLY:
        s = RunSettings(**kw)
        folder = t.model_folder(root, arch, weights=s.kbit)
        traced = trace_step(t.spec_for(folder), s, seq_len=s.seq_len).live_peaks()[0]
        analytic = estimate(ModelShape.from_config(t.CFGS[arch], name=arch), s, dev, calibrate=False)
        measured = t.gloo_peaks(folder, s) if (arch, kw) in CASES else []
        peaks = [r["peak"] for r in measured]
        row = {"arch": arch, "settings": s.describe(), "world_size": s.world_size, "traced": traced,
               "analytic": analytic.allocated_peak_bytes, "measured_min": min(peaks, default=""),
               "measured_max": max(peaks, default=""),
               "with_gloo_copy_max": max((r["peak_with_gloo"] for r in measured), default=""),
               "traced_vs_measured": round(traced / max(peaks) - 1, 4) if peaks else "",
               "analytic_vs_measured": round(analytic.allocated_peak_bytes / max(peaks) - 1, 4) if peaks else "",
               "traced_vs_analytic": round(traced / analytic.allocated_peak_bytes - 1, 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\n{'arch':<8} {'settings':<44} {'N':>2} {'measured KiB':>14} {'traced':>9} {'x-1':>7} {'analytic':>9} "
          f"{'x-1':>7} {'+gloo copy':>10}")
    for r in rows:
        m = f"{r['measured_min'] // 1024}" + (f"-{r['measured_max'] // 1024}" if r["measured_min"] != r["measured_max"]
                                               else "") if r["measured_min"] != "" else "(traced only)"
        print(f"{r['arch']:<8} {r['settings']:<44} {r['world_size']:>2} {m:>14} {r['traced'] // 1024:>9} "
              f"{_pct(r['traced_vs_measured']):>7} {r['analytic'] // 1024:>9} {_pct(r['analytic_vs_measured']):>7} "
              f"{r['with_gloo_copy_max'] // 1024 if r['with_gloo_copy_max'] != '' else '-':>10}")
    return rows


def _pct(x) -> str:
    return f"{x:+.1%}" if x != "" else "-"


def speed() -> None:
    from fitburst.memory.trace import trace_step
    from fitburst.settings import RunSettings
    from fitburst.spec import PipelineSpec

    spec = PipelineSpec.model_validate(dict(name="t", model=dict(name="meta-llama/Meta-Llama-3-70B"),
                                            data=dict(path="x.jsonl")))
    s = RunSettings(method="qlora", rank=16, micro_batch_size=1, seq_len=2048, gradient_checkpointing=True,
                    precision="bf16",
                      world_size=8)
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    t = trace_step(spec, s, seq_len=2048)
    cpu1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
    peak, phase, _ = t.live_peaks()
    print(f"trace of Llama-3-70B {s.describe()}: {wall:.1f} s wall, {cpu:.1f} s CPU, {len(t.events)} events; "
          f"per-GPU tensor peak {peak / GiB:.2f} GiB ({phase})")


def plans() -> None:
    from fitburst.cloud.gpus import offers
    from fitburst.cloud.rank import rank_candidates
    from fitburst.data import images_per_record
    from fitburst.hardware import Gpus, resolve_device
    from fitburst.models import resolve_model
    from fitburst.preflight import conclude, exact_estimate, plan_checked
    from fitburst.settings import settings_from_spec
    from fitburst.spec import load_pipeline

    seeds = {
        "Llama-3-70B QLoRA nf4, 2048 tokens": ("llama3-70b-qlora", {"training.grad_accum": 1}),
        "Qwen2.5-7B full bf16, 2048 tokens": ("qwen7b-lora", {
            "method.type": "full", "training.precision": "bf16", "data.max_seq_len": 2048,
            "training.micro_batch_size": 1, "training.grad_accum": 1, "training.gradient_checkpointing": True,
            "burst.gpus": ["A6000", "T4", "H100"], "burst.providers": ["runpod", "lambda", "aws"],
            "burst.max_hourly_usd": 20.0, "preflight.allow.optimizer_8bit": False}),
    }
    for title, (name, over) in seeds.items():
        spec = load_pipeline(REPO / "pipelines.yaml", name, {**over, "training.max_steps": None})
        model = resolve_model(spec)
        shape = model.shape
        seq = spec.data.max_seq_len
        settings = settings_from_spec(spec, None, seq, images=images_per_record(spec), family=model.family)
        offer_list = [o for n in (1, 2, 4, 8) for o in offers(spec.burst.gpu_names(), spec.burst.providers,
                                                                use_catalog=False, count=n)]
        t0 = time.perf_counter()
        cands = rank_candidates(spec, shape, settings, tokens=TOKENS, offer_list=offer_list,
                                exact=exact_estimate(spec, seq))
        print(f"\n== {title}: cloud ({time.perf_counter() - t0:.0f} s to plan, traces included)")
        _print_candidates(cands)
        for offload in (False, True):
            local = spec.with_overrides({"training.fsdp.cpu_offload": offload})
            box = Gpus(resolve_device("RTX4090"), 2, 1, 128 * GiB)
            checked = plan_checked(local, shape, settings_from_spec(local, box.device, seq,
                                                                    images=images_per_record(local),
                                                                    family=model.family),
                box.device, seq, box)
            rep = conclude(local.with_overrides({"burst.policy": "never"}), model, box.device, checked, seq, TOKENS,
                           gpus=box)
            e, n = rep.estimate, rep.world_size
            hours = f"{rep.local_hours:.1f} h" if rep.local_hours else "-"
            print(f"   local 2x RTX4090 (128 GiB RAM){' + cpu_offload' if offload else ''}: {rep.verdict.placement}"
                  f" on {n} GPU(s): per GPU {e.device_total_bytes / GiB:.1f} GiB (upper edge "
                  f"{rep.plan.needed_bytes / GiB:.1f} of {rep.plan.limit_bytes / GiB:.1f}), all "
                  f"{e.device_total_bytes * n / GiB:.1f} GiB, host {e.host_bytes / GiB:.1f} GiB, {hours}; "
                  f"{'; '.join(rep.changes[:2])}")
            if rep.local_time:
                print(f"     time: {rep.local_time.source}")


def _print_candidates(cands) -> None:
    for c in cands:
        e = c.estimate
        mem = (f"{e.device_total_bytes / GiB:5.1f} GiB/GPU, {e.device_total_bytes * c.world_size / GiB:6.1f} all, "
               f"{e.method}" if e else "-")
        print(f"   {c.label():<36} fits={str(c.fits):<5} {mem}  ${c.hourly_usd}/h x {c.est_hours} h = "
              f"${c.est_total_usd}  {c.reason}")
    best = next((c for c in cands if c.usable), None)
    if best:
        print(f"   chosen: {best.label()}; time: {best.hours_source}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="accuracy,speed,plans")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "distributed.csv")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    import os

    os.environ.setdefault("FITBURST_TRACE_CACHE", "0")
    if "accuracy" in parts:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        accuracy(args.out)
    if "speed" in parts:
        speed()
    if "plans" in parts:
        plans()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
