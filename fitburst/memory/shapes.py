"""Model shapes from config.json alone (no weights, no torch): what the estimator needs to count memory."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .architectures import (
    ARCHITECTURES,
    Architecture,
    Getter,
    ModelConfigError,
    UnmodelledArchitecture,
    VisionShape,
    architecture,
    qwen2_vl_vision,
    qwen2_vl_vision_params,
)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# model_type values whose layer names and saved tensors the analytic estimate models (see from_config)
SUPPORTED_TYPES = tuple(ARCHITECTURES)
# target_modules names peft 0.21 maps onto the fused expert parameters of transformers 5, per model_type
EXPERT_ALIASES = {t: a.expert_aliases for t, a in ARCHITECTURES.items() if a.expert_aliases}
# config keys that mark a mixture-of-experts model (Mixtral, Qwen-MoE, DeepSeek, OLMoE, ...)
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# suffixes stripped from a hub id's basename when looking for a bundled config
_SUFFIXES = ("-instruct", "-it", "-hf", "-chat", "-base", "-4e1t", "-v0.1", "-v0.2", "-v0.3", "-4k", "-128k")
# hidden_act names as the estimate's activation rules call them (anything else: silu)
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_new", "gelu": "gelu", "relu": "relu"}


@dataclass(frozen=True)
class Linear:
    """One nn.Linear of a block: peft targets it by ``name`` (the last part of the module path)."""

    name: str
    fan_in: int
    fan_out: int
    bias: bool = False

    @property
    def numel(self) -> int:
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)


@dataclass
class ModelShape:
    """The architecture facts that decide training memory."""

    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    mlp: str = "gated"  # gated (gate/up/down) or plain (fc1/fc2)
    act: str = "silu"  # silu | gelu_tanh (native) | gelu_new (python formula) | gelu | relu
    norm: str = "rms"  # rms (weight only) | layer (weight + bias)
    norm_style: str = "llama"  # llama (x.to(fp32)...) | gemma (fp32 math, 1+w) | layernorm (native)
    norms_per_layer: int = 2
    qk_norm: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    parallel_block: bool = False  # phi-1.5: attention and MLP share one norm
    lm_head_bias: bool = False
    softcap: bool = False  # the head's logits are soft-capped (final_logit_softcapping: Gemma 2)
    # mixture of experts: transformers 5 keeps each layer's experts as two 3-D parameters, gate_up_proj
    # (E, 2*I, h) and down_proj (E, h, I), not nn.Linear, so bitsandbytes leaves them unquantized (fp32 after
    # k-bit preparation) and peft's target_modules / all-linear never wraps them (its target_parameters does)
    experts: int = 0
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # qwen2_moe's always-on shared expert (0: none), gated by a (h -> 1) linear
    encoder_layers: int = 0  # encoder-decoder (T5): encoder depth; ``layers`` is then the decoder depth
    dropout: float = 0.0  # the model's own dropout in training (T5: dropout_rate, 0.1 as shipped): masks are saved
    extra_params: int = 0  # vision tower, relative position tables, ... (weights only, no text activations)
    vision: VisionShape | None = None  # a vision-language model's tower (its weights are in extra_params)
    extra_note: str = ""
    max_position: int | None = None
    sliding_window: int | None = None
    config_dtype: str | None = None
    source: str = ""
    notes: list[str] = field(default_factory=list)

    # --- derived ----------------------------------------------------------------------------------------
    @property
    def arch(self) -> Architecture:
        """The per-architecture facts of this shape's model_type (fitburst.memory.architectures)."""
        return architecture(self.model_type)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attn_linears(self, cross: bool = False) -> list[Linear]:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        q_name, k_name, v_name, o_name = self.arch.attention_names
        if self.fused_qkv:
            return [Linear("qkv_proj", h, q + 2 * kv, self.qkv_bias), Linear(o_name, q, h, self.o_bias)]
        return [
            Linear(q_name, h, q, self.qkv_bias),
            Linear(k_name, h, kv, self.qkv_bias),
            Linear(v_name, h, kv, self.qkv_bias),
            Linear(o_name, q, h, self.o_bias),
        ]

    def mlp_linears(self) -> list[Linear]:
        """The block's feed-forward nn.Linear layers (for an MoE block: its shared expert and gate only)."""
        h, i, b = self.hidden, self.intermediate, self.mlp_bias
        if self.experts:  # the router is a (h -> experts) linear that peft's all-linear wraps; last by design
            s = self.shared_intermediate
            shared = [Linear("gate_proj", h, s), Linear("up_proj", h, s), Linear("down_proj", s, h),
                      Linear("shared_expert_gate", h, 1)] if s else []
            router = [Linear("gate", h, self.experts)] if self.arch.router_is_linear else []
            return shared + router
        if names := self.arch.feed_forward_names:
            return [Linear(names[0], h, i), Linear(names[1], h, i), Linear(names[2], i, h)]
        if self.mlp == "plain":
            return [Linear("fc1", h, i, b), Linear("fc2", i, h, b)]
        if self.fused_gate_up:
            return [Linear("gate_up_proj", h, 2 * i, b), Linear("down_proj", i, h, b)]
        return [Linear("gate_proj", h, i, b), Linear("up_proj", h, i, b), Linear("down_proj", i, h, b)]

    def expert_tensors(self) -> list[tuple[str, int, int]]:
        """One block's routed-expert 3-D parameters as (peft target_parameters name, dim 1, dim 2), each with
        ``experts`` slices."""
        h, i = self.hidden, self.expert_intermediate
        return [("experts.gate_up_proj", 2 * i, h), ("experts.down_proj", h, i)] if self.experts else []

    def expert_numels(self) -> list[int]:
        """numel of one block's routed-expert parameters, and of a router that is no linear (qwen2_moe's; other
        routers are among :meth:`mlp_linears`: peft wraps them like linears)."""
        router = [] if self.arch.router_is_linear else [self.experts * self.hidden]
        return [self.experts * a * b for _, a, b in self.expert_tensors()] + router

    @property
    def expert_params(self) -> int:
        return sum(self.expert_numels())

    def lora_experts(self, targets: list[str] | str) -> list[tuple[str, int, int, int]]:
        """The expert tensors peft 0.21 wraps (ParamWrapper) for these ``target_modules``, as (name, rank
        multiplier, fan_in, fan_out) per expert: ``all-linear`` and the pre-transformers-5 names reach them
        (Mixtral w1/w3/w2, Qwen3-MoE gate/up/down_proj; none on qwen2_moe), the fused gate_up_proj at twice
        the rank."""
        alias = self.arch.expert_aliases
        if targets == "all-linear" or targets == ["all-linear"]:
            want = set(alias.values())
        else:
            want = {alias[t.split(".")[-1]] for t in targets if t.split(".")[-1] in alias}
        h, i = self.hidden, self.expert_intermediate
        return ([("experts.gate_up_proj", 2, h, 2 * i)] if "gate_up_proj" in want else []) + (
            [("experts.down_proj", 1, i, h)] if "down_proj" in want else [])

    def layer_linears(self, decoder: bool = True) -> list[Linear]:
        """Linears of one block; decoder blocks with cross-attention (T5) hold it too (same peft names q/k/v/o)."""
        lins = self.attn_linears()
        if self.arch.cross_attention and decoder:
            lins = lins + self.attn_linears(cross=True)
        return lins + self.mlp_linears()

    def norm_params_per_layer(self, decoder: bool = True) -> int:
        per = self.hidden * (2 if self.norm == "layer" else 1)
        n = self.norms_per_layer + (1 if self.arch.cross_attention and decoder else 0)
        extra = 2 * self.head_dim if self.qk_norm else 0
        return n * per + extra

    def blocks(self) -> list[tuple[int, bool]]:
        """(count, is_decoder) per stack."""
        if self.encoder_layers:
            return [(self.encoder_layers, False), (self.layers, True)]
        return [(self.layers, True)]

    @property
    def total_layers(self) -> int:
        return self.layers + self.encoder_layers

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """Separate lm_head weights (0 when tied to the embeddings)."""
        return 0 if self.tied else self.vocab * self.hidden + (self.vocab if self.lm_head_bias else 0)

    @property
    def final_norm_params(self) -> int:
        per = self.hidden * (2 if self.norm == "layer" else 1)
        return per * (2 if self.encoder_layers else 1)

    def linear_params(self) -> int:
        return sum(c * sum(lin.numel for lin in self.layer_linears(dec)) for c, dec in self.blocks())

    def param_count(self) -> int:
        norms = sum(c * self.norm_params_per_layer(dec) for c, dec in self.blocks())
        return (
            self.embed_params
            + self.lm_head_params
            + self.linear_params()
            + norms
            + self.final_norm_params
            + self.extra_params
            + self.layers * self.expert_params
        )

    def active_param_count(self) -> int:
        """Parameters one token runs through (``experts_per_tok`` of the routed experts)."""
        idle = (self.experts - self.experts_per_tok) * sum(a * b for _, a, b in self.expert_tensors())
        return self.param_count() - self.layers * idle

    def largest_linear(self) -> int:
        return max(lin.fan_in * lin.fan_out for c, dec in self.blocks() for lin in self.layer_linears(dec))

    # --- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict, name: str | None = None, source: str = "") -> ModelShape:
        """Build a shape from a Hugging Face config.json dict; unsupported architectures are refused
        (:class:`ModelConfigError`), never estimated as something they are not."""
        mt = str(cfg.get("model_type", "")).lower()
        where = f"{name or mt or 'model'}" + (f" ({source})" if source else "")
        arch = _modelled(cfg, mt, where)
        top, cfg = cfg, _language_config(cfg)
        name = name or cfg.get("_name_or_path") or top.get("_name_or_path") or mt or "model"
        g = _getter(cfg)
        if arch.encoder_decoder or "d_model" in cfg:
            return cls(**_t5_fields(g, name, source))
        kw = _decoder_fields(g, name, mt, source)
        kw.update(arch.read(g))
        if arch.read_experts is not None:
            arch.read_experts(kw, cfg, where)
            kw["experts_per_tok"] = int(cfg.get("num_experts_per_tok", 2))
        kw.update(_vision_fields(top, arch, kw["hidden"]))
        return cls(**kw)


