"""The one rule table: which settings can run together, and where. :func:`problems` reads it.

Each row is one rule, written once, over :class:`fitburst.settings.RunSettings` (and the device, the model
family's refusals and the model's architecture, where the rule needs them): ``validate`` and spec loading locate its
problems in pipelines.yaml (:mod:`fitburst.spec`), the planner and the ladder take no rung and no GPU count that would
break a row (:func:`new_problems`), the loop refuses before the model loads (:func:`fitburst.builders.refuse_problems`;
the probed device's bf16 and bitsandbytes in :mod:`fitburst.device`), and the cloud ranking plans each GPU by it. A
rule whose fact is not known (no device named, no family or model looked up) is not checked.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from fitburst.hardware import (
    Device,
    fused_loss_kernel,
    fused_loss_missing,
    library_missing,
    named_device,
    resolve_device,
    split_count,
)

if TYPE_CHECKING:
    from fitburst.memory.shapes import ModelShape
    from fitburst.settings import RunSettings


class FamilyFacts(Protocol):
    """What a model family (:class:`fitburst.families.Family`) refuses, in its own words (None: nothing)."""

    @property
    def packing_refusal(self) -> str | None: ...

    @property
    def fused_loss_refusal(self) -> str | None: ...


@dataclass(frozen=True)
class ModelFacts:
    """What rows read of the model's architecture, from its config.json (:meth:`of` its shape)."""

    model_type: str
    decoder: bool  # its blocks are a decoder's (not an encoder-decoder's)
    experts: bool  # it routes tokens to experts (a mixture of experts)
    gated_mlp: bool  # each block's feed-forward is gated (gate, up, down: SwiGLU / GEGLU), not fc1, fc2
    head_bias: bool  # its output head adds a bias (phi-1.5)
    tied: bool = False  # its input embeddings are its output head's weight too
    vision: bool = False  # a vision tower beside its text blocks (a vision-language model)

    @classmethod
    def of(cls, shape: ModelShape | None) -> ModelFacts | None:
        """The facts of ``shape`` (None: the model was not looked up, or the estimate does not model it)."""
        if shape is None:
            return None
        decoder = shape.arch.block == "decoder"
        # a decoder's extra_params are its vision tower's weights (whether or not the tower's shape is modelled)
        return cls(shape.model_type, decoder, bool(shape.experts), shape.mlp == "gated", shape.lm_head_bias,
                   shape.tied, vision=shape.vision is not None or (decoder and shape.extra_params > 0))


def tiled_mlp_refusal(m: ModelFacts) -> str | None:
    """Why the tiled MLP (liger-kernel's ``apply_tiled_mlp`` over each block's feed-forward) does not apply to the
    model, or None when it does: a dense decoder whose feed-forward is gated."""
    if not m.decoder:
        return f"{m.model_type}'s blocks are an encoder-decoder's, not a decoder's"
    if m.experts:
        return f"{m.model_type} routes tokens to experts (a mixture of experts), not through one gated MLP"
    if not m.gated_mlp:
        return f"{m.model_type}'s feed-forward is a plain MLP (fc1, fc2), not a gated one (gate, up, down)"
    return None


@functools.cache
def _liger_model_types() -> tuple[frozenset[str], str | None]:
    """The model types Liger Kernel has an ``apply_liger_kernel_to_<model_type>`` for (the keys of its own
    ``MODEL_TYPE_TO_APPLY_LIGER_FN``, read from its installed source: importing it takes seconds, transformers and
    Triton with it; tests/test_liger_kernels.py checks the two agree), and why it cannot run here (None: it can)."""
    spec = importlib.util.find_spec("liger_kernel")
    if spec is None or not spec.submodule_search_locations:
        return frozenset(), "liger-kernel is not installed"
    if importlib.util.find_spec("triton") is None:
        return frozenset(), "Triton, which its kernels are written in, is not installed"
    source = Path(next(iter(spec.submodule_search_locations))) / "transformers" / "monkey_patch.py"
    for node in ast.parse(source.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "MODEL_TYPE_TO_APPLY_LIGER_FN" for t in node.targets)):
            return frozenset(str(k.value) for k in node.value.keys if isinstance(k, ast.Constant)), None
    return frozenset(), f"this liger-kernel has no MODEL_TYPE_TO_APPLY_LIGER_FN in {source}"


