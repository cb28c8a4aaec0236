"""The longest context, and the largest bundled model, a card trains with fitburst's plain stack and with its best
plan, beside Unsloth's and Hugging Face + FA2's published limits (issue 35).

Usage: PYTHONPATH=$PWD python benchmarks/context_fit.py [--traced] > benchmarks/results/context_fit.txt
       PYTHONPATH=$PWD python benchmarks/context_fit.py --traced-only > benchmarks/results/context_fit_traced.txt

The runs are Unsloth's (QLoRA nf4 with double quant, rank 32 on all linear layers, batch 1, bf16, sequences padded
to the length) on ``cuda:<N>GiB`` cards. A length fits when the analytic estimate's device total (reserved +
context, the point estimate, no error band) is within the card, as the issue measures. Plain: gradient
checkpointing only (lora dropout 0.05, the standard loss, AdamW). Best: the least of the planner's most frugal
plans, every rung of the ladder that applies taken, or all but one (fitburst.memory.planner.frugal_plans):
whatever rungs this checkout has. The host RAM is not limited here (Unsloth's numbers assume a host that holds
the offloaded checkpoints): the host column
says what the best plan pins there. Beside it, ``planned``: what `fitburst estimate` plans on that card (the
estimate's error band's upper edge within the budget less 3 % headroom, host RAM 256 GiB), which is what a user
gets. ``--traced`` also traces the best plan at its longest length and at Unsloth's on the 24 GB and 80 GB
rows (FakeTensorMode: minutes each on a 2-core box). The search is a bisection in steps of 64 tokens up to 1,048,576.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from fitburst.hardware import GiB, resolve_device
from fitburst.memory.estimator import Estimate, estimate
from fitburst.memory.host import host_limit
from fitburst.memory.planner import _longest, frugal_plans, longest_planned
from fitburst.memory.shapes import ModelConfigError, ModelShape, bundled_names, load_shape
from fitburst.settings import RunSettings

CARDS = (8, 12, 16, 24, 40, 48, 80)
# unsloth.ai docs, "Unsloth Benchmarks": Llama-3.1-8B Instruct, QLoRA nf4, rank 32 all linear, batch 1 (stack-notes)
UNSLOTH = {8: 2972, 12: 21848, 16: 40724, 24: 78475, 40: 153977, 48: 191728, 80: 342733}
HF_FA2 = {8: 0, 12: 932, 16: 2551, 24: 5789, 40: 12264, 48: 15502, 80: 28454}
MORE_MODELS = ("qwen2.5-7b", "llama-3.2-3b")
LONGEST = 1 << 20
PLANNED_HOST_RAM = 256 * GiB


def plain(seq_len: int = 2048) -> RunSettings:
    return RunSettings(method="qlora", quant="nf4", double_quant=True, rank=32, alpha=16.0, dropout=0.05,
                       target_modules="all-linear", micro_batch_size=1, seq_len=seq_len,
                       gradient_checkpointing=True, precision="bf16", attention="sdpa", keep_logits=False)


def card(n: int):
    return resolve_device(f"cuda:{n}GiB")


def best(s: RunSettings, n: int, shape: ModelShape) -> RunSettings:
    """Of the most frugal plans (every rung, and every rung but one), the one that needs least here."""
    return min(frugal_plans(s, card(n), shape=shape), key=lambda t: estimate(shape, t, card(n)).device_total_bytes)


def point_fits(shape: ModelShape, s: RunSettings, n: int) -> bool:
    return estimate(shape, s, card(n)).device_total_bytes <= n * GiB


def longest(shape: ModelShape, n: int, frugal: bool) -> int:
    def fits(t: int) -> bool:
        s = plain(t)
        return point_fits(shape, best(s, n, shape) if frugal else s, n)
    return _longest(fits, LONGEST)


def where(e: Estimate, k: int = 4) -> str:
    top = sorted(e.components.items(), key=lambda kv: -kv[1])[:k]
    return f"{e.peak_phase}: " + ", ".join(f"{name} {v / GiB:.1f}" for name, v in top)


def fmt(n: int) -> str:
    return "OOM" if not n else (f">={n:,}" if n >= LONGEST else f"{n:,}")


def context_table(model: str, published: bool) -> list[str]:
    shape = load_shape(model)
    head = "| card | plain (ckpt) | best plan | planned (band) |"
    sep = "|---:|---:|---:|---:|"
    if published:
        head += " Unsloth | HF + FA2 | best/Unsloth |"
        sep += "---:|---:|---:|"
    head += " host GiB at best | where the memory goes at the best plan's longest (GiB) |"
    sep += "---:|---|"
    out = [f"### {shape.name}: QLoRA nf4+dq r32 all-linear, batch 1, bf16", "", head, sep]
    for n in CARDS:
        p, b = longest(shape, n, False), longest(shape, n, True)
        planned, _ = longest_planned(shape, plain(2048), card(n), host_limit=host_limit(PLANNED_HOST_RAM),
                                     longest=LONGEST)
        row = f"| {n} GB | {fmt(p)} | {fmt(b)} | {fmt(planned)} |"
        if published:
            row += f" {UNSLOTH[n]:,} | {fmt(HF_FA2[n])} | {b / UNSLOTH[n]:.2f} |"
        e = estimate(shape, best(plain(max(b, 64)), n, shape), card(n))
        row += f" {e.offloaded_host_bytes / GiB:.1f} | {where(e) if b else '-'} |"
        out.append(row)
    return out


def gap_lines(model: str) -> list[str]:
    """At Unsloth's length on each card: the best plan's device total and where it goes."""
    shape = load_shape(model)
    out = ["", f"At Unsloth's length, {shape.name}'s best plan needs (device total, point estimate) and spends it on:",
           ""]
    for n in CARDS:
        e = estimate(shape, best(plain(UNSLOTH[n]), n, shape), card(n))
        out.append(f"- {n} GB at {UNSLOTH[n]:,} tokens: {e.device_total_bytes / GiB:.1f} GiB "
                   f"({e.device_total_bytes / (n * GiB):.2f} x the card); {where(e, 6)}")
    s = best(plain(UNSLOTH[24]), 24, shape)  # describe() leaves dropout out: said beside it
    e8 = best(plain(2048), 8, shape)
    out += ["", f"Best plan's settings (24 GB row): {s.describe()}, lora dropout {s.dropout:g}",
            f"Best plan's settings (8 GB row): {e8.describe()}, lora dropout {e8.dropout:g}"]
    return out


def largest_models() -> list[str]:
    """The largest bundled model (most parameters) whose best plan fits each card at 2,048 tokens."""
    shapes = []
    for name in bundled_names():
        try:
            shapes.append(load_shape(name))
        except (ModelConfigError, ValueError):
            continue
    out = ["", "### Largest bundled model that trains at 2,048 tokens (QLoRA r32, batch 1)", "",
           "| card | plain (ckpt) | device total GiB | best plan | device total GiB |", "|---:|---|---:|---|---:|"]
    for n in (8, 16, 24):
        row = f"| {n} GB |"
        for frugal in (False, True):
            fit = []
            for sh in shapes:
                try:
                    s = best(plain(2048), n, sh) if frugal else plain(2048)
                    e = estimate(sh, s, card(n))
                except (ValueError, KeyError):
                    continue
                if e.device_total_bytes <= n * GiB:
                    fit.append((sh.param_count(), sh.name, e.device_total_bytes))
            top = max(fit, default=None)
            row += f" {top[1]} ({top[0] / 1e9:.1f} B) | {top[2] / GiB:.1f} |" if top else " none | - |"
        out.append(row)
    return out


def traced_rows() -> list[str]:
    """The traced estimate of the best plan on the 24 GB and 80 GB rows, at the analytic longest length and at
    Unsloth's published length (the issue's goal: the trace fits Unsloth's length on these rows)."""
    shape = load_shape("llama-3.1-8b")
    out = ["", "### Traced check (Llama-3.1-8B, best plan at the analytic longest length and at Unsloth's)", "",
           "| card | length | analytic device total GiB | traced device total GiB | traced / analytic | fits (trace) "
           "| host GiB analytic / traced |", "|---:|---:|---:|---:|---:|---|---:|"]
    for n in (24, 80):
        for length in (longest(shape, n, True), UNSLOTH[n]):
            out.append(traced_row(shape, n, length))
    return out


