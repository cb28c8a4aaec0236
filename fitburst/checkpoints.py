"""Resumable checkpoints of a run folder: ``checkpoints/step-N/`` holds the trainable weights, the optimizer,
scheduler, GradScaler and RNG states (several ranks: FSDP's shards, :mod:`fitburst.distributed`), written
atomically, the oldest pruned; a resume at another world size keeps the effective batch."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from fitburst import distributed
from fitburst.device import Amp
from fitburst.distributed import SINGLE, World
from fitburst.spec import PipelineSpec
from fitburst.train import TrainError

log = logging.getLogger(__name__)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = [p for p in (run_dir / "checkpoints").glob("step-*")
             if not p.name.endswith(".tmp") and (p / "state.json").exists()]  # a .tmp: a save cut short
    return max(ckpts, key=lambda p: int(p.name.split("-")[1]), default=None)


def rng_states() -> dict:
    """The RNG states to resume with: CPU always, CUDA and MPS where that device is available."""
    import torch  # heavy: loaded only when training

    states: dict[str, torch.Tensor | list[torch.Tensor]] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        states["mps"] = torch.mps.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    import torch  # heavy: loaded only when training

    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "mps" in states and torch.backends.mps.is_available():
        torch.mps.set_rng_state(states["mps"])


def _checkpoint_state(scheduler, amp: Amp | None) -> dict:
    scaler = amp.scaler if amp is not None else None
    return {"scheduler": scheduler.state_dict(), "rng": rng_states(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "skipped_steps": amp.skipped_steps if amp is not None else 0}


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, keep: int = 2, *,
                    amp: Amp | None = None, world: World = SINGLE, samples: int | None = None,
                    samples_per_step: int | None = None) -> Path:
    """Trainable weights, optimizer, scheduler, GradScaler and RNG states; written atomically, oldest pruned.
    ``samples``: the samples the run has consumed (where the data stream resumes, whatever the world size then);
    ``samples_per_step``: its effective batch, all ranks' (a resume at another world size keeps it:
    :func:`spec_keeping_effective_batch`).

    Several ranks (collective: every rank calls it): the weights and optimizer state as sharded by FSDP, through
    torch.distributed.checkpoint (:func:`fitburst.distributed.save_sharded`); the rest is rank 0's (the same on every
    rank but the RNG, which restarts from rank 0's). The first rank of each node renames and prunes its node's
    folder, so a multi-node run's checkpoint is whole once the nodes' folders are copied together."""
    import torch  # heavy: loaded only when training
    from safetensors.torch import save_file

    dest = run_dir / "checkpoints" / f"step-{step}"
    tmp = dest.with_name(dest.name + ".tmp")
    meta = {"step": step, "samples": samples, "world_size": world.size, "samples_per_step": samples_per_step}
    if not world.sharded:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weights = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        save_file(weights, str(tmp / "trainable.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), **_checkpoint_state(scheduler, amp)}, tmp / "optim.pt")
        (tmp / "state.json").write_text(json.dumps(meta))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        _prune(run_dir, keep)
        return dest
    if world.node_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    distributed.save_sharded(tmp, model, optimizer, world)
    state = _checkpoint_state(scheduler, amp)
    if world.node_main:
        torch.save(state, tmp / "train_state.pt")
        (tmp / "state.json").write_text(json.dumps(meta))
    distributed.barrier()
    for turn in (world.main, world.node_main and not world.main):  # rank 0 first: on a shared disk it is done
        if turn and tmp.exists():
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
            _prune(run_dir, keep)
        distributed.barrier()
    return dest


def _prune(run_dir: Path, keep: int) -> None:
    older = sorted((p for p in (run_dir / "checkpoints").glob("step-*") if not p.name.endswith(".tmp")),
                   key=lambda p: int(p.name.split("-")[1]))
    for p in older[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


FRESH_OPTIMIZER = "fresh_optimizer"  # state.json: the optimizer restarts its moments (its class changed)


def drop_optimizer_state(ckpt: Path) -> None:
    """Keep the step, schedule and hyper-parameters of a checkpoint when its optimizer class changes (AdamW ->
    AdamW8bit): the moments cannot be carried across formats, so the new optimizer starts them fresh."""
    import torch  # heavy: loaded only when training

    if distributed.is_sharded(ckpt):
        meta = json.loads((ckpt / "state.json").read_text())
        (ckpt / "state.json").write_text(json.dumps({**meta, FRESH_OPTIMIZER: True}))
        return
    state = torch.load(ckpt / "optim.pt", map_location="cpu", weights_only=False)
    state["optimizer"] = {"state": {}, "param_groups": state["optimizer"]["param_groups"]}
    torch.save(state, ckpt / "optim.pt")


def load_checkpoint(ckpt: Path, model, optimizer, scheduler, device: str, *, amp: Amp | None = None,
                    world: World = SINGLE, params: list | None = None, meta: dict | None = None) -> int:
    """Restore a checkpoint written by :func:`save_checkpoint` at any world size into this run (sharded or not);
    returns its step. ``meta``: its ``state.json`` as rank 0 read it (every rank must load the same parts), else
    read here."""
    import torch  # heavy: loaded only when training
    from safetensors.torch import load_file

    meta = meta or json.loads((ckpt / "state.json").read_text())
    if distributed.is_sharded(ckpt):
        distributed.load_sharded(ckpt, model, None if meta.get(FRESH_OPTIMIZER) else optimizer)
        state = torch.load(ckpt / "train_state.pt", map_location="cpu", weights_only=False)
        if meta.get(FRESH_OPTIMIZER):  # the schedule's learning rate, as the dropped state would have held it
            for group, lr in zip(optimizer.param_groups, state["scheduler"]["_last_lr"], strict=False):
                group["lr"] = lr
    else:
        weights = load_file(str(ckpt / "trainable.safetensors"), device="cpu" if world.sharded else device)
        missing = set(weights) - {n for n, p in model.named_parameters() if p.requires_grad}
        if missing:
            raise TrainError(f"{ckpt} does not match this model/method (unknown tensors such as "
                             f"{sorted(missing)[:2]}): start a new run folder")
        # on the CPU: RNG states must stay CPU tensors; the optimizer moves its state to each parameter's device
        state = torch.load(ckpt / "optim.pt", map_location="cpu", weights_only=False)
        if world.sharded:  # a one-process checkpoint resumed on several ranks: each keeps its shards
            distributed.load_full_trainable(model, weights, optimizer, params or [], state["optimizer"])
        else:
            model.load_state_dict(weights, strict=False)
            optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_states(state["rng"])
    if amp is not None:
        if amp.scaler is not None and state.get("scaler"):
            amp.scaler.load_state_dict(state["scaler"])
            amp.scale = None  # the checkpoint's: read again at the next step
        amp.skipped_steps = state.get("skipped_steps", 0)
    return meta["step"]


def checkpoint_samples(ckpt: Path, samples_per_step: int) -> int:
    """The samples a run had consumed at a checkpoint (where its data stream resumes): as recorded, else (written by
    an earlier fitburst) its step times this run's samples per step."""
    meta = json.loads((ckpt / "state.json").read_text())
    samples = meta.get("samples")
    return int(samples) if samples is not None else meta["step"] * samples_per_step


