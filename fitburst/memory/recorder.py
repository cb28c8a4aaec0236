"""The trace's recorder: a TorchDispatchMode that records every new output storage (alloc) and its death (free) in
program order, with the tags the CUDA kernel rules (fitburst.memory.cuda_kernels) need. Imports torch: only the
traced estimate (fitburst.memory.trace) imports this module, when it traces.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter, tree_leaves

from .trace_events import Event

aten = torch.ops.aten
COUNTER_OPS = {aten.add_, aten._foreach_add_}  # overload packets that increment optimizer step counters
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
BIASED_MATMULS = (aten.addmm.default, aten.baddbmm.default)
REGION_ENTER = torch.ops.profiler._record_function_enter_new.default
REGION_EXIT = {torch.ops.profiler._record_function_exit.default,
               torch.ops.profiler._record_function_exit._RecordFunction}
CPU_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
EFFICIENT = aten._scaled_dot_product_efficient_attention.default


def _bitsandbytes_op(name: str) -> Any:
    """bitsandbytes' op ``name`` where bitsandbytes has registered it (it does when imported), else None."""
    op = getattr(getattr(torch.ops, "bitsandbytes", None), name, None)
    return op.default if op is not None else None


def _local(t):
    """A DTensor's (a parameter, gradient or optimizer state sharded by FSDP2) own shard: its storage is what the
    rank holds (the wrapper's storage has the global shape)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _runs_on_integers(args, kwargs) -> bool:
    """Integer bookkeeping: every tensor argument real (not fake, not meta) and none floating point (the ids and
    image grids of a vision-language batch). Asked of every op the trace dispatches, so it stops at the first fake
    tensor (almost every op's first argument)."""
    if args and isinstance(args[0], FakeTensor):
        return False
    found = False
    for t in tree_iter((args, kwargs)):
        if isinstance(t, torch.Tensor):
            if isinstance(t, FakeTensor) or t.is_meta or t.is_floating_point():
                return False
            found = True
    return found


def _grouped_mm(func, args, kwargs):
    """MoE experts (transformers' grouped_mm): the meta kernel accepts only bf16 (as the CUDA kernel once did); the
    CPU and CUDA kernels run fp32/fp16 too, with an output of the same shape and dtype."""
    low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return func(*low, **kwargs).to(args[0].dtype)


class Recorder(TorchDispatchMode):
    """Records every new output storage (alloc) and its deallocation (free) in order."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.live: dict[int, int] = {}  # storage _cdata -> sid
        self.sizes: dict[int, int] = {}  # sid -> bytes, while live
        self.finalized: set[int] = set()  # storages (_cdata) with a finalizer registered
        self.phase = "load"
        self.tag = ""
        self.regions: list[str] = []  # open torch.profiler regions (FSDP names its collectives this way)
        self._next = 0
        self.h2f: set[int] = set()  # sids of softmax outputs computed from an fp16 input's fp32 copy
        self.counters: set[int] = set()  # 0-dim tensors incremented in place (optimizer step counters)
        self._upcast: int | None = None  # sid of an fp32 copy of an fp16 tensor made by the last op
        # bitsandbytes' ops, as registered when the recorder starts
        self.quantize_4bit = _bitsandbytes_op("quantize_4bit")
        self.gemm_4bit = _bitsandbytes_op("gemm_4bit")

    # --- storages --------------------------------------------------------------------------------------------

    def _free(self, key: int, sid: int, size: int) -> None:
        """A tracked storage died: free what it holds now (nothing, if a resize to 0 freed it already). Its
        address may be reused by the next storage (a GradScaler's found-inf flag, read as inf if taken for a
        step counter): it is no longer a counter."""
        self.counters.discard(key)
        cur = self.live.pop(key, None)
        if cur is not None:
            self.events.append(Event("free", cur, self.sizes.pop(cur, size), self.phase))

    def resized(self, st, before: int, after: int) -> None:
        """``st`` was resized from ``before`` to ``after`` bytes (:func:`fitburst.memory.sharded.storage_resizes`):
        the bytes it held are freed and the new size allocated, under a new id."""
        key = st._cdata
        if (cur := self.live.pop(key, None)) is not None:
            self.events.append(Event("free", cur, self.sizes.pop(cur, before), self.phase))
        elif key not in self.finalized:  # a storage made before the recorder: track it from here on
            self.finalized.add(key)
            weakref.finalize(st, self._finalized, key, -1, 0)
        if after:
            sid = self._next
            self._next += 1
            self.live[key], self.sizes[sid] = sid, after
            self.events.append(Event("alloc", sid, after, self.phase, "resize_", self.tag or self.region_tag()))

    def region_tag(self) -> str:
        """The tag of what FSDP allocates in its collectives' regions (``fsdp_all_gather``: gathered weights
        and their buffer; ``fsdp_reduce_scatter``: gradient buffers), else ""."""
        for name in reversed(self.regions):
            if name.startswith("FSDP::"):
                what = name[6:].split(" ")[0]
                return ("fsdp_all_gather" if what.startswith("all_gather") or what.endswith("_prefetch") else
                        "fsdp_reduce_scatter" if "reduce" in what else "")
        return ""

    def track(self, t, op: str = "", tag: str = "") -> int | None:
        """Record ``t``'s storage as allocated (once); the index of its event, or None (no tensor, or known)."""
        if not isinstance(t, torch.Tensor):
            return None
        st = _local(t).untyped_storage()
        key = st._cdata
        if key in self.live:
            return None
        size = st.nbytes()
        sid = self._next
        self._next += 1
        self.live[key], self.sizes[sid] = sid, size
        self.events.append(Event("alloc", sid, size, self.phase, op, tag or self.tag or self.region_tag()))
        if key not in self.finalized:
            self.finalized.add(key)
            weakref.finalize(st, self._finalized, key, sid, size)
        return len(self.events) - 1

    def _finalized(self, key: int, sid: int, size: int) -> None:
        self.finalized.discard(key)
        self._free(key, sid, size)

    def sid_of(self, t) -> int | None:
        return self.live.get(_local(t).untyped_storage()._cdata)

    def _retag(self, t, tag: str, op: str | None = None) -> None:
        """Tag the allocation of ``t`` (only if the op that made it is ``op``, when given)."""
        sid = self.sid_of(t)
        for i in range(len(self.events) - 1, -1, -1):
            e = self.events[i]
            if e.sid == sid and e.kind == "alloc":
                if op is None or e.op == op:
                    self.events[i] = Event(e.kind, e.sid, e.size, e.phase, e.op, tag)
                return

    # --- dispatch --------------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._follow_regions(func, args)
        if _runs_on_integers(args, kwargs):
            with unset_fake_temporarily():  # real ids and image grids of a vision-language batch: run it
                return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:  # .item() has no data here: step counters read 1
            t = args[0]  # (they were incremented), anything else 0 (loss, GradScaler's found-inf flag)
            return False if t.dtype == torch.bool else int(_local(t).untyped_storage()._cdata in self.counters)
        if func.overloadpacket in COUNTER_OPS:
            self.counters.update(_local(t).untyped_storage()._cdata for t in tree_leaves(args[0])
                                 if isinstance(t, torch.Tensor) and t.dim() == 0)
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            out = _grouped_mm(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        tag, h2f = self._tag_of(func, args)
        self._track_outputs(func, args, out, tag)
        if h2f and (sid := self.sid_of(out)) is not None:  # the fp32 output of a softmax over an fp16 input (CUDA:
            self.h2f.add(sid)  # one half_to_float kernel)
        # CPU's softmax(fp16 x, dtype=fp32) is x.to(fp32) then _softmax: remember such a copy
        if func is aten._to_copy.default and args[0].dtype == torch.float16 and out.dtype == torch.float32:
            self._upcast = self.sid_of(out)
        return out

    def _follow_regions(self, func, args) -> None:
        """Keep the open torch.profiler regions (FSDP's collectives) as they open and close."""
        if func is REGION_ENTER:
            self.regions.append(args[0])
        elif func in REGION_EXIT and self.regions:
            self.regions.pop()

    def _tag_of(self, func, args) -> tuple[str, bool]:
        """(the tag of the op's outputs, whether it is a softmax over an fp16 tensor's fp32 copy); retags the inputs
        a rule needs to know (the fp32 copy, dropout's noise)."""
        name = func.__name__
        if func in MATMULS:
            return "matmul" + (".bias" if func in BIASED_MATMULS else ""), False
        if func is aten._softmax.default and self._upcast is not None and self.sid_of(args[0]) == self._upcast:
            self._retag(args[0], "softmax_upcast")
            return "", True
        if func is aten.bernoulli_.float:  # dropout's noise (CPU: input dtype; CUDA's fused kernel: bool); feature
            # dropout's noise (at::empty of a broadcast shape) stays a float tensor on CUDA too
            self._retag(args[0], f"dropout_noise:{args[0].element_size()}", op="empty_like.default")
        elif func is aten._softmax_backward_data.default:
            return ("softmax_bwd_h2f" if self.sid_of(args[1]) in self.h2f else "softmax_bwd"), False
        elif "scaled_dot_product" in name:  # the shapes the CUDA kernels size their temporaries by
            q, k = args[1:3] if "backward" in name else args[:2]
            b, h, sq, d = q.shape
            if "backward" not in name:
                return "sdpa_fwd", False
            return f"sdpa_bwd:{b}:{h}:{sq}:{d}:{k.shape[1]}:{k.shape[2]}:{q.element_size()}", False
        elif func is self.gemm_4bit:  # rows M and the bytes of the weight dequantized to the input's dtype
            a, (n, k) = args[0], args[2]
            return f"gemm_4bit:{a.numel() // a.shape[-1]}:{n * k * a.element_size()}", False
        return "", False

    def _track_outputs(self, func, args, out, tag: str) -> None:
        """Record the op's new output storages, each with its tag."""
        leaves = tree_leaves(out)
        if func is self.quantize_4bit:  # its CUDA kernel allocates absmax before the packed weight it returns first
            leaves = leaves[::-1]
        tags = [tag] * len(leaves)
        if func is CPU_FLASH:  # its logsumexp (b, h, s) fp32; the efficient kernel's has rows padded to 32
            b, h, sq, _ = args[0].shape
            tags[1] = f"sdpa_lse:{b * h * -(-sq // 32) * 32 * 4}"
        elif func is EFFICIENT:  # the philox seed and offset are host tensors on CUDA
            tags[2:] = ["host"] * (len(leaves) - 2)
        for t, t_tag in zip(leaves, tags, strict=True):
            self.track(t, func.__name__, t_tag)
