"""One run over several GPUs (or CPU processes) with torch's FSDP2: one process per device, started by torchrun.

What the Recipe (:mod:`fitburst.recipe`) asks of this module when torchrun started it (``WORLD_SIZE`` > 1):

- :func:`world` reads torchrun's environment; :func:`start` opens the process group (NCCL for CUDA tensors,
  gloo for CPU ones) and names the device this rank trains on.
- :func:`shard`: ``fully_shard`` on every transformer block (the model's ``_no_split_modules``, the classes
  accelerate's FSDP auto-wrap shards too), then on the root, with a ``MixedPrecisionPolicy`` for the run's
  precision (weights gathered in the compute dtype, gradients reduced in fp32) and the spec's knobs
  (``training.fsdp``: reshard after forward, CPU offload). Gradients are summed across ranks, not averaged: each
  rank's loss is already divided by the label tokens of the whole step on every rank (:func:`all_sum`), so N ranks
  x micro-batch b step as one process with N x b.
- Sharded checkpoints (:func:`save_sharded`, :func:`load_sharded`) through ``torch.distributed.checkpoint``: every
  rank writes its own shards of the trainable weights and the optimizer state into ``step-N/sharded/``; loading
  reshards them for the world size of the run that loads them (another number of ranks, or one process).
- :func:`gathered_state`: the trainable weights (a full fine-tune: every weight) gathered on rank 0, which saves
  them as an ordinary peft adapter / model folder, so eval, ``fitburst merge`` and the MLflow model are unchanged.

Rank 0 alone writes the run folder's records (metrics, result, adapter) and talks to MLflow and Prefect; every
rank measures its own memory peak and rank 0 records them all (:func:`gather`).

Loading (:func:`fitburst.builders.build_model`): rank 0 alone reads the checkpoint into host RAM; every other rank
builds the model without weights (meta device), every rank shards it, and :func:`fill_from_rank0` gives each rank its
shards of rank 0's weights, so a node holds one copy of the model while loading, not one per rank, and no GPU ever
holds the whole model. A 4-bit base is loaded by every rank (:func:`fitburst.memory.fsdp_terms.loads_once` says why),
its packed weights stored in the compute dtype, ``bnb_4bit_quant_storage``, so they shard like any weight
(:func:`fitburst.models.quantization_config`).

torch is imported inside the functions: this module is on the import path of the recipe's modules, which keeps them
light.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitburst import environ
from fitburst.errors import UserError

SHARDED_DIR = "sharded"  # the torch.distributed.checkpoint folder inside a checkpoint's step-N/


class DistributedError(UserError, RuntimeError):
    """A multi-process run that cannot start as asked; the message says what to change."""


@dataclass(frozen=True)
class World:
    """This process's place in the run: global rank and size, rank and size on its node (torchrun's env)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def main(self) -> bool:
        """The rank that writes the run folder's records and talks to MLflow and Prefect."""
        return self.rank == 0

    @property
    def node_main(self) -> bool:
        """The first rank of its node: it renames and prunes the node's checkpoint folders (a node's disk)."""
        return self.local_rank == 0

    @property
    def sharded(self) -> bool:
        return self.size > 1


SINGLE = World()


def world(env: dict[str, str] | None = None) -> World:
    """This process's :class:`World` from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE);
    one process when they are not set."""
    env = environ.snapshot() if env is None else env
    size = int(env.get("WORLD_SIZE", "1"))
    return World(rank=int(env.get("RANK", "0")), size=size, local_rank=int(env.get("LOCAL_RANK", "0")),
                 local_size=int(env.get("LOCAL_WORLD_SIZE", str(size))))


def start(w: World, device: str) -> str:
    """Open the process group of ``w`` (once per process) and return the device this rank trains on: its own GPU
    (``cuda:<local rank>``), or the CPU. MPS is one device with no process group: refused (the rule table's
    ``fsdp_on_mps`` row, which the loop's set-up asks before this)."""
    import torch  # heavy: loaded only when training
    import torch.distributed as dist

    from fitburst.rules import device_of_kind, located, problems
    from fitburst.settings import RunSettings

    kind = device.split(":")[0]
    if found := problems(RunSettings(world_size=w.size, distributed="fsdp"), device_of_kind(kind)):
        raise DistributedError(f"{w.size} processes were started: {located(found)}")
    if kind == "cuda":
        if w.local_rank >= torch.cuda.device_count():
            raise DistributedError(f"rank {w.rank} is local rank {w.local_rank} but this node has "
                                   f"{torch.cuda.device_count()} GPU(s): start at most that many processes per node")
        torch.cuda.set_device(w.local_rank)
        device = f"cuda:{w.local_rank}"
    if not dist.is_initialized():
        # gloo for CPU tensors (object collectives, the CPU's own runs), NCCL for CUDA ones
        dist.init_process_group("cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo")
    return device


