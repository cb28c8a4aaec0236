"""Write fitburst/configs/*.json (HF config.json format) from ../shared/memory/architectures.csv facts.

Run once: python benchmarks/_gen_configs.py. Kept so the bundled files can be regenerated and reviewed.
"""

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "fitburst" / "configs"


def causal(arch, mt, h, L, H, kv, hd, i, V, tied, extra=None, **kw):
    cfg = {
        "architectures": [arch],
        "model_type": mt,
        "hidden_size": h,
        "num_hidden_layers": L,
        "num_attention_heads": H,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "intermediate_size": i,
        "vocab_size": V,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }
    cfg.update(kw)
    cfg.update(extra or {})
    return cfg


QWEN = dict(arch="Qwen2ForCausalLM", mt="qwen2", max_position_embeddings=32768, rope_theta=1000000.0)
LLAMA3 = dict(
    arch="LlamaForCausalLM",
    mt="llama",
    max_position_embeddings=131072,
    rope_theta=500000.0,
    attention_bias=False,
    mlp_bias=False,
    rms_norm_eps=1e-5,
)
VIT = {
    "depth": 32,
    "embed_dim": 1280,
    "mlp_ratio": 4,
    "num_heads": 16,
    "in_chans": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

CONFIGS = {
    "qwen2.5-0.5b": causal(h=896, L=24, H=14, kv=2, hd=64, i=4864, V=151936, tied=True, **QWEN),
    "qwen2.5-1.5b": causal(h=1536, L=28, H=12, kv=2, hd=128, i=8960, V=151936, tied=True, **QWEN),
    "qwen2.5-3b": causal(h=2048, L=36, H=16, kv=2, hd=128, i=11008, V=151936, tied=True, **QWEN),
    "qwen2.5-7b": causal(h=3584, L=28, H=28, kv=4, hd=128, i=18944, V=152064, tied=False, **QWEN),
    "qwen2.5-14b": causal(h=5120, L=48, H=40, kv=8, hd=128, i=13824, V=152064, tied=False, **QWEN),
    "llama-3.1-8b": causal(h=4096, L=32, H=32, kv=8, hd=128, i=14336, V=128256, tied=False, **LLAMA3),
    "llama-3.1-70b": causal(h=8192, L=80, H=64, kv=8, hd=128, i=28672, V=128256, tied=False, **LLAMA3),
    "llama-3.2-1b": causal(h=2048, L=16, H=32, kv=8, hd=64, i=8192, V=128256, tied=True, **LLAMA3),
    "llama-3.2-3b": causal(h=3072, L=28, H=24, kv=8, hd=128, i=8192, V=128256, tied=True, **LLAMA3),
    "mistral-7b": causal(
        "MistralForCausalLM",
        "mistral",
        4096,
        32,
        32,
        8,
        128,
        14336,
        32000,
        False,
        sliding_window=4096,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
    ),
    "gemma-3-270m": causal(
        "Gemma3ForCausalLM",
        "gemma3_text",
        640,
        18,
        4,
        1,
        256,
        2048,
        262144,
        True,
        hidden_activation="gelu_pytorch_tanh",
        hidden_act=None,
        sliding_window=512,
        max_position_embeddings=32768,
        query_pre_attn_scalar=256,
    ),
    "gemma-3-1b": causal(
        "Gemma3ForCausalLM",
        "gemma3_text",
        1152,
        26,
        4,
        1,
        256,
        6912,
        262144,
        True,
        hidden_activation="gelu_pytorch_tanh",
        hidden_act=None,
        sliding_window=512,
        max_position_embeddings=32768,
        query_pre_attn_scalar=256,
    ),
    "phi-3-mini": causal(
        "Phi3ForCausalLM",
        "phi3",
        3072,
        32,
        32,
        32,
        96,
        8192,
        32064,
        False,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    "qwen2-vl-7b": causal(
        "Qwen2VLForConditionalGeneration",
        "qwen2_vl",
        3584,
        28,
        28,
        4,
        128,
        18944,
        152064,
        False,
        vision_config=dict(VIT, hidden_size=3584),
        max_position_embeddings=32768,
    ),
    "qwen2-vl-2b": causal(
        "Qwen2VLForConditionalGeneration",
        "qwen2_vl",
        1536,
        28,
        12,
        2,
        128,
        8960,
        151936,
        True,
        vision_config=dict(VIT, hidden_size=1536),
        max_position_embeddings=32768,
    ),
    "llama-2-7b": causal(
        h=4096,
        L=32,
        H=32,
        kv=32,
        hd=128,
        i=11008,
        V=32000,
        tied=False,
        **dict(LLAMA3, max_position_embeddings=4096, rope_theta=10000.0),
    ),
    "llama-2-13b": causal(
        h=5120,
        L=40,
        H=40,
        kv=40,
        hd=128,
        i=13824,
        V=32000,
        tied=False,
        **dict(LLAMA3, max_position_embeddings=4096, rope_theta=10000.0),
    ),
    "phi-1.5": causal(
        "PhiForCausalLM",
        "phi",
        2048,
        24,
        32,
        32,
        64,
        8192,
        51200,
        False,
        hidden_act="gelu_new",
        partial_rotary_factor=0.5,
        max_position_embeddings=2048,
        layer_norm_eps=1e-5,
        torch_dtype="float16",
    ),
    "stablelm-3b": causal(
        "StableLmForCausalLM",
        "stablelm",
        2560,
        32,
        32,
        32,
        80,
        6912,
        50304,
        False,
        partial_rotary_factor=0.25,
        use_qkv_bias=False,
        max_position_embeddings=4096,
        layer_norm_eps=1e-5,
    ),
    "flan-t5-xl": {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "d_model": 2048,
        "d_kv": 64,
        "d_ff": 5120,
        "num_layers": 24,
        "num_decoder_layers": 24,
        "num_heads": 32,
        "vocab_size": 32128,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "layer_norm_epsilon": 1e-6,
        "is_encoder_decoder": True,
        "torch_dtype": "float32",
    },
}

ALIASES = {"phi-3-mini-4k": "phi-3-mini", "mistral-7b-v0.1": "mistral-7b"}

if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for name, cfg in {**CONFIGS, **{a: CONFIGS[t] for a, t in ALIASES.items()}}.items():
        cfg = {k: v for k, v in cfg.items() if v is not None}
        (OUT / f"{name}.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"wrote {len(CONFIGS) + len(ALIASES)} configs to {OUT}")