def spec_keeping_effective_batch(spec: PipelineSpec, meta: dict | None, w: World) -> PipelineSpec:
    """The spec a run resuming from a checkpoint (its ``state.json``, ``meta``; None: a fresh run) trains with.
    Resumed at another world size than the checkpoint's, an optimizer step must take as many samples as it did
    (``samples_per_step``: ranks x ``micro_batch_size`` x ``grad_accum``), or the run would go on with another
    effective batch under the same learning-rate schedule: ``grad_accum`` is set to keep it, and where no whole
    ``grad_accum`` does with this ``micro_batch_size``, the resume is refused with what to set. At the same world
    size the spec stands as it is (the OOM step-down trades micro-batch for accumulation itself)."""
    if meta is None or meta.get("world_size", 1) == w.size:
        return spec
    tr, step = spec.training, meta["step"]
    want = meta.get("samples_per_step") or (meta["samples"] // step if meta.get("samples") and step else None)
    if want is None or want == w.size * tr.micro_batch_size * tr.grad_accum:
        return spec
    was = f"{meta.get('world_size', 1)} rank(s)"
    if want % (w.size * tr.micro_batch_size) == 0:
        accum = want // (w.size * tr.micro_batch_size)
        log.warning("resuming a checkpoint of %s on %d: training.grad_accum %d -> %d keeps its %d samples per "
                    "optimizer step", was, w.size, tr.grad_accum, accum, want)
        return spec.with_overrides({"training.grad_accum": accum})
    if want % w.size:
        fix = f"resume on a number of ranks that divides {want}, or start a new run folder to train with another batch"
    else:
        per_rank = want // w.size
        micro = max(m for m in range(1, tr.micro_batch_size + 1) if per_rank % m == 0)
        fix = (f"set training.micro_batch_size: {micro} and training.grad_accum: {per_rank // micro} (any pair "
               f"whose product is {per_rank})")
    raise TrainError(f"pipeline '{spec.name}': the checkpoint at step {step} trained {want} samples per optimizer "
                     f"step on {was}; on {w.size} ranks training.micro_batch_size {tr.micro_batch_size} takes no "
                     f"whole training.grad_accum to {want}: {fix}")
