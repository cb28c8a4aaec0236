"""What autograd saves of one training step's activations, op by op, in the Hugging Face blocks.

The terms follow the decoder layers (RMSNorm up-casts, projections, RoPE, attention kernel, gated MLP) and T5's
blocks, with peft's fp32 LoRA path (an fp32 copy of each targeted module's input, dropout noise) and
prepare_model_for_kbit_training's fp32 residual stream under k-bit quantization (under autocast, the matmuls and
adapters keep 16-bit copies of its tensors instead), and a vision tower's. Each block function returns its saved
tensors by name (shared tensors share a name), whether its output needs grad, and its top sub-layer's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from fitburst.hardware import Device, attention_masked, expands_kv
from fitburst.rules import ModelFacts, liger_missing, liger_refusal, tiled_mlp_refusal
from fitburst.settings import RunSettings

from .params import DTYPE_BYTES, resolve_targets
from .shapes import ModelShape

Block = Callable[["ModelShape", "StepContext", bool, bool], tuple[dict, bool, int]]


@dataclass(frozen=True)
class StepContext:
    """The sizes and precisions one micro-step's activations are counted in."""

    tokens: int  # tokens in the micro-batch (a packed batch: its real tokens)
    rows: int  # sequences in the micro-batch
    seq: int  # their (padded) length
    act_bytes: int  # bytes of an element of the residual stream
    full: bool
    lora: bool
    targets: set[str]
    rank: int
    drop: bool
    mask_b: int  # bytes per element of the dropout mask (CUDA fused: bool; elsewhere a float noise tensor)
    attention: str  # flash | math | eager
    padded: bool
    kv_expanded: bool = False  # grouped-query k/v expanded before SDPA (fitburst.models.EXPANDED_KV)
    merged_experts: int = 0  # bytes of one block's expert weights merged with their LoRA (kept for backward)
    lora16: int = 0  # LoRA under autocast: bytes of the 16-bit dtype its adapters compute in (0: no autocast)
    master: bool = False  # full fine-tuning with fp32 master weights under autocast: fp32 residual stream, 16-bit
    # copies of each weight (autocast's cache) and of each norm output a linear reads (one per linear)
    gpu_amp: bool = False  # CUDA's and MPS's autocast: pow, exp, rsqrt, ... run in fp32 (autocast_policy)
    norm32: bool = False  # CUDA's and MPS's autocast run native layer_norm in fp32 (a 16-bit stream's norms keep an
    # fp32 copy of their input)
    half_to_float: bool = False  # CUDA's softmax of fp16 scores to fp32 (cuda_kernels.softmax_half_to_float)
    fsdp_mp: bool = False  # FSDP's mixed precision: LoRA adapters gathered in 16 bits (no fp32 copy of their input)
    dtype_bytes: int = 2  # bytes of the compute dtype
    logit_bytes: int = 2  # bytes of an element of the head's output (k-bit's fp32 head outside autocast: 4)
    mlp_shard: int = 0  # the tiled MLP (fitburst.models.tile_mlps): tokens of one sequence shard (0: not tiled)
    liger: bool = False  # Liger Kernel's RMSNorm and SwiGLU / GEGLU Functions (training.liger_kernels, CUDA)


