"""How long a run takes on a device: one model for the local device and for rented GPUs.

Hours = tokens / throughput (+ provisioning on a cloud node). Throughput is, in order of preference: the
probe's measured tokens/s on this device; else the device's dense 16-bit peak (a table of named GPUs, Apple
chips and the CPU) times the fraction a LoRA fine-tune sustains, over the FLOPs per token. Each figure says
where it came from. Pure Python: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fitburst.memory import Device, ModelShape, RunSettings

# Provisioning, setup (pip install) and the base-model download on a fresh node, charged to every cloud run.
CLOUD_OVERHEAD_HOURS = 0.25

# Dense 16-bit tensor-core peak in TFLOP/s with fp32 accumulation (fp16 on cards without bf16), from the
# vendors' data sheets; fitburst device names (fitburst.hardware). Time estimates only.
PEAK_TFLOPS = {
    "T4": 65.0,
    "V100-16GB": 125.0,
    "V100-32GB": 125.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX3090": 71.0,
    "RTX4090": 165.0,
    "RTX5090": 209.0,
    "A4000": 76.7,
    "A5000": 111.0,
    "A6000": 155.0,
    "L40S": 362.0,
    "A40": 150.0,
    "A100-40GB": 312.0,
    "A100-80GB": 312.0,
    "H100": 756.0,
    "H200": 989.0,
}
# fraction of the peak a LoRA fine-tune sustains (model FLOPs utilisation)
MFU = {"T4": 0.25}
DEFAULT_MFU = 0.35
# Apple GPUs (MPS): fp16 peak TFLOP/s per chip from Apple's figures; MPS sustains less of it than CUDA.
APPLE_TFLOPS = {"M1": 2.6, "M1-PRO": 5.2, "M1-MAX": 10.4, "M1-ULTRA": 21.0, "M2": 3.6, "M2-PRO": 6.8,
                "M2-MAX": 13.6, "M2-ULTRA": 27.2, "M3": 4.1, "M3-PRO": 7.4, "M3-MAX": 16.4, "M4": 4.3,
                "M4-PRO": 9.2, "M4-MAX": 18.4}
MPS_MFU = 0.3
MPS_DEFAULT_TFLOPS = 4.0  # an Apple chip not named: about an M2
CPU_TFLOPS = 0.3  # sustained fp32 training throughput of a desktop CPU (time estimates only)


# Several GPUs (FSDP): each step every rank receives the other ranks' shards of every block (all-gather; twice when
# blocks are gathered again for backward) and reduces the gradients (reduce-scatter), overlapped with compute by
# FSDP's prefetch. A step then takes as long as the longer of its compute and its communication: the scaling
# efficiency is compute / max(compute, communication), not a fixed figure. Link bandwidth per GPU, one direction,
# GB/s, from the vendors' data sheets: NVLink 4 (H100/H200 SXM) 450, NVLink 3 (A100 SXM) 300, NVLink 2 (V100) 150;
# PCIe 4.0 x16 32 for the other cards (RTX 4090, A6000, L4, A10G, L40S: no NVLink in a rented or desktop box; a
# two-card NVLink bridge on an A6000 or 3090 is faster), PCIe 3.0 x16 16 on the T4. Between rented nodes 100 Gbit/s
# Ethernet is assumed (12.5 GB/s; providers' multi-node clusters often have more). NCCL's ring collectives reach
# about 70 % of a link's peak (COLLECTIVE_FRACTION, an assumption in line with nccl-tests' bus bandwidth).
LINK_GBPS = {"H100": 450.0, "H200": 450.0, "A100-40GB": 300.0, "A100-80GB": 300.0, "V100-16GB": 150.0,
             "V100-32GB": 150.0, "T4": 16.0}
PCIE4_GBPS = 32.0
NODE_GBPS = 12.5
COLLECTIVE_FRACTION = 0.7
# even communication hidden entirely behind compute leaves some exposed (the first block's all-gather, the last
# reduce-scatter) and takes some of the compute (NCCL's kernels share the GPU): at most this much (assumed)
MAX_SCALING = 0.95


@dataclass(frozen=True)
class Scaling:
    """How much of N GPUs' compute a sharded run keeps, and where the figure comes from."""

    efficiency: float
    source: str


def link_gbps(device: Device, nodes: int = 1) -> tuple[float, str]:
    """(GB/s one GPU's collectives get, what link that is)."""
    name = gpu_name(device.name) if device.kind == "cuda" else None
    gbps = LINK_GBPS.get(name or "", PCIE4_GBPS)
    what = {450.0: "NVLink 4", 300.0: "NVLink 3", 150.0: "NVLink 2", 16.0: "PCIe 3.0 x16"}.get(gbps, "PCIe 4.0 x16")
    if nodes > 1 and NODE_GBPS < gbps:
        return NODE_GBPS, "100 Gbit/s between nodes (assumed)"
    return gbps, what


