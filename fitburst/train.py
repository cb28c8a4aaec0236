"""The training recipe: one readable loop for LoRA, QLoRA and full fine-tuning on CUDA, MPS or CPU.

Config in (a resolved :class:`PipelineSpec` and the prepared data), a run folder out:
``adapter/`` (peft adapter + tokenizer), ``checkpoints/step-N/`` (resumable state), ``metrics.jsonl`` (the loss
curve) and ``train_result.json`` (steps, timings, measured memory peak). A crash, Ctrl-C or OOM saves a
checkpoint first; running again on the same run folder resumes from the newest one.

Started by torchrun (``WORLD_SIZE`` > 1), the same loop trains one shard of the run per process with FSDP2
(:mod:`fitburst.distributed`): each rank reads its share of every step's samples, the loss is weighted by the
label tokens of the whole step, checkpoints are sharded, and rank 0 alone writes the run folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from fitburst import distributed
from fitburst.data import PreparedData, batch_tokens, collate, load_split
from fitburst.device import (
    Amp,
    make_amp,
    resolve_precision,
    select_device,
    warn_pure_bf16,
)
from fitburst.distributed import SINGLE, World
from fitburst.errors import UserError
from fitburst.families import Family, family_for
from fitburst.hardware import resolve_device
from fitburst.memory.cuda_kernels import adamw_impl
from fitburst.memory.fsdp_terms import loads_once
from fitburst.meter import MemoryMeter, MemoryPeak
from fitburst.models import load_pipeline_model, model_family, prepare_kbit, tokenizer_for
from fitburst.rules import device_of_kind, explain, problems
from fitburst.settings import settings_from_spec
from fitburst.spec import PipelineSpec, resolve_quant

log = logging.getLogger(__name__)

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


# --- model setup ---------------------------------------------------------------------------------------

def build_model(spec: PipelineSpec, device: str, precision: str, *, world: World = SINGLE):
    """Load the base model once (:func:`fitburst.models.load_pipeline_model`) and wrap it for the configured
    method. Several ranks (``world``): shard it with FSDP2 over the process group (:func:`fitburst.distributed.shard`),
    each rank's shards on ``device``. Unless its weights are 4-bit (:func:`fitburst.memory.fsdp_terms.loads_once`),
    only rank 0 reads the checkpoint: the other ranks build the same model without weights, LoRA adapters included,
    and receive every weight, the adapters' initial ones too, from rank 0 (:func:`fitburst.distributed.
    fill_from_rank0`). Returns (model, tokenizer)."""
    if not world.sharded:
        return prepare_for_training(load_pipeline_model(spec, device, precision), spec), tokenizer_for(spec.model)
    fs = spec.training.fsdp
    once = loads_once(resolve_quant(spec.method.type, spec.method.quant))
    model = prepare_for_training(load_pipeline_model(spec, device, precision, sharded=True,
                                                     empty=once and not world.main), spec)
    distributed.same_layout(model)
    full = model.state_dict() if once and world.main else {}  # references to rank 0's weights, no copy
    distributed.shard(model, precision, reshard_after_forward=fs.reshard_after_forward,
                      cpu_offload=fs.cpu_offload, pure_bf16=spec.training.pure_bf16)
    if once:  # offloaded shards live in host memory, as FSDP's CPU offload keeps them
        distributed.fill_from_rank0(model, full, "cpu" if fs.cpu_offload else device)
        del full  # rank 0's whole copy goes: each rank now holds its shards only
    else:
        _quant_states_to(model, device)
    return model, tokenizer_for(spec.model)


def _quant_states_to(model, device: str) -> None:
    """A 4-bit layer's quantization state (absmax, code) stays on the module when FSDP turns its weight into a
    shard (bitsandbytes restores it onto the gathered weight in forward); it goes to the rank's device with the
    shards. Nothing to do for an unquantized model."""
    for m in model.modules():
        state = getattr(m, "quant_state", None)
        if state is not None and hasattr(state, "to"):
            state.to(device)


def prepare_for_training(model, spec: PipelineSpec):
    """Wrap a loaded base model for the configured method (k-bit prep, checkpointing, LoRA). The preflight's
    trace applies this same function to a model built on the meta device, so estimate and training cannot drift."""
    import torch  # heavy: loaded only when training

    method, tr = spec.method, spec.training
    model.config.use_cache = False
    if method.quant != "none":
        # FSDP's mixed precision gathers every weight in 16 bits: a sharded run keeps peft's preparation as it is
        model = prepare_kbit(model, gradient_checkpointing=tr.gradient_checkpointing,
                             frozen_fp32=method.frozen_fp32 or tr.distributed == "fsdp")
    elif tr.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if method.type != "full":
            model.enable_input_require_grads()
    family = family_for(model.config)
    refuse_problems(spec, family)
    init = spec.init_folder()
    if init is not None:  # method.init_from, fetched and checked by fitburst.init_adapter: its weights train on
        from peft import LoraConfig, PeftModel, get_peft_model  # heavy: loaded only when training

        if next(model.parameters()).is_meta:  # the preflight's trace: the adapter's layers, no weights to read
            config = LoraConfig.from_pretrained(str(init))
            config.inference_mode = False
            model = get_peft_model(model, config)
        else:
            model = PeftModel.from_pretrained(model, str(init), is_trainable=True)
    elif method.type in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model  # heavy: loaded only when training

        check_lora_targets(model, method.target_modules, spec.name)
        targets = family.lora_targets(model, method.target_modules, method)
        # peft annotates lora_alpha as int; its scaling (alpha / r) takes the spec's real-valued alpha as is
        model = get_peft_model(model, LoraConfig(
            r=method.rank, lora_alpha=method.alpha,  # type: ignore[arg-type]
            lora_dropout=method.dropout, task_type=family.peft_task_type,
            target_modules=targets if targets == "all-linear" else list(targets)))
    else:
        family.freeze(model, method)
    if tr.tiled_mlp:
        from fitburst.models import spec_shape, tile_mlps

        try:
            tile_mlps(model, spec_shape(spec))
        except ValueError as e:
            raise TrainError(f"pipeline '{spec.name}': training.tiled_mlp: {e}: set it false") from None
    if not tr.pure_bf16:  # mixed precision: what trains (and so its optimizer state) is fp32
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    return model


def loss_kernel(spec: PipelineSpec, device: str, precision: str) -> str:
    """The loss the run trains with: "standard", or for ``training.loss: fused`` the fused kernel that runs on
    ``device`` (:func:`fitburst.hardware.fused_loss_kernel`), its library checked installed. ``auto`` trains with
    the standard loss unless a plan switched it to fused."""
    if spec.training.loss != "fused":
        return "standard"
    from fitburst.families.loss import check_installed
    from fitburst.hardware import fused_loss_kernel, resolve_device

    named = spec.preflight.device
    kernel, why = fused_loss_kernel(resolve_device(named if named not in ("auto", device) else device), precision)
    check_installed(kernel)
    log.info("fused loss: %s", why)
    return kernel


def activation_offloading(spec: PipelineSpec, model, device: str) -> contextlib.AbstractContextManager | None:
    """TRL's activation-offloading context for ``model`` (saved tensors to pinned host memory, copied on a side
    stream) when ``training.activation_offloading`` asks for it (CUDA only: :func:`refuse_problems` refused it
    elsewhere before the model loaded)."""
    if not spec.training.activation_offloading:
        return None
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise TrainError("training.activation_offloading runs TRL's offloading context, which is not installed: "
                         "pip install 'fitburst[lean]'")
    from trl.models.activation_offloading import get_act_offloading_ctx_manager  # heavy, optional: lean extra

    return get_act_offloading_ctx_manager(model, warn_if_no_head=False)


def refuse_problems(spec: PipelineSpec, family: Family, world_size: int = 1, kind: str | None = None) -> None:
    """A TrainError naming each field and its fix where what this process runs (``world_size`` processes on a
    ``kind`` device: cuda | mps | cpu, None: not known) breaks a row of the rule table
    (:func:`fitburst.rules.problems`)."""
    s = replace(settings_from_spec(spec), world_size=world_size)
    found = problems(s, device_of_kind(kind) if kind else None, family)
    if found:
        raise TrainError(explain(spec.name, found))


def check_lora_targets(model, targets: list[str] | str, where: str) -> None:
    """Every name of an explicit ``target_modules`` list must name a module of ``model`` (peft would silently
    skip the others, or fail on none with no hint); a miss says what was meant and lists the linear layers.
    ``all-linear`` fits every model. Names peft maps onto fused expert parameters (Mixtral's w1/w2/w3) count."""
    import difflib

    import torch  # heavy: loaded only when training

    from fitburst.memory.shapes import EXPERT_ALIASES

    if targets == "all-linear":
        return
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n}
    names |= set(EXPERT_ALIASES.get(getattr(model.config, "model_type", ""), {}))
    head = model.get_output_embeddings()
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and m is not head})
    missing = [t for t in targets if t.rsplit(".", 1)[-1] not in names]
    if missing:
        hints = []
        for t in missing:
            close = difflib.get_close_matches(t.rsplit(".", 1)[-1], linears, n=1)
            hints.append(f"{t!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TrainError(f"{where}: method.target_modules {', '.join(hints)} name no layer of this model; its "
                         f"linear layers: {', '.join(linears)} (or target_modules: all-linear, every one of them "
                         "but the output head)")


def make_optimizer(name: str, params: list, lr: float, weight_decay: float, adamw: str = "for-loop"):
    """The run's optimizer; ``adamw``: how AdamW steps (:func:`fitburst.memory.cuda_kernels.adamw_impl`: fused,
    foreach or for-loop), which the estimates model."""
    import torch  # heavy: loaded only when training

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=adamw == "fused" or None,
                                 foreach=adamw == "foreach")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    import bitsandbytes as bnb  # heavy: loaded only when training

    cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw8bit" else bnb.optim.AdamW8bit
    return cls(params, lr=lr, weight_decay=weight_decay)


def count_params(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


# --- checkpoints -----------------------------------------------------------------------------------------

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


# --- the loop --------------------------------------------------------------------------------------------

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


def optimizer_step(model, optimizer, params: list, micro_batches: list[dict], *, device: str,
                   max_grad_norm: float | None, amp: Amp | None = None, loss: str = "standard",
                   offload: contextlib.AbstractContextManager | None = None, n_items=None, world: World = SINGLE,
                   on_device: bool = False) -> Any:
    """One optimizer step over ``micro_batches`` (gradient accumulation over all of them); returns the loss: a float,
    or with ``on_device`` a 0-d tensor on ``device`` (the loop's: reading a value on the host waits for the device to
    finish the step, so the loop reads the loss at log intervals only).

    The loss is token-weighted over the whole window (sum of token losses / label tokens in the window, through
    transformers' ``num_items_in_batch``), so two micro-batches of 4 give the gradient of one batch of 8. With
    ``amp`` (:func:`fitburst.device.make_amp`) the forward runs under autocast, and fp16 goes through its GradScaler:
    a step whose gradients hold inf/nan is skipped and counted in ``amp.skipped_steps``. The model output is
    dropped as soon as the loss is taken, so the logits do not live through backward. How label tokens are counted
    and each micro-batch's loss weighted is the model's family's (:class:`fitburst.families.Family`); ``loss`` the
    kernel it runs (:func:`loss_kernel`). ``offload``: a saved-tensors context the forwards run under (activation
    offloading, :func:`activation_offloading`).

    Several ranks: ``n_items`` is the label tokens of the step on every rank (:func:`fitburst.distributed.all_sum`),
    the sharded gradients are summed across ranks, and the loss returned is the whole step's."""
    import torch  # heavy: loaded only when training

    scaler = amp.scaler if amp is not None else None
    family = family_for(model.config)
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
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        amp.last_step_skipped = scaler.get_scale() < scale
        amp.skipped_steps += int(amp.last_step_skipped)
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if world.sharded:
        total = distributed.all_sum(total, device)
    return total if on_device else total.item()


def to_device(t, device: str):
    """A host tensor on ``device``. On CUDA through pinned (page-locked) memory and a non-blocking copy: the host
    goes on queueing kernels while the copy runs, where a pageable copy would stage it and wait. Elsewhere ``.to``
    as is (on the CPU the tensor itself, no copy)."""
    if not device.startswith("cuda"):
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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


def pace_for(spec: PipelineSpec, device: str, total_params: int) -> Pace:
    """The :class:`Pace` of ``spec``'s run on ``device``: the model's parameters and attention width from its shape
    (its loaded parameter count where the analytic estimate does not model it: attention then not counted), the
    peak of a CUDA GPU or Apple chip."""
    from fitburst.hours import peak_tflops
    from fitburst.models import spec_shape

    shape = spec_shape(spec)
    kind = device.split(":")[0]
    peak = peak_tflops(resolve_device(device)) if kind in ("cuda", "mps") else None
    if shape is None:
        return Pace(device, peak, total_params)
    return Pace(device, peak, shape.param_count(), shape.layers * shape.q_dim)


def train(spec: PipelineSpec, prepared: PreparedData, run_dir: str | Path, *, device: str | None = None,
          on_metrics: MetricsFn | None = None, progress: bool = True, stop_after: int | None = None) -> TrainResult:
    """Train ``spec`` on ``prepared`` into ``run_dir`` (resuming from its newest checkpoint) and return the result.

    ``stop_after`` ends the loop early after that many optimizer steps (for tests of interruption). Started by
    torchrun, every rank calls it; rank 0's result is the run's (it alone writes the run folder and calls
    ``on_metrics``).
    """
    import torch  # heavy: loaded only when training
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tr = spec.training
    family = model_family(spec.model)
    w = distributed.world()
    device = device or select_device(spec.preflight.device)
    refuse_problems(spec, family, w.size, device.split(":")[0])  # before the model loads
    if w.sharded:
        refuse_offload_beyond_host_ram(spec, w)
        device = distributed.start(w, device)
    kind = device.split(":")[0]  # a rank's GPU is cuda:<local rank>
    precision = resolve_precision(tr.precision, kind)
    kernel = loss_kernel(spec, kind, precision)
    warn_pure_bf16(tr.pure_bf16, tr.learning_rate)
    ckpt = latest_checkpoint(run_dir) if w.main else None
    meta = json.loads((ckpt / "state.json").read_text()) if ckpt is not None else None
    if w.sharded:  # rank 0's folder decides; each node reads its own ranks' part from its own disk
        name, meta = distributed.broadcast((ckpt.name if ckpt is not None else None, meta))
        ckpt = run_dir / "checkpoints" / name if name is not None else None
    spec = spec_keeping_effective_batch(spec, meta, w)  # before the model loads: a refusal costs nothing
    tr = spec.training
    amp = make_amp(precision, device, pure_bf16=tr.pure_bf16, sharded=w.sharded)
    torch.manual_seed(tr.seed)

    meter = MemoryMeter(device)
    meter.reset()
    model, tok = build_model(spec, device, precision, world=w)
    trainable, total = count_params(model)
    offload = activation_offloading(spec, model, kind)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(tr.optimizer, params, tr.learning_rate, tr.weight_decay, adamw_impl(kind, w.size))
    steps = total_steps(spec, prepared.n_train, w.size)
    scheduler = get_scheduler(tr.lr_scheduler, optimizer, num_warmup_steps=tr.warmup_steps,
                              num_training_steps=steps)

    step, resumed_from = 0, None
    per_step = w.size * tr.micro_batch_size * tr.grad_accum  # samples one optimizer step takes, all ranks
    samples = 0
    if ckpt is not None:
        step = resumed_from = load_checkpoint(ckpt, model, optimizer, scheduler, device, amp=amp, world=w,
                                              params=params, meta=meta)
        samples = checkpoint_samples(ckpt, per_step)
        log.info("resuming from %s (step %d of %d)", ckpt, step, steps)

    rows = load_split(prepared, "train").to_list()
    stream = batches(rows, tr.micro_batch_size, tok.pad_token_id, tr.seed, samples // (w.size * tr.micro_batch_size),
                     tr.packing, collate=family.collate, world=w)
    metrics_file = (run_dir / "metrics.jsonl").open("a") if w.main else None
    model.train()
    bar = tqdm(total=steps, initial=step, desc=f"train {spec.name}", disable=not progress or not w.main, unit="step")
    t0, tokens, start_step = time.perf_counter(), 0, step
    pace = pace_for(spec, device, total)
    # the window's loss stays on the device, summed there: read (a wait for the device) at log intervals only
    window_loss, window_tokens, last_loss = torch.zeros((), device=device), 0, float("nan")
    try:
        while step < steps and (stop_after is None or step - start_step < stop_after):
            micro = [next(stream) for _ in range(tr.grad_accum)]
            n_items = sum(family.label_tokens(b) for b in micro)
            if w.sharded:
                n_items = distributed.all_sum(n_items, device)
            loss = optimizer_step(model, optimizer, params, micro, device=device, max_grad_norm=tr.max_grad_norm,
                                  amp=amp, loss=kernel, offload=offload, n_items=n_items, world=w, on_device=True)
            if not amp.last_step_skipped:  # as accelerate does: a skipped step does not advance the schedule
                scheduler.step()
            tokens += sum(batch_tokens(b) for b in micro)
            pace.add(micro)
            meter.sample()
            step += 1
            samples += per_step
            window_loss += loss * n_items
            window_tokens += n_items
            bar.update(1)
            if step % tr.log_every == 0 or step == steps:
                last_loss = (window_loss / max(int(window_tokens), 1)).item()  # token-weighted, as a step's loss
                row = {"train_loss": last_loss, "learning_rate": scheduler.get_last_lr()[0], **pace.rates()}
                if amp.scaler is not None:
                    row.update(skipped_steps=amp.skipped_steps, loss_scale=amp.scaler.get_scale())
                if metrics_file is not None:
                    metrics_file.write(json.dumps({"step": step, **row}) + "\n")
                    metrics_file.flush()
                bar.set_postfix(progress_fields(row))
                if on_metrics and w.main:
                    on_metrics(row, step)
                window_loss, window_tokens = torch.zeros((), device=device), 0
            if step == start_step + 1:  # the warm-up step: the pace is timed from here
                pace.start()
            if step % tr.checkpoint_every == 0 and step < steps:
                save_checkpoint(run_dir, step, model, optimizer, scheduler, amp=amp, world=w, samples=samples,
                        samples_per_step=per_step)
    except BaseException as exc:  # OOM, Ctrl-C, crash: keep the work, then let it propagate
        optimizer.zero_grad(set_to_none=True)
        if w.sharded:  # a checkpoint is collective and the other ranks may be anywhere: the last one stands
            _record_rank_failure(run_dir, w, step, exc, meter)
        elif step > (resumed_from or 0):
            path = save_checkpoint(run_dir, step, model, optimizer, scheduler, amp=amp, samples=samples,
                                   samples_per_step=per_step)
            log.error("training stopped at step %d (%s); resumable checkpoint: %s", step, type(exc).__name__, path)
        if isinstance(exc, torch.OutOfMemoryError):
            raise TrainError(f"out of memory at step {step} on {device}: lower training.micro_batch_size or "
                             "method.rank, enable gradient_checkpointing, or let the preflight plan it "
                             f"(fitburst preflight {spec.name}); a rerun resumes from the last checkpoint") from exc
        raise
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    seconds = time.perf_counter() - t0
    synchronize(device)  # the last step's work done: the pace's clock reads the device's time
    rates = pace.rates()
    if step < steps:  # stopped early on request: keep a checkpoint so a rerun picks up here
        save_checkpoint(run_dir, step, model, optimizer, scheduler, amp=amp, world=w, samples=samples,
                        samples_per_step=per_step)

    adapter_dir = run_dir / "adapter"
    save_trained(model, tok, adapter_dir, spec, w)
    peak = meter.peak()
    rank_peaks = distributed.gather(peak) if w.sharded else []
    if rank_peaks:
        peak = max(rank_peaks, key=lambda p: p.allocated_bytes or 0)
        tokens = int(distributed.all_sum(tokens, device).item())  # every rank's samples
    done = step - start_step
    result = TrainResult(
        run_dir=str(run_dir), adapter_dir=str(adapter_dir), device=device, precision=precision, steps=step,
        total_steps=steps, final_loss=last_loss, seconds=seconds,
        steps_per_sec=rates.get("steps_per_s", done / seconds if seconds else 0.0),
        tokens_per_sec=rates.get("tokens_per_s", tokens / seconds if seconds else 0.0), mfu=rates.get("mfu"),
        tokens=tokens, trainable_params=trainable, total_params=total, resumed_from=resumed_from,
        skipped_steps=amp.skipped_steps, peak=peak, loss=kernel, activation_offloading=offload is not None,
        world_size=w.size, rank_peaks=rank_peaks, grad_accum=tr.grad_accum, samples_per_step=per_step)
    if w.main:
        result.save()
    return result


def progress_fields(row: dict) -> dict[str, str]:
    """The progress line's fields from a log row: loss, and where timed, tokens/s and MFU."""
    fields = {"loss": f"{row['train_loss']:.3f}"}
    if "tokens_per_s" in row:
        fields["tok/s"] = f"{row['tokens_per_s']:,.0f}"
    if "mfu" in row:
        fields["mfu"] = f"{row['mfu']:.1%}"
    return fields


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


def refuse_offload_beyond_host_ram(spec: PipelineSpec, w: World) -> None:
    """FSDP's CPU offload refused before the model loads where this node's host RAM cannot hold its ranks' shards
    (what cannot be sharded at all is the rule table's: :func:`refuse_problems`)."""
    if spec.training.fsdp.cpu_offload:
        need, have = offload_host_bytes(spec, w), available_host_bytes()
        if need is not None and have is not None and need > have:
            gib = 2**30
            raise TrainError(f"pipeline '{spec.name}': training.fsdp.cpu_offload keeps this node's shards of the "
                             f"weights, gradients and optimizer state in host RAM: about {need / gib:.1f} GiB for "
                             f"its {w.local_size} rank(s), but {have / gib:.1f} GiB is available: set "
                             "training.fsdp.cpu_offload: false, or spread the run over more nodes")


def offload_host_bytes(spec: PipelineSpec, w: World) -> int | None:
    """Host RAM this node's ranks hold with FSDP's CPU offload: their share of the weights as loaded, of the
    trainable weights' fp32 gradients and of the optimizer state (the analytic estimate's figures); None for an
    architecture it does not model."""
    from fitburst.memory.params import optimizer_bytes, param_counts, weight_bytes
    from fitburst.models import spec_shape

    shape = spec_shape(spec)
    if shape is None:
        return None
    s = settings_from_spec(spec)
    trainable = param_counts(shape, s)["trainable"]
    state, _, paged = optimizer_bytes(s, [trainable], 4, resolve_device("cpu"))
    whole = sum(weight_bytes(shape, s).values()) + 4 * trainable + state + paged
    return whole * w.local_size // w.size


def available_host_bytes() -> int | None:
    """Memory the OS can give this node now (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _record_rank_failure(run_dir: Path, w: World, step: int, exc: BaseException, meter: MemoryMeter) -> None:
    """``rank-<r>.failed.json`` in the run folder: what stopped this rank (an out-of-memory error's kind, the
    message, the peak), for the process that started torchrun (the other ranks are ended by torchrun)."""
    from fitburst.oom_errors import oom_kind  # torch: a rank failed

    record = {"rank": w.rank, "step": step, "type": type(exc).__name__, "oom_kind": oom_kind(exc),
              "error": str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
              "peak_bytes": meter.peak().allocated_bytes}
    (run_dir / f"rank-{w.rank}.failed.json").write_text(json.dumps(record))