def step_context(shape: ModelShape, s: RunSettings, device: Device) -> StepContext:
    """One micro-step's sizes and precisions on ``device``: a packed batch as one row of its real tokens, the
    attention kernel that runs there, what autocast, k-bit preparation and FSDP's mixed precision make of the
    residual stream and the adapters."""
    d = DTYPE_BYTES[s.precision]
    # FSDP's mixed precision (fitburst.distributed.mixed_precision) gathers every weight in the compute dtype and
    # casts each block's inputs to it: a 16-bit stream even where k-bit preparation or fp32 master weights would
    # make it fp32, and no autocast copies of fp32 weights
    mp = s.world_size > 1 and s.amp
    a = 4 if s.kbit and not mp else d
    tokens, rows, seq = s.micro_batch_size * s.seq_len, s.micro_batch_size, s.seq_len
    # padded: a b x S x S mask reaches the attention kernel (FlashAttention-2 gets none: varlen over the real tokens)
    padded = attention_masked(device, s.attention, s.micro_batch_size > 1 if s.padded is None else s.padded)
    if s.packed_fill:  # one row of the real tokens; sdpa/eager get a block-diagonal mask, flash-attn varlen none
        tokens = seq = max(1, round(tokens * s.packed_fill))
        rows, padded = 1, attention_masked(device, s.attention, True)
    full = s.method == "full"
    attention = s.attention
    if attention == "flash" and device.kind != "cuda":
        attention = "sdpa"
    kv_expanded = attention == "sdpa" and expands_kv(device, s.precision, shape.kv_heads < shape.heads)
    if attention == "sdpa":
        attention = "math" if device.kind == "mps" else "flash"
    gpu_amp = device.kind in ("cuda", "mps") and s.amp
    return StepContext(
        tokens=tokens, rows=rows, seq=seq, act_bytes=a, full=full, lora=not full,
        targets=set() if full else resolve_targets(shape,
                                                   s.target_modules), rank=s.rank, drop=s.dropout > 0 and not full,
        mask_b=1 if device.kind == "cuda" else 4, attention=attention, padded=padded, kv_expanded=kv_expanded,
        merged_experts=0 if full or not shape.lora_experts(s.target_modules) else a * shape.expert_params,
        master=s.master_weights and not mp, lora16=d if s.amp and not full else 0, gpu_amp=gpu_amp,
        norm32=gpu_amp and not full and not s.kbit and shape.norm_style == "layernorm",
        half_to_float=device.kind == "cuda" and s.precision == "fp16" and a == 2, fsdp_mp=mp, dtype_bytes=d,
        logit_bytes=4 if s.kbit and not s.amp else d,  # k-bit's fp32 head; under autocast its output is 16-bit
        mlp_shard=mlp_shard_tokens(shape, s, tokens, seq), liger=liger_modelled(shape, s, device))


def liger_modelled(shape: ModelShape, s: RunSettings, device: Device) -> bool:
    """Liger Kernel's model kernels as the estimates count them: on CUDA where they can run (this install, for a run
    that trains here), for a model Liger patches (the rule table refuses the rest), its RMS norms and its gated MLP's
    SwiGLU / GEGLU (fitburst.memory.model_kernels)."""
    facts = ModelFacts.of(shape)
    return (s.liger_kernels and device.kind == "cuda" and liger_missing(device) is None and facts is not None
            and liger_refusal(facts, device) is None)


