"""One home for a run's settings: :class:`RunSettings` and the only conversion between it and a PipelineSpec.

The estimator, the trace, the planner and its ladder, the OOM step-down, the probe and `fitburst estimate` all
read a run as :class:`RunSettings` made by :func:`settings_from_spec`; whatever changes a run (a plan, a
step-down) writes it back with :func:`spec_with_settings`. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from fitburst.hardware import Device, auto_precision
from fitburst.rules import FamilyFacts, problems

if TYPE_CHECKING:  # the schema reads its choices from here; the conversion only reads a spec's fields
    from fitburst.spec import PipelineSpec

# Label positions whose full-vocabulary fp32 logits exist at once in the eval's loss (fitburst.evaluate): the eval
# never holds batch x seq x vocab logits, and the estimate's eval phase counts one chunk.
EVAL_CHUNK_TOKENS = 1024
# Qwen2-VL: 14-pixel patches, 2 x 2 merged into one language token
QWEN2_VL_PIXELS_PER_TOKEN = 28 * 28

# the choices of pipelines.yaml's fields (fitburst.spec), RunSettings and `fitburst estimate`'s arguments
Method = Literal["full", "lora", "qlora"]
Quant = Literal["none", "int8", "nf4", "fp4"]
Optimizer = Literal["adamw", "adamw8bit", "paged_adamw8bit", "sgd"]
Precision = Literal["bf16", "fp16", "fp32"]
Attention = Literal["eager", "sdpa", "flash"]
Vision = Literal["frozen", "projector", "tower"]
# the training loss: "auto" runs the standard one and lets the planner's fused_loss rung switch it
Loss = Literal["auto", "standard", "fused"]
Distributed = Literal["auto", "none", "fsdp"]
METHODS: tuple[str, ...] = get_args(Method)
QUANTS: tuple[str, ...] = get_args(Quant)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
OPTIMIZERS_8BIT = ("adamw8bit", "paged_adamw8bit")  # bitsandbytes' (paged or not)
# how torch's AdamW steps: auto (the loop's choice for the device, fitburst.memory.cuda_kernels.adamw_impl), or the
# implementation a measured run used (a replay of a run from before the loop fused AdamW on CUDA)
ADAMW_IMPLS = ("auto", "fused", "foreach", "for-loop")
DTYPES: tuple[str, ...] = get_args(Precision)
ATTENTIONS: tuple[str, ...] = get_args(Attention)
VISION: tuple[str, ...] = get_args(Vision)
LOSSES: tuple[str, ...] = get_args(Loss)
DISTRIBUTED: tuple[str, ...] = get_args(Distributed)


def resolve_quant(method: str, quant: str | None) -> str:
    """The base weights' quantization: as given, else nf4 for qlora and none for lora and full (the one rule the
    spec and :class:`RunSettings` share)."""
    return quant if quant not in (None, "none") else ("nf4" if method == "qlora" else "none")

# the field names of settings stored by an earlier fitburst (RunSettings.from_dict reads them)
STORED_BEFORE_RENAME = {"batch": "micro_batch_size", "dtype": "precision", "targets": "target_modules",
                        "grad_checkpointing": "gradient_checkpointing", "offload": "activation_offloading"}


@dataclass
class RunSettings:
    """What decides a training step's memory and speed, as the loop runs it."""

    method: str = "lora"  # full | lora | qlora (LoRA on a quantized base; a quantized "lora" becomes "qlora")
    quant: str = "none"  # none | int8 | nf4 | fp4
    double_quant: bool = True
    # k-bit: fp32 copies of the frozen embeddings and head, as peft's k-bit preparation makes them (the default here:
    # what runs stored before the field existed did); pipelines.yaml's method.frozen_fp32 defaults to false
    frozen_fp32: bool = True
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: list[str] | str = "all-linear"  # peft's all-linear (fitburst.spec.MethodSpec.target_modules)
    micro_batch_size: int = 1  # micro batch
    seq_len: int = 512  # padded length (longest sample of the batch)
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"  # adamw | adamw8bit | paged_adamw8bit | sgd
    adamw: str = "auto"  # how AdamW steps (ADAMW_IMPLS)
    precision: str = "bf16"  # bf16 | fp16 | fp32
    attention: str = "sdpa"  # eager | sdpa | flash
    grad_accum: int = 1
    keep_logits: bool = True  # the loop keeps the model output (logits) alive until the next step
    eval_batch: int = 0  # > 0: fitburst's eval step (after training, a fresh load: no optimizer state) at this batch
    padded: bool | None = None  # batch holds padding (an attention mask reaches the kernel); None: batch > 1
    packed_fill: float = 0.0  # > 0: padding-free, one packed row per micro-batch of this fraction of batch x seq_len
    pure_bf16: bool = False  # full fine-tuning steps bf16 weights directly (no autocast, no fp32 master weights)
    # vision-language models: images per sample and language tokens per image (seq_len already counts them);
    # what of the vision side trains: frozen | projector | tower
    images: int = 0
    image_tokens: int = 0
    vision: str = "frozen"
    loss: str = "auto"  # auto | standard | fused (fitburst.families.loss; auto trains as standard)
    activation_offloading: bool = False  # saved activations offloaded to pinned host memory (CUDA)
    tiled_mlp: bool = False  # each block's gated MLP over sequence shards, recomputed in backward (liger-kernel)
    embeddings_on_host: bool = False  # the frozen input embedding table in host RAM, its lookup's output moved (CUDA)
    liger_kernels: bool = False  # Liger Kernel's RMSNorm, SwiGLU / GEGLU and RoPE patched into the model (CUDA)
    # several GPUs (fitburst.distributed): auto (one device unless the plan needs more) | none | fsdp (FSDP2), and
    # FSDP2's knobs: blocks' gathered weights freed after forward (ZeRO-3), sharded state kept in host RAM
    distributed: str = "auto"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # the ranks the model is sharded over (fitburst.distributed.shard; 1: one device, no sharding). ``batch`` stays per
    # rank: N ranks x micro-batch b train as one device with N x b.
    world_size: int = 1

    def __post_init__(self) -> None:
        checks = {"method": (self.method, METHODS), "quant": (self.quant, QUANTS),
                  "optimizer": (self.optimizer, OPTIMIZERS), "adamw": (self.adamw, ADAMW_IMPLS),
                  "precision": (self.precision, DTYPES),
                  "attention": (self.attention, ATTENTIONS), "vision": (self.vision, VISION),
                  "loss": (self.loss, LOSSES), "distributed": (self.distributed, DISTRIBUTED)}
        for k, (v, ok) in checks.items():
            if v not in ok:
                raise ValueError(f"{k} must be one of {', '.join(ok)} (got {v!r})")
        self.quant = resolve_quant(self.method, self.quant)
        if self.method == "lora" and self.quant != "none":
            self.method = "qlora"
        if min(self.micro_batch_size, self.seq_len, self.grad_accum, self.rank, self.world_size) < 1:
            raise ValueError("batch, seq_len, grad_accum, rank and world_size must be >= 1")

    @property
    def kbit(self) -> bool:
        return self.quant != "none"

    @property
    def optimizer_8bit(self) -> bool:
        """bitsandbytes' 8-bit AdamW (paged or not)."""
        return self.optimizer in OPTIMIZERS_8BIT

    @property
    def uses_bitsandbytes(self) -> bool:
        """Quantized weights or bitsandbytes' 8-bit optimizer."""
        return self.kbit or self.optimizer_8bit

    @property
    def sharded(self) -> bool:
        """Trained with FSDP over several processes (or asked to be)."""
        return self.world_size > 1 or self.distributed == "fsdp"

    @property
    def amp(self) -> bool:
        """The loop runs under autocast (fitburst.device.make_amp): 16-bit precision, not pure bf16."""
        return self.precision != "fp32" and not self.pure_bf16

    @property
    def master_weights(self) -> bool:
        """Full fine-tuning under autocast keeps fp32 master weights (fitburst.device.weight_dtype)."""
        return self.method == "full" and self.amp

    @property
    def fused_loss(self) -> bool:
        """The loss runs as a fused linear cross-entropy (no full logits)."""
        return self.loss == "fused"

    @property
    def frozen_16bit(self) -> bool:
        """k-bit preparation leaves the frozen embeddings and head in the 16-bit compute dtype
        (:func:`fitburst.models.prepare_kbit`): k-bit weights, 16-bit precision, one device (FSDP's mixed precision
        gathers every weight in 16 bits anyway)."""
        return self.kbit and not self.frozen_fp32 and self.precision != "fp32" and not self.sharded

    @property
    def host_embeddings_modelled(self) -> bool:
        """The input embeddings in host RAM as both estimates model them: a 16-bit table. Beside peft's fp32 copies
        (k-bit with ``frozen_fp32``) the loop moves the table too, but the trace of that cast is not modelled: both
        estimates leave it on the GPU (an over-estimate: the planner, which walks every combination, takes the
        rung with ``frozen_16bit``, before it in the ladder)."""
        return self.embeddings_on_host and self.method != "full" and (not self.kbit or self.frozen_16bit)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunSettings:
        """Settings stored as a dict (``asdict``: a run folder's ``stepdown.json``, a cloud node's rank file, an
        estimate's JSON), including one written before the fields took pipelines.yaml's names."""
        return cls(**{STORED_BEFORE_RENAME.get(k, k): v for k, v in d.items()})

    def describe(self) -> str:
        m = self.method + (f" r{self.rank}" if self.method != "full" else "")
        dq = "+dq" if self.double_quant and self.quant in ("nf4", "fp4") else ""
        q = f" {self.quant}{dq}" if self.kbit else ""
        ck = (" ckpt" if self.gradient_checkpointing else "") + (" packed" if self.packed_fill else "")
        ck += f" img{self.images}x{self.image_tokens}" if self.images else ""
        ck += " frozen16" if self.frozen_16bit else ""
        ck += " tiled-mlp" if self.tiled_mlp else ""
        ck += " embed-host" if self.embeddings_on_host else ""
        ck += " liger" if self.liger_kernels else ""
        ck += (" fused-ce" if self.fused_loss else "") + (" offload" if self.activation_offloading else "")
        shape = f"b{self.micro_batch_size}x{self.grad_accum} s{self.seq_len}"
        fsdp = ""
        if self.sharded:
            fsdp = " fsdp" + (f"{self.world_size}" if self.world_size > 1 else "") + (
                "" if self.reshard_after_forward else " keep-gathered") + (" cpu-offload" if self.cpu_offload else "")
        return f"{m}{q} {self.precision} {shape}{ck} {self.optimizer} {self.attention}{fsdp}"