# The model types Liger Kernel 0.8.5 patches (the keys of its MODEL_TYPE_TO_APPLY_LIGER_FN): what a plan for another
# machine reads where liger-kernel is not installed here (a Mac: the lean extra is Linux-only), as that machine
# installs it (fitburst.hardware.NODE_PACKAGES). tests/test_liger_kernels.py checks them against the installed
# Liger's own mapping.
LIGER_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2",
                               "gemma3", "gemma3_text", "gemma4", "gemma4_text", "glm4", "glm4v", "glm4v_moe",
                               "gpt_oss", "granite", "hunyuan_v1_dense", "hunyuan_v1_moe", "internvl", "llama",
                               "llama4", "llama4_text", "llava", "ministral", "mistral", "mixtral", "mllama",
                               "mllama_text_model", "muse_glimmer", "nemotron", "olmo2", "olmo3", "paligemma", "phi3",
                               "pixtral", "qwen2", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text",
                               "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe",
                               "qwen3_next", "qwen3_vl", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_vl_text",
                               "smollm3", "smolvlm"})


def liger_missing_here() -> str | None:
    """Why Liger Kernel's model kernels cannot be applied on this machine, or None when they can."""
    return _liger_model_types()[1]


def liger_missing(device: Device | None) -> str | None:
    """Why Liger Kernel's model kernels cannot be applied where a run on ``device`` trains, or None when they can:
    :func:`fitburst.hardware.library_missing` (this install for a run that trains here, a burst node's packages for a
    planned CUDA target), this install read by :func:`liger_missing_here`."""
    return library_missing("liger_kernel", device, liger_missing_here)


def _liger_types(device: Device | None) -> tuple[frozenset[str], str]:
    """The model types Liger patches where a run on ``device`` trains, and where that list comes from."""
    types, missing = _liger_model_types()
    if missing is None or (device is not None and device.local):
        return types, "its MODEL_TYPE_TO_APPLY_LIGER_FN"
    return LIGER_MODEL_TYPES, f"{missing} here; the types Liger Kernel 0.8.5 patches, which a burst node installs"


def liger_refusal(m: ModelFacts, device: Device | None = None) -> str | None:
    """Why training.liger_kernels does not apply to the model where a run on ``device`` trains, or None when it does:
    Liger Kernel patches its model type (its MODEL_TYPE_TO_APPLY_LIGER_FN: this install's, or for a planned target
    where none is installed here :data:`LIGER_MODEL_TYPES`), and it is a dense text decoder, the architecture both
    estimates model Liger's Functions in (:mod:`fitburst.memory.model_kernels` stands in for its RMSNorm, SwiGLU /
    GEGLU and RoPE only: a vision tower's LayerNorm, M-RoPE or the experts' kernels have no stand-in)."""
    types, source = _liger_types(device)
    if m.model_type not in types:
        return f"Liger Kernel has no apply_liger_kernel_to_{m.model_type} ({source})"
    if m.vision or m.experts or not m.decoder:
        kind = "a vision tower" if m.vision else "experts" if m.experts else "an encoder-decoder's blocks"
        return (f"{m.model_type} has {kind}: fitburst models Liger's kernels in a dense text decoder only "
                "(RMSNorm, SwiGLU / GEGLU, RoPE)")
    return None


@dataclass(frozen=True)
class Problem:
    """One broken rule: ``field`` its pipelines.yaml path, ``wrong`` what cannot run, ``fix`` what to write."""

    rule: str
    field: tuple[str, ...]
    wrong: str
    fix: str = ""

    @property
    def path(self) -> str:
        return ".".join(self.field)

    def __str__(self) -> str:
        return f"{self.wrong}: {self.fix}" if self.fix else self.wrong


When = Callable[["RunSettings", Device | None, FamilyFacts | None, "ModelFacts | None"], bool]
Says = Callable[["RunSettings", Device | None, FamilyFacts | None, "ModelFacts | None"], tuple[str, str]]


@dataclass(frozen=True)
class Rule:
    """A row: ``broken`` says whether the settings break it (False where a fact it needs is unknown), ``says`` what
    is wrong and the fix."""

    key: str
    field: tuple[str, ...]
    broken: When
    says: Says


def _bnb_where(d: Device | None) -> tuple[str, str]:
    """How a device without bitsandbytes is named in a message: the backend it lacks, and where to train instead."""
    assert d is not None
    return ("has no MPS backend", "on MPS") if d.kind == "mps" else (f"does not run on {d.name}", f"on {d.name}")


