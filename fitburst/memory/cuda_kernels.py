"""Where CUDA kernels allocate differently from the CPU kernels the trace runs: one explicit rule each, applied
to a CPU trace's ordered events to give the events a CUDA run would show.

- :func:`drop_cpu_resident`: AdamW's ``step`` counters stay on the CPU in a GPU run (checkpointing's RNG states are
  host tensors too, and never reach the trace).
- :func:`softmax_half_to_float`: CUDA's ``softmax(fp16 x, dtype=fp32)`` writes fp32 straight from fp16 input;
  the CPU makes an fp32 copy of ``x`` first (b*h*s*s*4 bytes in eager attention).
- :func:`softmax_backward_temp`: CUDA's softmax backward holds a ``grad * output`` temporary beside its result.
- :func:`dropout_bool_mask`: CUDA runs dropout (0 < p < 1) as one fused kernel that keeps a bool mask for the
  backward; the CPU draws a noise tensor of the input's dtype (4 bytes an element for an fp32 adapter input).
- :func:`cuda_sdpa_dispatch` (while tracing for a CUDA device): SDPA runs the fused kernel CUDA picks, through
  that kernel's own op, where the CPU would run its math kernel (dropout: T5, GPT-2) or its flash kernel for a
  call CUDA runs with the memory-efficient one.
- :func:`sdpa_kernel`: the CPU runs SDPA's flash kernel for CPU; a GPU runs the memory-efficient kernel (sm < 80,
  or with a mask) whose logsumexp is padded to 32 rows and whose backward holds a ``delta`` (b,h,s fp32) and an
  fp32 dq accumulator; FlashAttention-2 (sm >= 80, no mask) has the CPU kernel's outputs, and its backward holds
  ``softmax_d``, an fp32 dq accumulator and, for grouped-query heads, dk and dv expanded to every query head.
- :func:`cublas_workspaces`: one cuBLAS workspace per thread that runs a GEMM (the forward thread, autograd's
  device thread), allocated through the caching allocator at its first GEMM and never freed; cuBLASLt adds
  1 MiB per thread at its first biased GEMM.
- :func:`peft_adapter_upcast`: peft moves a new adapter to the base layer's device and dtype first, then up-casts
  it to fp32 (a 16-bit transient per adapter weight).
- :func:`kbit_prepare_upcast`: k-bit loading brings embeddings, norms and head in 16 bits; k-bit preparation then
  casts them to fp32 (the trace builds them in fp32 directly).
- :func:`bnb_dequant_linear`: bitsandbytes' CUDA ``gemm_4bit`` past a few hundred rows dequantizes the whole
  weight into a temporary of the input's dtype and runs ``F.linear`` (its fake kernel shows only the output).
- :func:`allocator_warmup`: from_pretrained with a device map (always so when bitsandbytes quantizes on load)
  first allocates and frees one block the size of the weights it will load (transformers'
  ``caching_allocator_warmup``): one segment that the loading, and later the step, carve up.
- :func:`adamw_impl`: how AdamW runs its step in fitburst's loop (fused on one CUDA GPU, foreach under FSDP on CUDA,
  per tensor elsewhere); the trace then runs that path itself and the analytic estimate counts its temporaries.
- :func:`offloaded_activations` (while tracing for a CUDA device with activation offloading): each tensor saved
  for backward is copied to host memory (allocations tagged ``host``, which :func:`drop_cpu_resident` leaves out)
  and copied back when its backward node runs, as TRL's ``OffloadActivations`` does, the device originals of the
  last ``OFFLOAD_STASH`` offloaded tensors kept alive until their copies are done (its forward stash), all of them
  released when the backward starts.
- CUDA autocast's policy (fp32 ops, reductions given an fp32 dtype, a 16-bit-logit cross_entropy):
  :mod:`fitburst.memory.autocast_policy`, MPS's beside it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

# expands_kv is read here as cuda_kernels.expands_kv by memory.trace
from fitburst.hardware import Device, attention_masked, expands_kv, sdpa_kernel_for  # noqa: F401

if TYPE_CHECKING:
    from fitburst.settings import RunSettings

CUBLASLT_WORKSPACE = 1024 * 1024
_WORKSPACE_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspace_size(device: Device, environ: Mapping[str, str] | None = None) -> int:
    """torch's cuBLAS workspace per handle and stream (aten/src/ATen/cuda/CublasHandlePool.cpp,
    ``parseChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG``'s ``:KiB:COUNT`` pairs where set, else 32 MiB on
    sm 9.x to 12.x (Hopper, Blackwell) and 4096 KiB x 2 + 16 KiB x 8 before; a GPU of unknown capability gets the
    larger. Measured: 33,554,432 bytes per thread on an H100 (benchmarks/results/gpu_check-*H100*)."""
    env = os.environ if environ is None else environ
    pairs = _WORKSPACE_PAIR.findall(env.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        return sum(int(kib) * 1024 * int(n) for kib, n in pairs)
    cap = device.capability
    return 4096 * 8 * 1024 if cap is None or 9 <= cap[0] <= 12 else 4096 * 1024 * 2 + 16 * 1024 * 8


def cublas_workspace_bytes(device: Device, biased: bool, recompute: bool) -> int:
    """What :func:`cublas_workspaces` leaves allocated after a step: one cuBLAS workspace per GEMM thread (forward
    and autograd), plus a cuBLASLt one per thread that runs a biased GEMM (the autograd thread only when
    checkpointing recomputes the forward)."""
    return 2 * cublas_workspace_size(device) + (CUBLASLT_WORKSPACE * (2 if recompute else 1) if biased else 0)


ADAMW_IMPLS = ("fused", "foreach", "for-loop")


def adamw_impl(kind: str, world_size: int = 1, ran: str = "auto") -> str:
    """How torch's AdamW runs fitburst's step on a device of ``kind`` over ``world_size`` processes: ``fused`` (one
    kernel updates each parameter in place, no temporaries) on one CUDA GPU, where the loop asks for it; ``foreach``
    (grouped temporaries, one as large as every parameter of a device/dtype group) on CUDA under FSDP, whose DTensor
    parameters the loop leaves to torch's multi-tensor path; ``for-loop`` (per tensor, torch's default) on CPU and
    MPS. ``ran``: the implementation a measured run used, where it is known and not this rule's (a replay of a run
    measured before the loop fused AdamW)."""
    if ran != "auto":
        return ran
    if kind == "cuda":
        return "fused" if world_size == 1 else "foreach"
    return "for-loop"


MATH = 0  # sdp::SDPBackend::math, what torch._fused_sdp_choice answers for the math kernel


@contextlib.contextmanager
def cuda_sdpa_dispatch(flash: bool) -> Iterator[None]:
    """A context in which SDPA runs the fused kernel a CUDA device picks (``flash``: it has FlashAttention-2, sm >= 80;
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) through that kernel's own op, whose fake (meta) kernel
    gives its outputs and whose autograd formula its backward. FlashAttention-2 for 16-bit inputs, head dims up to
    256 and no mask; otherwise the memory-efficient kernel (head dims aligned to its GEMMs), its mask made as torch's
    composite makes it (a bool mask becomes an additive one; a mask whose rows are not 8-element aligned is padded
    and sliced back; expanded to (b, h, s_q, s_k)). The CPU runs calls with dropout (training T5, GPT-2) with its
    math kernel: b*h*s*s scores, probabilities and a dropout mask per layer that CUDA never holds; a masked call it
    runs with its flash kernel, whose lse and backward :func:`sdpa_kernel` would take for flash on an sm >= 80
    device. Calls CUDA also runs with flash, with grouped-query heads, other than 4-D or with the math kernel are
    left alone."""
    from unittest import mock

    import torch
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention
    aten = torch.ops.aten

    def run(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        d, dv = query.shape[-1], value.shape[-1]
        takes_flash = flash and dtype != torch.float32 and attn_mask is None and d == key.shape[-1] == dv <= 256
        align = 8 if dtype != torch.float32 else 4 if flash else 1  # minimum_gemm_alignment
        takes_efficient = d == key.shape[-1] and d % align == 0 and dv % align == 0
        cpu_math = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                           enable_gqa=enable_gqa) == MATH
        if (query.dim() != 4 or query.shape[1] != key.shape[1] or (takes_flash and not cpu_math)
                or not (takes_flash or takes_efficient)):  # the fused kernels take 4-D (b, h, s, d) inputs
            return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        q, k, v = (t.to(dtype) for t in (query, key, value))  # autocast's cast for SDPA
        if takes_flash:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        mask = attn_mask
        if mask is not None:
            if mask.dtype == torch.bool:  # convert_boolean_attn_mask
                mask = torch.where(mask, 0.0, torch.full((), float("-inf"), dtype=dtype))
            mask = mask.to(dtype)
            if mask.stride(-1) != 1 or any(st % 8 for st in mask.stride()[:-1]):  # preprocess_mask's pad_bias<8>
                n = mask.shape[-1]
                mask = F.pad(mask, (0, 8 - n % 8))[..., :n]
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, lse, dropout_p, is_causal,
                                                            scale=scale)[0]

    with mock.patch.object(F, "scaled_dot_product_attention", run):
        yield


OFFLOAD_MIN_BYTES = 1024  # TRL's min_offload_size: smaller saved tensors stay on the device
OFFLOAD_STASH = 5  # TRL's max_fwd_stash_size: offloaded tensors whose device originals stay alive in the forward


def offloaded_activations(rec):
    """A saved-tensors context standing in for TRL's activation offloading in a trace: every saved tensor of at
    least ``OFFLOAD_MIN_BYTES`` that is not a parameter is packed as a host copy (``rec`` records it tagged
    ``host``) and unpacked as a fresh device copy that lives while its backward node runs; the forward stash keeps
    the originals of the last ``OFFLOAD_STASH`` until the backward starts."""
    import collections

    import torch

    stash: collections.deque = collections.deque(maxlen=OFFLOAD_STASH)

    def pack(t):
        if isinstance(t, torch.nn.Parameter) or t.numel() * t.element_size() < OFFLOAD_MIN_BYTES:
            return t
        stash.append(t)
        rec.tag, before = "host", rec.tag
        try:
            return ("host", t.clone())
        finally:
            rec.tag = before

    def unpack(packed):
        stash.clear()
        return packed[1].clone() if isinstance(packed, tuple) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _sids(events, tag: str) -> set[int]:
    return {e.sid for e in events if e.kind == "alloc" and e.tag == tag}


def _without(events, sids: set[int]):
    return [e for e in events if e.sid not in sids]


def drop_cpu_resident(events):
    return _without(events, _sids(events, "step_counter") | _sids(events, "host") | _sids(events, "host_weight"))


def softmax_backward_temp(events):
    """CUDA's softmax backward allocates a ``grad * output`` temporary (the grad's size) beside its result, freed
    when the kernel ends; the CPU kernel allocates only the result. (The half-to-float case:
    :func:`softmax_half_to_float`.)"""
    from dataclasses import replace

    out, nxt = [], max((e.sid for e in events), default=0) + 1
    for e in events:
        out.append(e)
        if e.kind == "alloc" and e.tag == "softmax_bwd":
            tmp = replace(e, sid=nxt, op="softmax_backward_tmp", tag="softmax_tmp")
            out += [tmp, replace(tmp, kind="free", op="")]
            nxt += 1
    return out


def softmax_half_to_float(events, dtype: str):
    """fp16 only (bf16 takes the copy path on CUDA too). Forward: drop the CPU's fp32 copy of the input.
    Backward: CUDA's kernel allocates an fp32 ``grad * output`` temporary and the fp16 grad while the incoming fp32
    grad is still held; the CPU returns an fp32 grad, drops the incoming one, then casts to fp16."""
    if dtype != "fp16":
        return events
    events = _without(events, _sids(events, "softmax_upcast"))
    out: list = []
    late_free: set[int] = set()
    i = 0
    while i < len(events):
        e = events[i]
        if e.kind == "alloc" and e.tag == "softmax_bwd_h2f":
            j = next((k for k in range(i + 1, len(events)) if events[k].kind == "alloc"), None)
            if j is not None and events[j].size * 2 == e.size:
                from dataclasses import replace

                between = events[i + 1:j]
                out += [e, events[j], replace(e, kind="free", op="")] + between
                late_free.add(e.sid)
                i = j + 1
                continue
        if e.kind == "free" and e.sid in late_free:
            late_free.discard(e.sid)
        else:
            out.append(e)
        i += 1
    return out


def dropout_bool_mask(events):
    """CUDA's ``native_dropout`` (fused, 0 < p < 1) allocates a bool mask, then the output; the CPU's composite
    dropout allocates a noise tensor of the input's dtype, then the output: each noise block shrinks to one byte
    an element, for as long as it lives (saved for the backward)."""
    from dataclasses import replace

    out, resized = [], {}
    for e in events:
        if e.kind == "alloc" and e.tag.startswith("dropout_noise:"):
            resized[e.sid] = e.size // int(e.tag.split(":")[1])
            out.append(replace(e, size=resized[e.sid], op="native_dropout", tag="dropout_mask"))
        elif e.kind == "free" and e.sid in resized:
            out.append(replace(e, size=resized.pop(e.sid)))
        else:
            out.append(e)
    return out


def sdpa_backward_temps(tag: str, kernel: str) -> list[int]:
    """The temporaries a CUDA SDPA backward allocates beside its gradients, from the call's shapes in the recorder's
    ``sdpa_bwd:b:h:s_q:d:h_kv:s_kv:bytes`` tag. Memory-efficient kernel: ``delta`` (b, h, s_q) and a dq accumulator
    (b, s_q, h, d), fp32. FlashAttention-2 (flash_api.cpp ``mha_bwd``): ``softmax_d`` (b, h, s_q rounded to 128)
    and ``dq_accum`` (b, s_q rounded to 128, h, d rounded to 32, or 64 past 128), fp32; with fewer k/v heads, dk and
    dv expanded to every query head (b, s_kv, h, d) in the inputs' dtype before they are summed per group."""
    b, h, sq, d, hk, sk, n = (int(x) for x in tag.split(":")[1:])
    if kernel == "efficient":
        return [b * h * sq * 4, b * sq * h * d * 4]
    sq128, dr = -(-sq // 128) * 128, -(-d // (32 if d <= 128 else 64)) * (32 if d <= 128 else 64)
    return [b * h * sq128 * 4, b * sq128 * h * dr * 4] + ([b * sk * h * d * n] * 2 if hk != h else [])


def sdpa_kernel(events, kernel: str):
    """``kernel``: the kernel the CPU flash kernel's calls stand for, efficient | flash. The memory-efficient kernel's
    logsumexp has its rows padded to 32 (fp32, (b, h, s) on the CPU: resized to the size its tag carries). Each
    backward gets the temporaries of its kernel (:func:`sdpa_backward_temps`) for the op's duration; a call traced
    through a CUDA kernel's own op (:func:`cuda_sdpa_dispatch`) gets that kernel's, whatever ``kernel`` is."""
    from dataclasses import replace

    out, nxt = [], max((e.sid for e in events), default=0) + 1
    resized: dict[int, int] = {}
    i = 0
    while i < len(events):
        e = events[i]
        if kernel == "efficient" and e.kind == "alloc" and e.tag.startswith("sdpa_lse:"):
            resized[e.sid] = int(e.tag.split(":")[1])
            out.append(replace(e, size=resized[e.sid]))
        elif e.kind == "free" and e.sid in resized:
            out.append(replace(e, size=resized.pop(e.sid)))
        elif e.kind == "alloc" and e.tag.startswith("sdpa_bwd:"):
            j = i
            while j < len(events) and events[j].kind == "alloc" and events[j].tag == e.tag:
                j += 1
            out.extend(events[i:j])
            own = ("efficient" if e.op.startswith("_scaled_dot_product_efficient") else
                   "flash" if e.op.startswith("_scaled_dot_product_flash_attention_backward") else kernel)
            temps = sdpa_backward_temps(e.tag, own)
            ids = list(range(nxt, nxt + len(temps)))
            nxt += len(temps)
            out.extend(replace(e, sid=sid, size=t, op=f"{own}_attention_backward", tag="sdpa_tmp")
                       for sid, t in zip(ids, temps, strict=True))
            out.extend(replace(e, kind="free", sid=sid, size=t, op="", tag="sdpa_tmp")
                       for sid, t in zip(ids[::-1], temps[::-1], strict=True))
            i = j
            continue
        else:
            out.append(e)
        i += 1
    return out


def cublas_workspaces(events, device: Device):
    """Insert the per-thread cuBLAS (and cuBLASLt) workspaces after the first GEMM of the forward thread and of the
    backward thread (checkpointing's recomputation runs on the backward thread)."""
    from dataclasses import replace

    ws = cublas_workspace_size(device)
    out, nxt = [], max((e.sid for e in events), default=0) + 1
    seen: set[tuple[str, str]] = set()
    for e in events:
        out.append(e)
        if e.kind != "alloc" or not e.tag.startswith("matmul"):
            continue
        thread = "backward" if e.phase.endswith("backward") else "forward"
        need = [("cublas", ws)] + ([("cublaslt", CUBLASLT_WORKSPACE)] if e.tag == "matmul.bias" else [])
        for lib, size in need:
            if (thread, lib) not in seen:
                seen.add((thread, lib))
                out.append(replace(e, sid=nxt, size=size, op=f"{lib}_workspace", tag="workspace"))
                nxt += 1
    return out


def peft_adapter_upcast(events, dtype: str):
    """peft places every new adapter weight on the base layer's device in its 16-bit dtype while injecting, and
    up-casts them to fp32 once all are injected: all 16-bit copies first, then per weight fp32 alloc, 16-bit free."""
    if dtype == "fp32":
        return events
    from dataclasses import replace

    adapters = [e for e in events if e.kind == "alloc" and e.tag == "adapter" and e.phase == "load"]
    if not adapters:
        return events
    first = events.index(adapters[0])
    nxt = max(e.sid for e in events) + 1
    halves = [replace(e, sid=nxt + i, size=e.size // 2, tag="adapter_16bit") for i, e in enumerate(adapters)]
    upcast = [x for h, e in zip(halves, adapters, strict=True) for x in (e, replace(h, kind="free", op=""))]
    rest = [e for e in events[first:] if not (e.kind == "alloc" and e.tag == "adapter" and e.phase == "load")]
    return events[:first] + halves + upcast + rest


def kbit_prepare_upcast(events, empty_cache: bool | None = None):
    """k-bit loading: the non-quantized weights (embeddings, norms, head) arrive in 16 bits with the quantized ones;
    prepare_model_for_kbit_training then casts each to fp32 (fp32 alloc, 16-bit free) before peft adds adapters,
    and (peft >= 0.20, ``auto_clear_cache``) empties the CUDA cache: segments left free by the quantize-on-load
    transients and the 16-bit copies go back to the driver. ``empty_cache``: None = as the installed peft does."""
    from dataclasses import replace

    cast = [e for e in events if e.kind == "alloc" and e.tag == "kbit_upcast" and e.phase == "load"]
    if not cast:
        return events
    if empty_cache is None:
        empty_cache = peft_empties_cache()
    nxt = max(e.sid for e in events) + 1
    halves = {e.sid: replace(e, sid=nxt + i, size=e.size // 2, tag="kbit_16bit") for i, e in enumerate(cast)}
    load_end = max(i for i, e in enumerate(events) if e.phase == "load" and e.tag != "adapter") + 1
    head = [halves.get(e.sid, e) if e.kind == "alloc" else e for e in events[:load_end]]
    upcast = [x for e in cast for x in (e, replace(halves[e.sid], kind="free", op=""))]
    if empty_cache:
        upcast.append(replace(cast[-1], kind="empty_cache", sid=-1, size=0, op="empty_cache", tag=""))
    return head + upcast + events[load_end:]


# bitsandbytes 0.50 (backends/cuda/ops.py): past this many rows every CUDA arch takes _dequant_linear_fallback
# (below it, a per-arch heuristic may pick the fused kernel: on a T4, only at <= 320 rows).
GEMM_4BIT_FUSED_MAX_ROWS = {"T4": 320}
GEMM_4BIT_FUSED_MAX_ROWS_DEFAULT = 512


def bnb_dequant_linear(events, device: Device):
    """``gemm_4bit`` events (tag ``gemm_4bit:<rows>:<weight bytes>``) with more rows than the fused kernel takes:
    the dequantized weight is allocated before the output and freed right after it."""
    from dataclasses import replace

    limit = GEMM_4BIT_FUSED_MAX_ROWS.get(device.name.upper(), GEMM_4BIT_FUSED_MAX_ROWS_DEFAULT)
    nxt = max((e.sid for e in events), default=0) + 1
    out = []
    for e in events:
        if e.kind == "alloc" and e.tag.startswith("gemm_4bit:"):
            _, rows, nbytes = e.tag.split(":")
            if int(rows) > limit:
                tmp = replace(e, sid=nxt, size=int(nbytes), op="dequantize_4bit", tag="bnb_dequant")
                nxt += 1
                out += [tmp, e, replace(tmp, kind="free", op="")]
                continue
        out.append(e)
    return out


WARMUP_HEADROOM = int(1.2 * 1024**3)  # caching_allocator_warmup never asks for more than the device less 1.2 GiB


def allocator_warmup(events, nbytes: int):
    """transformers' ``caching_allocator_warmup``: before the first weight loads, one ``nbytes`` block (the
    checkpoint's weights on the device, 4-bit ones at half a byte per element) is allocated and freed."""
    from dataclasses import replace

    first = next((i for i, e in enumerate(events) if e.phase == "load"), None)
    if first is None or nbytes <= 0:
        return events
    sid = max(e.sid for e in events) + 1
    block = replace(events[first], kind="alloc", sid=sid, size=nbytes, op="caching_allocator_warmup", tag="")
    return events[:first] + [block, replace(block, kind="free", op="")] + events[first:]


def peft_empties_cache() -> bool:
    """Whether the installed peft's prepare_model_for_kbit_training calls torch.cuda.empty_cache() (0.20 on)."""
    from peft import prepare_model_for_kbit_training  # peft: heavy, only the traced estimate asks

    return "auto_clear_cache" in inspect.signature(prepare_model_for_kbit_training).parameters


def expanded_kv_note(device: Device) -> str:
    return (f"{device.name}: no FlashAttention for this dtype, so grouped-query k/v are expanded before SDPA and its "
            "memory-efficient kernel runs (unexpanded, SDPA would fall to its math kernel: b*h*s*s fp32 scores)")


def sdpa_kernel_of(trace, device: Device, settings: RunSettings) -> str | None:
    """The SDPA kernel a CUDA ``device`` runs for a model traced as ``trace`` (None: eager attention). FlashAttention-2
    (attention ``flash``) takes grouped-query heads itself; a trace whose k/v were expanded hands SDPA all heads."""
    s = settings
    if s.attention not in ("sdpa", "flash"):
        return None
    padded = attention_masked(device, s.attention, s.micro_batch_size > 1 if s.padded is None else s.padded)
    gqa = s.attention == "sdpa" and 0 < trace.kv_heads < trace.heads and not trace.kv_expanded
    return sdpa_kernel_for(device, s.precision, padded, gqa)


def apply(trace, device: Device, settings: RunSettings, seq_len: int, *, empty_cache: bool | None = None,
          device_map: bool | None = None, sdpa: str | None = None):
    """All rules for a CUDA ``device``; returns (events, index of the measured step's first event).
    ``empty_cache``: whether k-bit preparation empties the cache (None: as the installed peft does).
    ``device_map``: whether from_pretrained loaded with a device map (None: only k-bit, whose quantizer sets one).
    ``sdpa``: the SDPA kernel the run was pinned to (None: what the device's dispatch picks,
    :func:`sdpa_kernel_of`). A trace made for another device, whose grouped-query k/v reach SDPA unexpanded here,
    would stand for the math kernel, which fitburst's loader avoids: refused."""
    s = settings
    events = drop_cpu_resident(list(trace.events))
    if s.kbit if device_map is None else device_map:
        events = allocator_warmup(events, min(trace.load_bytes, device.total_bytes - WARMUP_HEADROOM))
    events = bnb_dequant_linear(events, device)
    events = dropout_bool_mask(events)
    events = softmax_half_to_float(events, s.precision)
    events = softmax_backward_temp(events)
    kernel = sdpa or sdpa_kernel_of(trace, device, s)
    if kernel == "math":
        raise ValueError(f"on {device.name} fitburst expands grouped-query k/v before SDPA: trace for this device "
                         "(trace_step(device=...))")
    events = sdpa_kernel(events, kernel or "flash")
    events = cublas_workspaces(events, device)
    events = kbit_prepare_upcast(events, empty_cache)
    events = peft_adapter_upcast(events, s.precision)
    return events, measured_start(events)


def measured_start(events) -> int:
    """Index of the measured step's first event (phases of the warm-up are prefixed, loading is ``load``)."""
    return next((i for i, e in enumerate(events) if e.phase != "load" and not e.phase.startswith("warmup.")),
                len(events))
