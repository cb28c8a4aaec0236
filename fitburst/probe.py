"""Measured probe: a few real optimizer steps at the planned settings, on the local device, with the longest
batch the data holds, measured with :class:`fitburst.meter.MemoryMeter` and set beside the estimate.

The step is :func:`fitburst.train.optimizer_step`, the body of the training loop (the model output is
dropped as soon as the loss is taken; clipping, step, ``zero_grad(set_to_none=True)``); the accuracy benchmark
(``benchmarks/_measure.py``) runs the same function.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from fitburst.data import PreparedData
from fitburst.memory import Estimate
from fitburst.spec import PipelineSpec

log = logging.getLogger(__name__)


def longest_batch(prepared, batch_size: int, pad_id: int) -> dict:
    """The ``batch_size`` longest training samples, collated as the loop collates (padded to the longest)."""
    from fitburst.data import collate, load_split

    ds = load_split(prepared, "train")
    lengths = [len(x) for x in ds["input_ids"]]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:batch_size]
    rows = [ds[i] for i in order]
    return collate(rows, pad_id)


def probe(spec: PipelineSpec, prepared: PreparedData, estimate: Estimate, device: str | None = None, *,
          steps: int = 2) -> dict:
    """Run ``steps`` optimizer steps of ``spec`` (as planned) on the longest batch; measured vs estimated peak.

    Returns a dict with ``measured_peak_bytes`` (CUDA max_memory_allocated, MPS sampled driver memory, CPU live
    tensor bytes counted by a dispatch tracker), ``estimated_peak_bytes`` (the estimate's figure comparable with it, see
    :meth:`fitburst.memory.Estimate.comparable_bytes`), their ``ratio`` (measured / estimated), the batch
    shape, seconds, and the meter's record. ``estimate``: the preflight's estimate of ``spec`` on this device.
    """
    import torch

    from fitburst.builders import build_model, count_params, make_optimizer, refuse_problems
    from fitburst.device import make_amp, probed_device, resolve_precision, select_device
    from fitburst.meter import MemoryMeter
    from fitburst.models import resolve_model
    from fitburst.train import optimizer_step

    tr = spec.training
    device = device or select_device(spec.preflight.device)
    resolved = resolve_model(spec)
    refuse_problems(spec, resolved.family, 1, probed_device(device), resolved=resolved)  # before the load
    precision = resolve_precision(tr.precision, device)
    amp = make_amp(precision, device, pure_bf16=tr.pure_bf16)
    torch.manual_seed(tr.seed)
    t0 = time.perf_counter()
    meter = MemoryMeter(device)
    meter.reset()
    model, tok = build_model(spec, device, precision, resolved=resolved)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(tr.optimizer, params, tr.learning_rate, tr.weight_decay)
    batch = longest_batch(prepared, tr.micro_batch_size, tok.pad_token_id)
    seq_len = int(batch["input_ids"].shape[1])
    model.train()
    losses = []
    tracker = None
    if device == "cpu":  # RSS cannot see memory glibc already holds: count tensor storages exactly instead
        tracker = TensorTracker()
        tracker.add(list(model.parameters()) + list(model.buffers()) + list(batch.values()))
    import contextlib

    with tracker if tracker is not None else contextlib.nullcontext():
        for _ in range(steps):
            t_step = time.perf_counter()
            losses.append(optimizer_step(model, optimizer, params, [batch] * tr.grad_accum, device=device,
                                         max_grad_norm=tr.max_grad_norm, amp=amp))
            step_seconds = time.perf_counter() - t_step  # the last step: warm-up (first step) excluded
            meter.sample()
    peak = meter.peak()
    if tracker is not None:
        peak = replace(peak, allocated_bytes=tracker.peak, method="live tensor storages (dispatch tracker)")
    seconds = time.perf_counter() - t0
    trainable, total = count_params(model)
    del model, optimizer, params

    kind = device.split(":")[0]
    # what the measurement compares with: allocated (CUDA allocator, CPU tensor tracker); reserved on MPS
    est_alloc = estimate.allocated_peak_bytes if tracker is not None else estimate.comparable_bytes(kind)
    measured = peak.allocated_bytes
    return {
        "device": device,
        "precision": precision,
        "steps": steps,
        "batch": int(batch["input_ids"].shape[0]),
        "seq_len": seq_len,
        "measured_peak_bytes": measured,
        "measured_reserved_bytes": peak.reserved_bytes,
        "measured_rss_peak_bytes": peak.rss_peak_bytes,
        "estimated_peak_bytes": est_alloc,
        "estimated_reserved_bytes": estimate.reserved_peak_bytes or est_alloc,
        "ratio": (measured / est_alloc) if measured and est_alloc else None,
        "losses": losses,
        "seconds": seconds,
        "step_seconds": step_seconds,
        # padded tokens of the longest batch per optimizer step / its time: what fitburst.hours times the run by
        "tokens_per_s": tr.grad_accum * int(batch["input_ids"].numel()) / step_seconds if step_seconds else None,
        "trainable_params": trainable,
        "total_params": total,
        "meter": peak.to_dict(),
    }


def _make_tracker():
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Tracker(TorchDispatchMode):
        """Live tensor storages seen by the dispatcher (exact bytes, like the CUDA allocator's allocated)."""

        def __init__(self):
            super().__init__()
            self.live: dict[int, tuple] = {}
            self.cur = self.peak = 0

        def _purge(self):
            dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
            for k in dead:
                self.cur -= self.live.pop(k)[1]

        def add(self, tensors):
            self._purge()
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                k = st.data_ptr()
                if k == 0 or k in self.live:
                    continue
                self.live[k] = (StorageWeakRef(st), st.nbytes())
                self.cur += st.nbytes()
            self.peak = max(self.peak, self.cur)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.add(tree_leaves(out))
            return out

    return Tracker


def TensorTracker():  # noqa: N802
    """A dispatch mode that counts live tensor storages: ``with t:`` ... ``t.peak`` (bytes)."""
    return _make_tracker()()
