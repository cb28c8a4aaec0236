"""Tracing the step of a run sharded with FSDP2 as rank 0 of N, in one process.

The model is sharded by the training loop's own function (:func:`fitburst.distributed.shard`: ``fully_shard`` per
block, then the root, the run's mixed precision), so what is traced is what trains. :func:`fake_process_group`
stands one process in for rank 0 of ``world_size`` ranks (torch's fake process group: collectives return at once,
their output buffers are allocated as on a real rank). Under ``FakeTensorMode`` the sharded step then runs at full
size with no memory: sharded parameters, gradients and optimizer state, the all-gather and reduce-scatter buffers
and the prefetch of the next block's all-gather, in the order a real rank allocates them. :func:`storage_resizes`
makes those visible to the trace's recorder: FSDP2 allocates and frees unsharded parameters by resizing their
storage (``UntypedStorage.resize_``), which no dispatch mode sees (torch's own ``MemTracker`` patches it the same
way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy: imported where sharding runs
    import torch


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks with this process as rank 0 (torch's own, for tests and
    tracing); the group this process had before (if any) is refused rather than replaced."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized here: trace a sharded step in its own process")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def storage_resizes(rec) -> Iterator[None]:
    """Record ``UntypedStorage.resize_`` as the recorder's frees and allocations (FSDP2's unsharded parameters
    come and go this way): a storage resized to 0 frees what it held, one resized from 0 allocates anew."""
    import torch

    orig = torch.UntypedStorage.resize_

    def resize_(st: torch.UntypedStorage, size: int):
        before = st.nbytes()
        out = orig(st, size)
        after = st.nbytes()
        if before != after:
            rec.resized(st, before, after)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = orig  # type: ignore[method-assign]


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor of a DTensor (a parameter or gradient sharded by FSDP2), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


# --- the sharded trace (fitburst.memory.trace) -----------------------------------------------------------------


def in_fake_group() -> bool:
    """Whether this process already stands in for rank 0 in a fake process group (:func:`fake_process_group`)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def _shard_traced(model, s) -> None:
    """Shard a model being traced as the training loop shards it (:func:`fitburst.distributed.shard`); offload is
    left to :func:`traced`'s tagging: on the fake CPU device of a trace there is no host to offload to."""
    from fitburst.distributed import shard

    shard(model, s.precision, reshard_after_forward=s.reshard_after_forward, pure_bf16=s.pure_bf16)


def shard_on_meta(model, s) -> None:
    """Shard a model still on the meta device for the trace of ``s`` (a sharded run without quantized weights;
    4-bit weights are sharded once quantized, :func:`materialize`)."""
    if s.world_size > 1 and not s.kbit:
        _shard_traced(model, s)


def materialize(model, rec, s, quantize) -> int:
    """The rank's weights as fake tensors, loaded sharded: only the rank's shards are ever on its device (as a
    sharded loader puts them; loading the whole model on each GPU first would need the whole model's memory there).
    Unquantized: the meta model sharded by :func:`shard_on_meta` materialized with ``to_empty``. 4-bit: ``quantize``
    (the trace's quantize-on-load) then sharding, each module keeping its quantization state (replicated on every
    rank: bitsandbytes finds it on the module once FSDP has swapped the weight, ``fix_4bit_weight_quant_state_from_
    module``). The load phase's events are then rewritten as the allocations of what is left: the rank's shards,
    in order. Returns 0 for the trace's ``load_bytes``: no from_pretrained with a device map warms the caching
    allocator up for the whole checkpoint (:func:`fitburst.memory.cuda_kernels.allocator_warmup`)."""
    if s.kbit:
        quantize()
        for m in model.modules():
            state = getattr(getattr(m, "weight", None), "quant_state", None)
            if type(m).__name__ == "Linear4bit" and state is not None:
                m.quant_state = state
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # FSDP's default mesh reads rank values; the fake weights stay fake
            _shard_traced(model, s)
    else:
        model.to_empty(device="cpu")
    adapters = {rec.sid_of(local(p)) for n, p in model.named_parameters() if "lora_" in n}
    rec.events[:] = [type(e)(e.kind, e.sid, e.size, e.phase, e.op, "adapter" if e.sid in adapters else "")
                     for e in rec.events]
    live: dict[int, Any] = {}
    for e in rec.events:
        if e.kind == "alloc":
            live[e.sid] = e
        else:
            live.pop(e.sid, None)
    rec.events[:] = list(live.values())
    return 0


@contextlib.contextmanager
def traced(rec, s) -> Iterator[None]:
    """What a sharded trace needs around its steps: FSDP's storage resizes recorded; bitsandbytes' recovery of a
    4-bit weight's quantization state done without re-wrapping the gathered fake weight (a tensor subclass cannot
    wrap a fake tensor; the weight keeps its storage either way); with ``s.cpu_offload``, what lives in host memory
    tagged ``host`` (sharded weights, gradients and optimizer state, the optimizer step's temporaries: dropped from
    a GPU's events by :func:`fitburst.memory.cuda_kernels.drop_cpu_resident`). Nothing for one device."""
    if s.world_size <= 1:
        yield
        return
    from unittest import mock

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    with contextlib.ExitStack() as stack:
        stack.enter_context(storage_resizes(rec))
        if s.kbit:
            import bitsandbytes.nn.modules as bnb_modules

            def keep_state(module) -> None:
                if getattr(module.weight, "quant_state", None) is None:
                    module.weight.quant_state = module.quant_state

            stack.enter_context(mock.patch.object(bnb_modules, "fix_4bit_weight_quant_state_from_module", keep_state))
        host: set[int | None] = set()
        if s.cpu_offload:
            def grads(opt, *_):
                host.update(rec.sid_of(local(p.grad)) for g in opt.param_groups for p in g["params"]
                            if p.grad is not None)

            def states(opt, *_):
                host.update(rec.sid_of(local(t)) for st in opt.state.values() for t in st.values()
                            if isinstance(t, torch.Tensor))

            stack.callback(register_optimizer_step_pre_hook(grads).remove)
            stack.callback(register_optimizer_step_post_hook(states).remove)
        yield
        if s.cpu_offload:
            first = {e.sid: e for e in reversed(rec.events) if e.kind == "alloc"}
            host |= {sid for sid, e in first.items() if e.phase == "load" or e.phase.endswith("optimizer_step")}
            rec.events[:] = [type(e)(e.kind, e.sid, e.size, e.phase, e.op, "host") if e.sid in host else e
                             for e in rec.events]
