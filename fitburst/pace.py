"""The run's pace: optimizer steps, tokens and model FLOPs per second after the warm-up step (MFU where the
device's peak is known), the progress line's fields, and the wait for the device's queued work that the loop's
timing rests on (the step's pinned non-blocking host-to-device copy is the step's: :func:`fitburst.train.to_device`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fitburst.hardware import resolve_device

if TYPE_CHECKING:
    from fitburst.memory.shapes import ModelShape


def synchronize(device: str) -> None:
    """Wait for the work queued on ``device`` (a clock read after it times the device's work, not the queueing)."""
    import torch  # heavy: loaded only when training

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    elif device.startswith("mps"):
        torch.mps.synchronize()


@dataclass
class Pace:
    """The run's pace after its warm-up step (whose allocations, kernel choices and first launches are not the
    run's): optimizer steps, real tokens and model FLOPs (:func:`fitburst.hours.model_flops`) over the seconds since
    it ended. The clock is read where the host has waited for the device anyway (a loss read at a log interval, the
    end of the run), so timing adds one wait to the whole run: the one that starts the clock."""

    device: str
    peak_tflops: float | None = None  # the device's (fitburst.hours.peak_tflops); None: no MFU
    params: int = 0  # the model's parameters, for its FLOPs
    attn_width: int = 0  # layers x query width (0: attention not counted)
    t0: float | None = None
    steps: int = 0
    tokens: int = 0
    flops: float = 0.0

    def start(self) -> None:
        """The warm-up step is done: start the clock once the device has finished it."""
        synchronize(self.device)
        self.t0 = time.perf_counter()

    def add(self, micro_batches: list[dict]) -> None:
        """One timed optimizer step over ``micro_batches`` (host tensors: counting them waits for nothing)."""
        from fitburst.hours import model_flops

        if self.t0 is None:
            return
        lengths = [lengths_of(b) for b in micro_batches]
        tokens = sum(sum(ls) for ls in lengths)
        self.steps += 1
        self.tokens += tokens
        self.flops += model_flops(self.params, tokens, self.attn_width, sum(n * n for ls in lengths for n in ls))

    def rates(self) -> dict[str, float]:
        """steps/s, tokens/s and MFU (where the device's peak is known) so far; {} before any timed step. Call it
        where the device's work is done (after a loss read), or the clock times the queueing."""
        from fitburst.hours import mfu

        if self.t0 is None or not self.steps:
            return {}
        seconds = time.perf_counter() - self.t0
        rates = {"steps_per_s": self.steps / seconds, "tokens_per_s": self.tokens / seconds}
        util = mfu(self.flops, seconds, self.peak_tflops)
        return rates | ({"mfu": util} if util is not None else {})


def lengths_of(batch: dict) -> list[int]:
    """Each sequence's real (non-padding) length in a collated host batch."""
    mask = batch.get("attention_mask")
    if mask is None:
        return [int(batch["input_ids"].shape[-1])] * int(batch["input_ids"].shape[0])
    return [int(n) for n in mask.reshape(mask.shape[0], -1).sum(-1).tolist()]


def pace_for(shape: ModelShape | None, device: str, total_params: int) -> Pace:
    """The :class:`Pace` of a run on ``device``: the model's parameters and attention width from its ``shape`` (its
    loaded parameter count where the analytic estimate does not model it, None: attention then not counted), the
    peak of a CUDA GPU or Apple chip."""
    from fitburst.hours import peak_tflops

    kind = device.split(":")[0]
    peak = peak_tflops(resolve_device(device)) if kind in ("cuda", "mps") else None
    if shape is None:
        return Pace(device, peak, total_params)
    return Pace(device, peak, shape.param_count(), shape.layers * shape.q_dim)


def progress_fields(row: dict) -> dict[str, str]:
    """The progress line's fields from a log row: loss, and where timed, tokens/s and MFU."""
    fields = {"loss": f"{row['train_loss']:.3f}"}
    if "tokens_per_s" in row:
        fields["tok/s"] = f"{row['tokens_per_s']:,.0f}"
    if "mfu" in row:
        fields["mfu"] = f"{row['mfu']:.1%}"
    return fields
