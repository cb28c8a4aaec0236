"""Per-architecture facts, one registry entry per Hugging Face ``model_type`` the analytic estimate models.

The estimate and :class:`fitburst.memory.shapes.ModelShape` never test a ``model_type``: they ask its
:class:`Architecture` (layer names, what its config adds to the common fields, an encoder-decoder's extras, a vision
tower), the way :data:`fitburst.memory.ladder.LADDER` holds the plan's rungs. A new architecture is one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fitburst.errors import UserError

Getter = Callable[..., Any]  # g(*keys, default=None): the first of ``keys`` the config sets


class ModelConfigError(UserError, ValueError):
    """A model's config.json cannot be found or read, or describes an architecture the estimate cannot model."""


class UnmodelledArchitecture(ModelConfigError):
    """config.json was read, but its architecture is not one the analytic estimate models: the traced estimate
    (which builds the real model with transformers) still can, so callers with a trace fall back to it."""

    def __init__(self, message: str, model_type: str):
        super().__init__(message)
        self.model_type = model_type


@dataclass(frozen=True)
class VisionShape:
    """A Qwen2-VL-style vision tower: patch embedding, ``depth`` pre-norm ViT blocks (LayerNorm, fused qkv,
    attention within each image, fc1 -> QuickGELU -> fc2) over patch tokens, and the merger (LayerNorm, then an MLP
    on ``merge``**2 neighbouring patches that emits one language-model token of width ``out``)."""

    depth: int
    dim: int
    heads: int
    mlp: int
    patch: int  # pixels per patch side
    temporal: int  # frames per patch (a still image is repeated to fill them)
    channels: int
    merge: int  # spatial merge size: merge**2 patches per language token
    out: int

    @property
    def patch_in(self) -> int:
        """Values per patch in pixel_values."""
        return self.channels * self.temporal * self.patch ** 2


