"""What a model's parameters weigh in one training step: the base weights as loaded (k-bit: quantized), the trained
tensors (LoRA's adapters or every weight), their gradients and the optimizer's state. Arithmetic on the shape."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

from fitburst.hardware import Device
from fitburst.settings import RunSettings

from .cuda_kernels import adamw_impl, cublas_workspace_bytes
from .shapes import ModelShape

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
BNB_MIN_8BIT = 4096  # bitsandbytes optimizers keep 32-bit state for smaller tensors
BNB_BLOCK = 256  # blockwise 8-bit optimizer state: one fp32 absmax per 256 values


@dataclass(frozen=True)
class ModelStates:
    """What a step's parameters hold through every phase (bytes, but ``trained``)."""

    weights: dict[str, int]  # the base model's weights by how they are stored, and CUDA's cuBLAS workspaces
    adapters: int  # LoRA's fp32 adapters (0: a full fine-tune trains the weights themselves)
    trained: int  # values trained
    value_bytes: int  # bytes of one trained value's gradient (and of each optimizer slot of it)
    gradients: int
    optimizer: int  # the optimizer's state
    optimizer_temp: int  # the optimizer step's temporaries
    paged: int  # a paged optimizer's state, in CUDA unified memory outside torch's allocator
    # the input embedding table the training loop keeps in host RAM (training.embeddings_on_host), by the
    # ``weights`` key it is left out of: fitburst.evaluate's fresh load holds it on the GPU
    host_embeddings: dict[str, int] = field(default_factory=dict)


def model_states(shape: ModelShape, s: RunSettings, device: Device) -> ModelStates:
    """The weights (fp32 master weights under autocast: :func:`weight_bytes`), the trained tensors, their gradients
    and the optimizer's state."""
    w = weight_bytes(shape, s)
    d = DTYPE_BYTES[s.precision]
    if shape.arch.fp32_ff_out and d != 4 and not s.master_weights and not s.kbit:  # wo kept in fp32: 2 bytes more
        w["weights"] += 2 * shape.intermediate * shape.hidden * shape.total_layers
    host = {}
    if s.host_embeddings_modelled and device.kind == "cuda" and not shape.tied:  # fitburst.models.embeddings_to_host
        host = {"weights_16bit" if s.kbit else "weights": shape.embed_params * d}
        w.update({k: w[k] - n for k, n in host.items()})
    if device.kind == "cuda":  # the cuBLAS workspaces the warm-up step left (never freed)
        biased = any(lin.bias for _, dec in shape.blocks() for lin in shape.layer_linears(dec))
        w["cuda_workspaces"] = cublas_workspace_bytes(device, biased, s.gradient_checkpointing)
    if s.method == "full":
        tensors = full_tensors(shape, s.vision)
        value_bytes = 4 if s.master_weights else d  # fp32 master weights: fp32 gradients and optimizer state
        adapters = 0
    else:
        tensors = lora_tensors(shape, s)
        value_bytes = 4  # peft keeps adapters in fp32
        adapters = 4 * sum(tensors)
    state, temp, paged = optimizer_bytes(s, tensors, value_bytes, device)
    return ModelStates(weights=w, adapters=adapters, trained=sum(tensors), value_bytes=value_bytes,
                       gradients=value_bytes * sum(tensors), optimizer=state, optimizer_temp=temp, paged=paged,
                       host_embeddings=host)


def resolve_targets(shape: ModelShape, targets: list[str] | str) -> set[str]:
    names = {lin.name for c, dec in shape.blocks() for lin in shape.layer_linears(dec)}
    names |= set(shape.arch.expert_aliases)
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


def lora_params(shape: ModelShape, s: RunSettings) -> int:
    return sum(lora_tensors(shape, s))


def lora_tensors(shape: ModelShape, s: RunSettings) -> list[int]:
    """numel of each LoRA tensor (A and B of each targeted module)."""
    t = resolve_targets(shape, s.target_modules)
    out: list[int] = []
    for c, dec in shape.blocks():
        per = [
            n
            for lin in shape.layer_linears(dec)
            if lin.name in t
            for n in (s.rank * lin.fan_in, s.rank * lin.fan_out)
        ]
        out += per * c
    for _, mult, fan_in, fan_out in shape.lora_experts(s.target_modules):  # A and B of all experts at once
        out += [mult * s.rank * shape.experts * fan_in, mult * s.rank * shape.experts * fan_out] * shape.layers
    return out + [s.rank * n for n in vision_linears(shape, s.vision, lora=True)]


def vision_linears(shape: ModelShape, vision: str, lora: bool = False) -> list[int]:
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


def weight_bytes(shape: ModelShape, s: RunSettings) -> dict[str, int]:
    """Base model weights as loaded (and, for k-bit, after prepare_model_for_kbit_training)."""
    d = 4 if s.master_weights else DTYPE_BYTES[s.precision]
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
    if s.frozen_16bit:  # the frozen embeddings and head stay in the compute dtype (fitburst.models.prepare_kbit)
        frozen = embed_head_params(shape)
        return {"weights_quantized": int(q), "weights_fp32": (rest - frozen) * 4, "weights_16bit": frozen * d}
    return {"weights_quantized": int(q), "weights_fp32": rest * 4}


def four_bit_bytes(values: float, double_quant: bool) -> float:
    """A 4-bit weight of ``values`` values as bitsandbytes stores it: half a byte each, and an absmax per block of 64
    (fp32; double quantization: 8-bit, with an fp32 absmax per 256 of them and a 256-entry code)."""
    blocks = values / 64
    return values / 2 + (blocks + blocks / 256 * 4 + 256 * 4 if double_quant else blocks * 4)


def param_counts(shape: ModelShape, s: RunSettings) -> dict[str, int]:
    """The parameters as counted (a 4-bit weight by its values), and ``loaded``: the base model's bytes as loaded and
    prepared (:func:`weight_bytes`), what a sharded run's loading holds in host RAM."""
    total = shape.param_count()
    trainable = sum(full_tensors(shape, s.vision)) if s.method == "full" else lora_params(shape, s)
    return {"total": total + (0 if s.method == "full" else trainable), "trainable": trainable, "base": total,
            "loaded": sum(weight_bytes(shape, s).values())}


def optimizer_bytes(
    s: RunSettings, tensors: list[int], pbytes: int, device: Device
) -> tuple[int, int, int]:
    """(state bytes, step-time temporary bytes, paged bytes outside the allocator)."""
    if s.optimizer == "sgd":  # fitburst's SGD runs with momentum 0.9: one buffer per parameter, in-place update
        return pbytes * sum(tensors), 0, 0
    if s.optimizer == "adamw":
        state = 2 * pbytes * sum(tensors)
        # torch AdamW as the loop runs it (cuda_kernels.adamw_impl): fused updates in place; foreach holds one
        # sqrt buffer over all params; per tensor, two buffers of the largest tensor
        impl = adamw_impl(device.kind, s.world_size, s.adamw)
        temp = {"fused": 0, "foreach": pbytes * sum(tensors)}.get(impl, 2 * pbytes * max(tensors, default=0))
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



def embed_head_params(shape: ModelShape) -> int:
    return shape.embed_params + shape.lm_head_params


def full_tensors(shape: ModelShape, vision: str = "tower") -> list[int]:
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
        out += vision_linears(shape, vision) + ([2 * shape.vision.dim] if vision == "projector" else [])
    elif shape.extra_params:
        out.append(shape.extra_params)
    return out
