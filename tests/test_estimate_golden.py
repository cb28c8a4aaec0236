"""The analytic estimate, pinned: every figure of a broad grid (every bundled config, and synthetic configs of the
architectures no bundled one has, x lora / qlora / full x settings x devices x 1 or 2 GPUs) against a golden file.

A restructuring of fitburst.memory (estimator, shapes) must leave every byte of it unchanged; a change meant to move
a figure regenerates the file on purpose: ``python tests/test_estimate_golden.py --write``.
"""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "estimate_golden.json.gz"

# settings beside the method's defaults; each varies what one branch of the estimate reads
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "ckpt": {"gradient_checkpointing": True},
    "ckpt-batch4-padded-eval": {"gradient_checkpointing": True, "micro_batch_size": 4, "seq_len": 256, "eval_batch": 2},
    "fused": {"loss": "fused", "grad_accum": 4},
    "adamw8bit-dropout0": {"optimizer": "adamw8bit", "dropout": 0.0, "keep_logits": False},
    "paged-eager": {"optimizer": "paged_adamw8bit", "attention": "eager", "micro_batch_size": 2, "seq_len": 128},
    "fp16-sgd-targets": {"precision": "fp16", "optimizer": "sgd", "target_modules": ["q_proj", "v_proj", "q", "v",
                                                                                     "qkv_proj"]},
    "fp32-flash": {"precision": "fp32", "attention": "flash", "seq_len": 1024},
    "packed-offload": {"packed_fill": 0.6, "micro_batch_size": 4, "activation_offloading": True,
                       "gradient_checkpointing": True},
    "images-tower": {"images": 2, "image_tokens": 64, "vision": "tower", "seq_len": 640},
    "images-projector": {"images": 1, "image_tokens": 256, "vision": "projector", "seq_len": 512, "dropout": 0.0},
    "pure-bf16-eval": {"pure_bf16": True, "eval_batch": 4, "loss": "fused"},
    "eval-heavy": {"seq_len": 256, "eval_batch": 32, "keep_logits": False},
    "images-frozen": {"images": 4, "image_tokens": 1024, "seq_len": 256, "gradient_checkpointing": True,
                      "loss": "fused", "attention": "eager"},
}
METHODS: dict[str, dict[str, Any]] = {
    "lora": {"method": "lora"},
    "qlora": {"method": "qlora", "quant": "nf4"},
    "qlora-int8": {"method": "qlora", "quant": "int8", "double_quant": False},
    "full": {"method": "full"},
}
DEVICES = ("A100-80GB", "T4", "M2-Max-64GB", "cpu:64GiB")
# FSDP over 2 GPUs: per-rank figures, gathered blocks, host RAM
SHARDED: dict[str, dict[str, Any]] = {
    "fsdp2": {"world_size": 2, "distributed": "fsdp"},
    "fsdp2-keep-offload": {"world_size": 2, "distributed": "fsdp", "reshard_after_forward": False,
                           "cpu_offload": True, "gradient_checkpointing": True},
}


def _synthetic_configs() -> dict[str, dict]:
    """Architectures the estimate models that no bundled config has: made from a bundled config of a kin."""
    from fitburst.memory.shapes import CONFIG_DIR

    def read(name: str) -> dict:
        return json.loads((CONFIG_DIR / f"{name}.json").read_text())

    out = {"synthetic-gemma": {**read("gemma-3-270m"), "model_type": "gemma"},
           "synthetic-gemma2": {**read("gemma-3-1b"), "model_type": "gemma2", "final_logit_softcapping": 30.0},
           "synthetic-qwen3": {**read("qwen2.5-0.5b"), "model_type": "qwen3", "head_dim": 128,
                               "attention_bias": False},
           "synthetic-qwen2_5_vl": {**read("qwen2-vl-2b"), "model_type": "qwen2_5_vl"},
           "synthetic-llama-biased": {**read("smollm2-135m"), "attention_bias": True, "mlp_bias": True},
           "synthetic-stablelm-qkv-bias": {**read("stablelm-3b"), "use_qkv_bias": True},
           "synthetic-t5-relu": {**read("flan-t5-xl"), "feed_forward_proj": "relu", "dropout_rate": 0.0}}
    # refused: an architecture not modelled, a mixture of experts not modelled, experts among dense layers
    out["synthetic-gpt-neox"] = {**read("smollm2-135m"), "model_type": "gpt_neox"}
    out["synthetic-deepseek-moe"] = {**read("smollm2-135m"), "model_type": "deepseek_v2", "n_routed_experts": 8}
    out["synthetic-llama-moe"] = {**read("smollm2-135m"), "num_local_experts": 4}
    out["synthetic-qwen2-moe-sparse-step"] = {**read("qwen1.5-moe-a2.7b"), "decoder_sparse_step": 2}
    text = read("qwen2.5-0.5b")
    out["synthetic-text-config"] = {"model_type": "qwen2_vl", "tie_word_embeddings": True,
                                    "text_config": {k: v for k, v in text.items() if k != "tie_word_embeddings"}}
    return out


def _configs() -> dict[str, dict]:
    from fitburst.memory.shapes import CONFIG_DIR

    bundled = {p.stem: json.loads(p.read_text()) for p in sorted(CONFIG_DIR.glob("*.json"))}
    return {**bundled, **_synthetic_configs()}