def stop() -> None:
    """Close the process group (the last collective has run)."""
    import torch.distributed as dist  # heavy: loaded only when training

    if dist.is_initialized():
        dist.destroy_process_group()


def block_classes(model) -> set[str]:
    """The class names of the model's transformer blocks (decoder / encoder layers, a vision tower's blocks):
    transformers' ``_no_split_modules``, looked up on the model under peft's wrappers."""
    inner = model
    while not getattr(inner, "_no_split_modules", None):
        nxt = getattr(inner, "base_model", None)
        nxt = getattr(nxt, "model", nxt) if nxt is not None and nxt is not inner else None
        if nxt is None or nxt is inner:
            raise DistributedError(f"{type(model).__name__} names no transformer blocks (_no_split_modules): "
                                   "FSDP needs them to shard block by block; train it with training.distributed: "
                                   "none")
        inner = nxt
    return set(inner._no_split_modules)


def mixed_precision(precision: str, pure_bf16: bool = False):
    """FSDP2's MixedPrecisionPolicy for the run's precision: fp32 gathers and reduces in fp32 (none needed);
    bf16 / fp16 gather the weights in the compute dtype (what autocast computes in on one device) and reduce the
    gradients in fp32, as the trainable fp32 weights receive them on one device. Pure bf16 keeps bf16 throughout."""
    import torch  # heavy: loaded only when training
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fitburst.device import torch_dtype

    if precision == "fp32":
        return MixedPrecisionPolicy()
    dtype = torch_dtype(precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype if pure_bf16 else torch.float32)


def shard(model, precision: str, *, reshard_after_forward: bool = True, cpu_offload: bool = False,
          pure_bf16: bool = False):
    """``fully_shard`` each transformer block (:func:`block_classes`), then the root; gradients summed across ranks
    (the loss is already normalised by the whole step's label tokens). Returns the model (sharded in place)."""
    import torch  # heavy: loaded only when training
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    names = block_classes(model)
    policy: dict[str, Any] = {
        "mp_policy": mixed_precision(precision, pure_bf16),
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
    }
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise DistributedError(f"none of the block classes {sorted(names)} is in {type(model).__name__}")
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **policy)
    fully_shard(model, **policy)  # the rest (embeddings, head, final norm); the root keeps its weights for backward
    for m in model.modules():
        if isinstance(m, FSDPModule):  # a plain sum (gloo has no pre-multiplied sum, and the factor is 1 anyway)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def same_layout(model) -> None:
    """Refuse a model whose parameters (tied ones counted once) differ from rank 0's before sharding: FSDP would
    shard different tensors on different ranks and its first all-gather would hang or fail far from the cause."""
    names = [n for n, _ in model.named_parameters()]
    ref = broadcast(names)
    if names != ref:
        diff = sorted(set(names) ^ set(ref))[:4]
        raise DistributedError(f"this rank built {len(names)} parameters, rank 0 loaded {len(ref)} (first that "
                               f"differ: {diff}): the model built without weights is not the model loaded; train "
                               "with one process, or report the architecture")


def fill_from_rank0(model, full: dict, device: str) -> None:
    """Fill a sharded ``model`` from rank 0's full state dict ``full`` (the others pass an empty dict): torch's
    ``set_model_state_dict`` with ``broadcast_from_rank0`` sends one tensor at a time and each rank keeps its shard
    of it. A rank whose model was built without weights gets storage for its shards on ``device`` first
    (``to_empty``, which keeps tied weights tied); its buffers (which ``to_empty`` would blank) are kept as built:
    persistent ones are then overwritten from rank 0, non-persistent ones (a rotary embedding's ``inv_freq``) are
    not in a state dict and were computed from the config as on rank 0. Collective: every rank calls it."""
    import torch.distributed as dist  # heavy: loaded only when training
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dist.get_rank() != 0:
        buffers = dict(model.named_buffers())
        model.to_empty(device=device)
        for name, buf in buffers.items():
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, buf)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def all_sum(value, device: str):
    """``value`` (a tensor or a number) summed over every rank, as a tensor on ``device``."""
    import torch  # heavy: loaded only when training
    import torch.distributed as dist

    t = torch.as_tensor(value, device=device).clone()
    dist.all_reduce(t)
    return t


def gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order, on every rank (picklable objects)."""
    import torch.distributed as dist  # heavy: loaded only when training

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (what only rank 0 decides: the checkpoint to resume, a plan)."""
    import torch.distributed as dist  # heavy: loaded only when training

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    import torch.distributed as dist  # heavy: loaded only when training

    dist.barrier()


# --- sharded checkpoints -----------------------------------------------------------------------------------