def traced_row(shape: ModelShape, n: int, length: int) -> str:
    """One traced check: the best plan at ``length`` tokens on an ``n`` GB card, analytic beside traced."""
    from fitburst.memory.trace import traced_estimate
    from fitburst.spec import PipelineSpec

    spec = PipelineSpec.model_validate(dict(name="context-fit", model=dict(name="llama-3.1-8b"),
                                            data=dict(path="unused.jsonl"),
                                            method=dict(type="qlora", quant="nf4", rank=32, double_quant=True)))
    s = best(plain(length), n, shape)
    a = estimate(shape, s, card(n))
    t0 = time.time()
    t = traced_estimate(spec, s, card(n), seq_len=length)
    return (f"| {n} GB | {length:,} | {a.device_total_bytes / GiB:.2f} | {t.device_total_bytes / GiB:.2f} | "
            f"{t.device_total_bytes / a.device_total_bytes - 1:+.1%} | "
            f"{'yes' if t.device_total_bytes <= n * GiB else 'no'} ({time.time() - t0:.0f} s) | "
            f"{a.offloaded_host_bytes / GiB:.2f} / {t.offloaded_host_bytes / GiB:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traced", action="store_true", help="trace the 24 GB and 80 GB rows' best plans too")
    ap.add_argument("--traced-only", action="store_true", help="only the traced check (minutes, not the tables)")
    args = ap.parse_args()
    t0 = time.time()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"# context_fit: commit {commit}, load average {os.getloadavg()[0]:.2f} (2-core box, shared), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "# fits: the analytic estimate's device total (point estimate) within the card (cuda:<N>GiB); "
             "planned: fitburst estimate's verdict (band's upper edge, 3 % headroom, 256 GiB host)", ""]
    if not args.traced_only:
        lines += context_table("llama-3.1-8b", True)
        lines += gap_lines("llama-3.1-8b")
        for m in MORE_MODELS:
            lines += [""] + context_table(m, False)
        lines += largest_models()
    if args.traced or args.traced_only:
        lines += traced_rows()
    lines += ["", f"# {time.time() - t0:.0f} s"]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
