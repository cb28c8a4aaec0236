"""The CPU reference checked against the operating system: the probe's dispatch tracker (live tensor bytes, what the
CPU "measured" peaks and the probe report) against the process's own resident memory over the same training steps.

Each configuration runs in a fresh process (benchmarks/_measure.py: fitburst's build_model, make_optimizer and the
loop's step, 2 optimizer steps). Just before each step the resident high-water mark is reset to the resident size
(5 > /proc/self/clear_refs); after it, ``OS growth`` = VmHWM - that size and ``tracker growth`` = the tracker's
peak in the step - the live bytes it started from. The warm (second) step compares like with like; the first step
also touches library code, starts thread pools and sets up kernels once: printed apart, with what of it stays
resident. glibc keeps freed memory for reuse, so the process is run with
MALLOC_MMAP_THRESHOLD_=131072 (large blocks come from and go back to the OS at once; see the stack notes,
"Measuring memory") and, for comparison, with glibc's default (--default-malloc).

``gap`` = OS growth / tracker growth - 1 on the warm step: what the tracker does not see (kernels' scratch memory,
oneDNN / BLAS workspaces, thread stacks, the allocator's own overhead and rounding), relative to what it sees.
Usage: python benchmarks/tracker_vs_os.py [--quick] [--default-malloc] [--json out.json]   (Linux only)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
QV = ["q_proj", "v_proj"]
CASES = [
    dict(arch="llama", dtype="fp32", method="lora", rank=8, targets=QV, batch=1, seq_len=256),
    dict(arch="llama", dtype="bf16", method="lora", rank=8, targets=QV, batch=1, seq_len=256),
    dict(arch="llama", dtype="bf16", method="lora", rank=16, targets="all-linear", batch=2, seq_len=512),
    dict(arch="llama", dtype="fp32", method="lora", rank=8, targets=QV, batch=4, seq_len=512,
         grad_checkpointing=True),
    dict(arch="llama", dtype="fp32", method="full", batch=1, seq_len=256),
    dict(arch="llama", dtype="bf16", method="lora", quant="nf4", rank=8, targets=QV, batch=1, seq_len=256),
    dict(arch="qwen2", dtype="fp32", method="lora", rank=8, targets=QV, batch=2, seq_len=512),
    dict(arch="qwen2", dtype="bf16", method="lora", rank=8, targets=QV, batch=2, seq_len=512, attention="eager"),
    dict(arch="gpt_neox", dtype="fp32", method="lora", rank=8, targets=["query_key_value"], batch=2, seq_len=256),
    dict(arch="phi3", dtype="fp32", method="lora", rank=8, targets="all-linear", batch=2, seq_len=256),
]


def measure(cfg: dict, root: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "_measure.py"), json.dumps(dict(cfg, root=root))],
                         capture_output=True, text=True, env=env, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return {"error": (out.stderr or out.stdout)[-300:]}
    return json.loads(line[len("RESULT "):])


def label(cfg: dict) -> str:
    t = cfg.get("targets", "")
    t = "all" if t == "all-linear" else "+".join(x.split("_")[0] for x in t) if t else "-"
    q = f" {cfg['quant']}" if cfg.get("quant") else ""
    extra = (" ckpt" if cfg.get("grad_checkpointing") else "") + (f" {cfg['attention']}" if cfg.get("attention")
                                                                  else "")
    return f"{cfg['arch']} {cfg['method']}{q} {cfg['dtype']} {t} b{cfg['batch']} s{cfg['seq_len']}{extra}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first half of the grid")
    ap.add_argument("--default-malloc", action="store_true", help="also run with glibc's default thresholds")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    cases = CASES[: len(CASES) // 2] if args.quick else CASES
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    base_env["PYTHONPATH"] = str(HERE.parent)
    modes = {"mmap 128 KiB": dict(base_env, MALLOC_MMAP_THRESHOLD_="131072")}
    if args.default_malloc:
        modes["glibc default"] = base_env
    rows = []
    with tempfile.TemporaryDirectory() as root:
        print("| configuration | malloc | tracker growth MiB | OS growth MiB, warm step | gap | first step: OS "
              "beyond the tracker MiB | kept after it MiB |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for cfg in cases:
            for mode, env in modes.items():
                m = measure(cfg, root, env)
                row = dict(case=label(cfg), malloc=mode, **m)
                rows.append(row)
                if "error" in m or m["steps"][0]["rss_before"] is None:
                    print(f"| {row['case']} | {mode} | {m.get('error', 'no /proc')[:80]} | | | | |", flush=True)
                    continue
                first, warm = m["steps"][0], m["steps"][-1]
                tracker = warm["tracker_peak"] - warm["tracker_start"]
                osg = warm["rss_hwm"] - warm["rss_before"]
                one_off = (first["rss_hwm"] - first["rss_before"]) - (first["tracker_peak"] - first["tracker_start"])
                # resident memory the first step left behind that no live tensor accounts for
                kept = (warm["rss_before"] - first["rss_before"]) - (warm["tracker_start"] - first["tracker_start"])
                row.update(tracker_growth=tracker, os_growth=osg, gap=osg / tracker - 1, first_step_extra=one_off,
                           kept=kept)
                print(f"| {row['case']} | {mode} | {tracker / 2**20:,.1f} | {osg / 2**20:,.1f} | {row['gap']:+.1%} | "
                      f"{one_off / 2**20:+,.1f} | {kept / 2**20:+,.1f} |", flush=True)
    for mode in modes:
        rr = [r for r in rows if r["malloc"] == mode and "gap" in r]
        if rr:
            gaps = [r["gap"] for r in rr]
            extra = [r["first_step_extra"] / 2**20 for r in rr]
            print(f"{mode}: warm-step gap n={len(gaps)} median {statistics.median(gaps):+.1%}, "
                  f"{min(gaps):+.1%} .. {max(gaps):+.1%}; first step beyond the tracker {min(extra):+.0f} .. "
                  f"{max(extra):+.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
