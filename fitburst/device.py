"""Device and precision: which torch device to use, which dtype to load weights in, and torch AMP for the step.

The precision scheme is the one accelerate / the HF Trainer use: trainable parameters and optimizer state in fp32,
a frozen base in the low dtype, compute under ``torch.autocast`` (bf16 or fp16), and ``torch.amp.GradScaler`` for
fp16. Full fine-tuning keeps fp32 master weights; ``training.pure_bf16`` is the explicit opt-in for bf16 weights
stepped directly.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any

from fitburst.errors import UserError
from fitburst.hardware import Device, auto_precision
from fitburst.rules import device_of_kind, located, problems
from fitburst.settings import RunSettings

log = logging.getLogger(__name__)

PURE_BF16_MIN_LR = 1e-4  # below this an AdamW update is mostly under bf16's resolution (2**-8 relative)


class DeviceError(UserError, RuntimeError):
    """The device cannot run what the spec asks for; the message says what to change."""


def select_device(pref: str = "auto") -> str:
    """The torch device to train on: ``auto`` picks CUDA, then MPS, then CPU."""
    import torch  # torch: heavy, loaded only at use

    p = pref.lower()
    if p == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    kind = "cpu" if p.startswith("cpu") else "mps" if p.startswith(("mps", "m1", "m2", "m3", "m4")) else "cuda"
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}[kind]
    if not available:
        raise DeviceError(f"preflight.device is {pref!r} ({kind}) but torch sees no {kind} device here: "
                          "set preflight.device: auto, or run where that device is")
    return kind


def resolve_precision(precision: str, device: str) -> str:
    """The compute precision (fp32, bf16 or fp16); ``auto`` follows :func:`fitburst.hardware.auto_precision`
    (the estimate's rule). An explicit one the probed device cannot run is refused by the rule table's row, with the
    message ``validate`` gives for a device named so."""
    probed = probed_device(device)
    if precision != "auto":
        _refuse(RunSettings(precision=precision), probed)
    return precision if precision != "auto" else auto_precision(probed.kind, probed.supports_bf16)


def probed_device(device: str) -> Device:
    """This process's ``device`` (cuda | mps | cpu) with what the rule table asks of it: on CUDA the current GPU's
    name and whether it has native bf16, read in this process (sm >= 80: torch's default also says yes where it
    merely emulates bf16, on a T4, which would train in slow emulated bf16 while the preflight planned fp16, as
    :func:`fitburst.hardware.probe_local` reads capability >= 8.0); the kind's facts elsewhere."""
    kind = device.split(":")[0]
    if kind != "cuda":
        return device_of_kind(kind)
    import torch  # torch: heavy, loaded only at use

    name = torch.cuda.get_device_properties(torch.cuda.current_device()).name
    return replace(device_of_kind("cuda", name), supports_bf16=torch.cuda.is_bf16_supported(including_emulation=False))


def _refuse(s: RunSettings, device: Device) -> None:
    """A DeviceError naming the field and the fix where ``s`` breaks a row of the rule table on ``device``."""
    if found := problems(s, device):
        raise DeviceError(located(found))


def torch_dtype(precision: str):
    import torch  # torch: heavy, loaded only at use

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def weight_dtype(precision: str, method_type: str, pure_bf16: bool = False):
    """The dtype to load the base weights in: the low dtype for a frozen base (LoRA, QLoRA), fp32 master weights
    when every weight trains (full), bf16 for full fine-tuning only with the ``pure_bf16`` opt-in."""
    import torch  # torch: heavy, loaded only at use

    if method_type == "full" and not pure_bf16:
        return torch.float32
    return torch_dtype(precision)


def warn_pure_bf16(pure_bf16: bool, lr: float) -> None:
    if pure_bf16 and lr < PURE_BF16_MIN_LR:
        log.warning("training.pure_bf16 steps bf16 weights directly: at learning_rate %g most AdamW updates are "
                    "below bf16 resolution and are lost; use mixed precision (pure_bf16: false) or a larger lr", lr)


@dataclass
class Amp:
    """torch AMP for one run: the autocast dtype (None: no autocast) and the fp16 GradScaler; counts the steps the
    scaler skipped on inf/nan gradients."""

    device: str
    dtype: Any = None
    scaler: Any = None
    skipped_steps: int = 0
    last_step_skipped: bool = False
    scale: float | None = None  # the scaler's scale after the last step (None: not read since it was set)

    def autocast(self):
        import torch  # torch: heavy, loaded only at use

        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.split(":")[0], dtype=self.dtype)


def make_amp(precision: str, device: str, *, pure_bf16: bool = False, sharded: bool = False) -> Amp:
    """The AMP setup for a resolved ``precision`` on ``device``: autocast for bf16/fp16 and a GradScaler for fp16;
    nothing for fp32 or pure bf16 (the weights are already bf16). ``sharded`` (FSDP): torch's ShardedGradScaler,
    which agrees across ranks on whether a step's gradients hold inf/nan (each rank sees only its shards)."""
    import torch  # torch: heavy, loaded only at use

    if precision == "fp32" or pure_bf16:
        return Amp(device)
    kind = device.split(":")[0]
    scaler: Any = None
    if precision == "fp16":
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(kind)
        else:
            scaler = torch.amp.GradScaler(kind)
    return Amp(device, dtype=torch_dtype(precision), scaler=scaler)