@dataclass(frozen=True)
class Architecture:
    """What one ``model_type`` adds to the sizes its config.json gives."""

    # peft's names of a block's attention linears (q, k, v, output)
    attention_names: tuple[str, str, str, str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # a feed-forward whose linears carry these names whatever the config's layout (T5: wi_0, wi_1, wo); None: gated
    # gate/up/down_proj or plain fc1/fc2 as the config says
    feed_forward_names: tuple[str, str, str] | None = None
    # fields of ModelShape this architecture reads from its config beyond the common ones (biases, norms, fusions)
    read: Callable[[Getter], dict[str, Any]] = lambda g: {}
    # mixture of experts: its expert counts, read into the fields (``None``: a dense architecture)
    read_experts: Callable[[dict, dict, str], None] | None = None
    # whether the MoE router is an nn.Linear peft wraps (qwen2_moe's is counted with the experts instead)
    router_is_linear: bool = True
    # target_modules names peft 0.21 maps onto the fused expert parameters of transformers 5 (its MoE conversion)
    expert_aliases: dict[str, str] = field(default_factory=dict)
    # an encoder-decoder read from T5's config keys (d_model, num_heads, d_ff, ...): an encoder stack before the decoder
    encoder_decoder: bool = False
    # the saved tensors of a block laid out as fitburst.memory.activations.BLOCKS names them: "decoder" (pre-norm
    # attention and MLP) or "t5" (T5's sub-layers, the model's dropout and relative position biases)
    block: str = "decoder"
    # each decoder block also attends to the encoder's output, behind a norm of its own
    cross_attention: bool = False
    # attention takes a relative position bias (1 x heads x S x S, or per row with padding) as a float mask
    position_bias: bool = False
    # transformers keeps the feed-forward's output projection (T5's ``wo``) in fp32: ``_keep_in_fp32_modules``
    fp32_ff_out: bool = False
    # the loss takes cross_entropy of the 16-bit logits with no upcast first (under a GPU's autocast: a 16-bit
    # log_softmax copied to fp32)
    loss_on_16bit_logits: bool = False
    # the vision tower this type's ``vision_config`` describes: "modelled" (its weights and, per image, its
    # activations), "weights" (its weights only)
    vision: str = ""


def _llama(g: Getter) -> dict[str, Any]:
    bias = bool(g("attention_bias", default=False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(g("mlp_bias", default=False))}


def _phi(g: Getter) -> dict[str, Any]:
    return dict(mlp="plain", qkv_bias=True, o_bias=True, mlp_bias=True, norm="layer", norm_style="layernorm",
                norms_per_layer=1, parallel_block=True, lm_head_bias=True)


def _mixtral_experts(kw: dict, cfg: dict, where: str) -> None:
    kw.update(experts=int(cfg["num_local_experts"]), expert_intermediate=kw["intermediate"])


def _qwen_experts(kw: dict, cfg: dict, where: str) -> None:
    """Qwen-MoE's routed experts (and shared expert); layouts the count would get wrong are refused."""
    step, dense = int(cfg.get("decoder_sparse_step", 1)), cfg.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise ModelConfigError(
            f"{where}: dense layers among the expert layers (decoder_sparse_step={step}, mlp_only_layers="
            f"{dense}) are not modelled by the analytic estimate. Use the traced estimate "
            "(`fitburst estimate --exact`, or `fitburst preflight`)")
    experts = int(cfg.get("num_experts") or cfg["num_local_experts"])  # transformers 5 saves num_local_experts
    kw.update(experts=experts, expert_intermediate=int(cfg["moe_intermediate_size"]),
              shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0))
    kw["intermediate"] = kw["expert_intermediate"]


def _qwen2_moe_experts(kw: dict, cfg: dict, where: str) -> None:
    _qwen_experts(kw, cfg, where)
    kw["qkv_bias"] = bool(cfg.get("qkv_bias", True))


def _qwen3_moe_experts(kw: dict, cfg: dict, where: str) -> None:
    _qwen_experts(kw, cfg, where)
    kw.update(qk_norm=True, qkv_bias=bool(cfg.get("attention_bias", False)))


_QKV_BIAS = Architecture(read=lambda g: {"qkv_bias": True})
_GEMMA3 = Architecture(read=lambda g: {"norm_style": "gemma", "norms_per_layer": 4, "qk_norm": True})

# the model types the analytic estimate models, in the order its refusal lists them
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(read=_llama),
    "mistral": Architecture(read=_llama),
    "qwen2": _QKV_BIAS,
    "qwen3": Architecture(read=lambda g: {"qk_norm": True, "qkv_bias": bool(g("attention_bias", default=False))}),
    "qwen2_vl": Architecture(read=_QKV_BIAS.read, vision="modelled"),
    "qwen2_5_vl": Architecture(read=_QKV_BIAS.read, vision="weights"),  # its tower (RMSNorm, gated MLP, windows)
    "gemma": Architecture(read=lambda g: {"norm_style": "gemma"}),
    "gemma2": Architecture(read=lambda g: {"norm_style": "gemma", "norms_per_layer": 4}),
    "gemma3": _GEMMA3,
    "gemma3_text": _GEMMA3,
    "phi": Architecture(attention_names=("q_proj", "k_proj", "v_proj", "dense"), read=_phi),
    "phi3": Architecture(read=lambda g: {"fused_qkv": True, "fused_gate_up": True}),
    "stablelm": Architecture(read=lambda g: {"norm": "layer", "norm_style": "layernorm",
                                             "qkv_bias": bool(g("use_qkv_bias", default=False))}),
    "t5": Architecture(attention_names=("q", "k", "v", "o"), feed_forward_names=("wi_0", "wi_1", "wo"),
                       encoder_decoder=True, block="t5", cross_attention=True, position_bias=True, fp32_ff_out=True,
                       loss_on_16bit_logits=True),
    "mixtral": Architecture(read_experts=_mixtral_experts,
                            expert_aliases={"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}),
    "qwen2_moe": Architecture(read_experts=_qwen2_moe_experts, router_is_linear=False),
    "qwen3_moe": Architecture(read_experts=_qwen3_moe_experts,
                              expert_aliases={"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
                                              "down_proj": "down_proj"}),
}
# a model type outside the registry (a shape made by hand): a llama-like decoder
DECODER = Architecture()


def architecture(model_type: str) -> Architecture:
    """The registry's entry for ``model_type``."""
    return ARCHITECTURES.get(model_type, DECODER)


def expert_aliases(model_type: str) -> dict[str, str]:
    """target_modules names that reach a ``model_type``'s fused expert parameters (none for a dense model)."""
    return architecture(model_type).expert_aliases


# --- vision towers ------------------------------------------------------------------------------------------


def qwen2_vl_vision(v: dict, out_hidden: int) -> VisionShape:
    """A Qwen2-VL ``vision_config`` as a tower shape (the language model's width where it names no output)."""
    d = int(v.get("embed_dim", 1280))
    return VisionShape(depth=int(v.get("depth", 32)), dim=d, heads=int(v.get("num_heads", 16)),
                       mlp=int(d * float(v.get("mlp_ratio", 4))), patch=int(v.get("patch_size", 14)),
                       temporal=int(v.get("temporal_patch_size", 2)),
                       channels=int(v.get("in_chans", v.get("in_channels", 3))),
                       merge=int(v.get("spatial_merge_size", 2)), out=int(v.get("hidden_size", out_hidden)))


def qwen2_vl_vision_params(v: dict, out_hidden: int) -> int:
    """Parameters of a Qwen2-VL-style tower: patch embedding, blocks (two LayerNorms, qkv, proj, fc1, fc2), merger."""
    t = qwen2_vl_vision(v, out_hidden)
    d, mlp = t.dim, t.mlp
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * mlp + mlp) + (mlp * d + d)
    m = d * t.merge * t.merge
    merger = 2 * d + (m * m + m) + (m * t.out + t.out)
    return t.patch_in * d + t.depth * block + merger