def _fused_loss_kernel_name(d: Device | None, s: RunSettings) -> str:
    """The fused loss's kernel on ``d`` for the settings' precision (fitburst.hardware.fused_loss_kernel)."""
    return fused_loss_kernel(d, s.precision)[0] if d is not None else ""


def flash_refusal(s: RunSettings, d: Device | None) -> str | None:
    """Why FlashAttention-2 cannot run ``s`` where a run on ``d`` trains, or None (also where ``d`` is not known):
    it needs a CUDA GPU of Ampere or newer (bf16 marks them) computing in 16 bits, with flash-attn installed there
    (:func:`fitburst.hardware.library_missing`: a burst node does not install it)."""
    if d is None:
        return None
    if d.kind != "cuda":
        return f"it runs on CUDA GPUs only, not on {d.name}"
    if not d.supports_bf16:
        return f"it needs an Ampere or newer GPU, and {d.name} is older"
    if s.precision == "fp32":
        return "it computes in 16 bits, and training.precision is fp32"
    return library_missing("flash_attn", d)


RULES: tuple[Rule, ...] = (
    Rule("full_quantized", ("method", "quant"),
         lambda s, d, f, m: s.method == "full" and s.kbit,
         lambda s, d, f, m: ("full fine-tuning cannot train quantized weights", "set quant: none or use qlora")),
    Rule("bf16_unsupported", ("training", "precision"),
         lambda s, d, f, m: d is not None and not d.supports_bf16 and s.precision == "bf16",
         lambda s, d, f, m: (f"{d.name if d else ''} has no bf16 support",
                             "set training.precision: fp16 (or auto, which picks fp16 there)")),
    Rule("kbit_needs_bnb", ("method", "quant"),
         lambda s, d, f, m: d is not None and not d.supports_bnb and s.kbit,
         lambda s, d, f, m: (f"{s.quant} weights need bitsandbytes, which {_bnb_where(d)[0]}",
                             f"use method.type: lora with quant: none {_bnb_where(d)[1]}, or a CUDA device")),
    Rule("optimizer_8bit_needs_bnb", ("training", "optimizer"),
         lambda s, d, f, m: d is not None and not d.supports_bnb and s.optimizer_8bit,
         lambda s, d, f, m: (f"{s.optimizer} is bitsandbytes' optimizer, which {_bnb_where(d)[0]}",
                             f"use optimizer: adamw {_bnb_where(d)[1]}, or a CUDA device")),
    Rule("fsdp_on_mps", ("training", "distributed"),
         lambda s, d, f, m: s.sharded and d is not None and d.kind == "mps",
         lambda s, d, f, m: ("an Apple GPU is one device and torch has no MPS process group",
                             "set training.distributed: none (or auto) on MPS, or a CUDA device")),
    Rule("processes_without_fsdp", ("training", "distributed"),
         lambda s, d, f, m: s.world_size > 1 and s.distributed == "none",
         lambda s, d, f, m: (f"training.distributed is none but torchrun started {s.world_size} processes",
                             "start one process, or set training.distributed: fsdp (or auto)")),
    Rule("fsdp_int8", ("method", "quant"),
         lambda s, d, f, m: s.sharded and s.quant == "int8",
         lambda s, d, f, m: ("int8 weights cannot be sharded by FSDP (bitsandbytes Int8Params)",
                             "use quant: nf4 (its 4-bit weights shard in the compute dtype), or training.distributed: "
                             "none")),
    Rule("fsdp_optimizer_8bit", ("training", "optimizer"),
         lambda s, d, f, m: s.sharded and s.optimizer_8bit,
         lambda s, d, f, m: ("bitsandbytes' 8-bit optimizers do not run on FSDP's sharded parameters",
                             "use optimizer: adamw (FSDP shards its state over the GPUs already), or "
                             "training.distributed: none")),
    Rule("fsdp_fused_loss", ("training", "loss"),
         lambda s, d, f, m: s.sharded and s.loss == "fused",
         lambda s, d, f, m: ("the fused loss reads the output head's weight outside the model's forward, where FSDP "
                             "holds only a shard of it", "set training.loss: standard (or auto), or "
                             "training.distributed: none")),
    Rule("cpu_offload_without_fsdp", ("training", "fsdp", "cpu_offload"),
         lambda s, d, f, m: s.cpu_offload and s.distributed == "none",
         lambda s, d, f, m: ("CPU offload is FSDP's",
                             "set training.distributed: fsdp (or auto), or cpu_offload: false")),
    Rule("activation_offloading_off_cuda", ("training", "activation_offloading"),
         lambda s, d, f, m: s.activation_offloading and d is not None and d.kind != "cuda",
         lambda s, d, f, m: ("training.activation_offloading moves saved activations from a CUDA GPU to pinned host "
                             f"memory, and this run is on {d.name if d else ''}", "set it false")),
    Rule("activation_offloading_missing", ("training", "activation_offloading"),
         lambda s, d, f, m: (s.activation_offloading and d is not None and d.kind == "cuda"
                             and library_missing("trl", d) is not None),
         lambda s, d, f, m: (f"activation offloading runs TRL's offloading context, and {library_missing('trl', d)}",
                             "pip install 'fitburst[lean]', or set training.activation_offloading: false")),
    Rule("embeddings_on_host_mps", ("training", "embeddings_on_host"),
         lambda s, d, f, m: s.embeddings_on_host and d is not None and d.kind == "mps",
         lambda s, d, f, m: ("training.embeddings_on_host keeps the input embeddings in host RAM, and on Apple "
                             "silicon that is the GPU's memory: nothing is saved", "set it false")),
    Rule("embeddings_on_host_trained", ("training", "embeddings_on_host"),
         lambda s, d, f, m: s.embeddings_on_host and s.method == "full",
         lambda s, d, f, m: ("training.embeddings_on_host keeps a frozen table in host RAM, and a full fine-tune "
                             "trains the embeddings", "set it false, or use method.type: lora or qlora")),
    Rule("fsdp_embeddings_on_host", ("training", "embeddings_on_host"),
         lambda s, d, f, m: s.embeddings_on_host and s.sharded,
         lambda s, d, f, m: ("FSDP shards the input embeddings over the GPUs with the rest of the model",
                             "set training.embeddings_on_host: false, or training.distributed: none")),
    Rule("embeddings_on_host_tied", ("training", "embeddings_on_host"),
         lambda s, d, f, m: s.embeddings_on_host and m is not None and m.tied,
         lambda s, d, f, m: (f"{m.model_type if m else ''}'s input embeddings are tied to its output head, which "
                             "runs on the GPU", "set training.embeddings_on_host: false")),
    Rule("embeddings_on_host_model", ("training", "embeddings_on_host"),
         lambda s, d, f, m: s.embeddings_on_host and m is not None and not m.decoder,
         lambda s, d, f, m: (f"{m.model_type if m else ''}'s encoder and decoder each look the input embeddings up "
                             "through their own module, which would read the moved table on the GPU",
                             "set training.embeddings_on_host: false")),
    Rule("liger_kernels_off_cuda", ("training", "liger_kernels"),
         lambda s, d, f, m: s.liger_kernels and d is not None and d.kind != "cuda",
         lambda s, d, f, m: ("training.liger_kernels patches the model with Liger Kernel's Triton kernels, which run "
                             f"on CUDA GPUs, and this run is on {d.name if d else ''}", "set it false")),
    Rule("liger_kernels_missing", ("training", "liger_kernels"),
         lambda s, d, f, m: s.liger_kernels and d is not None and d.kind == "cuda" and liger_missing(d) is not None,
         lambda s, d, f, m: (f"training.liger_kernels needs Liger Kernel, and {liger_missing(d)}",
                             "pip install 'fitburst[lean]' on Linux, or set it false")),
    Rule("liger_kernels_model", ("training", "liger_kernels"),
         lambda s, d, f, m: (s.liger_kernels and m is not None and liger_missing(d) is None
                             and liger_refusal(m, d) is not None),
         lambda s, d, f, m: ((liger_refusal(m, d) if m else None) or "", "set training.liger_kernels: false")),
    Rule("flash_attention_missing", ("training", "attention"),
         lambda s, d, f, m: s.attention == "flash" and flash_refusal(s, d) is not None,
         lambda s, d, f, m: (f"training.attention: flash runs FlashAttention-2, and {flash_refusal(s, d)}",
                             "set training.attention: sdpa (or auto), or train on an Ampere or newer GPU in 16 bits "
                             "with flash-attn installed")),
    Rule("packing_images", ("training", "packing"),
         lambda s, d, f, m: s.packed_fill > 0 and (s.images > 0 or s.image_tokens > 0),
         lambda s, d, f, m: ("packed batches carry no images", "set training.packing: false for a pipeline with "
                             "data.image_max_pixels (a vision-language one)")),
    Rule("family_packing", ("training", "packing"),
         lambda s, d, f, m: s.packed_fill > 0 and f is not None and f.packing_refusal is not None,
         lambda s, d, f, m: ((f.packing_refusal if f else None) or "", "")),
    Rule("family_fused_loss", ("training", "loss"),
         lambda s, d, f, m: s.loss == "fused" and f is not None and f.fused_loss_refusal is not None,
         lambda s, d, f, m: ((f.fused_loss_refusal if f else None) or "", "")),
    Rule("fused_loss_head_bias", ("training", "loss"),
         lambda s, d, f, m: s.loss == "fused" and m is not None and m.head_bias,
         lambda s, d, f, m: (f"the fused loss takes a bias-free linear output head, and {m.model_type if m else ''}'s "
                             "adds a bias", "set training.loss: standard (or auto)")),
    Rule("fused_loss_missing", ("training", "loss"),
         lambda s, d, f, m: s.loss == "fused" and d is not None and fused_loss_missing(d, s.precision) is not None,
         lambda s, d, f, m: (f"the fused loss on {d.name if d else ''} is {_fused_loss_kernel_name(d, s)}, and "
                             f"{fused_loss_missing(d, s.precision) if d else ''}",
                             "pip install 'fitburst[lean]', or set training.loss: standard (or auto)")),
    Rule("tiled_mlp_missing", ("training", "tiled_mlp"),
         lambda s, d, f, m: s.tiled_mlp and library_missing("liger_kernel", d) is not None,
         lambda s, d, f, m: ("the tiled MLP is liger-kernel's apply_tiled_mlp, and "
                             f"{library_missing('liger_kernel', d)}",
                             "pip install 'fitburst[lean]' on Linux, or set training.tiled_mlp: false")),
    Rule("tiled_mlp_model", ("training", "tiled_mlp"),
         lambda s, d, f, m: s.tiled_mlp and m is not None and tiled_mlp_refusal(m) is not None,
         lambda s, d, f, m: (f"the tiled MLP shards a gated MLP (gate, up, down) and "
                             f"{tiled_mlp_refusal(m) if m else ''}", "set training.tiled_mlp: false")),
)
RULE_KEYS = {r.key for r in RULES}