def settings_from_spec(spec: PipelineSpec, device: Device | None = None, seq_len: int | None = None, *,
                       images: int = 0, family: FamilyFacts | None = None) -> RunSettings:
    """The settings ``spec`` trains with, resolved once, as fitburst's loop runs it: ``precision: auto`` resolved
    for ``device`` (bf16 when no device is given: a cloud GPU resolves its own), ``seq_len`` the longest sample
    (default ``data.max_seq_len``), the model output dropped after the loss, the eval after training. ``images``:
    the most images one record holds (:func:`fitburst.data.images_per_record`), for a vision-language pipeline.
    ``family``: the model's (:func:`fitburst.models.model_family`); where the rule table refuses it the fused loss,
    ``loss: auto`` resolves to the standard loss (the planner then never offers the fused_loss rung)."""
    m, t = spec.method, spec.training
    dtype: str = t.precision
    if dtype == "auto":
        dtype = auto_precision(device.kind, device.supports_bf16) if device is not None else "bf16"
    px = spec.data.image_max_pixels
    s = RunSettings(
        method=m.type, quant=m.quant or "none", double_quant=m.double_quant, frozen_fp32=m.frozen_fp32,
        rank=m.rank, alpha=m.alpha,
        dropout=m.dropout, target_modules=m.target_modules, micro_batch_size=t.micro_batch_size,
        grad_accum=t.grad_accum,
        seq_len=seq_len or spec.data.max_seq_len, gradient_checkpointing=t.gradient_checkpointing,
        optimizer=t.optimizer, precision=dtype, attention="sdpa" if t.attention == "auto" else t.attention,
        keep_logits=False, eval_batch=spec.eval.batch_size if spec.eval.enabled else 0,
        packed_fill=1.0 if t.packing else 0.0,  # the bound: every sample as long as the longest
        pure_bf16=t.pure_bf16, loss=t.loss, activation_offloading=t.activation_offloading, tiled_mlp=t.tiled_mlp,
        embeddings_on_host=t.embeddings_on_host, liger_kernels=t.liger_kernels,
        # the vision-language terms only for a pipeline with images (data.image_max_pixels)
        images=0 if px is None else images, image_tokens=0 if px is None else px // QWEN2_VL_PIXELS_PER_TOKEN,
        vision="frozen" if px is None else m.vision,
        distributed=t.distributed, reshard_after_forward=t.fsdp.reshard_after_forward, cpu_offload=t.fsdp.cpu_offload)
    if s.loss == "auto" and family is not None and any(
            p.rule == "family_fused_loss" for p in problems(replace(s, loss="fused"), None, family)):
        s = replace(s, loss="standard")
    return s


