"""How long a run takes on a device: one model for the local device and for rented GPUs.

Hours = tokens / throughput (+ provisioning on a cloud node). Throughput is, in order of preference: the
probe's measured tokens/s on this device; else the device's dense 16-bit peak (a table of named GPUs, Apple
chips and the CPU) times the fraction a LoRA fine-tune sustains, over the FLOPs per token. Each figure says
where it came from. Pure Python: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fitburst.memory import Device, ModelShape, TrainSettings

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


def flops_per_token(shape: ModelShape | int, settings: TrainSettings) -> float:
    """Training FLOPs per token: 2N forward, 2N activation grads, +2N weight grads for full fine-tuning,
    +2N recompute with gradient checkpointing; dequantizing a 4/8-bit base costs about 25 % more. ``shape``: the
    model's shape, or its parameter count N (a traced model the analytic estimate does not model)."""
    n = shape if isinstance(shape, int) else shape.param_count()
    mult = 6.0 if settings.method == "full" else 4.0
    if settings.grad_checkpointing:
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


def estimate_hours(shape: ModelShape | int, settings: TrainSettings, speed: Throughput, tokens: int | None, *,
                   cloud: bool = False) -> Hours | None:
    """Wall-clock hours for ``tokens`` at ``speed`` (plus provisioning on a cloud node); None without tokens."""
    if not tokens:
        return None
    seconds = tokens / speed.tokens_per_second(flops_per_token(shape, settings))
    overhead = CLOUD_OVERHEAD_HOURS if cloud else 0.0
    return Hours(seconds / 3600 + overhead, speed.source + (f" + {overhead:g} h provisioning" if cloud else ""))
