"""FSDP2 (fitburst.distributed) in the analytic estimate: one rank's share of the model states, the weights and
gradient buffers FSDP gathers in each phase, and the host RAM a node needs to load (and offload) a sharded run."""

from __future__ import annotations

from fitburst.hardware import resolve_device
from fitburst.settings import RunSettings

from .params import DTYPE_BYTES, optimizer_bytes, param_counts, resolve_targets, weight_bytes
from .shapes import ModelShape


def packed_4bit(shape: ModelShape, s: RunSettings) -> int:
    """Bytes of the packed 4-bit weights (sharded; their quantization statistics stay whole on every rank)."""
    if s.quant not in ("nf4", "fp4"):
        return 0
    return sum(c * sum(lin.fan_in * lin.fan_out for lin in shape.layer_linears(dec)) for c, dec in shape.blocks()) // 2


def gathered_bytes(shape: ModelShape, s: RunSettings) -> tuple[int, int, int, int, int]:
    """(root bytes, largest block's bytes, all blocks' bytes, largest block's trained numel, root's trained numel)
    as FSDP gathers them: the compute dtype under its mixed precision, else each weight's own (fp32 adapters, master
    weights, k-bit's fp32 norms); packed 4-bit weights as packed. The root holds what no block does (embeddings,
    head, final norms, a vision tower's extras)."""
    d = DTYPE_BYTES[s.precision]
    mp = s.amp
    full = s.method == "full"
    base = d if mp or not (full and s.master_weights) else 4
    rest = d if mp else (4 if s.kbit or s.master_weights or s.precision == "fp32" else d)  # norms, embeddings
    trained = 4 if not s.pure_bf16 else d
    train_g = d if mp else trained
    per_lora = {}
    if not full:
        t = resolve_targets(shape, s.target_modules)
        for _, dec in shape.blocks():
            per_lora[dec] = sum(s.rank * (lin.fan_in + lin.fan_out) for lin in shape.layer_linears(dec)
                                if lin.name in t)
            per_lora[dec] += sum(mult * s.rank * shape.experts * (fi + fo) for _, mult, fi, fo in
                                 shape.lora_experts(s.target_modules))
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


def fsdp_buffers(shape: ModelShape, s: RunSettings) -> dict[str, int]:
    """What FSDP2 adds on a rank in each phase of the step, from its code (torch.distributed.fsdp._fully_shard) and
    measured against the sharded trace: the root's weights are gathered for the whole step; in forward a block's
    gathered weights, its all-gather buffer (kept until the next block's copy-out) and the next block's buffer
    (3 blocks' worth); the loss runs beside one; backward holds a block and the prefetched one (2) plus the
    gradient reduction of one block or of the root: its unsharded gradient (compute dtype) and the fp32
    reduce-scatter input. Keeping gathered weights after forward (``reshard_after_forward`` off) holds every block
    from forward to its backward."""
    root, block, blocks, train, root_train = gathered_bytes(shape, s)
    reduce = (DTYPE_BYTES[s.precision] if s.amp else 4) + 4
    if s.reshard_after_forward:
        fwd, loss, bwd = root + 3 * block, root + block, root + 2 * block
    else:
        fwd, loss, bwd = root + blocks + block, root + blocks, root + blocks + block
    bwd = max(bwd + train * reduce, root + root_train * reduce)
    return {"forward": fwd, "vision": root + 3 * block, "loss": loss, "backward": bwd, "optimizer_step": 0,
            "eval": root + 2 * block}


def per_rank(comp: dict[str, int], n: int, replicated: int, buffers: int, step: bool,
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


def model_state_bytes(params: dict[str, int], s: RunSettings) -> dict[str, int]:
    """The whole run's weights (as trained: 4-bit packed, fp32 masters), gradients and optimizer state, from an
    estimate's parameter counts (``total``, ``trainable``, ``base``): what FSDP shards, offloads and loads."""
    d = DTYPE_BYTES[s.precision]
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


def host_bytes(params: dict[str, int], s: RunSettings, gpus_per_node: int) -> int:
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


def offload_host_bytes(shape: ModelShape, s: RunSettings, local_size: int, size: int) -> int:
    """Host RAM a node's ``local_size`` ranks (of ``size``) hold with FSDP's CPU offload: their share of the weights
    as loaded, of the trainable weights' fp32 gradients and of the optimizer state (the analytic estimate's
    figures)."""
    trainable = param_counts(shape, s)["trainable"]
    state, _, paged = optimizer_bytes(s, [trainable], 4, resolve_device("cpu"))
    whole = sum(weight_bytes(shape, s).values()) + 4 * trainable + state + paged
    return whole * local_size // size