def scaling(comm_bytes: int, compute_s: float, device: Device, world_size: int, nodes: int = 1) -> Scaling:
    """The scaling efficiency of one micro-batch on each of ``world_size`` GPUs: ``compute_s`` of compute per rank
    against ``comm_bytes`` (:func:`fsdp_traffic`) over the link (:func:`link_gbps`) at COLLECTIVE_FRACTION."""
    if world_size <= 1:
        return Scaling(1.0, "one GPU")
    gbps, link = link_gbps(device, nodes)
    comm_s = comm_bytes * (world_size - 1) / world_size / (gbps * COLLECTIVE_FRACTION * 1e9)
    eff = MAX_SCALING * (compute_s / max(compute_s, comm_s) if compute_s > 0 else 1.0)
    return Scaling(eff, f"{eff:.0%} scaling over {world_size} GPUs: {compute_s:.2f} s compute vs {comm_s:.2f} s "
                        f"FSDP traffic per micro-batch over {link} ({gbps:g} GB/s x {COLLECTIVE_FRACTION:.0%}), at "
                        f"most {MAX_SCALING:.0%}")


def fsdp_traffic(gathered: int, trained_numel: int, settings: RunSettings) -> int:
    """Bytes each rank's collectives move per micro-batch before the (N-1)/N of a ring: every gathered weight once
    in forward and again in backward (once when kept gathered), and the gradients reduced in fp32."""
    return gathered * (2 if settings.reshard_after_forward else 1) + 4 * trained_numel


@dataclass(frozen=True)
class Throughput:
    """Training throughput on one device and where the figure comes from."""

    source: str  # "probe: ..." | "table: ..."
    tokens_per_s: float | None = None  # measured (probe)
    tflops: float | None = None  # sustained TFLOP/s (table x MFU)

    def tokens_per_second(self, flops_per_tok: float) -> float:
        if self.tokens_per_s:
            return self.tokens_per_s
        if self.tflops is None:
            raise ValueError(f"{self.source}: neither a measured rate nor a TFLOP/s figure")
        return self.tflops * 1e12 / flops_per_tok


@dataclass(frozen=True)
class Hours:
    hours: float
    source: str


def gpu_name(raw: str) -> str | None:
    """The table name of a CUDA card as torch names it ("cuda (NVIDIA RTX A6000)", "NVIDIA H100 80GB HBM3",
    "NVIDIA GeForce RTX 4090") or as fitburst does ("A6000"); None when unknown. The longest model number
    found in the name wins (A100 over A10, A4000 over A40); memory variants share one peak."""
    key = re.sub(r"[^A-Z0-9]", "", raw.upper())
    best: tuple[str, str] | None = None
    for name in PEAK_TFLOPS:
        base = re.sub(r"[^A-Z0-9]", "", name.split("-")[0])
        if base in key and (best is None or len(base) > len(best[1])
                            or (base == best[1] and re.sub(r"[^A-Z0-9]", "", name) in key)):
            best = (name, base)
    return best[0] if best else None


def apple_chip(raw: str) -> str | None:
    """"M2-Max-32GB", "Apple M2 Max" -> "M2-MAX"; None when not an Apple chip name."""
    m = re.search(r"\bM([1-4])(?:[\s-]+(PRO|MAX|ULTRA))?\b", raw.upper().replace("APPLE", ""))
    if not m:
        return None
    return f"M{m.group(1)}" + (f"-{m.group(2)}" if m.group(2) else "")


def throughput(device: Device, measured_tokens_per_s: float | None = None) -> Throughput:
    """What ``device`` sustains: the probe's measurement when given, else the table entry for its name."""
    if measured_tokens_per_s:
        return Throughput(f"probe: {measured_tokens_per_s:,.0f} tokens/s measured on {device.name}",
                          tokens_per_s=measured_tokens_per_s)
    if device.kind == "cuda":
        name = gpu_name(device.name)
        if name is None:
            return Throughput(f"table: {device.name} is not in the table, timed as a T4 (the slowest listed)",
                              tflops=PEAK_TFLOPS["T4"] * MFU["T4"])
        mfu = MFU.get(name, DEFAULT_MFU)
        return Throughput(f"table: {name} {PEAK_TFLOPS[name]:g} TFLOP/s x {mfu:.0%} MFU",
                          tflops=PEAK_TFLOPS[name] * mfu)
    if device.kind == "mps":
        chip = apple_chip(device.name)
        peak = APPLE_TFLOPS.get(chip or "", MPS_DEFAULT_TFLOPS)
        what = chip if chip in APPLE_TFLOPS else f"{device.name} (chip not named)"
        return Throughput(f"table: {what} {peak:g} TFLOP/s x {MPS_MFU:.0%}", tflops=peak * MPS_MFU)
    return Throughput(f"table: CPU {CPU_TFLOPS:g} TFLOP/s sustained", tflops=CPU_TFLOPS)


