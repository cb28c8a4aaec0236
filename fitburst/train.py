"""One optimizer step and what a run's training returns: the step (gradient accumulation, AMP, token-weighted
loss; several ranks: the whole step's loss), the shuffled micro-batch stream, the run's step count, its result and
its error. The recipe (:mod:`fitburst.recipe`) loops over the step; the probe and the preflight's trace run it
as is."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from fitburst import distributed
from fitburst.data import collate
from fitburst.device import Amp
from fitburst.distributed import SINGLE, World
from fitburst.errors import UserError
from fitburst.families import Family, family_for
from fitburst.meter import MemoryPeak
from fitburst.spec import PipelineSpec

MetricsFn = Callable[[dict, int], None]


class TrainError(UserError, RuntimeError):
    """Training could not start or stopped; the message says why and what to change."""


@dataclass
class TrainResult:
    run_dir: str
    adapter_dir: str
    device: str
    precision: str
    steps: int
    total_steps: int
    final_loss: float
    seconds: float
    steps_per_sec: float  # after the warm-up step (Pace); a run of one step: that step's
    tokens: int
    trainable_params: int
    total_params: int
    resumed_from: int | None = None
    skipped_steps: int = 0
    peak: MemoryPeak = field(default_factory=lambda: MemoryPeak("cpu"))  # several ranks: the highest rank's
    loss: str = "standard"  # the loss kernel that ran (standard, or the fused one: cce, liger, cce_compile, chunked)
    activation_offloading: bool = False
    world_size: int = 1  # processes (GPUs) the run was sharded over
    grad_accum: int = 1  # as trained: a resume at another world size sets it to keep the effective batch
    samples_per_step: int = 0  # the effective batch: world size x micro-batch x grad_accum
    rank_peaks: list[MemoryPeak] = field(default_factory=list)  # several ranks: each rank's peak, in rank order
    tokens_per_sec: float = 0.0  # real tokens, after the warm-up step (several ranks: rank 0's)
    mfu: float | None = None  # model FLOPs utilisation after the warm-up step; None: the device's peak is not known

    def save(self) -> None:
        Path(self.run_dir, "train_result.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, run_dir: str | Path) -> TrainResult:
        d = json.loads(Path(run_dir, "train_result.json").read_text())
        return cls(**{**d, "peak": MemoryPeak(**d.get("peak") or {"kind": d["device"]}),
                      "rank_peaks": [MemoryPeak(**p) for p in d.get("rank_peaks") or []]})


def total_steps(spec: PipelineSpec, n_train: int, world_size: int = 1) -> int:
    """Optimizer steps of the run: ``max_steps``, else its epochs over ``n_train`` samples, each step taking
    ``micro_batch_size`` x ``grad_accum`` samples on each of ``world_size`` ranks."""
    tr = spec.training
    if tr.max_steps:
        return tr.max_steps
    per_epoch = math.ceil(math.ceil(n_train / world_size) / tr.micro_batch_size)
    return max(1, math.ceil(per_epoch * (tr.epochs or 1.0) / tr.grad_accum))


def batches(rows: list[dict], batch_size: int, pad_id: int, seed: int, start_micro: int, packed: bool = False,
            collate: Callable[..., dict] = collate, *, world: World = SINGLE):
    """Endless shuffled micro-batches (a fresh seeded order each epoch), skipping ``start_micro`` for resume;
    ``packed``: each micro-batch one padding-free row; ``collate``: the model family's
    (:meth:`fitburst.families.Family.collate`; by default told from the samples).

    The order is torch's ``DistributedSampler``'s (one process: the seeded permutation itself): rank r takes every
    world-size-th sample of it, so the ranks' k-th micro-batches together hold the samples one process takes in its
    k-th micro-batch of world size x ``batch_size`` (an epoch whose samples do not divide evenly repeats a few, as
    the sampler pads)."""
    from torch.utils.data import Dataset, DistributedSampler  # heavy: loaded only when training

    indices = cast("Dataset[int]", range(len(rows)))  # the sampler needs only len()
    sampler: DistributedSampler[int] = DistributedSampler(indices, num_replicas=world.size, rank=world.rank,
                                                          shuffle=True, seed=seed)
    per_epoch = math.ceil(len(sampler) / batch_size)
    epoch, offset = divmod(start_micro, per_epoch)
    while True:
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(offset, per_epoch):
            yield collate([rows[j] for j in order[i * batch_size:(i + 1) * batch_size]], pad_id, packed)
        epoch, offset = epoch + 1, 0


def to_device(t, device: str):
    """A host tensor on ``device``. On CUDA through pinned (page-locked) memory and a non-blocking copy: the host
    goes on queueing kernels while the copy runs, where a pageable copy would stage it and wait. Elsewhere ``.to``
    as is (on the CPU the tensor itself, no copy)."""
    if not device.startswith("cuda"):
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def optimizer_step(model, optimizer, params: list, micro_batches: list[dict], *, device: str,
                   max_grad_norm: float | None, amp: Amp | None = None, loss: str = "standard",
                   offload: contextlib.AbstractContextManager | None = None, n_items=None, world: World = SINGLE,
                   on_device: bool = False, family: Family | None = None) -> Any:
    """One optimizer step over ``micro_batches`` (gradient accumulation over all of them); returns the loss: a float,
    or with ``on_device`` a 0-d tensor on ``device`` (the loop's: reading a value on the host waits for the device to
    finish the step, so the loop reads the loss at log intervals only).

    The loss is token-weighted over the whole window (sum of token losses / label tokens in the window, through
    transformers' ``num_items_in_batch``), so two micro-batches of 4 give the gradient of one batch of 8. With
    ``amp`` (:func:`fitburst.device.make_amp`) the forward runs under autocast, and fp16 goes through its GradScaler:
    a step whose gradients hold inf/nan is skipped and counted in ``amp.skipped_steps``. The model output is
    dropped as soon as the loss is taken, so the logits do not live through backward. How label tokens are counted
    and each micro-batch's loss weighted is the model's ``family``'s (:class:`fitburst.families.Family`; None:
    looked up from the model's config); ``loss`` the kernel it runs (:func:`loss_kernel`). ``offload``: a
    saved-tensors context the forwards run under (activation offloading, :func:`activation_offloading`).

    Several ranks: ``n_items`` is the label tokens of the step on every rank (:func:`fitburst.distributed.all_sum`),
    the sharded gradients are summed across ranks, and the loss returned is the whole step's."""
    import torch  # heavy: loaded only when training

    scaler = amp.scaler if amp is not None else None
    family = family or family_for(model.config)
    if n_items is None:
        n_items = sum(family.label_tokens(mb) for mb in micro_batches)
    n_items = to_device(torch.as_tensor(n_items), device).clamp(min=1)
    total = torch.zeros((), device=device)
    for mb in micro_batches:
        with amp.autocast() if amp is not None else contextlib.nullcontext(), offload or contextlib.nullcontext():
            value = family.train_loss(model, {k: to_device(v, device) for k, v in mb.items()}, n_items, loss)
        (scaler.scale(value) if scaler is not None else value).backward()
        total += value.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if amp is not None and scaler is not None:  # scaler is amp's
        # the scale is read once a step (a wait for the device): after the update, kept for the next step's test
        before = amp.scale if amp.scale is not None else scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        amp.scale = scaler.get_scale()
        amp.last_step_skipped = amp.scale < before
        amp.skipped_steps += int(amp.last_step_skipped)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if world.sharded:
        total = distributed.all_sum(total, device)
    return total if on_device else total.item()