def _shape_record(shape) -> dict:
    """What the estimate reads of a shape: its fields and the layers and counts derived from them."""
    rec = asdict(shape)
    rec["layer_linears"] = [[asdict(lin) for lin in shape.layer_linears(dec)] for _, dec in shape.blocks()]
    rec["expert_numels"] = shape.expert_numels()
    rec["lora_experts_all"] = shape.lora_experts("all-linear")
    rec["lora_experts_named"] = shape.lora_experts(["w1", "w2", "gate_proj", "down_proj"])
    rec["norm_params"] = [shape.norm_params_per_layer(dec) for _, dec in shape.blocks()]
    rec["counts"] = [shape.param_count(), shape.active_param_count(), shape.largest_linear(),
                     shape.final_norm_params, shape.lm_head_params]
    return rec


def _estimate_record(shape, settings, device) -> Any:
    from fitburst.memory.estimator import estimate
    from fitburst.memory.fsdp_terms import host_bytes

    try:
        est = estimate(shape, settings, device, calibrate=False)
    except (ValueError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    rec = est.to_dict()
    rec.pop("settings")
    rec.pop("offloaded_host_bytes")  # the host side of offloading: pinned by tests/test_host_ram.py
    rec["host_bytes"] = host_bytes(est.params, settings, 1)
    return rec


def _cases() -> list[tuple[str, dict, str]]:
    """(case name, settings, device) of the grid."""
    out = []
    for method, mkw in METHODS.items():
        for variant, vkw in VARIANTS.items():
            for dev in DEVICES:
                out.append((f"{method}/{variant}/{dev}", {**mkw, **vkw}, dev))
        for sharded, skw in SHARDED.items():
            for variant in ("plain", "fused", "ckpt-batch4-padded-eval"):
                out.append((f"{method}/{variant}/{sharded}/A100-80GB", {**mkw, **VARIANTS[variant], **skw},
                            "A100-80GB"))
    return out


def golden_records() -> dict[str, Any]:
    """Every config's shape and its estimates over the grid, as plain JSON values."""
    from fitburst.hardware import resolve_device
    from fitburst.memory.shapes import ModelConfigError, ModelShape
    from fitburst.settings import RunSettings

    devices = {d: resolve_device(d) for d in DEVICES}
    out: dict[str, Any] = {}
    for name, cfg in _configs().items():
        try:
            shape = ModelShape.from_config(cfg, name=name, source=f"configs/{name}")
        except ModelConfigError as e:
            out[name] = f"{type(e).__name__}: {e}"
            continue
        out[f"{name}/shape"] = _shape_record(shape)
        for case, kw, dev in _cases():
            try:
                settings = RunSettings(**kw)
            except ValueError as e:
                out[f"{name}/{case}"] = f"ValueError: {e}"
                continue
            out[f"{name}/{case}"] = _estimate_record(shape, settings, devices[dev])
        # the estimate of an eval with a different seq_len, and with the batch the shape does not pad
        out[f"{name}/lora/unpadded-b2/A100-80GB"] = _estimate_record(
            shape, RunSettings(micro_batch_size=2, padded=False), devices["A100-80GB"])
    return json.loads(json.dumps(out))  # tuples as lists, as the golden file reads back


@pytest.fixture
def pinned_environment(monkeypatch):
    """What the estimate reads from this machine, fixed: torch's SDPA version rule, the C++ compiler inductor
    would find, cuBLAS's workspace setting."""
    from fitburst import hardware

    monkeypatch.setattr(hardware, "efficient_takes_gqa", lambda: False)
    monkeypatch.setattr(hardware, "cpu_compiler", lambda: True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)


def _first_differences(got: dict, want: dict, limit: int = 5) -> list[str]:
    out = []
    for key in sorted(set(got) | set(want)):
        if got.get(key) != want.get(key):
            g, w = got.get(key), want.get(key)
            if isinstance(g, dict) and isinstance(w, dict):
                fields = [f"{f}: {w.get(f)!r} -> {g.get(f)!r}" for f in sorted(set(g) | set(w)) if g.get(f) != w.get(f)]
                out.append(f"{key}: " + "; ".join(fields)[:600])
            else:
                out.append(f"{key}: {str(w)[:300]} -> {str(g)[:300]}")
            if len(out) >= limit:
                break
    return out


def test_every_estimate_figure_is_as_recorded(pinned_environment):
    want = json.loads(gzip.decompress(GOLDEN.read_bytes()))
    got = golden_records()
    assert len(got) == len(want) > 3000
    assert got == want, "estimates moved:\n" + "\n".join(_first_differences(got, want))


def test_the_golden_grid_reaches_every_phase_and_architecture():
    """The grid is broad: each phase is somewhere the peak, and every architecture the estimate models is in it."""
    from fitburst.memory.shapes import SUPPORTED_TYPES

    want = json.loads(gzip.decompress(GOLDEN.read_bytes()))
    peaks = {r["peak_phase"] for r in want.values() if isinstance(r, dict) and "peak_phase" in r}
    assert {"forward", "vision", "loss", "backward", "optimizer_step", "eval"} <= peaks
    types = {r["model_type"] for r in want.values() if isinstance(r, dict) and "model_type" in r}
    assert types >= set(SUPPORTED_TYPES) - {"gemma3"}  # gemma3 (the multimodal one) reads as gemma3_text's


if __name__ == "__main__" and "--write" in sys.argv:
    with pytest.MonkeyPatch.context() as mp:
        from fitburst import hardware

        mp.setattr(hardware, "efficient_takes_gqa", lambda: False)
        mp.setattr(hardware, "cpu_compiler", lambda: True)
        mp.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
        records = golden_records()
    GOLDEN.write_bytes(gzip.compress(json.dumps(records, sort_keys=True, indent=0).encode(), mtime=0))
    print(f"{len(records)} records -> {GOLDEN}")