def spec_with_settings(spec: PipelineSpec, s: RunSettings) -> PipelineSpec:
    """``spec`` with ``s`` written into it: what the train, eval and traced steps then run. ``attention: auto``
    stays auto for SDPA (the loader picks the device's SDPA variant); a lowered image resolution becomes
    ``data.image_max_pixels``."""
    method = spec.method.model_copy(update={
        "type": s.method, "quant": s.quant, "double_quant": s.double_quant, "frozen_fp32": s.frozen_fp32,
        "rank": s.rank, "alpha": s.alpha,
        "dropout": s.dropout, "target_modules": s.target_modules})
    attention = "auto" if spec.training.attention == "auto" and s.attention == "sdpa" else s.attention
    training = spec.training.model_copy(update={
        "micro_batch_size": s.micro_batch_size, "grad_accum": s.grad_accum,
        "gradient_checkpointing": s.gradient_checkpointing,
        "optimizer": s.optimizer, "precision": s.precision, "attention": attention, "packing": s.packed_fill > 0,
        "pure_bf16": s.pure_bf16, "loss": s.loss, "activation_offloading": s.activation_offloading,
        "tiled_mlp": s.tiled_mlp, "embeddings_on_host": s.embeddings_on_host, "liger_kernels": s.liger_kernels,
        "distributed": "fsdp" if s.world_size > 1 else s.distributed,
        "fsdp": spec.training.fsdp.model_copy(update={"reshard_after_forward": s.reshard_after_forward,
                                                       "cpu_offload": s.cpu_offload})})
    update = {"method": method, "training": training}
    px = spec.data.image_max_pixels
    if s.images and px is not None and s.image_tokens < px // QWEN2_VL_PIXELS_PER_TOKEN:  # the resolution rung
        update["data"] = spec.data.model_copy(update={"image_max_pixels": s.image_tokens * QWEN2_VL_PIXELS_PER_TOKEN})
    if s.eval_batch:
        update["eval"] = spec.eval.model_copy(update={"batch_size": s.eval_batch})
    return spec.model_copy(update=update)
