"""Analytic and traced estimates vs measured peak for the model families beyond dense causal LMs (mixture-of-experts,
T5, Qwen2-VL LoRA / full with images), on CPU, through fitburst's own training step (benchmarks/_measure.py:
fitburst.builders.build_model, make_optimizer, fitburst.train.optimizer_step, with a tracker of live tensor storages).

    PYTHONPATH=$PWD python benchmarks/families_accuracy.py [ARCH_PREFIX, e.g. t5 or qwen2_vl]

Prints one row per case and the median / worst absolute error (targets: median <= 4 %, worst <= 10 %). The
estimate is the uncalibrated analytic model; no constant was fitted to these rows (the T5 terms were written
against the in-sample rows' saved tensors), and the held-out rows were run only after.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fitburst.memory import RunSettings, estimate, load_shape, resolve_device  # noqa: E402

ARCHS = {
    "mixtral": dict(model_type="mixtral", hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=8000,
                    num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                    max_position_embeddings=4096),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=192, intermediate_size=512, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512, num_experts=4, num_experts_per_tok=2,
                      num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, vocab_size=8000,
                      tie_word_embeddings=False, max_position_embeddings=4096),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=192,
                      num_experts=8, num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, vocab_size=6000, tie_word_embeddings=False,
                      max_position_embeddings=4096),
    # encoder-decoder: FLAN-T5's layout (gated-gelu, relative attention bias, dropout 0.1 as shipped; transformers 5
    # builds it with the head tied, as it loads a checkpoint that holds no separate lm_head)
    "t5": dict(model_type="t5", d_model=256, d_kv=32, d_ff=640, num_layers=3, num_decoder_layers=3, num_heads=8,
               vocab_size=8000, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.1,
               pad_token_id=0, eos_token_id=2, decoder_start_token_id=0),
    # T5 v1.0's layout (relu, tied head), deeper decoder than encoder: held-out rows only
    "t5_v1": dict(model_type="t5", d_model=192, d_kv=32, d_ff=768, num_layers=2, num_decoder_layers=4,
                  num_heads=6, vocab_size=6000, feed_forward_proj="relu", tie_word_embeddings=True,
                  dropout_rate=0.1, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0),
    # a small Qwen2-VL: text proportions as the llama row of _measure.py, a 2-block vision tower of width 128
    "qwen2_vl": dict(model_type="qwen2_vl", image_token_id=7990, video_token_id=7991, vision_start_token_id=7992,
                     vision_end_token_id=7993, tie_word_embeddings=False,
                     text_config=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=8000,
                                      max_position_embeddings=4096,
                                      rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6],
                                                       "rope_theta": 10000.0}),
                     vision_config=dict(depth=2, embed_dim=128, num_heads=4, mlp_ratio=4, patch_size=14,
                                        spatial_merge_size=2, temporal_patch_size=2, hidden_size=256)),
}
QV = ["q_proj", "v_proj"]
T5_QV = ["q", "v"]
# Qwen2-VL LoRA with images: images per sample x language tokens per image (x 4 patches each in the tower)
VL = dict(arch="qwen2_vl", dtype="fp32")
CASES = [
    dict(arch="mixtral", method="lora", targets=QV, batch=2, seq_len=256, dtype="fp32"),
    dict(arch="mixtral", method="lora", targets="all-linear", rank=16, batch=4, seq_len=128, dtype="fp32"),
    dict(arch="mixtral", method="full", batch=2, seq_len=256, dtype="fp32"),
    dict(arch="mixtral", method="lora", targets="all-linear", batch=2, seq_len=256, dtype="fp32",
         grad_checkpointing=True),
    dict(arch="qwen2_moe", method="lora", targets="all-linear", batch=2, seq_len=256, dtype="fp32"),
    dict(arch="qwen2_moe", method="full", batch=2, seq_len=128, dtype="fp32"),
    # held out: added after the model above was settled, and not looked at while building it
    dict(arch="qwen3_moe", method="lora", targets="all-linear", batch=2, seq_len=256, dtype="fp32", held_out=True),
    dict(arch="qwen3_moe", method="full", batch=1, seq_len=256, dtype="fp32", held_out=True),
    # this row, first run held out at -35.8 %, showed expert-only LoRA saving nothing in the estimate: fixed, so
    # it is in-sample now; the row after it was added after that fix
    dict(arch="mixtral", method="lora", targets=["w1", "w2", "w3"], batch=1, seq_len=512, dtype="fp32"),
    dict(arch="qwen3_moe", method="lora", targets=["gate_proj", "up_proj", "down_proj"], batch=2, seq_len=192,
         dtype="fp32", held_out=True),
    dict(arch="qwen2_moe", method="lora", targets="all-linear", batch=4, seq_len=128, dtype="fp32",
         grad_checkpointing=True, held_out=True),
    # encoder-decoder (T5): encoder input and target both seq_len long
    dict(arch="t5", method="lora", targets=T5_QV, batch=2, seq_len=256, dtype="fp32"),
    dict(arch="t5", method="lora", targets="all-linear", rank=16, batch=4, seq_len=128, dtype="fp32"),
    dict(arch="t5", method="full", batch=2, seq_len=128, dtype="fp32"),
    dict(arch="t5", method="lora", targets="all-linear", batch=2, seq_len=256, dtype="fp32", grad_checkpointing=True),
    dict(arch="t5", method="full", batch=2, seq_len=256, dtype="bf16", grad_checkpointing=True),
    # these two, first run held out at -15.4 % and -12.7 %, showed the 16-bit terms missing (CPU SDPA's fp32
    # upcast, LoRA inputs kept as they are under autocast, wo kept in fp32, master weights' norms in fp32): fixed,
    # so they are in-sample now
    dict(arch="t5", method="lora", targets="all-linear", batch=4, seq_len=192, dtype="bf16"),
    dict(arch="t5_v1", method="full", batch=2, seq_len=192, dtype="bf16"),
    # held out: not looked at while the T5 terms were set (the last three added after the fix above)
    dict(arch="t5", method="full", batch=4, seq_len=128, dtype="fp32", grad_checkpointing=True, held_out=True),
    dict(arch="t5_v1", method="lora", targets=T5_QV, batch=2, seq_len=256, dtype="fp32", held_out=True),
    dict(arch="t5", method="lora", targets=T5_QV, batch=2, seq_len=256, dtype="bf16", grad_checkpointing=True,
         held_out=True),
    dict(arch="t5", method="full", batch=1, seq_len=256, dtype="bf16", held_out=True),
    dict(arch="t5_v1", method="lora", targets="all-linear", batch=2, seq_len=128, dtype="bf16", held_out=True),
    dict(VL, method="lora", targets="all-linear", batch=2, seq_len=192, images=1, image_tokens=64),
    dict(VL, method="lora", targets=QV, batch=4, seq_len=128, images=1, image_tokens=16),
    dict(VL, method="lora", targets="all-linear", batch=2, seq_len=256, images=2, image_tokens=64,
         vision="projector"),
    dict(VL, method="lora", targets="all-linear", batch=2, seq_len=192, images=1, image_tokens=64, vision="tower"),
    dict(VL, method="full", batch=1, seq_len=256, images=1, image_tokens=100),
    dict(VL, method="lora", targets=QV, batch=1, seq_len=1100, images=4, image_tokens=256, vision="tower"),
    dict(VL, method="lora", targets=QV, batch=1, seq_len=1100, images=1, image_tokens=1024),
    # held out: added after the vision terms above were settled, and not looked at while building them
    dict(VL, method="lora", targets="all-linear", batch=4, seq_len=160, images=1, image_tokens=36,
         grad_checkpointing=True, held_out=True),
    dict(VL, method="lora", targets=QV, batch=1, seq_len=512, images=4, image_tokens=100, vision="tower",
         held_out=True),
    dict(VL, method="full", batch=2, seq_len=192, images=1, image_tokens=64, vision="projector", held_out=True),
]


def settings_of(c: dict) -> RunSettings:
    return RunSettings(method=c["method"], rank=c.get("rank", 8), dropout=0.0, target_modules=c.get("targets", QV),
                         micro_batch_size=c["batch"], seq_len=c["seq_len"],
                         gradient_checkpointing=c.get("grad_checkpointing", False),
                         precision=c["dtype"], attention="sdpa", keep_logits=False, images=c.get("images", 0),
                         image_tokens=c.get("image_tokens", 0), vision=c.get("vision", "frozen"))


def measure_one(case: dict) -> dict:
    """In a child process: the case's random model, trained two steps by _measure.run."""
    import _measure

    from fitburst.memory.trace import TraceUnsupported, traced_estimate

    _measure.ARCHS.update(ARCHS)
    out = _measure.run(case)
    spec = _measure.spec_of(case, _measure.build(case["arch"], case["root"]))
    t0 = time.perf_counter()
    try:  # the traced estimate of the same step (its allocated peak: live tensor bytes, as measured)
        out["traced"] = traced_estimate(spec, settings_of(case), resolve_device("cpu:64GiB"),
                                        seq_len=case["seq_len"]).allocated_peak_bytes
    except TraceUnsupported:
        out["traced"] = None
    out["trace_s"] = time.perf_counter() - t0
    return out