def mlp_shard_tokens(shape: ModelShape, s: RunSettings, tokens: int, seq: int) -> int:
    """Tokens of one shard of the tiled MLP (0: not tiled): liger-kernel's apply_tiled_mlp cuts each row's sequence
    into ceil(seq / hidden) shards (its default), and its backward the flattened rows into as many."""
    facts = ModelFacts.of(shape)
    if not s.tiled_mlp or facts is None or tiled_mlp_refusal(facts) is not None:  # refused (fitburst.rules)
        return 0
    return -(-tokens // math.ceil(seq / shape.hidden))


def norm(saved: dict, key: str, in_key: str, rg_in: bool, c: StepContext, shape: ModelShape, width: int) -> bool:
    """Saved tensors of one norm; returns requires_grad of its output."""
    T, a = c.tokens, (4 if c.master else c.act_bytes)  # the residual stream's dtype
    style = shape.norm_style
    if c.liger and style in ("llama", "gemma"):  # LigerRMSNormFunction keeps its input as it is and fp32 RSTD
        if rg_in or c.full:
            saved[in_key] = a * T * width
            saved[key + ".rstd"] = 4 * T
    elif style == "layernorm":
        if rg_in or c.full:
            if c.norm32:
                saved[key + ".f32"] = 4 * T * width
            else:
                saved[in_key] = a * T * width
    elif style == "gemma":
        if rg_in:
            saved[in_key if a == 4 else key + ".f32"] = 4 * T * width
        if c.full:
            saved[key + ".normed"] = 4 * T * width
    else:  # llama / t5 style: x.to(fp32); ... weight * x.to(dtype)
        if rg_in:
            saved[in_key if a == 4 else key + ".f32"] = 4 * T * width
            if style == "t5" and a != 4:
                saved[in_key] = a * T * width
        if c.full:
            saved[key + ".cast"] = a * T * width
    return rg_in or c.full


def _linear(saved: dict, name: str, in_key: str, fan_in: int, rg_in: bool, c: StepContext) -> bool:
    T = c.tokens
    if c.full:
        if c.master and in_key in ("n1", "n2"):  # autocast casts the fp32 norm output again for each linear
            saved[f"{name}.in16"] = c.act_bytes * T * fan_in
        else:
            saved[in_key] = c.act_bytes * T * fan_in
        return True
    if name in c.targets and c.lora16:  # autocast: peft runs the adapter in 16 bits, no fp32 copy of its input
        if c.drop:  # dropout keeps its mask; lora_A keeps the dropout output, or (k-bit's fp32 stream) its
            # 16-bit cast, the fp32 output then freed (FSDP's 16-bit adapters: dropout on the 16-bit input itself)
            saved[f"{name}.noise"] = (c.lora16 if c.fsdp_mp and c.mask_b != 1 else c.mask_b) * T * fan_in
            saved[f"{name}.drop"] = c.lora16 * T * fan_in
        elif c.fsdp_mp:  # lora_A keeps the block's own 16-bit input
            saved[in_key] = c.lora16 * T * fan_in
        else:  # a 16-bit copy of its own: peft casts the input to the adapter's fp32 dtype (transient), autocast
            # casts that back for lora_A
            saved[f"{name}.cast16"] = c.lora16 * T * fan_in
        saved[f"{name}.loraA"] = c.lora16 * T * c.rank
        return True
    if name in c.targets:
        src = in_key if c.act_bytes == 4 else f"{name}.cast"
        if c.drop:
            saved[f"{name}.noise"] = c.mask_b * T * fan_in
            saved[f"{name}.drop"] = 4 * T * fan_in
        else:
            saved[src] = 4 * T * fan_in
        saved[f"{name}.loraA"] = 4 * T * c.rank
        return True
    return rg_in


def decoder_block(shape: ModelShape, c: StepContext, rg_in: bool, decoder: bool = True) -> tuple[dict, bool, int]:
    """Saved-for-backward tensors of one block (name -> bytes; shared tensors share a name), whether its output
    needs grad, and the bytes of its top sub-layer (the MLP and its norm: their backward runs first and frees them
    before the attention's backward runs)."""
    h = shape.hidden
    sv: dict[str, int] = {}
    if c.master:  # autocast's 16-bit copies of this block's weights, kept for backward
        sv["w16"] = c.act_bytes * sum(lin.fan_in * lin.fan_out for lin in shape.layer_linears(decoder))
    rg_n1 = norm(sv, "ln1", "x", rg_in, c, shape, h)
    rg_o = _self_attention(sv, shape, c, rg_n1)
    rg_h1 = rg_in or rg_o
    below = set(sv)  # the attention sub-layer's tensors (a parallel block's MLP reads its norm output too)
    if shape.parallel_block:
        rg_n2, n2 = rg_n1, "n1"
    else:
        extra_norms = max(0, shape.norms_per_layer - 2)
        if extra_norms:  # gemma: post-attention norm on the attention output, pre/post feed-forward norms
            norm(sv, "ln_post_attn", "o", rg_o, c, shape, h)
        rg_n2 = norm(sv, "ln2", "h1", rg_h1, c, shape, h)
        n2 = "n2"
    if shape.experts:
        rg_m = _moe(sv, shape, c, n2, rg_n2)
    elif c.mlp_shard:  # the tiled MLP keeps its input alone; backward recomputes it shard by shard
        rg_m = _gated_mlp({}, shape, c, n2, rg_n2)
        if rg_m:
            sv[n2] = _mlp_input_bytes(c) * c.tokens * h
    elif shape.mlp == "gated":
        rg_m = _gated_mlp(sv, shape, c, n2, rg_n2)
    else:
        rg_m = _plain_mlp(sv, shape, c, n2, rg_n2)
    if shape.norms_per_layer > 2:
        norm(sv, "ln_post_ff", "m", rg_m, c, shape, h)
    return sv, rg_h1 or rg_m, sum(v for k, v in sv.items() if k not in below)


def _self_attention(sv: dict, shape: ModelShape, c: StepContext, rg_n1: bool) -> bool:
    """The attention sub-layer after its norm: q, k, v (fused or not), qk-norms, the kernel's saved tensors, the
    output projection; returns whether its output needs grad."""
    T, h, qd, kvd = c.tokens, shape.hidden, shape.q_dim, shape.kv_dim
    if shape.fused_qkv:
        rg_att = _linear(sv, "qkv_proj", "n1", h, rg_n1, c)
    else:
        names = [lin.name for lin in shape.attn_linears()]
        rg_q = _linear(sv, names[0], "n1", h, rg_n1, c)
        rg_k = _linear(sv, names[1], "n1", h, rg_n1, c)
        rg_v = _linear(sv, names[2], "n1", h, rg_n1, c)
        rg_att = rg_q or rg_k or rg_v
    if shape.qk_norm and rg_att:
        sv["qnorm.f32"] = 4 * T * qd
        sv["knorm.f32"] = 4 * T * kvd
    if rg_att:
        _attention_kernel(sv, shape, c)
    return _linear(sv, shape.attn_linears()[-1].name, "ctx", qd, rg_att, c)


def _attention_kernel(sv: dict, shape: ModelShape, c: StepContext) -> None:
    """What attention's matmuls keep of their inputs (under autocast, 16-bit copies; k-bit's fp32 q/k/v freed): k and
    v repeated to every query head where the kernel takes no grouped-query heads; the fused kernels' output and
    log-sum-exp, eager's and math's probabilities (fp32 softmax output, plus eager's 16-bit cast)."""
    T, qd, kvd = c.tokens, shape.q_dim, shape.kv_dim
    m = attention_bytes(c)
    groups = shape.heads // shape.kv_heads
    sv["q_rope"] = m * T * qd
    repeat = (
        groups > 1
        and (c.attention != "flash" or c.padded or c.kv_expanded)
        and shape.head_dim <= 256
        or (groups > 1 and shape.head_dim > 256)
    )
    kv_saved = m * T * (qd if repeat else kvd)
    sv["k_rope"] = kv_saved
    sv["v"] = kv_saved
    if c.attention == "flash":
        sv["attn_out"] = m * T * qd
        sv["lse"] = 4 * T * shape.heads
        if c.padded:
            sv["attn_bias"] = m * c.rows * c.seq * c.seq
    else:
        sv["probs.f32"] = 4 * c.rows * shape.heads * c.seq * c.seq
        if m != 4:
            sv["probs"] = m * c.rows * shape.heads * c.seq * c.seq


def _gated_mlp(sv: dict, shape: ModelShape, c: StepContext, n2: str, rg_n2: bool) -> bool:
    """gate/up (fused or not), the activation and its product, down; returns whether its output needs grad."""
    T, a, h, i = c.tokens, c.act_bytes, shape.hidden, shape.intermediate
    mlp = shape.mlp_linears()
    if shape.fused_gate_up:
        rg_g = rg_u = _linear(sv, mlp[0].name, n2, h, rg_n2, c)
    else:
        rg_g = _linear(sv, mlp[0].name, n2, h, rg_n2, c)
        rg_u = _linear(sv, mlp[1].name, n2, h, rg_n2, c)
    if _liger_mlp(shape, c):  # Liger's SiLU / GELU-mul Function keeps gate and up, whichever needs grad
        if rg_g or rg_u:
            sv["gate"], sv["up"] = a * T * i, a * T * i
        return _linear(sv, mlp[-1].name, "p", i, rg_g or rg_u, c)
    act = a
    if rg_g:
        sv["gate"] = a * T * i  # activation input
        if shape.act == "gelu_new":
            act = _gelu_new(sv, "gate", c, a, i)
    if rg_u:
        sv["act"] = act * T * i
    if rg_g:
        sv["up"] = a * T * i
    return _linear(sv, mlp[-1].name, "p", i, rg_g or rg_u, c)


def _liger_mlp(shape: ModelShape, c: StepContext) -> bool:
    """The gated MLP runs Liger's SwiGLU or GEGLU Function (not gelu_new's python formula: T5's, not patched)."""
    return c.liger and shape.act in ("silu", "gelu_tanh")


def _plain_mlp(sv: dict, shape: ModelShape, c: StepContext, n2: str, rg_n2: bool) -> bool:
    """fc1, the activation, fc2; returns whether its output needs grad."""
    a, i = c.act_bytes, shape.intermediate
    mlp = shape.mlp_linears()
    rg_f = _linear(sv, mlp[0].name, n2, shape.hidden, rg_n2, c)
    if rg_f:
        sv["fc1"] = a * c.tokens * i
        if shape.act == "gelu_new":
            _gelu_new(sv, "fc1", c, a, i)
    return _linear(sv, mlp[-1].name, "p", i, rg_f, c)


def t5_block(shape: ModelShape, c: StepContext, rg_in: bool, decoder: bool = True) -> tuple[dict, bool, int]:
    """Saved-for-backward tensors of one T5 block: self-attention (and, in the decoder, cross-attention on the
    encoder's output), then the feed-forward, each behind a T5LayerNorm and closed by a residual dropout. The
    model's dropout (``shape.dropout``) keeps a mask wherever a gradient flows through it (CUDA: bool; elsewhere
    noise in the tensor's dtype). The residual stream and the norms are in the weights' dtype: fp32 with master
    weights, where each linear then keeps its own 16-bit autocast copy of its input."""
    sv: dict[str, int] = {}
    rg = rg_in
    subs = [("sa", _t5_attention)] + ([("ca", _t5_attention)] if decoder else []) + [("ff", _t5_feed_forward)]
    for k, (name, fn) in enumerate(subs):
        sub: dict[str, int] = {}
        rg_n = _t5_norm(sub, shape, c, rg)
        rg_out = fn(sub, shape, c, rg_n, cross=name == "ca", decoder=decoder)
        if rg_out and shape.dropout:
            sub["res.drop"] = _t5_drop_bytes(c, c.act_bytes) * c.tokens * shape.hidden
        rg = rg or rg_out
        # the block input is "x"; each later sublayer's input is a new residual sum
        sv.update({(key if key == "x" and k == 0 else f"{name}.{key}"): v for key, v in sub.items()})
    if c.master:  # autocast's 16-bit copies of this block's weights, kept for backward (as in decoder_block)
        sv["w16"] = c.act_bytes * sum(lin.fan_in * lin.fan_out for lin in shape.layer_linears(decoder))
    return sv, rg, sum(v for k, v in sv.items() if k.startswith("ff."))


def _t5_res(c: StepContext) -> int:
    """Bytes per element of T5's residual stream and norm outputs (its weights' dtype)."""
    return 4 if c.master else c.act_bytes


def _t5_drop_bytes(c: StepContext, of: int) -> int:
    return 1 if c.mask_b == 1 else of  # CUDA: bool mask; CPU / MPS: noise in the input's dtype (``of`` bytes)


def _t5_norm(sv: dict, shape: ModelShape, c: StepContext, rg_in: bool) -> bool:
    """T5LayerNorm: x.to(fp32).pow(2).mean, x * rsqrt(...) (keeps x, its fp32 copy and rsqrt), then weight * that
    (keeps it when the weight trains)."""
    T, r, h = c.tokens, _t5_res(c), shape.hidden
    if rg_in:
        sv["x"] = r * T * h
        if r != 4:
            sv["x.f32"] = 4 * T * h
        sv["ln.rsqrt"] = 4 * T
    if c.full:
        sv["ln.normed"] = r * T * h
    return rg_in or c.full


def _t5_linear(sv: dict, name: str, in_key: str, fan_in: int, rg_in: bool, c: StepContext, in_bytes: int) -> bool:
    """A T5 linear under autocast on an input of ``in_bytes`` per element: a trained weight keeps its input (its own
    16-bit copy when the input is fp32 under 16-bit autocast); a LoRA adapter (no dropout) keeps its input in the
    activation dtype (under autocast a copy of its own, as :func:`_linear`), plus lora_A's output."""
    T, a = c.tokens, c.act_bytes
    if c.full:
        if in_bytes != a:
            sv[f"{name}.in16"] = a * T * fan_in
        else:
            sv[in_key] = a * T * fan_in
        return True
    if name in c.targets and not c.drop:
        sv[f"{name}.cast16" if c.lora16 else in_key] = a * T * fan_in  # under autocast, as in _linear
        sv[f"{name}.loraA"] = a * T * c.rank
        return True
    return _linear(sv, name, in_key, fan_in, rg_in, c)


def _t5_attention(sv: dict, shape: ModelShape, c: StepContext, rg_n: bool, cross: bool = False,
                  decoder: bool = False) -> bool:
    """T5 attention (scores + position bias as a float mask); cross-attention takes k and v from the encoder's
    output (which needs grad: the encoder trains). Outside CUDA, SDPA with dropout takes its math path, which
    upcasts 16-bit inputs to fp32: q, k, v, the probabilities, the dropout noise and the dropped probabilities are
    kept in fp32. On CUDA the memory-efficient kernel keeps q, k, v, its output, the log-sum-exp and its own bias,
    made per call: a self-attention's from the permuted relative-position bias (with the encoder's padding mask
    folded in: b rows), which torch's composite pads to 8-element rows; a cross-attention's is the shared zero
    bias (counted once, in ``estimate``) unless a padding mask makes one per call (b rows)."""
    T, a, h, qd, r = c.tokens, c.act_bytes, shape.hidden, shape.q_dim, _t5_res(c)
    kv_in, rg_kv_in = ("enc", True) if cross else ("n1", rg_n)
    rg_q = _t5_linear(sv, "q", "n1", h, rg_n, c, r)
    rg_k = _t5_linear(sv, "k", kv_in, h, rg_kv_in, c, r)
    rg_v = _t5_linear(sv, "v", kv_in, h, rg_kv_in, c, r)
    rg_att = rg_q or rg_k or rg_v
    if rg_att:
        sq = c.rows * shape.heads * c.seq * c.seq
        if c.attention == "flash" and (c.mask_b == 1 or not shape.dropout):  # efficient / flash kernel
            sv.update({"att.q": a * T * qd, "att.k": a * T * qd, "att.v": a * T * qd, "att.out": a * T * qd,
                       "att.lse": 4 * c.rows * shape.heads * c.seq})
            rows = c.rows if c.padded and not (decoder and not cross) else 1
            if c.mask_b == 1 and (rows > 1 or not cross):
                width = c.seq if cross else c.seq + 8 - c.seq % 8  # a self-attention's bias is padded
                sv["att.bias"] = a * rows * shape.heads * c.seq * width
        else:
            ab = 4 if c.mask_b != 1 else a
            sv.update({"att.q": ab * T * qd, "att.k": ab * T * qd, "att.v": ab * T * qd, "att.probs": ab * sq})
            if shape.dropout:
                sv["att.drop"] = _t5_drop_bytes(c, ab) * sq
                sv["att.dropped"] = ab * sq
    return _t5_linear(sv, "o", "ctx", qd, rg_att, c, a)


def _gelu_new(sv: dict, key: str, c: StepContext, a: int, i: int) -> int:
    """gelu_new's python formula keeps its input ``key`` (for pow), tanh, 0.5 x and 1 + tanh. Under a GPU's autocast
    pow runs in fp32, so a 16-bit input is kept as an fp32 copy and everything after it but 0.5 x is fp32. Returns
    the bytes per element of its output."""
    f, T = (4 if c.gpu_amp else a), c.tokens
    sv.update({key: f * T * i, "gelu.tanh": f * T * i, "gelu.half": a * T * i, "gelu.1pt": f * T * i})
    return f


def _t5_feed_forward(sv: dict, shape: ModelShape, c: StepContext, rg_n: bool, cross: bool = False,
                     decoder: bool = False) -> bool:
    """T5's DenseReluDense: gated (gelu_new(wi_0 x) * wi_1 x, as FLAN-T5) or plain (relu(wi x)), dropout, wo (kept
    in fp32 by transformers: its input goes to fp32 and autocast makes a 16-bit copy of that)."""
    T, a, i, r = c.tokens, c.act_bytes, shape.intermediate, _t5_res(c)
    mlp = shape.mlp_linears()
    if shape.mlp == "gated":
        rg_g = _t5_linear(sv, mlp[0].name, "n2", shape.hidden, rg_n, c, r)
        rg_u = _t5_linear(sv, mlp[1].name, "n2", shape.hidden, rg_n, c, r)
        act = _gelu_new(sv, "gate", c, a, i) if rg_g else a
        if rg_u:
            sv["act"] = act * T * i
        if rg_g:
            sv["up"] = a * T * i
        rg_p = rg_g or rg_u
    else:
        rg_p = _t5_linear(sv, mlp[0].name, "n2", shape.hidden, rg_n, c, r)
        if rg_p:
            sv["relu"] = a * T * i
    if rg_p and shape.dropout:
        sv["p.drop"] = _t5_drop_bytes(c, a) * T * i
    return _t5_linear(sv, mlp[-1].name, "pd", i, rg_p, c, a)


def _moe(sv: dict, shape: ModelShape, c: StepContext, in_key: str, rg_in: bool) -> bool:
    """Saved tensors of a routed MoE block: each token's state runs through ``experts_per_tok`` experts
    (k*T rows in all, one expert at a time), plus the router's fp32 probabilities and any shared expert."""
    T, a, h, i, s = c.tokens, c.act_bytes, shape.hidden, shape.expert_intermediate, shape.shared_intermediate
    kT = shape.experts_per_tok * T
    rg_r = _linear(sv, "gate", in_key, h, rg_in, c)
    if not (rg_r or c.full or c.merged_experts):
        return False
    if rg_r:  # the routing weights need grad: their softmax and each expert's output are kept
        sv["router.probs"] = 4 * T * shape.experts
        sv["moe.out"] = a * kT * h
    sv["moe.gate"] = sv["moe.act"] = sv["moe.up"] = a * kT * i  # activation input and the two factors
    if c.full or c.merged_experts:  # expert weights train: their gathered inputs are kept too
        sv["moe.x"] = a * kT * h
        sv["moe.p"] = a * kT * i
    if c.merged_experts:  # peft's ParamWrapper runs the experts on W + B@A, a full-size tensor per block
        sv["moe.merged"] = c.merged_experts
    if s:
        _linear(sv, "gate_proj", in_key, h, rg_in, c)
        _linear(sv, "up_proj", in_key, h, rg_in, c)
        sv["shared.gate"] = sv["shared.act"] = sv["shared.up"] = a * T * s
        _linear(sv, "down_proj", "shared.p", s, True, c)
        _linear(sv, "shared_expert_gate", in_key, h, rg_in, c)
        sv["shared.out"] = a * T * h
    return True


def _mlp_input_bytes(c: StepContext) -> int:
    """Bytes of an element of the MLP's input (its norm's output: the stream's dtype, fp32 with master weights or
    autocast's fp32 LayerNorm)."""
    return 4 if c.master or c.norm32 else c.act_bytes


def _tiled_mlp_backward(shape: ModelShape, c: StepContext) -> int:
    """The tiled MLP's backward beyond its saved input: the input's gradient (zeros, filled shard by shard), and one
    shard's recomputed forward (what it saves, its output) with that shard's backward transient; the shard's input
    is a view of the saved input."""
    shard = replace(c, tokens=c.mlp_shard, mlp_shard=0)
    saved: dict[str, int] = {}
    _gated_mlp(saved, shape, shard, "n2", True)
    saved.pop("n2", None)
    mlp_t = block_backward_transient(shape, shard)[0]
    return _mlp_input_bytes(c) * c.tokens * shape.hidden + sum(saved.values()) + mlp_t + \
        c.act_bytes * c.mlp_shard * shape.hidden


def block_backward_transient(shape: ModelShape, c: StepContext) -> tuple[int, int]:
    """Gradient tensors alive inside one block's backward beyond its saved tensors: (during the MLP's backward, its
    input grads while its own saved inputs are released node by node; during the attention's, its grads)."""
    T, a, h, i = c.tokens, c.act_bytes, shape.hidden, shape.intermediate
    down = shape.mlp_linears()[-1].name
    if c.full:
        down_saved = a * T * i
    elif down in c.targets:  # the adapter's saved input (16-bit under autocast, else an fp32 copy)
        lo = c.lora16 or 4
        down_saved = (lo + c.mask_b) * T * i if c.drop else lo * T * i
    else:
        down_saved = 0
    mlp = max(
        3 * a * T * i - down_saved,
        (((c.lora16 or 4) + a) * T * i if not c.full and down in c.targets else a * T * i),
    )
    if shape.act == "gelu_new" and c.gpu_amp and a != 4:  # its fp32 tail (CUDA or MPS autocast) runs backward in fp32
        mlp = max(mlp, (12 + a) * T * i - down_saved)
    mlp = _tiled_mlp_backward(shape, c) if c.mlp_shard else mlp + a * T * h
    if c.attention == "flash":
        att = 4 * T * (shape.q_dim + 2 * shape.kv_dim) + 2 * a * T * shape.q_dim
    else:  # the probabilities' grad in fp32 and the softmax backward's output, the probabilities' 16-bit copy
        # (if any) freed by then; CUDA's kernel adds an fp32 grad * output temporary, or (fp16 scores) writes
        # the fp16 grad beside that temporary instead of an fp32 output (cuda_kernels.softmax_backward_temp and
        # softmax_half_to_float)
        m = attention_bytes(c)
        per_score = 8 + (4 if c.mask_b == 1 else 0) - (2 if c.half_to_float else 0) - (0 if m == 4 else m)
        att = per_score * c.rows * shape.heads * c.seq * c.seq
    return mlp, att


def forward_transient(shape: ModelShape, c: StepContext, kbit_casts: bool = False) -> int:
    """Beyond everything the forward keeps: the last block's MLP intermediates, or its masked scores (the stream's
    dtype) beside their softmax, and an fp32 copy of 16-bit scores where the softmax kernel makes one (not CUDA's
    half-to-float kernel), before the probabilities' 16-bit copy exists. ``kbit_casts``: bitsandbytes' casts of the
    largest (MLP) linear's input and output in the compute dtype (one shard's, tiled)."""
    T, a = c.tokens, c.act_bytes
    upcast = 4 if a != 4 and not c.half_to_float else 0
    m = c.lora16 or a
    att = {"flash": 0, "math": 4}.get(c.attention, max(0, a + upcast - (0 if m == 4 else m)))
    # the tiled MLP: one shard's intermediates beside the output shards made so far, then their concatenation
    mlp = (max(2 * a * c.mlp_shard * shape.intermediate + a * T * shape.hidden, 2 * a * T * shape.hidden)
           if c.mlp_shard else 2 * a * T * shape.intermediate)
    casts = 2 * (c.mlp_shard or T) * (shape.hidden + shape.intermediate) if kbit_casts else 0
    return max(mlp, att * c.rows * shape.heads * c.seq * c.seq) + casts


def attention_forward_transient(shape: ModelShape, c: StepContext) -> int:
    """A decoder block's attention sub-layer as its forward runs with the flash kernel and saves nothing (a
    checkpointed block), at its output projection: the norm's output (the stream's dtype), the rotated q and k and
    v (a k-bit layer casts its output back to its input's dtype, the stream's; under autocast otherwise the 16-bit
    dtype), the kernel's output and its contiguous copy in the 16-bit dtype, and the projection: with a LoRA adapter,
    peft's copy of its input in the adapter's fp32 dtype beside the base output and lora_B's, else its output."""
    if shape.arch.block != "decoder":
        return 0
    T, a, h, qd, kvd = c.tokens, c.act_bytes, shape.hidden, shape.q_dim, shape.kv_dim
    m = c.lora16 or a
    proj = m if c.master else a
    out = (4 * qd + 2 * m * h) if shape.attn_linears()[-1].name in c.targets else m * h
    return T * ((4 if c.master else a) * h + proj * (qd + 2 * kvd) + 2 * m * qd) + T * out


def attention_bytes(c: StepContext) -> int:
    """Bytes an element of what attention keeps (q, k, v, probabilities): the math composite (SDPA on MPS) upcasts
    16-bit q, k and v to fp32 and computes in fp32; eager and the fused kernels keep the stream's dtype (under
    autocast, its 16-bit copies)."""
    return 4 if c.attention == "math" else c.lora16 or c.act_bytes


def vision_activations(shape: ModelShape, s: RunSettings, a: int, attention: str, mask_b: int) -> tuple[int, int]:
    """(bytes kept for backward, forward transient) of the vision tower on one micro-batch's images.

    Frozen, nothing needs grad there, so its forward leaves only the image embeddings (counted in the language
    sequence) and peaks inside one block: the residual, the normed input, qkv, fp32 rotary q and k, the attention
    output (and, with the math kernel, one image's probabilities at a time: attention stays within each image), or
    the MLP's fc1 output, QuickGELU's sigmoid and product. Trained (``projector`` or ``tower``), each trained layer
    keeps what autograd saves per patch token, as the language model's layers do (LoRA: an fp32 copy of each
    adapted input)."""
    v = shape.vision
    if v is None or not s.images or not s.image_tokens:
        return 0, 0
    per_image = s.image_tokens * v.merge ** 2  # patches
    n = s.micro_batch_size * s.images * per_image
    d, m = v.dim, v.mlp
    probs = 0 if attention == "flash" else (4 + a) * v.heads * per_image ** 2
    attn = a * n * (d + 3 * d + d) + 4 * n * 2 * d + probs
    mlp = 3 * a * n * m
    fwd = (a * n * v.patch_in if a != 4 else 0) + a * n * d + max(attn, mlp, 3 * a * n * d)
    lora = s.method != "full"
    drop = (mask_b + 4) if (lora and s.dropout > 0) else 4

    def kept_input(width: int) -> int:  # what a trained linear keeps of its input
        return (drop if lora else a) * n * width + (4 * n * s.rank if lora else 0)

    saved = 0
    if s.vision in ("projector", "tower"):  # merger: LayerNorm, Linear(4d, 4d), GELU, Linear(4d, out)
        saved += kept_input(d) + a * n * d + kept_input(d) + (a * n * d if s.vision == "tower" else 0)
    if s.vision == "tower":
        block = a * n * d + 8 * n * d + a * n * 3 * d + a * n * d + a * n * d + 2 * a * n * m
        block += kept_input(d) + kept_input(d) + kept_input(d) + kept_input(m)
        saved += v.depth * block
    return saved, fwd


# the block functions by the layout an architecture's blocks have (fitburst.memory.architectures.Architecture.block)
BLOCKS: dict[str, Block] = {"decoder": decoder_block, "t5": t5_block}
