"""The Recipe: one run's training, read top to bottom: set-up, the loop, save. LoRA, QLoRA and full fine-tuning on
CUDA, MPS or CPU.

Config in (a resolved :class:`PipelineSpec` and the prepared data), a run folder out: ``adapter/`` (peft adapter
+ tokenizer), ``checkpoints/step-N/`` (resumable state, :mod:`fitburst.checkpoints`), ``metrics.jsonl`` (the loss
curve) and ``train_result.json`` (steps, timings, measured memory peak). A crash, Ctrl-C or OOM saves a
checkpoint first; running again on the same run folder resumes from the newest one.

Each rank torchrun starts (``WORLD_SIZE`` > 1) runs the Recipe directly (``fitburst train``): it trains one shard
of the run with FSDP2 (:mod:`fitburst.distributed`): each rank reads its share of every step's samples, the loss is
weighted by the label tokens of the whole step, checkpoints are sharded, and rank 0 alone writes the run folder.
What wraps it (the run folder's claim, the OOM step-down, starting the ranks, MLflow, evaluation) is the
supervisor's (:mod:`fitburst.supervisor`); nothing here calls back up.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from fitburst import distributed
from fitburst.builders import (
    activation_offloading,
    build_model,
    count_params,
    loss_kernel,
    make_optimizer,
    refuse_offload_beyond_host_ram,
    refuse_problems,
)
from fitburst.checkpoints import (
    checkpoint_samples,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    spec_keeping_effective_batch,
)
from fitburst.data import PreparedData, batch_tokens, load_split
from fitburst.device import make_amp, probed_device, resolve_precision, select_device, warn_pure_bf16
from fitburst.distributed import World
from fitburst.memory.cuda_kernels import adamw_impl
from fitburst.meter import MemoryMeter
from fitburst.models import ResolvedModel, resolve_model
from fitburst.pace import pace_for, progress_fields, synchronize
from fitburst.spec import PipelineSpec
from fitburst.train import MetricsFn, TrainError, TrainResult, batches, optimizer_step, total_steps

log = logging.getLogger(__name__)


def train(spec: PipelineSpec, prepared: PreparedData, run_dir: str | Path, *, device: str | None = None,
          on_metrics: MetricsFn | None = None, progress: bool = True, stop_after: int | None = None) -> TrainResult:
    """Train ``spec`` on ``prepared`` into ``run_dir`` (resuming from its newest checkpoint): :class:`Recipe`, for
    the tests and benchmarks that train one spec directly."""
    return Recipe(spec, prepared, run_dir, device=device, on_metrics=on_metrics, progress=progress,
                  stop_after=stop_after).run()


class Recipe:
    """Train ``spec`` on ``prepared`` into ``run_dir`` (resuming from its newest checkpoint): :meth:`run` is
    :meth:`setup`, :meth:`loop`, :meth:`save`, in that order.

    ``resolved``: the model's reference, family and shape as the supervisor resolved them (default: resolved here,
    as a rank torchrun started does). ``stop_after`` ends the loop early after that many optimizer steps (for tests
    of interruption). Started by torchrun, every rank runs it; rank 0's result is the run's (it alone writes the
    run folder and calls ``on_metrics``)."""

    def __init__(self, spec: PipelineSpec, prepared: PreparedData, run_dir: str | Path, *,
                 resolved: ResolvedModel | None = None, device: str | None = None,
                 on_metrics: MetricsFn | None = None, progress: bool = True, stop_after: int | None = None):
        self.spec, self.prepared, self.run_dir, self.device = spec, prepared, Path(run_dir), device or ""
        self.resolved = resolved
        self.on_metrics, self.progress, self.stop_after = on_metrics, progress, stop_after

    def run(self) -> TrainResult:
        from fitburst.memory.model_kernels import transformers_restored

        # training.liger_kernels patches transformers' modeling modules for the process: this process's next model
        # (another run in a Prefect worker, a trace) is built from transformers' own classes again
        with transformers_restored():
            self.setup()
            self.loop()
            return self.save()

    # --- set-up ----------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Device, precision and loss kernel; the checkpoint to resume; AMP; model, optimizer and schedule (builders
        chosen from the config, :mod:`fitburst.builders`), restored from the checkpoint; the data stream. Everything
        a setting can refuse is refused before the model loads."""
        import torch  # heavy: loaded only when training

        self.run_dir.mkdir(parents=True, exist_ok=True)
        spec, w = self.spec, distributed.world()
        resolved = self.resolved = self.resolved or resolve_model(spec)
        self.family, self.shape = resolved.family, resolved.shape
        self.device = self.device or select_device(spec.preflight.device)
        refuse_problems(spec, self.family, w.size, probed_device(self.device), resolved=resolved)  # before the load
        if w.sharded:
            refuse_offload_beyond_host_ram(spec, self.shape, w)
            self.device = distributed.start(w, self.device)
        self.world, device = w, self.device
        kind = device.split(":")[0]  # a rank's GPU is cuda:<local rank>
        self.precision = resolve_precision(spec.training.precision, kind)
        self.kernel = loss_kernel(spec, kind, self.precision)
        warn_pure_bf16(spec.training.pure_bf16, spec.training.learning_rate)
        ckpt, meta = self._checkpoint_to_resume()
        # a resume at another world size keeps the effective batch; before the model loads: a refusal costs nothing
        self.spec = spec = spec_keeping_effective_batch(spec, meta, w)
        tr = spec.training
        self.amp = make_amp(self.precision, device, pure_bf16=tr.pure_bf16, sharded=w.sharded)
        torch.manual_seed(tr.seed)

        self.meter = MemoryMeter(device)
        self.meter.reset()
        self.model, self.tok = build_model(spec, device, self.precision, world=w, resolved=resolved)
        self.trainable, self.total = count_params(self.model)
        self.offload = activation_offloading(spec, self.model, kind)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(tr.optimizer, self.params, tr.learning_rate, tr.weight_decay,
                                        adamw_impl(kind, w.size))
        self.steps = total_steps(spec, self.prepared.n_train, w.size)
        # imported after the refusals: transformers' optimization module pulls in peft, bitsandbytes (which
        # compiles at import) and scikit-learn, ~5 s of a process that a refused run need not spend (every fitburst
        # process has left out scikit-learn, and a rank bitsandbytes unless its run uses it: fitburst.unused_imports)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(tr.lr_scheduler, self.optimizer, num_warmup_steps=tr.warmup_steps,
                                       num_training_steps=self.steps)

        self.step, self.resumed_from, self.samples = 0, None, 0
        self.per_step = w.size * tr.micro_batch_size * tr.grad_accum  # samples one optimizer step takes, all ranks
        if ckpt is not None:
            self.step = self.resumed_from = load_checkpoint(ckpt, self.model, self.optimizer, self.scheduler, device,
                                                            amp=self.amp, world=w, params=self.params, meta=meta)
            self.samples = checkpoint_samples(ckpt, self.per_step)
            log.info("resuming from %s (step %d of %d)", ckpt, self.step, self.steps)
        rows = load_split(self.prepared, "train").to_list()
        self.stream = batches(rows, tr.micro_batch_size, self.tok.pad_token_id, tr.seed,
                              self.samples // (w.size * tr.micro_batch_size), tr.packing,
                              collate=self.family.collate, world=w)

    def _checkpoint_to_resume(self) -> tuple[Path | None, dict | None]:
        """The run folder's newest checkpoint and its ``state.json``. Several ranks: rank 0's folder decides; each
        node reads its own ranks' part from its own disk."""
        w = self.world
        ckpt = latest_checkpoint(self.run_dir) if w.main else None
        meta = json.loads((ckpt / "state.json").read_text()) if ckpt is not None else None
        if w.sharded:
            name, meta = distributed.broadcast((ckpt.name if ckpt is not None else None, meta))
            ckpt = self.run_dir / "checkpoints" / name if name is not None else None
        return ckpt, meta

    # --- the loop --------------------------------------------------------------------------------------------

    def loop(self) -> None:
        """Optimizer steps until the run's last (or ``stop_after``): each step accumulates ``grad_accum``
        micro-batches, logs at ``log_every`` and checkpoints at ``checkpoint_every``. An OOM, Ctrl-C or crash keeps
        a checkpoint first (several ranks: the last one stands, and the rank records why it stopped), then
        propagates."""
        import torch  # heavy: loaded only when training
        from tqdm.auto import tqdm

        spec, w, device = self.spec, self.world, self.device
        metrics_file = (self.run_dir / "metrics.jsonl").open("a") if w.main else None
        self.model.train()
        bar = tqdm(total=self.steps, initial=self.step, desc=f"train {spec.name}",
                   disable=not self.progress or not w.main, unit="step")
        self.t0, self.tokens, self.start_step = time.perf_counter(), 0, self.step
        self.pace = pace_for(self.shape, device, self.total)
        # the window's loss stays on the device, summed there: read (a wait for the device) at log intervals only
        self.window_loss, self.window_tokens, self.last_loss = torch.zeros((), device=device), 0, float("nan")
        try:
            while self.step < self.steps and (self.stop_after is None or self.step - self.start_step < self.stop_after):
                self._step()
                bar.update(1)
                if self.step % spec.training.log_every == 0 or self.step == self.steps:
                    bar.set_postfix(progress_fields(self._log(metrics_file)))
                if self.step == self.start_step + 1:  # the warm-up step: the pace is timed from here
                    self.pace.start()
                if self.step % spec.training.checkpoint_every == 0 and self.step < self.steps:
                    self._checkpoint()
        except BaseException as exc:  # OOM, Ctrl-C, crash: keep the work, then let it propagate
            self._keep_work(exc)
            if isinstance(exc, torch.OutOfMemoryError):
                raise TrainError(f"out of memory at step {self.step} on {device}: lower training.micro_batch_size "
                                 "or method.rank, enable gradient_checkpointing, or let the preflight plan it "
                                 f"(fitburst preflight {spec.name}); a rerun resumes from the last checkpoint") from exc
            raise
        finally:
            bar.close()
            if metrics_file is not None:
                metrics_file.close()
        self.seconds = time.perf_counter() - self.t0

    def _step(self) -> None:
        """One optimizer step over ``grad_accum`` micro-batches; its loss is added to the log window on the device."""
        tr, w, amp = self.spec.training, self.world, self.amp
        micro = [next(self.stream) for _ in range(tr.grad_accum)]
        n_items: Any = sum(self.family.label_tokens(b) for b in micro)
        if w.sharded:
            n_items = distributed.all_sum(n_items, self.device)
        loss = optimizer_step(self.model, self.optimizer, self.params, micro, device=self.device,
                              max_grad_norm=tr.max_grad_norm, amp=amp, loss=self.kernel, offload=self.offload,
                              n_items=n_items, world=w, on_device=True, family=self.family)
        if not amp.last_step_skipped:  # as accelerate does: a skipped step does not advance the schedule
            self.scheduler.step()
        self.tokens += sum(batch_tokens(b) for b in micro)
        self.pace.add(micro)
        self.meter.sample()
        self.step += 1
        self.samples += self.per_step
        self.window_loss += loss * n_items
        self.window_tokens += n_items

    def _log(self, metrics_file) -> dict:
        """The log row of the window since the last one (its token-weighted loss: a wait for the device), written
        to ``metrics.jsonl`` and passed to ``on_metrics``; the window restarts."""
        import torch  # heavy: loaded only when training

        self.last_loss = (self.window_loss / max(int(self.window_tokens), 1)).item()  # token-weighted, as a step's
        row = {"train_loss": self.last_loss, "learning_rate": self.scheduler.get_last_lr()[0], **self.pace.rates()}
        if self.amp.scaler is not None:  # the scale as the step read it: no second wait for the device
            row.update(skipped_steps=self.amp.skipped_steps, loss_scale=self.amp.scale)
        if metrics_file is not None:
            metrics_file.write(json.dumps({"step": self.step, **row}) + "\n")
            metrics_file.flush()
        if self.on_metrics and self.world.main:
            self.on_metrics(row, self.step)
        self.window_loss, self.window_tokens = torch.zeros((), device=self.device), 0
        return row

    def _checkpoint(self) -> Path:
        return save_checkpoint(self.run_dir, self.step, self.model, self.optimizer, self.scheduler, amp=self.amp,
                               world=self.world, samples=self.samples, samples_per_step=self.per_step)

    def _keep_work(self, exc: BaseException) -> None:
        """What a stopped loop keeps: one process saves a checkpoint (when it got past the one it resumed); a rank
        records why it stopped (a checkpoint is collective and the other ranks may be anywhere)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.world.sharded:
            record_rank_failure(self.run_dir, self.world, self.step, exc, self.meter)
        elif self.step > (self.resumed_from or 0):
            path = self._checkpoint()
            log.error("training stopped at step %d (%s); resumable checkpoint: %s", self.step, type(exc).__name__,
                      path)

    # --- save ------------------------------------------------------------------------------------------------

    def save(self) -> TrainResult:
        """A checkpoint where the loop stopped early; the trained weights (``adapter/``); the run's result, with
        every rank's peak and tokens (rank 0 writes ``train_result.json``)."""
        w, device = self.world, self.device
        synchronize(device)  # the last step's work done: the pace's clock reads the device's time
        rates = self.pace.rates()
        if self.step < self.steps:  # stopped early on request: keep a checkpoint so a rerun picks up here
            self._checkpoint()
        adapter_dir = self.run_dir / "adapter"
        save_trained(self.model, self.tok, adapter_dir, self.spec, w)
        peak, tokens = self.meter.peak(), self.tokens
        rank_peaks = distributed.gather(peak) if w.sharded else []
        if rank_peaks:
            peak = max(rank_peaks, key=lambda p: p.allocated_bytes or 0)
            tokens = int(distributed.all_sum(tokens, device).item())  # every rank's samples
        done, seconds, tr = self.step - self.start_step, self.seconds, self.spec.training
        result = TrainResult(
            run_dir=str(self.run_dir), adapter_dir=str(adapter_dir), device=device, precision=self.precision,
            steps=self.step, total_steps=self.steps, final_loss=self.last_loss, seconds=seconds,
            steps_per_sec=rates.get("steps_per_s", done / seconds if seconds else 0.0),
            tokens_per_sec=rates.get("tokens_per_s", tokens / seconds if seconds else 0.0), mfu=rates.get("mfu"),
            tokens=tokens, trainable_params=self.trainable, total_params=self.total, resumed_from=self.resumed_from,
            skipped_steps=self.amp.skipped_steps, peak=peak, loss=self.kernel,
            activation_offloading=self.offload is not None, world_size=w.size, rank_peaks=rank_peaks,
            grad_accum=tr.grad_accum, samples_per_step=self.per_step)
        if w.main:
            result.save()
        return result


