"""The step-down ladder: the changes people make by hand to fit a run, each with where it applies and its cost.

The planner (:mod:`fitburst.memory.planner`) searches combinations of rungs before a run starts; the OOM step-down
(:mod:`fitburst.supervisor`) takes the next rung after a real out-of-memory error: the cheapest one that applies, among
those a resumed run can take (``midrun``). Both ask the same rungs the same questions, so for the same settings
they choose the same next rung. A smaller micro-batch keeps the effective batch exactly (:func:`smaller_batch`).
A rung applies where its own condition holds (what it changes is not on already, and changes what runs) and the
settings it makes break no row of the rule table (:func:`fitburst.rules.new_problems`: what runs where, whether its
library is installed where the run trains, what FSDP refuses, and what the model's architecture refuses when the
model is known).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from fitburst.hardware import Device, fused_loss_kernel
from fitburst.rules import ModelFacts, flash_refusal, new_problems
from fitburst.settings import RunSettings

from .shapes import ModelShape

Check = Callable[[RunSettings, Device], bool]
Step = Callable[[RunSettings, Device], RunSettings]
Explain = Callable[[RunSettings, Device], str]


@dataclass(frozen=True)
class Rung:
    """One change: ``key`` is its ``preflight.allow`` switch; ``cost`` its relative step time (1.0 unchanged; the
    planner minimises the product); ``midrun``: whether a run resuming its checkpoint may take it (it trains the
    same model on the same data: no change of dropout, precision, packing or images)."""

    key: str
    cost: float
    midrun: bool
    applies: Check
    take: Step
    explain: Explain  # what the change does, said of the settings it is taken from
    # a row of the rule table reads the model's architecture to allow the change: asked without a model (``shape``
    # None, where the table checks nothing of it), such a rung is not taken
    needs_model: bool = False

    def allowed(self, s: RunSettings, device: Device, allow: Mapping[str, bool] | None = None,
                shape: ModelShape | None = None) -> bool:
        return bool((allow or {}).get(self.key, True) and (shape is not None or not self.needs_model)
                    and self.applies(s, device)
                    and not new_problems(s, self.take(s, device), device, model=ModelFacts.of(shape)))


def smaller_batch(s: RunSettings) -> RunSettings:
    """The next micro-batch down (its largest proper divisor: half when even) with gradient accumulation raised
    so that the effective batch stays exactly the same."""
    smaller = max(d for d in range(1, s.micro_batch_size) if s.micro_batch_size % d == 0)
    return replace(s, micro_batch_size=smaller, grad_accum=s.grad_accum * (s.micro_batch_size // smaller))


def _fast_attention(s: RunSettings, device: Device) -> str:
    """FlashAttention-2 where it runs (:func:`fitburst.rules.flash_refusal`: 16-bit compute on an Ampere or newer
    card with flash-attn where the run trains), SDPA everywhere else."""
    return "flash" if flash_refusal(s, device) is None else "sdpa"


def _lower_resolution(s: RunSettings, device: Device) -> RunSettings:
    """A quarter of the pixels per image: a quarter of the image tokens, and the sequence shorter by the rest."""
    cut = s.images * (s.image_tokens - s.image_tokens // 4)
    return replace(s, image_tokens=s.image_tokens // 4, seq_len=max(1, s.seq_len - cut))


def _batch_text(s: RunSettings, device: Device) -> str:
    t = smaller_batch(s)
    return (f"micro batch {s.micro_batch_size} -> {t.micro_batch_size}, grad_accum {s.grad_accum} -> {t.grad_accum} "
            f"(same effective batch {s.effective_batch})")


# Costs: step time relative to the run as configured. Attention and packing from the kernels' published speed-ups
# (and benchmarks/packing.py: on the CPU, SDPA with a block mask over one packed row was slower than padded
# batches, so packing is offered with flash-attn varlen only); checkpointing is one extra forward (~4/3);
# 4-bit weights dequantize per matmul; a halved micro-batch runs smaller matmuls and more Python per token.
# Lowering the image resolution or leaving fp32 changes what the model sees or computes: taken after every
# change that costs only time. The fused loss (training.loss: auto only): the same loss and gradients without the
# logits; Cut Cross-Entropy's README reports it "without sacrificing training speed" and Liger Kernel's README its
# fused linear cross-entropy at equal or higher throughput, on this project's 2-core CPU box CCE's torch_compile
# path measured within a few % of the standard loss (benchmarks/lean_memory.py): ~1.01. Activation offloading
# (CUDA): saved tensors cross PCIe twice per step; TRL overlaps the copies on a side stream, but without prefetch
# PyTorch's offloading "causes a major performance degradation" (AWS SageMaker model-parallel docs), and nothing
# here measured it on a GPU: ranked right after checkpointing (1.35), before the rungs that change the weights.
# Frozen embeddings and head in 16 bits (k-bit): the same matmuls in the same dtype (under autocast the head ran in
# 16 bits already, from a copy autocast made of the fp32 weight each forward; the embeddings' output is cast to fp32
# as the fp32 lookup made it), so 1.0; tests/test_frozen_16bit.py measures the demo QLoRA step on this CPU.

# The input embeddings in host RAM (CUDA, untied, frozen): each micro-batch's ids go to the host, the table is read
# there (b x s rows) and the rows come back over PCIe, b x s x hidden x 2 bytes (16 MiB for Llama-3.1-8B at 2,048
# tokens: ~1-3 ms at 5-12 GB/s), once per forward (checkpointing recomputes inside the blocks, never the lookup;
# the frozen table has no backward). Against a step of ~6 x 8e9 x 2,048 = 1e14 FLOPs (seconds on any card) that
# is ~0.1 %, plus the wait for the ids' copy to the host: 1.002, not measured on a GPU here.
EMBEDDINGS_ON_HOST_COST = 1.002

# Double quantization of 4-bit weights (method.double_quant): each block of 64 weights keeps an 8-bit absmax (with an
# fp32 one per 256 of them) instead of an fp32 one, 0.31 GiB less for Llama-3.1-8B (four_bit_bytes). bitsandbytes
# dequantizes the absmax first in each 4-bit matmul's dequantization, one small kernel over 1/64 of the weight's
# values; the QLoRA paper (Dettmers et al. 2023) turns it on by default for its memory at no reported loss of speed
# or quality. Not measured here: 1.01, after the rungs that change nothing the model computes. Not midrun: the base
# weights a resumed run dequantizes would differ by the absmax's rounding.
DOUBLE_QUANT_COST = 1.01

# The tiled MLP recomputes each MLP's forward in backward, shard by shard: measured on this project's 2-core CPU box
# (tiny Llama h128 i1024, s2048 in 16 shards, LoRA all-linear, fp32, median of 10 steps beside other work): x1.30
# without checkpointing, x1.41 with it; no GPU measurement here. Right before checkpointing (1.33).
TILED_MLP_COST = 1.3

# Liger Kernel's model kernels (CUDA: Triton RMSNorm, SwiGLU / GEGLU, RoPE; training.liger_kernels): the same
# computation in fused kernels. Liger's README reports "+20% throughput" for LLaMA 3-8B on 8 A100s (FSDP, bf16,
# checkpointing), but with its fused linear cross-entropy in the set (here the fused_loss rung); its docs give
# RMSNorm "~7x speed" as a kernel. Norms, activations and RoPE are a small part of a step's time, and nothing here
# measured them on a GPU: 1.0 (no speed claimed), after the rungs that change nothing the model computes.
LIGER_KERNELS_COST = 1.0

LADDER: tuple[Rung, ...] = (
    Rung("attention", 0.9, True,
         lambda s, d: s.attention == "eager",
         lambda s, d: replace(s, attention=_fast_attention(s, d)),
         lambda s, d: f"attention eager -> {_fast_attention(s, d)}: no seq x seq probability matrix kept"),
    Rung("packing", 0.9, False,
         lambda s, d: not s.packed_fill and s.micro_batch_size > 1 and s.attention == "flash",
         lambda s, d: replace(s, packed_fill=1.0),
         lambda s, d: "packed batches: one padding-free row per micro-batch (flash-attn varlen): no padding run"),
    Rung("dropout", 0.98, False,
         lambda s, d: s.method != "full" and s.dropout > 0,
         lambda s, d: replace(s, dropout=0.0),
         lambda s, d: f"lora dropout {s.dropout:g} -> 0: no dropout mask and output kept for each adapted input"),
    # applies where the change changes what runs (RunSettings.frozen_16bit: k-bit, 16-bit precision, one device): a
    # precondition, not a row of the rule table. Under FSDP method.frozen_fp32: false is valid (pipelines.yaml's
    # default) and changes nothing: the loader keeps peft's preparation there, as FSDP's mixed precision gathers every
    # weight in 16 bits anyway, so the rung has nothing to take.
    Rung("frozen_16bit", 1.0, True,
         lambda s, d: s.frozen_fp32 and replace(s, frozen_fp32=False).frozen_16bit,
         lambda s, d: replace(s, frozen_fp32=False),
         lambda s, d: "frozen embeddings and output head kept in 16 bits, not in peft's fp32 copies (the same "
                      "values: they were loaded in 16 bits)"),
    Rung("liger_kernels", LIGER_KERNELS_COST, True,
         lambda s, d: d.kind == "cuda" and not s.liger_kernels,
         lambda s, d: replace(s, liger_kernels=True),
         lambda s, d: "Liger Kernel's RMSNorm, SwiGLU and RoPE (Triton): no fp32 copy of a 16-bit norm input and no "
                      "MLP activation output kept for backward, the MLP's gradients written in place",
         needs_model=True),
    Rung("embeddings_on_host", EMBEDDINGS_ON_HOST_COST, True,
         lambda s, d: d.kind == "cuda" and not s.embeddings_on_host,
         lambda s, d: replace(s, embeddings_on_host=True),
         lambda s, d: "input embeddings kept in host RAM: only their lookup runs there, the looked-up rows go to "
                      "the GPU (the frozen table is not needed on the GPU)",
         needs_model=True),
    Rung("fused_loss", 1.01, True,
         lambda s, d: s.loss == "auto",
         lambda s, d: replace(s, loss="fused"),
         lambda s, d: f"fused linear cross-entropy ({fused_loss_kernel(d, s.precision)[0]}): no batch x seq x vocab "
                      "logits, the same loss and gradients"),
    Rung("double_quant", DOUBLE_QUANT_COST, False,
         lambda s, d: s.quant in ("nf4", "fp4") and not s.double_quant,
         lambda s, d: replace(s, double_quant=True),
         lambda s, d: f"{s.quant} double quantization: each block's absmax in 8 bits, not fp32 (~0.127 fewer "
                      "bits per weight)"),
    Rung("optimizer_8bit", 1.02, True,
         lambda s, d: s.optimizer == "adamw",
         lambda s, d: replace(s, optimizer="adamw8bit"),
         lambda s, d: "optimizer adamw -> adamw8bit: 2 bytes of state per parameter instead of 8"),
    Rung("reduce_batch", 1.12, True,
         lambda s, d: s.micro_batch_size > 1,
         lambda s, d: smaller_batch(s),
         _batch_text),
    Rung("tiled_mlp", TILED_MLP_COST, True,
         lambda s, d: not s.tiled_mlp,
         lambda s, d: replace(s, tiled_mlp=True),
         lambda s, d: "tiled MLP on: each block's gated MLP over sequence shards, recomputed in backward "
                      "(liger-kernel's apply_tiled_mlp): no whole layer's MLP intermediates at full length",
         needs_model=True),
    Rung("gradient_checkpointing", 1.33, True,
         lambda s, d: not s.gradient_checkpointing,
         lambda s, d: replace(s, gradient_checkpointing=True),
         lambda s, d: "gradient checkpointing on: keep one tensor per layer, recompute the rest in backward "
                      "(~30 % slower)"),
    Rung("activation_offloading", 1.35, True,
         lambda s, d: not s.activation_offloading,
         lambda s, d: replace(s, activation_offloading=True),
         lambda s, d: "activation offloading on: the tensors saved for backward wait in pinned host memory "
                      "(copied on a side stream)"),
    Rung("quantize", 1.4, True,
         lambda s, d: s.method == "lora" and s.quant == "none",
         lambda s, d: replace(s, method="qlora", quant="nf4", double_quant=True),
         lambda s, d: "QLoRA: base weights in 4-bit nf4 with double quant (~0.53 bytes per weight)"),
    Rung("precision", 1.5, False,
         lambda s, d: s.precision == "fp32",
         lambda s, d: replace(s, precision="bf16"),
         lambda s, d: "precision fp32 -> bf16 mixed: base weights and activations in 2 bytes (adapters and what "
                      "trains stay fp32)"),
    Rung("resolution", 1.5, False,
         lambda s, d: s.images > 0 and s.image_tokens >= 4,
         _lower_resolution,
         lambda s, d: f"image resolution halved per side: {s.image_tokens} -> {s.image_tokens // 4} language "
                      f"tokens per image (data.image_max_pixels / 4), "
                      f"{s.images * (s.image_tokens - s.image_tokens // 4)} fewer per sample"),
)
RUNGS = {r.key: r for r in LADDER}
# each further step of a smaller eval batch: the eval is a small part of the run's time
EVAL_HALVING_COST = 1.001


# the rungs that move memory from the GPU to host RAM: the pinned copies of saved tensors and the embedding table
HOST_RUNGS = frozenset({"activation_offloading", "embeddings_on_host"})


def next_rung(s: RunSettings, device: Device, allow: Mapping[str, bool] | None = None,
              *, midrun: bool = False, shape: ModelShape | None = None) -> Rung | None:
    """The cheapest rung that applies to ``s`` on ``device`` (only ``midrun`` ones for a resumed run); a rung that
    depends on the model only with its ``shape``. The host RAM is not asked (:func:`next_rung_on_host` asks it)."""
    return next_rung_on_host(s, device, allow, midrun=midrun, shape=shape)[0]


def next_rung_on_host(s: RunSettings, device: Device, allow: Mapping[str, bool] | None = None, *,
                      midrun: bool = False, shape: ModelShape | None = None,
                      host_problem: Callable[[RunSettings], str | None] | None = None) -> tuple[Rung | None, list[str]]:
    """:func:`next_rung`, moving past a rung of :data:`HOST_RUNGS` whose settings ``host_problem`` says the host
    cannot hold (the planner's judge does the same to a plan); with the reasons, one per rung skipped."""
    skipped: list[str] = []
    for r in LADDER:
        if not ((r.midrun or not midrun) and r.allowed(s, device, allow, shape)):
            continue
        why = host_problem(r.take(s, device)) if host_problem is not None and r.key in HOST_RUNGS else None
        if why is None:
            return r, skipped
        skipped.append(f"{r.key} skipped: {why}")
    return None, skipped