def problems(s: RunSettings, device: Device | None = None, family: FamilyFacts | None = None,
             model: ModelFacts | None = None) -> list[Problem]:
    """Every row of the table ``s`` breaks on ``device`` (None: not known) for a model of ``family`` with the
    architecture ``model`` (None: not looked up), in the table's order."""
    out = []
    for r in RULES:
        if r.broken(s, device, family, model):
            wrong, fix = r.says(s, device, family, model)
            out.append(Problem(r.key, r.field, wrong, fix))
    return out


def new_problems(before: RunSettings, after: RunSettings, device: Device | None,
                 family: FamilyFacts | None = None, model: ModelFacts | None = None) -> list[Problem]:
    """The problems a change from ``before`` to ``after`` brings (a rung, a GPU count): those ``before`` had already
    are the user's, refused where the run is validated, not the change's."""
    had = {p.rule for p in problems(before, device, family, model)}
    return [p for p in problems(after, device, family, model) if p.rule not in had]


def explain(pipeline: str, found: list[Problem]) -> str:
    """Problems as one message: the pipeline, each field and its fix."""
    return f"pipeline '{pipeline}': {located(found)}"


def located(found: list[Problem]) -> str:
    """Problems as one message: each field and its fix (where no pipeline is named)."""
    return "; ".join(f"field '{p.path}': {p}" for p in found)


def declared_device(name: str) -> Device | None:
    """The device ``preflight.device`` names, this machine's, known without probing it: a named or sized device, or
    the kind alone for ``mps`` and ``cpu`` (what the rules ask of a device: its kind, bf16, bitsandbytes, what is
    installed here); None for ``auto``, ``cuda`` and ``cuda:0,1`` (only a probe can tell)."""
    raw = split_count(name)[0]
    if raw.lower() in ("mps", "cpu"):
        return device_of_kind(raw.lower(), raw)
    named = named_device(name)
    return replace(named, local=True) if named is not None else None


def device_of_kind(kind: str, name: str | None = None) -> Device:
    """This machine's device of ``kind`` (cuda | mps | cpu) with the facts every device of that kind has and no
    others (a CUDA GPU of unknown capability counts as having bf16): what the loop, which trains here, asks the
    rule table with."""
    return replace(resolve_device(f"{kind}:1GiB"), name=name or kind, local=True)
