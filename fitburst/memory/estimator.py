"""Analytic peak-memory model of one training step of transformers + peft (+ bitsandbytes).

Everything here is arithmetic on the config: no torch, no weights. The activation terms follow what autograd
saves op by op in the Hugging Face decoder layers (RMSNorm up-casts, projections, RoPE, attention kernel,
gated MLP), with peft's fp32 LoRA path (an fp32 copy of each targeted module's input, dropout noise) and
prepare_model_for_kbit_training's fp32 residual stream under k-bit quantization (under autocast, the matmuls
and adapters keep 16-bit copies of its tensors instead); the loss keeps fp32 copies of the logits. Each phase of
the step (forward end, loss, backward, optimizer step, eval) is summed from components and the largest one is the
peak. Constants that are measured rather than derived are named.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field, fields

from fitburst.hardware import Device, GiB, MiB, expands_kv
from fitburst.runconfig import EVAL_CHUNK_TOKENS, TrainSettings

from . import calibration
from .calibration import ErrorBand
from .cuda_kernels import cublas_workspace_bytes, expanded_kv_note
from .loss_kernels import describe_lean, fused_eval_bytes, fused_loss_terms, hidden_cast, loss_kernel_of
from .shapes import EXPERT_ALIASES, ModelShape

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# CUDA caching allocator: reserved / allocated at a training peak (block rounding, fragmentation), plus a
# floor of segments; MPS heaps are coarser; on CPU glibc keeps freed memory (RSS above tensor bytes), and the
# first training step adds a heap of its own (autograd engine, oneDNN scratch, thread pools, lazily imported
# modules, the batch rows as Python objects): ~25-36 MiB measured with torch 2.13 on small models. On CPU the
# reserved figure is what fitburst.meter measures (VmHWM minus the RSS at the start, unpinned glibc malloc).
# On CUDA the loss's fp32 logits blocks (4 x tokens x vocab each) leave segments the later phases cannot fill:
# reserved = allocated x 1.064 + 0.363 x fp32 logits + 31 MiB, least squares on the caching-allocator replays of
# traced steps (fitburst.memory.trace), never on measurements: 50 configurations of 4 models. Scored by
# benchmarks/analytic_vs_traced.py (100 configurations of 10 models, T4 / L4 / A100, seed 1): reserved from the
# traced allocated figure on its 40 configurations of 5 held-out models -7.6 % .. +6.2 % (median 3.4 %), where
# x 1.06 + 64 MiB gives -13.4 % .. +5.9 % (3.4 %); the benchmark's own refit on its 60 fit-model configurations
# does no better held out (-7.2 % .. +10.3 %), so these are kept.
RESERVED_FACTOR = {"cuda": 1.064, "mps": 1.15, "cpu": 1.25}
RESERVED_FLOOR = {"cuda": 31 * MiB, "mps": 64 * MiB, "cpu": 32 * MiB}
RESERVED_PER_LOGITS = {"cuda": 0.363, "mps": 0.0, "cpu": 0.0}
# which figure of an estimate fitburst.meter's measured peak (allocated_bytes) compares with, per device kind:
# CUDA max_memory_allocated -> allocated; MPS driver memory and CPU RSS growth -> reserved
MEASURED_COUNTERPART = {"cuda": "allocated_peak_bytes", "mps": "reserved_peak_bytes", "cpu": "reserved_peak_bytes"}


BNB_MIN_8BIT = 4096  # bitsandbytes optimizers keep 32-bit state for smaller tensors
BNB_BLOCK = 256  # blockwise 8-bit optimizer state: one fp32 absmax per 256 values


@dataclass
class Estimate:
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    device_total_bytes: int
    components: dict[str, int]
    peak_phase: str
    device: str
    budget_bytes: int
    params: dict[str, int]
    plan: list[str] = field(default_factory=list)
    phases: dict[str, int] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    model: str = ""
    safety_margin: float = 0.0
    notes: list[str] = field(default_factory=list)
    calibration_factor: float = 1.0  # applied to the peak (fitburst calibrate); 1.0: the analytic model alone
    reserved_calibration_factor: float = 1.0  # applied to the reserved figure (CUDA: fitted on its own)
    method: str = "analytic"  # analytic | traced: which error band (fitburst.memory.calibration) applies
    band: ErrorBand | None = None  # set by Budget.judge (fitburst.memory.budget): the band the fit was judged by
    fits: bool | None = None  # set by Budget.judge: None until judged against a budget
    # several GPUs (FSDP): every figure above is one GPU's (each rank holds as much); ``host_bytes``: the host RAM one
    # node needs for the run beyond the processes themselves (:func:`host_bytes`)
    world_size: int = 1
    nodes: int = 1
    host_bytes: int = 0
    vocab: int = 0  # the model's vocabulary (0: not known); with the rest, what decides which band applies

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headroom_bytes"] = self.budget_bytes - self.device_total_bytes + self._context()
        d["gpus_per_node"] = self.world_size // max(self.nodes, 1)
        d["totals"] = {k: getattr(self, k) * self.world_size  # across all GPUs of the run
                       for k in ("allocated_peak_bytes", "reserved_peak_bytes", "device_total_bytes")}
        d["host_bytes_total"] = self.host_bytes * self.nodes
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Estimate:
        """Back from :meth:`to_dict` (an estimate that crossed a process boundary as JSON)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if kw.get("band"):
            kw["band"] = ErrorBand(**kw["band"])
        return cls(**kw)

    def comparable_bytes(self, kind: str) -> int:
        """The figure a measured peak (``MemoryPeak.allocated_bytes``) on a ``kind`` device compares with."""
        return int(getattr(self, MEASURED_COUNTERPART.get(kind, "allocated_peak_bytes")))

    def _context(self) -> int:
        return self.device_total_bytes - self.reserved_peak_bytes

    def to_markdown(self) -> str:
        g = lambda b: f"{b / GiB:,.2f}"  # noqa: E731
        lines = [
            f"**{self.model}** on **{self.device}**: peak {g(self.device_total_bytes)} GiB of "
            f"{g(self.budget_bytes + self._context())} GiB "
            f"({'fits' if self.fits else 'does not fit'}; peak phase: {self.peak_phase})",
            "",
            "| component | GiB |",
            "|---|---:|",
        ]
        for k, v in sorted(self.components.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {k} | {g(v)} |")
        lines += [
            f"| **allocated peak** | **{g(self.allocated_peak_bytes)}** |",
            f"| reserved (allocator) | {g(self.reserved_peak_bytes)} |",
            f"| + context = device total | {g(self.device_total_bytes)} |",
            f"| budget | {g(self.budget_bytes)} |",
        ]
        if self.plan:
            lines += ["", "Plan:"] + [f"- {c}" for c in self.plan]
        if self.notes:
            lines += [""] + [f"_{n}_" for n in self.notes]
        return "\n".join(lines)


# --- parameters ------------------------------------------------------------------------------------------


def resolve_targets(shape: ModelShape, targets: list[str] | str) -> set[str]:
    names = {lin.name for c, dec in shape.blocks() for lin in shape.layer_linears(dec)}
    names |= set(EXPERT_ALIASES.get(shape.model_type, {}))
    if targets == "all-linear" or targets == ["all-linear"]:
        return names
    want = {t.split(".")[-1] for t in targets}
    hit = want & names
    if not hit:
        close = [c for w in sorted(want) for c in difflib.get_close_matches(w, sorted(names), n=1)]
        raise ValueError(
            f"LoRA targets {sorted(want)} match no linear layer of {shape.name} "
            f"(its layers: {', '.join(sorted(names))}" + (f"; did you mean {', '.join(close)}?" if close else "")
            + "; or all-linear)"
        )
    return hit


def lora_params(shape: ModelShape, s: TrainSettings) -> int:
    return sum(lora_tensors(shape, s))


def lora_tensors(shape: ModelShape, s: TrainSettings) -> list[int]:
    """numel of each LoRA tensor (A and B of each targeted module)."""
    t = resolve_targets(shape, s.targets)
    out: list[int] = []
    for c, dec in shape.blocks():
        per = [
            n
            for lin in shape.layer_linears(dec)
            if lin.name in t
            for n in (s.rank * lin.fan_in, s.rank * lin.fan_out)
        ]
        out += per * c
    for _, mult, fan_in, fan_out in shape.lora_experts(s.targets):  # A and B of all experts at once
        out += [mult * s.rank * shape.experts * fan_in, mult * s.rank * shape.experts * fan_out] * shape.layers
    return out + [s.rank * n for n in _vision_linears(shape, s.vision, lora=True)]


def _vision_linears(shape: ModelShape, vision: str, lora: bool = False) -> list[int]:
    """fan_in and fan_out (LoRA's A and B sizes over the rank), or with ``lora`` false the weights and biases, of
    the vision side's trained linear layers: the merger's two with ``projector``, every block's qkv, proj, fc1
    and fc2 as well with ``tower`` (fitburst.families.vision_language.lora_target_names)."""
    v = shape.vision
    if v is None or vision == "frozen":
        return []
    m = v.dim * v.merge ** 2
    linears = [(m, m), (m, v.out)]
    if vision == "tower":
        linears += [(v.dim, 3 * v.dim), (v.dim, v.dim), (v.dim, v.mlp), (v.mlp, v.dim)] * v.depth
    if lora:
        return [n for fi, fo in linears for n in (fi, fo)]
    return [n for fi, fo in linears for n in (fi * fo, fo)]


def vision_activations(shape: ModelShape, s: TrainSettings, a: int, attention: str, mask_b: int) -> tuple[int, int]:
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
    n = s.batch * s.images * per_image
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


def weight_bytes(shape: ModelShape, s: TrainSettings) -> dict[str, int]:
    """Base model weights as loaded (and, for k-bit, after prepare_model_for_kbit_training)."""
    d = 4 if s.master_weights else DTYPE_BYTES[s.dtype]
    total = shape.param_count()
    if not s.kbit:
        return {"weights": total * d}
    lin_w = sum(
        c * sum(lin.fan_in * lin.fan_out for lin in shape.layer_linears(dec)) for c, dec in shape.blocks()
    )
    rest = total - lin_w  # embeddings, lm_head, norms, biases, vision extras: fp32 after k-bit preparation
    q: float
    if s.quant == "int8":
        rows = sum(c * sum(lin.fan_out for lin in shape.layer_linears(dec)) for c, dec in shape.blocks())
        q = lin_w + rows * 4  # int8 weight + fp32 row scale (SCB)
    else:
        q = four_bit_bytes(lin_w, s.double_quant)
    return {"weights_quantized": int(q), "weights_fp32": rest * 4}


def four_bit_bytes(values: float, double_quant: bool) -> float:
    """A 4-bit weight of ``values`` values as bitsandbytes stores it: half a byte each, and an absmax per block of 64
    (fp32; double quantization: 8-bit, with an fp32 absmax per 256 of them and a 256-entry code)."""
    blocks = values / 64
    return values / 2 + (blocks + blocks / 256 * 4 + 256 * 4 if double_quant else blocks * 4)


def param_counts(shape: ModelShape, s: TrainSettings) -> dict[str, int]:
    """The parameters as counted (a 4-bit weight by its values), and ``loaded``: the base model's bytes as loaded and
    prepared (:func:`weight_bytes`), what a sharded run's loading holds in host RAM."""
    total = shape.param_count()
    trainable = sum(_full_tensors(shape, s.vision)) if s.method == "full" else lora_params(shape, s)
    return {"total": total + (0 if s.method == "full" else trainable), "trainable": trainable, "base": total,
            "loaded": sum(weight_bytes(shape, s).values())}


def optimizer_bytes(
    s: TrainSettings, tensors: list[int], pbytes: int, device: Device
) -> tuple[int, int, int]:
    """(state bytes, step-time temporary bytes, paged bytes outside the allocator)."""
    if s.optimizer == "sgd":  # fitburst's SGD runs with momentum 0.9: one buffer per parameter, in-place update
        return pbytes * sum(tensors), 0, 0
    if s.optimizer == "adamw":
        state = 2 * pbytes * sum(tensors)
        # torch AdamW: foreach on CUDA (one sqrt buffer over all params), per tensor elsewhere
        if device.kind == "cpu":
            temp = 2 * pbytes * max(tensors, default=0)
        else:
            temp = pbytes * sum(tensors)
        return state, temp, 0
    state = 0
    for n in tensors:
        if n < BNB_MIN_8BIT:
            state += 8 * n
        else:
            state += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
    if s.optimizer == "paged_adamw8bit" and device.kind == "cuda":
        return 0, 0, state  # unified memory: outside torch's allocator, evicted under pressure
    return state, 0, 0


# --- activations -----------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    T: int  # tokens in the micro batch
    b: int
    S: int
    a: int  # activation bytes (residual stream dtype)
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


def _norm(saved: dict, key: str, in_key: str, rg_in: bool, c: _Ctx, shape: ModelShape, width: int) -> bool:
    """Saved tensors of one norm; returns requires_grad of its output."""
    T, a = c.T, (4 if c.master else c.a)  # the residual stream's dtype
    style = shape.norm_style
    if style == "layernorm":
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


def _linear(saved: dict, name: str, in_key: str, fan_in: int, rg_in: bool, c: _Ctx) -> bool:
    T = c.T
    if c.full:
        if c.master and in_key in ("n1", "n2"):  # autocast casts the fp32 norm output again for each linear
            saved[f"{name}.in16"] = c.a * T * fan_in
        else:
            saved[in_key] = c.a * T * fan_in
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
        src = in_key if c.a == 4 else f"{name}.cast"
        if c.drop:
            saved[f"{name}.noise"] = c.mask_b * T * fan_in
            saved[f"{name}.drop"] = 4 * T * fan_in
        else:
            saved[src] = 4 * T * fan_in
        saved[f"{name}.loraA"] = 4 * T * c.rank
        return True
    return rg_in


def _layer(shape: ModelShape, c: _Ctx, rg_in: bool, decoder: bool = True) -> tuple[dict, bool, int]:
    """Saved-for-backward tensors of one block (name -> bytes; shared tensors share a name), whether its output
    needs grad, and the bytes of its top sub-layer (the MLP and its norm: their backward runs first and frees them
    before the attention's backward runs)."""
    T, a, h, i = c.T, c.a, shape.hidden, shape.intermediate
    qd, kvd = shape.q_dim, shape.kv_dim
    sv: dict[str, int] = {}
    if c.master:  # autocast's 16-bit copies of this block's weights, kept for backward
        sv["w16"] = a * sum(lin.fan_in * lin.fan_out for lin in shape.layer_linears(decoder))
    rg_n1 = _norm(sv, "ln1", "x", rg_in, c, shape, h)
    if shape.fused_qkv:
        rg_qkv = _linear(sv, "qkv_proj", "n1", h, rg_n1, c)
        rg_q = rg_k = rg_v = rg_qkv
    else:
        names = [lin.name for lin in shape.attn_linears()]
        rg_q = _linear(sv, names[0], "n1", h, rg_n1, c)
        rg_k = _linear(sv, names[1], "n1", h, rg_n1, c)
        rg_v = _linear(sv, names[2], "n1", h, rg_n1, c)
    rg_att = rg_q or rg_k or rg_v
    if shape.qk_norm and rg_att:
        sv["qnorm.f32"] = 4 * T * qd
        sv["knorm.f32"] = 4 * T * kvd
    if rg_att:  # attention's matmuls keep their inputs; under autocast, 16-bit copies (k-bit's fp32 q/k/v freed)
        m = _attention_bytes(c)
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
                sv["attn_bias"] = m * c.b * c.S * c.S
        else:  # eager / math: the probabilities are kept (fp32 softmax output, plus eager's 16-bit cast)
            sv["probs.f32"] = 4 * c.b * shape.heads * c.S * c.S
            if m != 4:
                sv["probs"] = m * c.b * shape.heads * c.S * c.S
    o_name = shape.attn_linears()[-1].name
    rg_o = _linear(sv, o_name, "ctx", qd, rg_att, c)
    if shape.model_type == "t5" and decoder:  # cross attention: approximate like self attention
        sub, _ = _attn_only(shape, c, rg_o)
        sv.update({f"x.{k}": v for k, v in sub.items()})
    rg_h1 = rg_in or rg_o
    below = set(sv)  # the attention sub-layer's tensors (a parallel block's MLP reads its norm output too)
    if shape.parallel_block:
        rg_n2, n2 = rg_n1, "n1"
    else:
        extra_norms = max(0, shape.norms_per_layer - 2)
        if extra_norms:  # gemma: post-attention norm on the attention output, pre/post feed-forward norms
            _norm(sv, "ln_post_attn", "o", rg_o, c, shape, h)
        rg_n2 = _norm(sv, "ln2", "h1", rg_h1, c, shape, h)
        n2 = "n2"
    mlp = shape.mlp_linears()
    if shape.experts:
        rg_m = _moe(sv, shape, c, n2, rg_n2)
    elif shape.mlp == "gated" or shape.model_type == "t5":
        if shape.fused_gate_up:
            rg_g = rg_u = _linear(sv, mlp[0].name, n2, h, rg_n2, c)
        else:
            rg_g = _linear(sv, mlp[0].name, n2, h, rg_n2, c)
            rg_u = _linear(sv, mlp[1].name, n2, h, rg_n2, c)
        act = a
        if rg_g:
            sv["gate"] = a * T * i  # activation input
            if shape.act == "gelu_new":
                act = _gelu_new(sv, "gate", c, a, i)
        if rg_u:
            sv["act"] = act * T * i
        if rg_g:
            sv["up"] = a * T * i
        rg_p = rg_g or rg_u
        rg_m = _linear(sv, mlp[-1].name, "p", i, rg_p, c)
    else:
        rg_f = _linear(sv, mlp[0].name, n2, h, rg_n2, c)
        if rg_f:
            sv["fc1"] = a * T * i
            if shape.act == "gelu_new":
                _gelu_new(sv, "fc1", c, a, i)
        rg_m = _linear(sv, mlp[-1].name, "p", i, rg_f, c)
    if shape.norms_per_layer > 2:
        _norm(sv, "ln_post_ff", "m", rg_m, c, shape, h)
    return sv, rg_h1 or rg_m, sum(v for k, v in sv.items() if k not in below)


def _t5_layer(shape: ModelShape, c: _Ctx, rg_in: bool, decoder: bool = True) -> tuple[dict, bool, int]:
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
            sub["res.drop"] = _t5_drop_bytes(c, c.a) * c.T * shape.hidden
        rg = rg or rg_out
        # the block input is "x"; each later sublayer's input is a new residual sum
        sv.update({(key if key == "x" and k == 0 else f"{name}.{key}"): v for key, v in sub.items()})
    if c.master:  # autocast's 16-bit copies of this block's weights, kept for backward (as in _layer)
        sv["w16"] = c.a * sum(lin.fan_in * lin.fan_out for lin in shape.layer_linears(decoder))
    return sv, rg, sum(v for k, v in sv.items() if k.startswith("ff."))


def _t5_res(c: _Ctx) -> int:
    """Bytes per element of T5's residual stream and norm outputs (its weights' dtype)."""
    return 4 if c.master else c.a


def _t5_drop_bytes(c: _Ctx, of: int) -> int:
    return 1 if c.mask_b == 1 else of  # CUDA: bool mask; CPU / MPS: noise in the input's dtype (``of`` bytes)


def _t5_norm(sv: dict, shape: ModelShape, c: _Ctx, rg_in: bool) -> bool:
    """T5LayerNorm: x.to(fp32).pow(2).mean, x * rsqrt(...) (keeps x, its fp32 copy and rsqrt), then weight * that
    (keeps it when the weight trains)."""
    T, r, h = c.T, _t5_res(c), shape.hidden
    if rg_in:
        sv["x"] = r * T * h
        if r != 4:
            sv["x.f32"] = 4 * T * h
        sv["ln.rsqrt"] = 4 * T
    if c.full:
        sv["ln.normed"] = r * T * h
    return rg_in or c.full


def _t5_linear(sv: dict, name: str, in_key: str, fan_in: int, rg_in: bool, c: _Ctx, in_bytes: int) -> bool:
    """A T5 linear under autocast on an input of ``in_bytes`` per element: a trained weight keeps its input (its own
    16-bit copy when the input is fp32 under 16-bit autocast); a LoRA adapter (no dropout) keeps its input in the
    activation dtype (under autocast a copy of its own, as :func:`_linear`), plus lora_A's output."""
    T, a = c.T, c.a
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


def _t5_attention(sv: dict, shape: ModelShape, c: _Ctx, rg_n: bool, cross: bool = False,
                  decoder: bool = False) -> bool:
    """T5 attention (scores + position bias as a float mask); cross-attention takes k and v from the encoder's
    output (which needs grad: the encoder trains). Outside CUDA, SDPA with dropout takes its math path, which
    upcasts 16-bit inputs to fp32: q, k, v, the probabilities, the dropout noise and the dropped probabilities are
    kept in fp32. On CUDA the memory-efficient kernel keeps q, k, v, its output, the log-sum-exp and its own bias,
    made per call: a self-attention's from the permuted relative-position bias (with the encoder's padding mask
    folded in: b rows), which torch's composite pads to 8-element rows; a cross-attention's is the shared zero
    bias (counted once, in ``estimate``) unless a padding mask makes one per call (b rows)."""
    T, a, h, qd, r = c.T, c.a, shape.hidden, shape.q_dim, _t5_res(c)
    kv_in, rg_kv_in = ("enc", True) if cross else ("n1", rg_n)
    rg_q = _t5_linear(sv, "q", "n1", h, rg_n, c, r)
    rg_k = _t5_linear(sv, "k", kv_in, h, rg_kv_in, c, r)
    rg_v = _t5_linear(sv, "v", kv_in, h, rg_kv_in, c, r)
    rg_att = rg_q or rg_k or rg_v
    if rg_att:
        sq = c.b * shape.heads * c.S * c.S
        if c.attention == "flash" and (c.mask_b == 1 or not shape.dropout):  # efficient / flash kernel
            sv.update({"att.q": a * T * qd, "att.k": a * T * qd, "att.v": a * T * qd, "att.out": a * T * qd,
                       "att.lse": 4 * c.b * shape.heads * c.S})
            rows = c.b if c.padded and not (decoder and not cross) else 1
            if c.mask_b == 1 and (rows > 1 or not cross):
                width = c.S if cross else c.S + 8 - c.S % 8  # a self-attention's bias is padded
                sv["att.bias"] = a * rows * shape.heads * c.S * width
        else:
            ab = 4 if c.mask_b != 1 else a
            sv.update({"att.q": ab * T * qd, "att.k": ab * T * qd, "att.v": ab * T * qd, "att.probs": ab * sq})
            if shape.dropout:
                sv["att.drop"] = _t5_drop_bytes(c, ab) * sq
                sv["att.dropped"] = ab * sq
    return _t5_linear(sv, "o", "ctx", qd, rg_att, c, a)


def _gelu_new(sv: dict, key: str, c: _Ctx, a: int, i: int) -> int:
    """gelu_new's python formula keeps its input ``key`` (for pow), tanh, 0.5 x and 1 + tanh. Under a GPU's autocast
    pow runs in fp32, so a 16-bit input is kept as an fp32 copy and everything after it but 0.5 x is fp32. Returns
    the bytes per element of its output."""
    f = 4 if c.gpu_amp else a
    sv.update({key: f * c.T * i, "gelu.tanh": f * c.T * i, "gelu.half": a * c.T * i, "gelu.1pt": f * c.T * i})
    return f


def _t5_feed_forward(sv: dict, shape: ModelShape, c: _Ctx, rg_n: bool, cross: bool = False,
                     decoder: bool = False) -> bool:
    """T5's DenseReluDense: gated (gelu_new(wi_0 x) * wi_1 x, as FLAN-T5) or plain (relu(wi x)), dropout, wo (kept
    in fp32 by transformers: its input goes to fp32 and autocast makes a 16-bit copy of that)."""
    T, a, i, r = c.T, c.a, shape.intermediate, _t5_res(c)
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


def _moe(sv: dict, shape: ModelShape, c: _Ctx, in_key: str, rg_in: bool) -> bool:
    """Saved tensors of a routed MoE block: each token's state runs through ``experts_per_tok`` experts
    (k*T rows in all, one expert at a time), plus the router's fp32 probabilities and any shared expert."""
    T, a, h, i, s = c.T, c.a, shape.hidden, shape.expert_intermediate, shape.shared_intermediate
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


def _attn_only(shape: ModelShape, c: _Ctx, rg_in: bool) -> tuple[dict, bool]:
    T, a = c.T, c.a
    sv: dict[str, int] = {}
    if rg_in or c.full or c.lora:
        sv["q_rope"] = a * T * shape.q_dim
        sv["k_rope"] = a * T * shape.kv_dim
        sv["v"] = a * T * shape.kv_dim
        sv["probs.f32"] = 4 * c.b * shape.heads * c.S * c.S
    return sv, True


def _layer_backward_transient(shape: ModelShape, c: _Ctx) -> tuple[int, int]:
    """Gradient tensors alive inside one block's backward beyond its saved tensors: (during the MLP's backward, its
    input grads while its own saved inputs are released node by node; during the attention's, its grads)."""
    T, a, h, i = c.T, c.a, shape.hidden, shape.intermediate
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
    mlp += a * T * h
    if c.attention == "flash":
        att = 4 * T * (shape.q_dim + 2 * shape.kv_dim) + 2 * a * T * shape.q_dim
    else:  # the probabilities' grad in fp32 and the softmax backward's output, the probabilities' 16-bit copy
        # (if any) freed by then; CUDA's kernel adds an fp32 grad * output temporary, or (fp16 scores) writes
        # the fp16 grad beside that temporary instead of an fp32 output (cuda_kernels.softmax_backward_temp and
        # softmax_half_to_float)
        m = _attention_bytes(c)
        per_score = 8 + (4 if c.mask_b == 1 else 0) - (2 if c.half_to_float else 0) - (0 if m == 4 else m)
        att = per_score * c.b * shape.heads * c.S * c.S
    return mlp, att


def _forward_transient(shape: ModelShape, c: _Ctx) -> int:
    """Beyond everything the forward keeps: the last block's MLP intermediates, or its masked scores (the stream's
    dtype) beside their softmax, and an fp32 copy of 16-bit scores where the softmax kernel makes one (not CUDA's
    half-to-float kernel), before the probabilities' 16-bit copy exists."""
    T, a = c.T, c.a
    upcast = 4 if a != 4 and not c.half_to_float else 0
    m = c.lora16 or a
    att = {"flash": 0, "math": 4}.get(c.attention, max(0, a + upcast - (0 if m == 4 else m)))
    return max(2 * a * T * shape.intermediate, att * c.b * shape.heads * c.S * c.S)


def _attention_bytes(c: _Ctx) -> int:
    """Bytes an element of what attention keeps (q, k, v, probabilities): the math composite (SDPA on MPS) upcasts
    16-bit q, k and v to fp32 and computes in fp32; eager and the fused kernels keep the stream's dtype (under
    autocast, its 16-bit copies)."""
    return 4 if c.attention == "math" else c.lora16 or c.a


def estimate(shape: ModelShape, settings: TrainSettings, device: Device, calibrate: bool = True) -> Estimate:
    """The analytic estimate of one training step of ``settings`` on ``device``; whether it fits is judged by
    :class:`fitburst.memory.budget.Budget`."""
    s = settings
    d = DTYPE_BYTES[s.dtype]
    # FSDP's mixed precision (fitburst.distributed.mixed_precision) gathers every weight in the compute dtype and
    # casts each block's inputs to it: a 16-bit stream even where k-bit preparation or fp32 master weights would
    # make it fp32, and no autocast copies of fp32 weights
    mp = s.world_size > 1 and s.amp
    a = 4 if s.kbit and not mp else d
    a_lm = 4 if s.kbit and not s.amp else d  # k-bit's fp32 head; under autocast its output is 16-bit
    T = s.batch * s.seq_len
    b, S, padded = s.batch, s.seq_len, s.batch > 1 if s.padded is None else s.padded
    if s.packed_fill:  # one row of the real tokens; sdpa/eager get a block-diagonal mask, flash-attn varlen none
        T = S = max(1, round(T * s.packed_fill))
        b, padded = 1, s.attention != "flash"
    full = s.method == "full"
    targets = set() if full else resolve_targets(shape, s.targets)
    attention = s.attention
    if attention == "flash" and device.kind != "cuda":
        attention = "sdpa"
    kv_expanded = attention == "sdpa" and expands_kv(device, s.dtype, shape.kv_heads < shape.heads)
    if attention == "sdpa":
        attention = "math" if device.kind == "mps" else "flash"
    c = _Ctx(
        T=T,
        b=b,
        S=S,
        a=a,
        full=full,
        lora=not full,
        targets=targets,
        rank=s.rank,
        drop=s.dropout > 0 and not full,
        mask_b=1 if device.kind == "cuda" else 4,
        attention=attention,
        padded=padded,
        kv_expanded=kv_expanded,
        merged_experts=0 if full or not shape.lora_experts(s.targets) else a * shape.expert_params,
        master=s.master_weights and not mp,
        lora16=d if s.amp and not full else 0,
        gpu_amp=device.kind in ("cuda", "mps") and s.amp,
        norm32=device.kind in ("cuda", "mps") and s.amp and not full and not s.kbit and shape.norm_style == "layernorm",
        half_to_float=device.kind == "cuda" and s.dtype == "fp16" and a == 2,
        fsdp_mp=mp,
    )
    V, h = shape.vocab, shape.hidden
    notes: list[str] = [expanded_kv_note(device)] if kv_expanded else []

    # weights, trainable params, grads, optimizer (fp32 master weights under autocast: weight_bytes)
    w = weight_bytes(shape, s)
    if shape.model_type == "t5" and d != 4 and not s.master_weights and not s.kbit:  # transformers keeps wo in fp32
        w["weights"] += 2 * shape.intermediate * shape.hidden * shape.total_layers
    if device.kind == "cuda":  # the cuBLAS workspaces the warm-up step left (never freed)
        biased = any(lin.bias for _, dec in shape.blocks() for lin in shape.layer_linears(dec))
        w["cuda_workspaces"] = cublas_workspace_bytes(device, biased, s.grad_checkpointing)
    if full:
        tensors = _full_tensors(shape, s.vision)
        pbytes = 4 if s.master_weights else d  # fp32 master weights: fp32 gradients and optimizer state
        lora_w = 0
    else:
        tensors = lora_tensors(shape, s)
        pbytes = 4  # peft keeps adapters in fp32
        lora_w = 4 * sum(tensors)
    P_tr = sum(tensors)
    G = pbytes * P_tr
    OPT, O_tmp, O_paged = optimizer_bytes(s, tensors, pbytes, device)
    if O_paged:
        notes.append(
            f"paged optimizer state ({O_paged / GiB:.2f} GiB) lives in CUDA unified memory, outside "
            "torch's allocator; it pages to host RAM under pressure"
        )
    ckpt = s.grad_checkpointing
    # enable_input_require_grads (ckpt, k-bit+ckpt) or trainable embeddings (full): layer 0 input needs grad
    rg0 = full or ckpt
    per_layer: list[int] = []
    per_layer_full: list[dict] = []
    per_layer_mlp: list[int] = []
    rg = rg0
    layer = _t5_layer if shape.model_type == "t5" else _layer
    for count, dec in shape.blocks():
        for _ in range(count):
            sv, rg_out, mlp_bytes = layer(shape, c, rg, dec)
            per_layer.append(sum(sv.values()))
            per_layer_full.append(sv)
            per_layer_mlp.append(mlp_bytes)
            rg = rg_out
        if shape.encoder_layers and not dec:
            rg = rg0
    # final norm (on the last layer's output) and lm_head input
    fin: dict[str, int] = {}
    _norm(fin, "lnf", "xL", rg, c, shape, h)
    if full:
        fin["nf"] = a * T * h
    A_final = sum(fin.values())
    mask_bytes = c.b * c.S * c.S if padded else 0  # boolean padding mask, built once per forward
    if attention == "eager":
        mask_bytes = a * c.b * c.S * c.S  # eager always gets an additive float mask
    rope = 2 * a * T * shape.head_dim
    shared = rope + mask_bytes + 16 * T  # cos/sin, mask, ids/labels
    if shape.model_type == "t5" and c.mask_b == 1:
        # CUDA: each attention call keeps its own bias (_t5_attention); every cross-attention keeps the one zero
        # bias when no padding mask makes one per call; checkpointed blocks keep the encoder's and the decoder's
        # relative-position biases (1 x heads x S x S, the weights' dtype) and that zero bias as inputs
        shared += (0 if padded else a * shape.heads * c.S * c.S) + (
            2 * shape.heads * c.S * c.S * (4 if s.master_weights or s.dtype == "fp32" else d) if ckpt else 0)
    elif shape.model_type == "t5" and ckpt:
        # T5's position-bias masks (encoder self, decoder self and cross: b x heads x S x S in the weights' dtype)
        # are inputs every checkpointed block keeps
        shared += 3 * c.b * shape.heads * c.S * c.S * (4 if s.master_weights or s.dtype == "fp32" else d)
    logits = a_lm * T * V
    L = len(per_layer)
    if ckpt:
        A_layers_kept = [(4 if c.master else a) * T * h] * L  # checkpointing keeps each layer's input
        recompute = [
            max(0, x - (a * T * h if "x" in sv else 0))
            for x, sv in zip(per_layer, per_layer_full, strict=True)
        ]
    else:
        A_layers_kept = per_layer
        recompute = [0] * L
    # autocast's 16-bit copies of the fp32 adapters (cached through the forward, kept for backward)
    lora_cast = d * P_tr if c.lora16 and not mp else 0
    v = shape.vision
    pixels = 4 * s.batch * s.images * s.image_tokens * v.merge ** 2 * v.patch_in if v is not None else 0
    shared += pixels  # the batch's pixel_values (fp32) live through the step
    vis_saved, vis_fwd = vision_activations(shape, s, a, attention, c.mask_b)
    # activation offloading (CUDA, TRL's context): what each layer saves waits in host memory; on the device, one
    # layer's worth (the forward's stash of the last few tensors being copied out, the layer whose tensors came
    # back in backward); the loss head is never offloaded
    offload = s.offload and device.kind == "cuda"
    window = max(A_layers_kept, default=0) if offload else 0
    A_dev = window if offload else sum(A_layers_kept)
    A_all = A_dev + A_final + shared + lora_cast + vis_saved
    G_acc = G if s.grad_accum > 1 else 0  # grads of earlier micro-steps stay while accumulating
    # the fused linear cross-entropy (decoder-only models: an encoder-decoder trains with the standard loss) holds
    # no logits; what it does hold is its kernel's rule (fitburst.memory.loss_kernels)
    fused = s.fused_loss and not shape.encoder_layers
    kernel = loss_kernel_of(s, device) if fused else "standard"
    kept_logits = logits if s.keep_logits and not fused else 0
    phases: dict[str, dict[str, int]] = {}
    qtemp = 0
    if s.kbit:  # bnb dequantizes the largest weight for each matmul (compute dtype), plus input/output casts
        qtemp = 2 * shape.largest_linear() + 2 * T * (h + shape.intermediate)
    # forward end: everything saved, the last block's transient
    fwd_t = _forward_transient(shape, c) + qtemp
    phases["forward"] = _comp(w, lora_w, G_acc, OPT, A_all, 0, fwd_t)
    if vis_fwd:  # the vision tower runs first, before the language model keeps anything
        phases["vision"] = _comp(w, lora_w, G_acc, OPT, shared + vis_saved, 0, vis_fwd)
    # loss forward: logits, their fp32 copy (a no-op when already fp32), the log_softmax output. Backward: the
    # saved log_softmax output plus two fp32 grads (of it, and of its input); the logits themselves are still
    # alive only when the loop keeps the model output (an output dropped after ``.loss`` frees them, since
    # neither the cast nor log_softmax saves its input).
    loss_fwd = logits + (4 * T * V if a_lm != 4 else 0) + 4 * T * V
    loss_bwd = kept_logits + 12 * T * V
    if shape.model_type == "t5" and c.gpu_amp and a_lm != 4:
        # T5 takes cross_entropy of its 16-bit logits (no upcast first): a GPU's autocast runs log_softmax in 16
        # bits and copies its output to fp32 for nll_loss, which keeps that copy; nll_loss's backward adds its fp32
        # grad (CPU autocast: an fp32 log_softmax, counted above)
        loss_fwd = logits + (a_lm + 4) * T * V
        loss_bwd = kept_logits + (a_lm + 8) * T * V
    # autocast's 16-bit copy of an fp32 head (master weights, k-bit's fp32 head), kept for its backward
    head16 = d * V * h if (s.master_weights or (s.kbit and s.amp)) and not mp else 0
    if fused:
        terms = fused_loss_terms(kernel, T, h, V, a_lm, head_grad=full, head_bytes=pbytes if full else None,
                                 softcap=shape.softcap)
        # fitburst casts fp32 hidden states (a k-bit model's stream under autocast, autocast's fp32 LayerNorm
        # output) to the matmul dtype first; a full fine-tune's copy is A_final's "nf", as for the standard head
        hidden_b = 4 if (a == 4 or c.norm32) and not full else a_lm
        cast = hidden_cast(kernel, T, h, a_lm, hidden_b)
        # on top of A_all, whose head input (``nf``, a trained head's) stands for the hidden states given to the
        # kernel: the rule's peak takes them off where the library frees them before its backward (``released``)
        loss_fwd = loss_bwd = terms.plus(cast).peak
        notes.append(f"loss: {describe_lean(s, device)}")
    phases["loss"] = _comp(w, lora_w, G_acc, OPT, A_all, max(loss_fwd, loss_bwd), head16)
    # backward through the blocks, top to bottom
    head_grad = pbytes * V * h if full else 0
    g_so_far = G_acc + head_grad if full else G_acc
    # eager attention's float mask is read by additions only: freed after the forward unless checkpointing keeps
    # it as a block input
    shared_bwd = shared - (mask_bytes if attention == "eager" and not ckpt else 0)
    # offloaded: only the current layer's tensors are back (``back`` below)
    remaining = (0 if offload else A_dev) + shared_bwd + lora_cast + vis_saved
    best_b = (0, 0, 0)
    layer_params = (P_tr - _embed_head_params(shape)) / max(L, 1) if full else 0
    mlp_t, att_t = _layer_backward_transient(shape, c)
    kq = 2 * shape.largest_linear() if s.kbit else 0  # bnb's dequantized weight (and its grad input's cast)
    for idx in range(L - 1, -1, -1):
        # the block's MLP backward runs with all of the block's saved tensors, the attention's after it freed
        # the MLP's
        back = A_layers_kept[idx] if offload else 0  # an offloaded layer's tensors are copied back for its backward
        for acts, bt in ((remaining + back + recompute[idx], mlp_t),
                         (remaining + back + recompute[idx] - per_layer_mlp[idx], att_t)):
            tot = acts + bt + kq + g_so_far + kept_logits + d * T * h
            if tot > sum(best_b):
                best_b = (acts, g_so_far, bt + kq + kept_logits + d * T * h)
        if not offload:
            remaining -= A_layers_kept[idx]
        if full:
            g_so_far += int(layer_params * pbytes)
    if full:  # embedding gradient (dense) arrives last
        emb_g = pbytes * V * h if s.world_size == 1 else 0  # sharded: in fsdp_buffers (its reduction)
        tot = shared_bwd + g_so_far + emb_g + kept_logits
        if tot > sum(best_b):
            best_b = (
                shared_bwd,
                g_so_far + emb_g - (emb_g if shape.tied else 0),
                kept_logits + (emb_g if shape.tied else 0),
            )
    phases["backward"] = _comp(
        w, lora_w, best_b[1] if full else max(best_b[1], G_acc), OPT, best_b[0], 0, best_b[2]
    )
    # optimizer step: all grads, states, the step's temporaries (logits still referenced by the loop)
    phases["optimizer_step"] = _comp(w, lora_w, G, OPT, 0, kept_logits, O_tmp)
    if s.eval_batch:  # fitburst.evaluate takes the loss in chunks: fp32 copy + log_softmax of one chunk only
        Te = s.eval_batch * s.seq_len
        chunk = min(Te, EVAL_CHUNK_TOKENS)
        loss_ev = (fused_eval_bytes(kernel, chunk, h, V, a_lm, head_grad=full, head_bytes=pbytes if full else None,
                                    softcap=shape.softcap)
                   if fused else a_lm * Te * V + 8 * chunk * V)
        ev = loss_ev + 4 * a * Te * max(h, shape.intermediate)
        phases["eval"] = _comp(w, lora_w, 0, 0, 0, ev, 0)
    if s.world_size > 1:  # per rank: model states sharded, FSDP's gathered weights and gradient buffers
        buffers = fsdp_buffers(shape, s)
        replicated = weight_bytes(shape, s).get("weights_quantized", 0) - _packed_4bit(shape, s)
        phases = {k: _per_rank(v, s.world_size, replicated, buffers[k], k == "optimizer_step", s.cpu_offload)
                  for k, v in phases.items()}
        notes.append(f"FSDP over {s.world_size} GPUs: per-GPU figures (model states / {s.world_size}, activations of "
                     "this GPU's micro-batch, gathered blocks and gradient buffers)")
    totals = {k: sum(v.values()) for k, v in phases.items()}
    peak_phase = max(totals, key=lambda k: totals[k])
    alloc = totals[peak_phase]
    reserved = (int(alloc * RESERVED_FACTOR[device.kind] + RESERVED_PER_LOGITS[device.kind] * 4 * T * V)
                + RESERVED_FLOOR[device.kind])
    factor, fitted_on = calibration.factor_for(device.name, device.kind) if calibrate else (1.0, "")
    rfactor = calibration.reserved_factor_for(device.name, device.kind) if calibrate else 1.0
    if factor != 1.0 or rfactor != 1.0:  # fitted by `fitburst calibrate` on measured runs; components as modelled
        alloc, reserved = int(alloc * factor), int(reserved * rfactor)
        notes.append(f"calibrated: allocated x{factor:.3f}, reserved x{rfactor:.3f} (fitted on {fitted_on})")
    total = reserved + device.outside_allocator
    if shape.extra_note:
        notes.append(f"{shape.extra_note}")
    if s.dtype == "bf16" and not device.supports_bf16:
        notes.append(f"{device.name} has no bf16: use fp16 (same memory, but bf16 would be emulated)")
    if s.kbit and not device.supports_bnb:
        notes.append(f"bitsandbytes quantization is not available on {device.name}")
    return Estimate(
        allocated_peak_bytes=int(alloc),
        reserved_peak_bytes=reserved,
        device_total_bytes=total,
        components={k: int(v) for k, v in phases[peak_phase].items() if v},
        peak_phase=peak_phase,
        device=device.name,
        budget_bytes=device.budget_bytes,
        params=param_counts(shape, s),
        phases={k: int(v) for k, v in totals.items()},
        settings=asdict(s),
        model=shape.name,
        notes=notes,
        calibration_factor=factor,
        reserved_calibration_factor=rfactor,
        world_size=s.world_size,
        vocab=shape.vocab,
    )


# --- FSDP (fitburst.memory.sharded): per rank -------------------------------------------------------------


def _packed_4bit(shape: ModelShape, s: TrainSettings) -> int:
    """Bytes of the packed 4-bit weights (sharded; their quantization statistics stay whole on every rank)."""
    if s.quant not in ("nf4", "fp4"):
        return 0
    return sum(c * sum(lin.fan_in * lin.fan_out for lin in shape.layer_linears(dec)) for c, dec in shape.blocks()) // 2


def gathered_bytes(shape: ModelShape, s: TrainSettings) -> tuple[int, int, int, int, int]:
    """(root bytes, largest block's bytes, all blocks' bytes, largest block's trained numel, root's trained numel)
    as FSDP gathers them: the compute dtype under its mixed precision, else each weight's own (fp32 adapters, master
    weights, k-bit's fp32 norms); packed 4-bit weights as packed. The root holds what no block does (embeddings,
    head, final norms, a vision tower's extras)."""
    d = DTYPE_BYTES[s.dtype]
    mp = s.amp
    full = s.method == "full"
    base = d if mp or not (full and s.master_weights) else 4
    rest = d if mp else (4 if s.kbit or s.master_weights or s.dtype == "fp32" else d)  # norms, embeddings
    trained = 4 if not s.pure_bf16 else d
    train_g = d if mp else trained
    per_lora = {}
    if not full:
        t = resolve_targets(shape, s.targets)
        for _, dec in shape.blocks():
            per_lora[dec] = sum(s.rank * (lin.fan_in + lin.fan_out) for lin in shape.layer_linears(dec)
                                if lin.name in t)
            per_lora[dec] += sum(mult * s.rank * shape.experts * (fi + fo) for _, mult, fi, fo in
                                 shape.lora_experts(s.targets))
    blocks = []
    for c, dec in shape.blocks():
        lin = sum(x.fan_in * x.fan_out for x in shape.layer_linears(dec))
        bias = sum(x.fan_out for x in shape.layer_linears(dec) if x.bias)
        other = shape.norm_params_per_layer(dec) + bias + shape.expert_params
        weights = (lin // 2 if s.quant in ("nf4", "fp4") else lin * base) + other * (rest if s.kbit else base)
        lora = per_lora.get(dec, 0)
        numel = lora if not full else lin + other
        blocks += [(weights + lora * train_g, numel)] * c
    root_numel = shape.embed_params + shape.lm_head_params + shape.final_norm_params + shape.extra_params
    root = root_numel * (rest if s.kbit else base)
    biggest = max(blocks, default=(0, 0))
    return root, biggest[0], sum(b for b, _ in blocks), biggest[1], root_numel if full else 0


def fsdp_buffers(shape: ModelShape, s: TrainSettings) -> dict[str, int]:
    """What FSDP2 adds on a rank in each phase of the step, from its code (torch.distributed.fsdp._fully_shard) and
    measured against the sharded trace: the root's weights are gathered for the whole step; in forward a block's
    gathered weights, its all-gather buffer (kept until the next block's copy-out) and the next block's buffer
    (3 blocks' worth); the loss runs beside one; backward holds a block and the prefetched one (2) plus the
    gradient reduction of one block or of the root: its unsharded gradient (compute dtype) and the fp32
    reduce-scatter input. Keeping gathered weights after forward (``reshard_after_forward`` off) holds every block
    from forward to its backward."""
    root, block, blocks, train, root_train = gathered_bytes(shape, s)
    reduce = (DTYPE_BYTES[s.dtype] if s.amp else 4) + 4
    if s.reshard_after_forward:
        fwd, loss, bwd = root + 3 * block, root + block, root + 2 * block
    else:
        fwd, loss, bwd = root + blocks + block, root + blocks, root + blocks + block
    bwd = max(bwd + train * reduce, root + root_train * reduce)
    return {"forward": fwd, "vision": root + 3 * block, "loss": loss, "backward": bwd, "optimizer_step": 0,
            "eval": root + 2 * block}


def _per_rank(comp: dict[str, int], n: int, replicated: int, buffers: int, step: bool,
              offload: bool = False) -> dict[str, int]:
    """One phase's components on one of ``n`` ranks: model states sharded (4-bit statistics ``replicated``: they
    are no parameters), activations and transients as the rank's own (the optimizer ``step``'s temporaries are
    sharded too), FSDP's ``buffers`` added. With ``offload`` the sharded states and the optimizer step live in host
    memory (:func:`host_bytes`)."""
    out = {}
    for k, v in comp.items():
        if k in ("weights", "weights_fp32", "lora_weights", "gradients", "optimizer_states") or (
                step and k == "transient"):
            v = 0 if offload else -(-v // n)
        elif k == "weights_quantized":
            v = replicated + (0 if offload else -(-(v - replicated) // n))
        out[k] = v
    out["fsdp_buffers"] = buffers
    return out


def model_state_bytes(params: dict[str, int], s: TrainSettings) -> dict[str, int]:
    """The whole run's weights (as trained: 4-bit packed, fp32 masters), gradients and optimizer state, from an
    estimate's parameter counts (``total``, ``trainable``, ``base``): what FSDP shards, offloads and loads."""
    d = DTYPE_BYTES[s.dtype]
    frozen = params["total"] - (params["trainable"] if s.method != "full" else params["total"])
    per = 0.5 if s.quant in ("nf4", "fp4") else 1.0 if s.quant == "int8" else (4 if s.master_weights else d)
    pbytes = 4 if (s.method != "full" or s.master_weights) else d
    state = {"adamw": 2 * pbytes, "sgd": pbytes}.get(s.optimizer, 2)
    return {"weights": int(frozen * per + params["trainable"] * pbytes), "gradients": params["trainable"] * pbytes,
            "optimizer_states": params["trainable"] * state}


def loads_once(quant: str) -> bool:
    """Whether a sharded run reads its checkpoint once (rank 0 loads the whole model into host RAM, every other rank
    builds it without weights and receives its shards from rank 0: :func:`fitburst.distributed.fill_from_rank0`)
    rather than once per rank. Not with 4-bit weights: bitsandbytes quantizes as it loads, and the packed shape and
    quantization state (absmax, code: no parameters) exist only on a rank that loaded; a rank that built the model
    without weights holds the unquantized shape and no state to receive them into."""
    return quant not in ("nf4", "fp4")


def host_bytes(params: dict[str, int], s: TrainSettings, gpus_per_node: int) -> int:
    """Host RAM the busiest node needs for a sharded run beyond its processes: with ``offload`` its ranks' shards
    of the weights, gradients and optimizer state (where the shards live in host RAM); and while loading, the base
    weights as loaded: one copy on rank 0's node where the others receive their shards from it
    (:func:`loads_once`: they go straight to each rank's GPU), else one copy per rank of the node, all loading at
    once (4-bit weights, quantized as each rank loads them). 0 for one device (the weights load onto it)."""
    if s.world_size <= 1:
        return 0
    states = model_state_bytes(params, s)
    # as loaded: a 4-bit base's quantization state, and its embeddings, head and norms unquantized (fp32 once
    # prepared); from the parameter counts alone where an estimate does not say
    loaded = params.get("loaded") or (states["weights"] - states["gradients"] if s.method != "full"
                                      else states["weights"])
    copies = 1 if loads_once(s.quant) else min(gpus_per_node, s.world_size)
    offloaded = sum(states.values()) // s.world_size * gpus_per_node if s.cpu_offload else 0
    return copies * loaded + offloaded


def _comp(w: dict, lora_w: int, grads: int, opt: int, acts: int, loss: int, transient: int) -> dict[str, int]:
    out = dict(w)
    out.update(
        {
            "lora_weights": lora_w,
            "gradients": grads,
            "optimizer_states": opt,
            "activations": acts,
            "logits_loss": loss,
            "transient": transient,
        }
    )
    return out


def _embed_head_params(shape: ModelShape) -> int:
    return shape.embed_params + shape.lm_head_params


def _full_tensors(shape: ModelShape, vision: str = "tower") -> list[int]:
    """numel of each trained tensor of a full fine-tune (the vision tower's as ``vision`` trains it)."""
    out = [shape.embed_params]
    if shape.lm_head_params:
        out.append(shape.lm_head_params)
    for c, dec in shape.blocks():
        per = []
        for lin in shape.layer_linears(dec):
            per.append(lin.fan_in * lin.fan_out)
            if lin.bias:
                per.append(lin.fan_out)
        per.append(shape.norm_params_per_layer(dec))
        per += shape.expert_numels()
        out += per * c
    out.append(shape.final_norm_params)
    if shape.vision is not None and vision != "tower":  # vision_language.freeze_vision: merger only, or nothing
        out += _vision_linears(shape, vision) + ([2 * shape.vision.dim] if vision == "projector" else [])
    elif shape.extra_params:
        out.append(shape.extra_params)
    return out
