"""fitcheck-llm's training-memory estimate for the accuracy benchmark's rows, run in fitcheck's own interpreter.

Not imported by fitburst: preflight_accuracy.py runs ``$FITCHECK_PYTHON benchmarks/_fitcheck.py`` with a JSON list of
requests on stdin and reads a JSON list of answers from stdout. Each request:

    {"config": "<path to an HF config.json>" (or "config_json": {...} inline), "name": "...",
     "reported_params": <int or null>,
     "training": {<fitcheck.TrainingConfig fields>}, "gpu": "<fitcheck GPU key>" | null, "vram_mib": <int or null>}

Offline: fitcheck's public loader (fetch_model_config) always calls hf_hub_download and the Hub API, so the ModelConfig
is built here from the local config.json with fitcheck's own parsing, MoE/multimodal refusal and parameter-count
reconciliation (config_parser._reject_unsupported / _parse_fields / _count_params / _reconcile_param_count).
``reported_params`` stands in for the Hub's safetensors total that fitcheck would fetch online: fitcheck refuses a
model whose config-derived count is more than 2 % off it, as it would online.

Each answer: total_mib (fitcheck's headline: peak reserved + CUDA context, what it calibrated on a T4),
overhead_mib (its context + fragmentation term), tensors_mib = total - overhead (weights, adapters, optimizer,
gradients, activations: the part comparable to max_memory_allocated), fits, verdict; or {"error": "..."}.
Exit status 3 when fitcheck is not importable.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import fitcheck
    from fitcheck import ModelConfig, TrainingConfig, estimate, get_gpu
    from fitcheck.config_parser import _count_params, _parse_fields, _reconcile_param_count, _reject_unsupported
except ImportError as e:
    print(f"fitcheck not importable: {e}", file=sys.stderr)
    raise SystemExit(3) from None


def model_config(req: dict) -> tuple[ModelConfig, str]:
    if "config_json" in req:
        raw = req["config_json"]
    else:
        with open(req["config"], encoding="utf-8") as f:
            raw = json.load(f)
    name = req.get("name") or "model"
    _reject_unsupported(raw, name)
    fields = _parse_fields(raw)
    warn = io.StringIO()
    with contextlib.redirect_stderr(warn):
        n = _reconcile_param_count(name, req.get("reported_params"), _count_params(fields))
    cfg = ModelConfig(
        name=name,
        num_params=n,
        hidden_size=fields.hidden_size,
        num_layers=fields.num_layers,
        num_attention_heads=fields.num_attention_heads,
        num_kv_heads=fields.num_kv_heads,
        intermediate_size=fields.intermediate_size,
        vocab_size=fields.vocab_size,
        head_dim=fields.head_dim,
        tie_word_embeddings=fields.tie_word_embeddings,
    )
    return cfg, warn.getvalue().strip()


def answer(req: dict) -> dict:
    try:
        cfg, warning = model_config(req)
        gpu = get_gpu(req["gpu"]) if req.get("gpu") else get_gpu("custom", vram_mib=int(req["vram_mib"]))
        rep = estimate(cfg, TrainingConfig(**req["training"]), gpu)
    except Exception as e:  # noqa: BLE001 - every refusal is an answer for the table
        msg = " ".join(str(e).split())
        return dict(error=f"{type(e).__name__}: {msg}")
    return dict(
        total_mib=rep.total_mib,
        overhead_mib=rep.overhead_mib,
        tensors_mib=rep.total_mib - rep.overhead_mib,
        fits=rep.fits,
        verdict=rep.verdict,
        num_params=cfg.num_params,
        warning=warning,
    )


def main() -> int:
    reqs = json.load(sys.stdin)
    print(json.dumps(dict(version=fitcheck.__version__, rows=[answer(r) for r in reqs])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
