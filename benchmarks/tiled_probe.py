"""Variants of a plan's settings trained on CUDA, each in a process of its own, to tell which setting, or which
change that is not a setting, a failure follows.

The plan is the one fitburst makes for Llama-3.1-8B QLoRA r32 on a 24 GiB card (nf4, checkpointing, offloaded
activations, the tiled MLP, the input embeddings in host RAM, the fused loss, 8-bit AdamW). It trains Llama-3.1-8B's
architecture cut to ``--layers`` layers (random weights) for 2 steps at 8,192 tokens (2 MLP shards). Each variant
turns one setting off, or changes what is not a setting: TRL's offloading without its side stream, torch's
checkpoint without early stop, or the allocator's history recorded as gpu_check's snapshots record it. A JSON line
per variant is appended to ``--out``/tiled_probe.jsonl as it ends; the exit status is 1 when one did not train.

Usage: python benchmarks/tiled_probe.py --out DIR --models DIR [--layers N] [--budget SECONDS] [--only NAME ...]
       python benchmarks/tiled_probe.py --dry-run --out DIR --models DIR  (CPU: the plumbing, a tiny stand-in)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _at_scale import QLORA, TINY, Case, build, fixed_length_data, spec_of  # noqa: E402

PLAN = {**QLORA, "method.rank": 32, "method.dropout": 0.05, "training.gradient_checkpointing": True,
        "training.activation_offloading": True, "training.tiled_mlp": True, "training.embeddings_on_host": True,
        "training.loss": "fused", "training.optimizer": "adamw8bit"}
OFF = {"activation_offloading": {"training.activation_offloading": False}, "tiled_mlp": {"training.tiled_mlp": False},
       "embeddings_on_host": {"training.embeddings_on_host": False}, "loss": {"training.loss": "standard"},
       "optimizer": {"training.optimizer": "adamw"}, "qlora": {"method.type": "lora"},
       "dropout": {"method.dropout": 0.0}}
# name -> (settings, a change that is not a setting)
VARIANTS: dict[str, tuple[dict, str]] = {  # the likeliest first: a run out of time keeps them
    "plan": (PLAN, ""),
    "plan-history": (PLAN, "history"),
    "no-activation_offloading": ({**PLAN, **OFF["activation_offloading"]}, ""),
    "no-tiled_mlp": ({**PLAN, **OFF["tiled_mlp"]}, ""),
    "plan-offload-no-streams": (PLAN, "no_streams"),
    "plan-no-early-stop": (PLAN, "no_early_stop"),
    # as planned at full size (the planner takes dropout off)
    "plan-d0": ({**PLAN, **OFF["dropout"]}, ""),
    "plan-d0-offload-no-streams": ({**PLAN, **OFF["dropout"]}, "no_streams"),
    "plan-d0-no-tiled_mlp": ({**PLAN, **OFF["dropout"], **OFF["tiled_mlp"]}, ""),
    "plan-d0-no-activation_offloading": ({**PLAN, **OFF["dropout"], **OFF["activation_offloading"]}, ""),
    **{f"no-{k}": ({**PLAN, **v}, "") for k, v in OFF.items() if k not in ("activation_offloading", "tiled_mlp")},
}
MODEL, LAYERS, SEQ, STEPS = "llama-3.1-8b", 4, 8192, 2


def patched(change: str) -> None:
    """``change`` applied in this process before training."""
    if change == "no_streams":
        import trl.models.activation_offloading as ao

        made = ao.get_act_offloading_ctx_manager
        ao.get_act_offloading_ctx_manager = lambda *a, **k: made(*a, **{**k, "use_streams": False})
    elif change == "no_early_stop":
        import torch.utils.checkpoint as ckpt

        ckpt._enable_checkpoint_early_stop = False
    elif change == "history":  # as gpu_check's Readings record it for a snapshot
        import torch

        if torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)


def run_variant(name: str, model: Path, tiny: bool) -> dict:
    """One variant trained (this process): its peak, seconds and loss, and the depth of the model it trained."""
    import torch

    from fitburst.data import prepare_pipeline
    from fitburst.recipe import train

    over, change = VARIANTS[name]
    if tiny:  # the CPU's subset: the rule table refuses CUDA's settings off CUDA
        over = {**QLORA, "method.type": "lora", "training.gradient_checkpointing": True}
    patched(change)
    with tempfile.TemporaryDirectory() as d:
        seq = SEQ // TINY if tiny else SEQ  # what spec_of sets
        data = fixed_length_data(Path(d) / "long.jsonl", n=8, words=seq)
        spec = spec_of(Case(name, MODEL, SEQ, over), str(model), data, STEPS, tiny)
        t0 = time.perf_counter()
        result = train(spec, prepare_pipeline(spec), Path(d) / "run", device="cpu" if tiny else "cuda",
                       progress=False)
    cuda = torch.cuda.is_available()
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    return {"variant": name, "layers": layers, "seq_len": seq, "status": "ok",
            "seconds": round(time.perf_counter() - t0, 1), "loss": round(result.final_loss, 4),
            "max_allocated_mib": torch.cuda.max_memory_allocated() >> 20 if cuda else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # the child's side
    ap.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    model = a.models / f"llama8b-{a.layers}layer{'-tiny' if a.dry_run else ''}"
    if a.build:
        build(MODEL, model, a.dry_run, a.layers)
        return 0
    if a.variant:
        print(json.dumps(run_variant(a.variant, model, a.dry_run)), flush=True)
        return 0
    return run_all(a, model)


def run_all(a: argparse.Namespace, model: Path) -> int:
    """The build, then each variant in a child process while the budget lasts; a JSON line each. Returns 1 when a
    variant that started did not train."""
    deadline = time.monotonic() + a.budget
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / "tiled_probe.jsonl"
    base = [sys.executable, __file__, "--out", str(a.out), "--models", str(a.models), "--layers", str(a.layers)]
    base += ["--dry-run"] * a.dry_run
    subprocess.run([*base, "--build"], check=True, timeout=max(deadline - time.monotonic(), 1))
    failed = 0
    for name in [v for v in VARIANTS if not a.only or v in a.only]:
        left = deadline - time.monotonic()
        facts = {"variant": name, "layers": a.layers}
        if left < 15:
            row = {**facts, "status": "not run: out of time"}
        else:
            row = {**facts, **child([*base, "--variant", name], left)}
            failed += row["status"] != "ok"
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{name:36} {row['status'][:160]} {row.get('seconds', '')}", flush=True)
    return 1 if failed else 0


def child(cmd: list[str], timeout: float) -> dict:
    """A variant's process: its JSON line, or why there is none (its failure's last line, or the budget's end)."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"status": f"stopped: the budget's last {timeout:.0f} s ran out", "seconds": round(timeout, 1)}
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0 and lines and lines[-1].startswith("{"):
        return json.loads(lines[-1])
    sys.stderr.write(p.stderr[-6000:])
    last = (p.stderr.strip().splitlines() or ["no JSON line and no error"])[-1][:300]
    return {"status": f"failed: {last}", "seconds": round(time.monotonic() - t0, 1)}


if __name__ == "__main__":
    sys.exit(main())