def save_trained(model, tok, dest: Path, spec: PipelineSpec, w: World) -> None:
    """The trained weights as an ordinary folder: the peft adapter (a full fine-tune: the model) and the tokenizer.
    Several ranks: the trainable weights (a full fine-tune: every weight) gathered on rank 0, which writes them."""
    if not w.sharded:
        model.save_pretrained(dest)
        tok.save_pretrained(dest)
        return
    state = distributed.gathered_state(model, trainable_only=spec.method.type != "full")
    # a tied weight (an output head sharing the embeddings) is gathered under both names, as two tensors that
    # save_pretrained cannot tell are one: keep the name it saves from one process
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    state = {k: v for k, v in state.items() if k not in aliases}
    if w.main:
        model.save_pretrained(dest, state_dict=state)
        tok.save_pretrained(dest)
    distributed.barrier()


def record_rank_failure(run_dir: Path, w: World, step: int, exc: BaseException, meter: MemoryMeter) -> None:
    """``rank-<r>.failed.json`` in the run folder: what stopped this rank (an out-of-memory error's kind, the
    message, the peak), for the process that started torchrun (the other ranks are ended by torchrun)."""
    from fitburst.oom_errors import oom_kind  # torch: a rank failed

    record = {"rank": w.rank, "step": step, "type": type(exc).__name__, "oom_kind": oom_kind(exc),
              "error": str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
              "peak_bytes": meter.peak().allocated_bytes}
    (run_dir / f"rank-{w.rank}.failed.json").write_text(json.dumps(record))