def _modelled(cfg: dict, mt: str, where: str) -> Architecture:
    """The registry's entry for ``mt``; a mixture of experts or an architecture it does not model is refused."""
    arch = ARCHITECTURES.get(mt)
    experts = next((int(cfg[k]) for k in _MOE_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 1), 0)
    if experts and (arch is None or arch.read_experts is None):
        raise UnmodelledArchitecture(
            f"{where}: model_type {mt!r} is a mixture-of-experts model ({experts} experts); the analytic "
            "estimate models dense blocks only and would count it wrong. Use the traced estimate "
            "(`fitburst estimate --exact`, or `fitburst preflight`), which builds the real model", mt)
    if arch is None:
        raise UnmodelledArchitecture(
            f"{where}: model_type {mt!r} is not one the analytic estimate models ({', '.join(SUPPORTED_TYPES)}); "
            "its layer names and saved tensors would be guessed. Use the traced estimate "
            "(`fitburst estimate --exact`, or `fitburst preflight`), which builds the real model", mt)
    return arch


def _language_config(cfg: dict) -> dict:
    """The language model's config: a multimodal config's ``text_config`` (with the top level's tying and dtype where
    it says none), else the config itself."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    if not (text and "hidden_size" in text):
        return cfg
    merged = dict(text)
    for k in ("tie_word_embeddings", "torch_dtype", "dtype"):
        if k in cfg and k not in merged:
            merged[k] = cfg[k]
    return merged


def _getter(cfg: dict) -> Getter:
    """g(*keys, default=None): the value of the first of ``keys`` that ``cfg`` sets (not None)."""

    def g(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        return default

    return g


def _t5_fields(g: Getter, name: str, source: str) -> dict:
    """A T5 config (d_model, num_heads, d_ff, ...) as ModelShape's fields: ``layers`` the decoder's depth."""
    h = int(g("d_model"))
    heads = int(g("num_heads"))
    gated = "gated" in str(g("feed_forward_proj", default="relu"))
    buckets = int(g("relative_attention_num_buckets", default=32))
    return dict(name=name, model_type="t5", hidden=h, layers=int(g("num_decoder_layers", default=g("num_layers"))),
                heads=heads, kv_heads=heads, head_dim=int(g("d_kv", default=h // heads)),
                intermediate=int(g("d_ff")), vocab=int(g("vocab_size")),
                tied=bool(g("tie_word_embeddings", default=True)), mlp="gated" if gated else "plain",
                act="gelu_new" if gated else "relu", norm="rms", norm_style="t5", norms_per_layer=2,
                encoder_layers=int(g("num_layers")), dropout=float(g("dropout_rate", default=0.1)),
                extra_params=2 * buckets * heads, max_position=None, config_dtype=g("torch_dtype", "dtype"),
                source=source)


def _decoder_fields(g: Getter, name: str, mt: str, source: str) -> dict:
    """The fields every decoder-only config gives (under the Hugging Face or the GPT-2 names)."""
    h = int(g("hidden_size", "n_embd", "d_model"))
    heads = int(g("num_attention_heads", "n_head"))
    act_name = str(g("hidden_act", "hidden_activation", "activation_function", default="silu"))
    return dict(
        name=name,
        model_type=mt,
        hidden=h,
        layers=int(g("num_hidden_layers", "n_layer")),
        heads=heads,
        kv_heads=int(g("num_key_value_heads", default=heads) or heads),
        head_dim=int(g("head_dim", default=h // heads) or h // heads),
        intermediate=int(g("intermediate_size", "n_inner", default=4 * h) or 4 * h),
        vocab=int(g("vocab_size")),
        tied=bool(g("tie_word_embeddings", default=False)),
        act=_ACTIVATIONS.get(act_name, "silu"),
        max_position=g("max_position_embeddings"),
        sliding_window=g("sliding_window"),
        config_dtype=g("torch_dtype", "dtype"),
        source=source,
        softcap=bool(g("final_logit_softcapping")),
    )


def _vision_fields(top: dict, arch: Architecture, hidden: int) -> dict:
    """A vision tower's fields: its weights (and with a modelled tower its shape) and the note saying what of it the
    estimate counts."""
    vis = top.get("vision_config") if isinstance(top.get("vision_config"), dict) else None
    if not vis:
        return {}
    if not arch.vision:
        return {"extra_note": "vision tower not counted"}
    out: dict = {"extra_params": qwen2_vl_vision_params(vis, hidden)}
    if arch.vision == "modelled":
        out["vision"] = qwen2_vl_vision(vis, hidden)
        out["extra_note"] = ("vision tower: frozen, its forward is a transient; trained, its activations per patch "
                             "are kept (images per sample and their resolution from the settings)")
    else:
        out["extra_note"] = "vision tower (weights only; image activations not modelled)"
    return out


# --- loading ---------------------------------------------------------------------------------------------


def bundled_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def bundled_config(ref: str, revision: str | None = None) -> Path | None:
    """The bundled config.json (fitburst/configs) of a hub id or model name at its main revision, or None."""
    if revision not in (None, "main"):
        return None
    for cand in _candidates(ref.rstrip("/").split("/")[-1]):
        f = CONFIG_DIR / f"{cand}.json"
        if f.exists():
            return f
    return None


def _candidates(base: str) -> list[str]:
    base = base.lower().replace("_", ".") if base.lower().startswith("phi-1_5") else base.lower()
    out = [base]
    changed = True
    while changed:
        changed = False
        for suf in _SUFFIXES:
            if out[-1].endswith(suf):
                out.append(out[-1][: -len(suf)])
                changed = True
    return out


def _read(path: Path, name: str) -> ModelShape:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"cannot read model config {path}: {e}") from None
    return ModelShape.from_config(cfg, name=name, source=str(path))


@functools.lru_cache(maxsize=64)
def _from_hub(ref: str, revision: str | None) -> Path:
    """config.json of a hub model (only that file, never weights), at ``revision``; huggingface_hub caches it
    and answers from its cache when offline (HF_HUB_OFFLINE=1)."""
    import httpx
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry warnings: the one message below says it all
    try:
        return Path(hf_hub_download(ref, "config.json", revision=revision))
    # RuntimeError: huggingface_hub 1.16 retries a refused connection on a client it has already closed
    except (LocalEntryNotFoundError, EntryNotFoundError, HfHubHTTPError, httpx.HTTPError, OSError,
            RuntimeError) as e:
        if isinstance(e, LocalEntryNotFoundError):
            why = "offline (HF_HUB_OFFLINE) and not in the local cache"
        elif isinstance(e, (EntryNotFoundError, HfHubHTTPError)):
            why = str(e).splitlines()[0][:200]
        else:
            why = "the hub is unreachable from here"
        at = f" at revision {revision!r}" if revision else ""
        raise ModelConfigError(
            f"cannot fetch config.json of {ref!r}{at} from the Hugging Face Hub: {why}. Offline, point "
            f"model.name (or --model) at a local folder or config.json of that model, or fetch it once online: "
            f"`hf download {ref} config.json{' --revision ' + revision if revision else ''}`") from None
    finally:
        hub_log.setLevel(level)


def load_shape(ref: str, revision: str | None = None) -> ModelShape:
    """A shape from a local dir / config.json path, a bundled config (hub ids of the bundled models, when no
    other ``revision`` is asked for), or the hub's config.json at ``revision`` (cached by huggingface_hub)."""
    path, name = config_path(ref, revision)
    return _read(path, name)


def config_path(ref: str, revision: str | None = None) -> tuple[Path, str]:
    """(config.json, model name) of a reference, found as :func:`load_shape` describes; no architecture check
    (the traced estimate reads it for any architecture transformers builds)."""
    p = Path(ref).expanduser()
    if p.is_dir():
        if (p / "config.json").exists():
            return p / "config.json", p.name
        raise ModelConfigError(f"{p} has no config.json: point at a model folder or its config.json")
    if p.is_file():
        return p, p.parent.name if p.name == "config.json" else p.stem
    base = ref.rstrip("/").split("/")[-1]
    if (bundled := bundled_config(ref, revision)) is not None:
        return bundled, base
    if ref.count("/") == 1 and not ref.startswith((".", "/", "~")):
        return _from_hub(ref, revision), ref
    raise ModelConfigError(f"unknown model {ref!r}: not a local folder or config.json, not a bundled config "
                           f"({', '.join(bundled_names())}), and not a hub id (org/name)")