def main(only: str | None = None) -> int:
    """Every case, or those whose arch starts with ``only`` (e.g. ``t5``, ``qwen2_vl``)."""
    dev = resolve_device("cpu:64GiB")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for c in (c for c in CASES if only is None or c["arch"].startswith(only)):
            c = dict(c, root=root)
            r = subprocess.run([sys.executable, __file__, "--one", json.dumps(c)], capture_output=True, text=True)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise SystemExit(f"measurement failed for {c}:\n{r.stderr[-3000:]}")
            m = json.loads(line[0][7:])
            e = estimate(load_shape(str(Path(root) / c["arch"])), settings_of(c), dev, calibrate=False)
            t = c.get("targets", QV)
            what = "" if c["method"] == "full" else " " + (t if isinstance(t, str) else "+".join(t))
            what += f" vision {c['vision']}" if c.get("vision") else ""
            name = f"{c['arch']}: {settings_of(c).describe()}{what}"
            rows.append((name, m["peak"], e.allocated_peak_bytes, c.get("held_out", False), m["traced"],
                         m["trace_s"]))
    print(f"{'case':<88} {'measured MiB':>12} {'estimate MiB':>12} {'error':>7} {'traced':>8} {'trace s':>7}")
    for name, meas, est, held, traced, secs in rows:
        tr = f"{traced / meas - 1:>+8.2%}" if traced else f"{'n/a':>8}"
        print(f"{name:<88} {meas / 2**20:>12.2f} {est / 2**20:>12.2f} {est / meas - 1:>+7.1%} {tr} {secs:>7.1f}"
              + ("  (held out)" if held else ""))
    ok = True
    parts = (("in-sample", [r for r in rows if not r[3]]), ("held out", [r for r in rows if r[3]]), ("all", rows))
    for part, sel in (p for p in parts if p[1]):
        errs = [abs(est / meas - 1) for _, meas, est, _, _, _ in sel]
        med, worst = statistics.median(errs), max(errs)
        ok = ok and med <= 0.04 and worst <= 0.10
        traced = [abs(t / meas - 1) for _, meas, _, _, t, _ in sel if t]
        trace = f"; traced: median {statistics.median(traced):.2%}, worst {max(traced):.2%}" if traced else ""
        print(f"{part}: median |error| {med:.1%}, worst {worst:.1%} over {len(errs)} rows (targets 4 % / 10 %)"
              + trace)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print("RESULT " + json.dumps(measure_one(json.loads(sys.argv[2]))), flush=True)
    else:
        raise SystemExit(main(sys.argv[1] if len(sys.argv) == 2 else None))