def flops_per_token(shape: ModelShape | int, settings: RunSettings) -> float:
    """Training FLOPs per token: 2N forward, 2N activation grads, +2N weight grads for full fine-tuning,
    +2N recompute with gradient checkpointing; dequantizing a 4/8-bit base costs about 25 % more. ``shape``: the
    model's shape, or its parameter count N (a traced model the analytic estimate does not model)."""
    n = shape if isinstance(shape, int) else shape.param_count()
    mult = 6.0 if settings.method == "full" else 4.0
    if settings.gradient_checkpointing:
        mult += 2.0
    return mult * n * (1.25 if settings.kbit else 1.0)


def train_tokens(spec, n_train: int | None = None, mean_len: float | None = None) -> int | None:
    """Tokens the run processes: steps x effective batch x length, or epochs x examples x length."""
    t = spec.training
    length = mean_len or spec.data.max_seq_len
    if t.max_steps:
        return int(t.max_steps * t.micro_batch_size * t.grad_accum * length)
    if n_train:
        return int((t.epochs or 1.0) * n_train * length)
    return None


def estimate_hours(shape: ModelShape | int, settings: RunSettings, speed: Throughput, tokens: int | None, *,
                   cloud: bool = False, device: Device | None = None, nodes: int = 1) -> Hours | None:
    """Wall-clock hours for ``tokens`` at ``speed`` per GPU (plus provisioning on a cloud node); None without
    tokens. A run sharded over ``settings.world_size`` GPUs of ``device`` (on ``nodes`` nodes) splits the tokens
    between them at the :func:`scaling` efficiency its FSDP traffic leaves."""
    if not tokens:
        return None
    per_token = flops_per_token(shape, settings)
    rate = speed.tokens_per_second(per_token)
    n = settings.world_size
    source = speed.source
    if n > 1:
        micro = settings.micro_batch_size * settings.seq_len
        eff = scaling(_traffic(shape, settings), micro / rate, device or _any_gpu(), n, nodes)
        rate *= n * eff.efficiency
        source += f"; {eff.source}"
    seconds = tokens / rate
    overhead = CLOUD_OVERHEAD_HOURS if cloud else 0.0
    return Hours(seconds / 3600 + overhead, source + (f" + {overhead:g} h provisioning" if cloud else ""))


def _traffic(shape: ModelShape | int, settings: RunSettings) -> int:
    """:func:`fsdp_traffic` of a run: from the model's shape, or without one (a traced architecture) from its
    parameter count, each weight gathered at 2 bytes (the trained ones' gradients reduced)."""
    from fitburst.memory.fsdp_terms import gathered_bytes
    from fitburst.memory.params import lora_params

    if isinstance(shape, int):
        trained = shape if settings.method == "full" else 0
        return fsdp_traffic(2 * shape, trained, settings)
    root, _, blocks, _, _ = gathered_bytes(shape, settings)
    trained = shape.param_count() if settings.method == "full" else lora_params(shape, settings)
    return fsdp_traffic(root + blocks, trained, settings)


def _any_gpu() -> Device:
    return Device("cuda", "cuda", 0, 0)


# --- measured speed --------------------------------------------------------------------------------------------


def model_flops(params: int, tokens: int, attn_width: int = 0, squared_lengths: int = 0) -> float:
    """Model FLOPs of training on ``tokens`` tokens, PaLM's count (Chowdhery et al. 2022, appendix B): 6 per parameter
    and token (the forward, and the backward to activations and to weights), plus attention's score and value
    products, 12 per unit of ``attn_width`` (layers x query width) and per token and position attended
    (``squared_lengths``: the sum of each sequence's length squared). Recomputation (checkpointing) is not counted,
    nor the weight gradients LoRA leaves out: one figure per model and data, whatever the method, so runs compare."""
    return 6.0 * params * tokens + 12.0 * attn_width * squared_lengths


def peak_tflops(device: Device) -> float | None:
    """The device's dense 16-bit peak TFLOP/s from the tables above (a named CUDA GPU or Apple chip); None where it
    is not known (the CPU, a GPU not in the table)."""
    if device.kind == "cuda":
        name = gpu_name(device.name)
        return PEAK_TFLOPS[name] if name else None
    if device.kind == "mps":
        return APPLE_TFLOPS.get(apple_chip(device.name) or "")
    return None


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops`` done in ``seconds`` over the ``peak`` TFLOP/s; None without a peak."""
    return flops / seconds / (peak * 1e12) if peak and seconds > 0 else None