def _state(model, optimizer) -> dict:
    """The trainable weights and the optimizer state, keyed by parameter name, each rank holding its shards
    (``torch.distributed.checkpoint.state_dict``: works on a sharded model and on an unsharded one alike)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model_sd, "optimizer": optim_sd}


def save_sharded(dest: Path, model, optimizer, w: World) -> None:
    """Write this rank's shards of the trainable weights and optimizer state into ``dest/sharded`` (collective:
    every rank calls it; on one node they share the folder, on several each node's disk holds its ranks' files).

    What FSDP does not shard (the optimizer's step counts and hyper-parameters, any unsharded tensor) is the same
    on every rank; ``torch.distributed.checkpoint`` would store each such item once, in some rank's file, where a
    rank on another node could not read it. The first rank of each node writes it to ``replicated.pt`` instead,
    and torch's index, ``.metadata`` (written on rank 0's disk), is copied to every node: each node's ranks resume
    from their own disk."""
    import torch  # heavy: loaded only when training
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    folder = dest / SHARDED_DIR
    sharded, replicated = _partition(_state(model, optimizer), lambda v: isinstance(v, DTensor))
    dcp.save(sharded or {}, checkpoint_id=str(folder))
    if w.node_main:
        torch.save(replicated or {}, folder / REPLICATED)
    if w.local_size < w.size:
        index = broadcast((folder / ".metadata").read_bytes() if w.main else None)
        if w.node_main and not w.main:
            (folder / ".metadata").write_bytes(index)


def load_sharded(src: Path, model, optimizer=None) -> None:
    """Load ``src/sharded`` into ``model`` (and ``optimizer``, unless None: an optimizer that starts afresh)
    whatever world size wrote it: torch's checkpoint planner reads each rank's part of every tensor (one process
    reads whole tensors)."""
    import torch  # heavy: loaded only when training
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # the state holds the trainable weights only, and loading it must leave the frozen ones as they are; a trainable
    # weight the checkpoint lacks fails in dcp.load
    options = StateDictOptions(ignore_frozen_params=True, strict=False)
    state: dict[str, Any] = _state(model, optimizer) if optimizer is not None else {
        "model": get_model_state_dict(model, options=options)}
    folder = src / SHARDED_DIR
    replicated = (torch.load(folder / REPLICATED, map_location="cpu", weights_only=True)
                  if (folder / REPLICATED).exists() else {})  # a checkpoint from before replicated.pt: all in dcp
    parts = set(state)  # the model's, and the optimizer's unless it starts afresh
    state = _without(state, replicated)
    dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    state = _merged(state, {k: v for k, v in replicated.items() if k in parts})
    set_model_state_dict(model, state["model"], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


REPLICATED = "replicated.pt"  # in a sharded checkpoint: what every rank holds alike (save_sharded)


def _partition(obj: Any, sharded: Callable[[Any], bool]) -> tuple[Any, Any]:
    """A nested state dict split in two: the leaves ``sharded`` says yes to, and the others (None: nothing)."""
    if isinstance(obj, dict):
        parts = {k: _partition(v, sharded) for k, v in obj.items()}
        yes = {k: a for k, (a, _) in parts.items() if a is not None}
        no = {k: b for k, (_, b) in parts.items() if b is not None}
        return yes or None, no or None
    return (obj, None) if sharded(obj) else (None, obj)


def _without(state: dict, other: dict) -> dict:
    """``state`` less the leaves ``other`` holds."""
    out = {}
    for k, v in state.items():
        if k not in other:
            out[k] = v
        elif isinstance(v, dict) and isinstance(other[k], dict):
            out[k] = _without(v, other[k])
    return out


def _merged(state: dict, other: dict) -> dict:
    """``state`` with ``other``'s leaves added."""
    out = dict(state)
    for k, v in other.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def is_sharded(ckpt: Path) -> bool:
    return (ckpt / SHARDED_DIR / ".metadata").exists()


def load_full_trainable(model, weights: dict, optimizer, params: list, optim_state: dict | None) -> None:
    """Load a one-process checkpoint (full tensors: ``trainable.safetensors``, and the optimizer's own state dict
    keyed by the index of each parameter in ``params``) into a sharded model: each rank keeps its shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    if optim_state is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        by_index = [names[id(p)] for p in params]
        set_optimizer_state_dict(model, optimizer, {
            "state": {by_index[i]: s for i, s in optim_state["state"].items()},
            "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]} for g in optim_state["param_groups"]],
        }, options=options)


def gathered_state(model, *, trainable_only: bool) -> dict:
    """The full weights (only the trainable ones with ``trainable_only``) on rank 0's CPU, keyed as
    ``model.state_dict()`` keys them; an empty dict on the other ranks (collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=trainable_only))
