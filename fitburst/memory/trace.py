"""The traced estimate: the project's own model preparation, optimizer and training step run at full size under
``FakeTensorMode`` (no memory used), every storage allocation and free recorded in order.

The model is built from config.json on the meta device, wrapped by :func:`fitburst.builders.prepare_for_training`
(the loop's own function), materialized as fake CPU tensors (base weights first, then adapters, tied weights
once), and stepped twice with :func:`fitburst.train.optimizer_step`: a warm-up step (optimizer state appears),
then the measured step. The ordered events feed :mod:`fitburst.memory.cuda_kernels` (where CUDA kernels
allocate differently from the CPU kernels traced here) and :mod:`fitburst.memory.allocator` (the CUDA caching
allocator), giving allocated, reserved and device-total figures.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from fitburst.allocator_env import allocator_mode
from fitburst.hardware import Device, MiB, attention_masked
from fitburst.settings import RunSettings, spec_with_settings

from .estimator import RESERVED_FACTOR, RESERVED_FLOOR, Estimate
from .trace_events import Event, StepTrace, live_peaks, peak_components
from .trace_guards import TraceUnsupported, device_sdpa, fake_kernels_of, untraceable

PHASES = ("load", "forward", "loss", "backward", "optimizer_step")
# Micro-batches of an accumulation window the trace steps through. The third and later ones repeat the second's
# allocations exactly (same shapes, gradients already there, the caching allocator already warm); what each one
# adds is its own input tensors, held by the loop's micro-batch list for the whole step: the trace builds all of
# those and keeps them alive, and steps through the first TRACED_MICRO (against tracing every micro-batch:
# benchmarks/trace_micro.py, its figures in docs/preflight.md).
TRACED_MICRO = 2
CPU_RUNTIME_FLOOR = 32 * MiB  # first-step heap of torch on CPU outside tensors (see estimator.RESERVED_FLOOR)


# --- making transformers behave as on a GPU --------------------------------------------------------------


@contextlib.contextmanager
def gpu_like_masking(padded: bool):
    """transformers treats FakeTensors as tracing and keeps full masks; a real run looks at the mask's values.
    Answer those value checks from what the batch is: unpacked, and padded or not."""
    from unittest import mock

    from transformers import masking_utils

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(masking_utils, "is_tracing", lambda *a, **k: False))
        stack.enter_context(mock.patch.object(masking_utils, "fast_all", lambda t: not padded))
        stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda p: None))
        stack.enter_context(mock.patch.object(  # an encoder's mask (T5), where .all() reads the values
            masking_utils, "_ignore_bidirectional_mask_sdpa",
            lambda padding_mask, kv_length, local_attention_size=None: not padded and (
                local_attention_size is None or kv_length < local_attention_size)))
        yield


# --- building ----------------------------------------------------------------------------------------------


def _params_and_states(model) -> Iterator[tuple[Any, Any]]:
    """Each parameter once (a tied weight once), with its 4-bit quantization state (on the weight, or on the module
    once FSDP sharded it; None for an unquantized one)."""
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            yield p, getattr(p, "quant_state", None) or (getattr(module, "quant_state", None) if name == "weight"
                                                         else None)


def _loaded_bytes(model, double_quant: bool, adapter_trains: bool) -> int:
    """The traced model's base weights as loaded and prepared, in bytes (an adapter's trainable weights left out):
    every parameter at its dtype (after k-bit preparation: the unquantized ones in fp32), a 4-bit weight by its
    packed values and quantization state (:func:`fitburst.memory.params.four_bit_bytes`)."""
    import math

    from .params import four_bit_bytes

    return int(sum(four_bit_bytes(math.prod(state.shape), double_quant) if state is not None
                   else p.numel() * p.element_size()
                   for p, state in _params_and_states(model) if not (adapter_trains and p.requires_grad)))


def _param_count(model) -> int:
    """The model's parameters as the analytic estimate counts them (a tied weight once): a 4-bit weight by the
    values it packs (its quantization state's shape), not by the elements of its packed storage, which are 2 or 4
    values each (uint8, or the compute dtype when sharded)."""
    import math

    return sum(math.prod(state.shape) if state is not None else p.numel() for p, state in _params_and_states(model))


def config_dict(ref: str) -> dict:
    """config.json of a model reference, found where :func:`fitburst.memory.load_shape` looks."""
    from .shapes import config_path

    return json.loads(config_path(ref)[0].read_text())


def _meta_model(cfg: dict, s: RunSettings, trust_remote_code: bool, pure_bf16: bool = False,
                device: Device | None = None):
    import torch
    from transformers import AutoConfig

    from fitburst.device import torch_dtype, weight_dtype
    from fitburst.models import attn_implementation, auto_model_class

    d = dict(cfg)
    mtype = d.pop("model_type", None)
    if not mtype:
        raise TraceUnsupported("config.json has no model_type: cannot build the model to trace it")
    try:
        config = AutoConfig.for_model(mtype, **d)
    except (KeyError, ValueError) as e:
        raise TraceUnsupported(f"transformers cannot build model_type {mtype!r} ({e}): update transformers, "
                               "or set model.trust_remote_code for a custom architecture") from None
    if mtype == "qwen2_5_vl":
        raise TraceUnsupported("the traced estimate does not cover Qwen2.5-VL's windowed vision tower yet")
    # FA2 needs its CUDA package: trace SDPA's shapes; on ``device`` the loader's choice (models.attn_implementation)
    impl = "sdpa" if s.attention == "flash" else (
        attn_implementation(s.attention, config, device, s.precision, trust_remote_code) or "sdpa")
    with torch.device("meta"):  # the class models.load_model loads
        model = auto_model_class(config).from_config(config, dtype=weight_dtype(s.precision, s.method, pure_bf16),
                                                     attn_implementation=impl, trust_remote_code=trust_remote_code)
    if config.is_encoder_decoder and cfg.get("tie_word_embeddings") is False:
        # transformers 5 builds T5 with its head tied to the embeddings, but T5 v1.1 / FLAN-T5 checkpoints (config
        # tie_word_embeddings false) hold a separate lm_head, which loading keeps untied: trace that model
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(torch.empty_like(head.weight, device="meta"))
    if s.kbit:  # bitsandbytes 4-bit layers in place of the linears, as from_pretrained's quantizer puts them
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear

        from fitburst.models import quantization_config

        head = [n for n, m in model.named_modules() if m is model.get_output_embeddings()]
        model = replace_with_bnb_linear(model, modules_to_not_convert=head,
                                        quantization_config=quantization_config(s.quant, s.double_quant,
                                                                                torch_dtype(s.precision),
                                                                                sharded=s.world_size > 1))
        model.is_loaded_in_4bit = True
    return model


@contextlib.contextmanager
def bnb_caches_kept(kbit: bool) -> Iterator[None]:
    """bitsandbytes keeps its 8-bit code table module-wide from first use (``functional.name2qmap``). Made while
    tracing it would be a fake tensor that every later real quantization in this process reads: double-quant
    statistics then come out wrong and a QLoRA run trained after the preflight in the same process sees a zero
    loss. The table as it was before the trace is put back after it."""
    if not kbit:
        yield
        return
    import bitsandbytes.functional as bnbf

    kept = dict(bnbf.name2qmap)
    try:
        yield
    finally:
        bnbf.name2qmap.clear()
        bnbf.name2qmap.update(kept)


def _quantized(w, compute_dtype, full=None):
    """A 4-bit weight as bitsandbytes loads it: the 16-bit weight (``full`` when already read), quantized (packed
    uint8 + QuantState), the 16-bit weight freed."""
    import bitsandbytes as bnb
    import torch

    if full is None:
        full = torch.empty(w.shape, dtype=compute_dtype, device="cpu")
    packed, state = bnb.functional.quantize_4bit(full, blocksize=w.blocksize, compress_statistics=w.compress_statistics,
                                                 quant_type=w.quant_type, quant_storage=w.quant_storage)
    del full
    p = torch.nn.Parameter(packed, requires_grad=False)
    p.quant_state = state  # type: ignore[attr-defined]  # where bitsandbytes' Params4bit keeps it
    return p


def warmup_bytes(model, compute_dtype) -> int:
    """Bytes transformers' ``caching_allocator_warmup`` allocates (and frees at once) on the device before a
    from_pretrained with a device map loads the weights (``get_total_byte_count``): every weight and persistent
    buffer of the checkpoint once (tied ones once), at half a byte per element for a 4-bit weight, else at its
    loading dtype (k-bit preparation's fp32 casts come later). Adapters are not in the checkpoint."""
    import torch

    total, seen = 0, set()
    kbit = any(type(p).__name__ == "Params4bit" for p in model.parameters())
    for name, m in model.named_modules():
        stores = [(k, t) for k, t in m._parameters.items()]
        stores += [(k, t) for k, t in m._buffers.items() if k not in m._non_persistent_buffers_set]
        for k, t in stores:
            if t is None or id(t) in seen or "lora_" in f"{name}.{k}":
                continue
            seen.add(id(t))
            if type(t).__name__ == "Params4bit":
                total += t.numel() // 2
            elif kbit and t.dtype == torch.float32 and compute_dtype not in (None, torch.float32):
                total += t.numel() * compute_dtype.itemsize  # k-bit preparation's fp32: loaded in 16 bits
            else:
                total += t.numel() * t.element_size()
    return total


def _materialize(model, rec, compute_dtype=None, kbit_read_ahead: int = 0) -> None:
    """Fake CPU storage for every meta parameter and buffer: base weights first (as loaded), then adapters (as
    peft adds them); a parameter shared by two modules (tied embeddings) materializes once. A quantize-on-load
    reads each 16-bit weight onto the device, quantizes it and frees it; ``kbit_read_ahead``: how many tensors
    the loader reads ahead of the one being quantized (0: none, as the installed transformers loads; transformers
    5.0's thread pool read ahead, see :func:`trace_step`)."""
    import torch

    adapter = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if "lora_" in n}
    quantized = any(type(p).__name__ == "Params4bit" for p in model.parameters())
    memo: dict[int, torch.Tensor] = {}
    read: dict[int, torch.Tensor | None] = {}  # 16-bit weights on the device, not yet quantized

    def fetch(t, second: bool) -> None:
        rec.tag = "adapter" if second else ""
        if type(t).__name__ == "Params4bit":
            read[id(t)] = torch.empty(t.shape, dtype=compute_dtype, device="cpu")
            return
        # k-bit preparation made this 16-bit weight fp32 (it loads in 16 bits, then is cast)
        cast = (quantized and isinstance(t, torch.nn.Parameter) and not second
                and t.dtype == torch.float32 and compute_dtype != torch.float32)
        rec.tag = "kbit_upcast" if cast else rec.tag
        new = torch.empty_like(t, device="cpu")
        memo[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
        read[id(t)] = None

    for second in (False, True):
        order = _load_order(model, quantized and not second)
        seq = list({id(t): t for store, k in order if (t := store[k]) is not None and (id(t) in adapter) == second
                    and t.device.type == "meta"}.values())
        ahead = kbit_read_ahead if quantized and not second else 0
        for i, t in enumerate(seq):
            for u in seq[i:i + ahead + 1]:
                if id(u) not in read:
                    fetch(u, second)
            if type(t).__name__ == "Params4bit":
                rec.tag = ""
                memo[id(t)] = _quantized(t, compute_dtype, read.pop(id(t)))
        for store, k in order:
            if store[k] is not None and id(store[k]) in memo:
                store[k] = memo[id(store[k])]
    rec.tag = ""


def _load_order(model, kbit: bool):
    """(parameter-or-buffer dict of a module, key) in the order loading allocates them: module order, except that
    from_pretrained quantizing on load (k-bit) loads synchronously in checkpoint-key order (transformers'
    ``dot_natural_key``: per layer input_layernorm, mlp.down/gate/up, post_attention_layernorm, self_attn.k/o/q/v),
    each 16-bit weight moved to the device, quantized and freed before the next is read."""
    slots = [(name, m, store, k) for name, m in model.named_modules()
             for store in (m._parameters, m._buffers) for k in store]
    if kbit:
        from transformers.core_model_loading import dot_natural_key

        slots.sort(key=lambda x: dot_natural_key(f"{x[0]}.{x[3]}" if x[0] else x[3]))
    return [(store, k) for _, _, store, k in slots]


def _phase_hooks(model, optimizer, rec, prefix: list[str], fused_loss: bool = False):
    """Mark phases: forward (model call), loss (after the output head), backward (after the model returns),
    optimizer_step (from optimizer.step). The fused loss calls the body, never the head nor the whole model:
    forward from the body's call, loss from its return (the loss's forward and backward), backward from the
    gradient of its hidden states."""
    head = model.get_output_embeddings()

    def setp(p):
        rec.phase = prefix[0] + p

    if fused_loss:
        from fitburst.families import family_for
        from fitburst.families.causal import CausalFamily

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        family = family_for(base.config)
        assert isinstance(family, CausalFamily)  # the families that take the fused loss (fused_loss_refusal)
        body = family.body(base)

        def body_done(module, args, out):
            setp("loss")
            hidden = out.last_hidden_state
            if hidden.requires_grad:
                hidden.register_hook(lambda g: setp("backward"))

        return [body.register_forward_pre_hook(lambda *a: setp("forward")), body.register_forward_hook(body_done),
                optimizer.register_step_pre_hook(lambda *a: setp("optimizer_step"))]
    hs = [
        model.register_forward_pre_hook(lambda *a: setp("forward")),
        head.register_forward_hook(lambda *a: setp("loss")),
        model.register_forward_hook(lambda *a: setp("backward")),
        optimizer.register_step_pre_hook(lambda *a: setp("optimizer_step")),
    ]
    return hs


def trace_step(spec, settings: RunSettings, *, seq_len: int, adamw: str = "for-loop", step=None,
               kbit_read_ahead: int = 0, autocast_of: str = "cpu", device: Device | None = None,
               traced_micro: int | None = TRACED_MICRO) -> StepTrace:
    """Trace warm-up + measured step of ``spec`` with ``settings`` at ``seq_len`` on fake CPU tensors.

    ``adamw``: how AdamW steps (:func:`fitburst.memory.cuda_kernels.adamw_impl`). ``step``: the step function (default:
    the loop's :func:`fitburst.train.optimizer_step`; a benchmark passes its own loop's). ``kbit_read_ahead``: tensors a
    quantize-on-load reads onto the device ahead of the one it quantizes (:func:`_materialize`): 0 for the installed
    transformers, transformers 5.0 read ahead on a thread pool. ``autocast_of``: the device kind whose autocast the
    loop's AMP follows (:func:`fitburst.memory.autocast_policy.device_autocast`). ``device``: the device the model is
    loaded for, whose attention the trace builds (:func:`fitburst.models.attn_implementation`): CUDA's fused SDPA kernel
    of that device (:func:`fitburst.memory.cuda_kernels.cuda_sdpa_dispatch`), MPS's math composite
    (:func:`fitburst.memory.mps_kernels.mps_sdpa_math`). ``traced_micro``: how many micro-batches of each step run
    (:data:`TRACED_MICRO`; None: all). Liger's kernels run as stand-ins (:mod:`.model_kernels`)."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401  (whether torch is here)
    except ImportError as e:  # a preflight-only install: the analytic estimate still runs
        raise TraceUnsupported(f"the traced estimate needs torch ({e}): install fitburst's training "
                               "dependencies, or use the analytic estimate") from None

    from fitburst.collector import seldom
    from fitburst.train import optimizer_step

    from . import model_kernels, sharded

    s = settings
    if (why := untraceable(s)) is not None:
        raise TraceUnsupported(why)
    wrap = (sharded.fake_process_group(s.world_size) if s.world_size > 1 and not sharded.in_fake_group() else
            model_kernels.liger_stand_ins() if s.liger_kernels and not model_kernels.standing_in() else None)
    if wrap is not None:  # rank 0 of world_size in a fake process group; Liger's patch on stand-ins, undone after
        with wrap:
            return trace_step(spec, settings, seq_len=seq_len, adamw=adamw, step=step, kbit_read_ahead=kbit_read_ahead,
                              autocast_of=autocast_of, device=device, traced_micro=traced_micro)
    with seldom():  # fake tensors hold no memory: fewer collections of the trace's objects (fitburst.collector)
        return _traced_step(spec, s, seq_len=seq_len, adamw=adamw, step=step or optimizer_step,
                            kbit_read_ahead=kbit_read_ahead, autocast_of=autocast_of, device=device,
                            traced_micro=traced_micro)


def _traced_step(spec, s: RunSettings, *, seq_len: int, adamw: str, step, kbit_read_ahead: int,
                 autocast_of: str, device: Device | None, traced_micro: int | None) -> StepTrace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fitburst.builders import prepare_for_training
    from fitburst.device import make_amp
    from fitburst.hardware import resolve_device
    from fitburst.models import EXPANDED_KV

    from . import cuda_kernels, sharded
    from .autocast_policy import device_autocast
    from .loss_kernels import loss_kernel_of, traced_fused_loss
    from .recorder import Recorder  # torch: imported only to trace

    t0 = time.perf_counter()
    sp = spec_with_settings(spec, s)
    cfg = config_dict(sp.model.name)
    model = _meta_model(cfg, s, sp.model.trust_remote_code, sp.training.pure_bf16, device)
    text = model.config.get_text_config()
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    model = prepare_for_training(model, sp)
    sharded.shard_on_meta(model, s)
    # FA2 is traced as SDPA's shapes: with no mask where FlashAttention-2 gets none (varlen over the real tokens)
    padded = attention_masked(device or resolve_device("cpu"), s.attention,
                              s.micro_batch_size > 1 if s.padded is None else s.padded)
    rec = Recorder()
    prefix = ["warmup."]
    kind = device.kind if device is not None else "cpu"
    sdpa = device_sdpa(device)
    with (bnb_caches_kept(s.kbit), FakeTensorMode(allow_non_fake_inputs=True), rec, sharded.traced(rec, s),
          gpu_like_masking(padded), device_autocast(autocast_of), sdpa, contextlib.ExitStack() as stack):
        load_bytes = _loaded(model, rec, s, kbit_read_ahead, kind)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        tr = sp.training
        opt = _optimizer(sp, params, adamw)
        hooks = _phase_hooks(model, opt, rec, prefix, fused_loss=s.fused_loss)
        # the loop's AMP (autocast copies, fp16 GradScaler), with CPU autocast standing in for the device's. CPU
        # autocast lowers the same ops as CUDA's and MPS's on these models (linear, matmul, bmm, baddbmm, addmm,
        # SDPA) and caches the casts of fp32 leaf weights alike; the ops those run in fp32 and CPU's does not
        # (norms, softmax, sum, pow, rsqrt, ...) run as the device's autocast runs them (autocast_of). The
        # GradScaler runs on fake tensors: its found-inf .item() reads 0 (the recorder), so the traced step is
        # always taken, never skipped.
        amp = make_amp(s.precision, "cpu", pure_bf16=tr.pure_bf16)
        micro = [_batch(s.micro_batch_size, seq_len, padded, s, model) for _ in range(s.grad_accum)]
        rec.phase = "warmup.forward"
        # the fused loss as its kernel's rule allocates (loss_kernels), offloading as cuda_kernels models it
        lean: dict = {"loss": loss_kernel_of(s, device or resolve_device("cpu"))} if s.fused_loss else {}
        if s.activation_offloading and kind == "cuda":
            lean["offload"] = cuda_kernels.offloaded_activations(rec)
        stack.enter_context(traced_fused_loss(lean.get("loss", "chunked")))
        with fake_kernels_of(sp.model.name):
            step(model, opt, params, micro[:traced_micro], device="cpu", max_grad_norm=tr.max_grad_norm, amp=amp,
                 **lean)
        del micro
        prefix[0] = ""
        rec.phase = "forward"
        start = len(rec.events)
        micro = [_batch(s.micro_batch_size, seq_len, padded, s, model) for _ in range(s.grad_accum)]
        step(model, opt, params, micro[:traced_micro], device="cpu", max_grad_norm=tr.max_grad_norm, amp=amp,
             **lean)
        for h in hooks:
            h.remove()
        _tag_cpu_resident(rec, opt)
        trainable, total = sum(p.numel() for p in params), _param_count(model)
        loaded = _loaded_bytes(model, s.double_quant, adapter_trains=s.method != "full")
    return StepTrace(events=rec.events, measured_start=start,
                     params={"total": total, "trainable": trainable, "loaded": loaded},
                     seconds=time.perf_counter() - t0, dtype_bytes={"fp32": 4}.get(s.precision, 2),
                     heads=heads, load_bytes=load_bytes, kv_heads=kv_heads,
                     kv_expanded=text._attn_implementation == EXPANDED_KV,
                     vocab=int(getattr(text, "vocab_size", 0) or 0))


def _loaded(model, rec, s: RunSettings, kbit_read_ahead: int, kind: str) -> int:
    """Materialize the model's weights under the recorder, as the loop loads them (a sharded run: rank 0's share of
    what FSDP loads), and on a ``kind`` "cuda" device the input embeddings then moved to the host where the loop
    moves them (:func:`_embeddings_to_host`); the bytes from_pretrained's caching_allocator_warmup reserves first."""
    from fitburst.device import torch_dtype

    from . import sharded

    if s.world_size > 1:
        load_bytes = sharded.materialize(model, rec, s, lambda: _materialize(model, rec, torch_dtype(s.precision)))
    else:
        load_bytes = warmup_bytes(model, torch_dtype(s.precision))
        _materialize(model, rec, torch_dtype(s.precision), kbit_read_ahead)
    if s.host_embeddings_modelled and kind == "cuda":
        _embeddings_to_host(model, rec)
    return load_bytes


def _embeddings_to_host(model, rec) -> None:
    """``training.embeddings_on_host`` as the loop runs it (:func:`fitburst.builders.host_embeddings`, its hook
    included), the table's move standing in for the GPU's: on fake CPU tensors ``.to("cpu")`` copies nothing, so
    the table is copied here, the copy tagged ``host_weight`` (left out of the device's trace,
    :func:`fitburst.memory.cuda_kernels.drop_cpu_resident`) and the loaded one, the GPU's, freed."""
    from fitburst.models import embeddings_to_host

    rec.tag, before = "host_weight", rec.tag
    try:
        for p in model.get_input_embeddings().parameters():
            p.data = p.data.clone()
    finally:
        rec.tag = before
    embeddings_to_host(model)


def _optimizer(sp, params: list, adamw: str):
    """The loop's optimizer over ``params``; ``adamw``: how AdamW steps (fused, foreach, for-loop)."""
    from fitburst.builders import make_optimizer

    tr = sp.training
    return make_optimizer(tr.optimizer, params, tr.learning_rate, tr.weight_decay, adamw)


def _batch(b: int, s: int, padded: bool, settings: RunSettings | None = None, model=None) -> dict:
    """A batch as fitburst.data.collate builds it (int64 ids, labels and mask, padded to the longest; for an
    encoder-decoder model the encoder input and the decoder's labels, both ``s`` long); with
    ``settings.images``, each sample opens with its images' tokens (each image a 2 x 2*tokens grid of merged
    patches, a text token after it) and carries their patches, as vision_language.collate_images builds it. The
    ids, mask, marks and grids are real tensors (the model reads their values to place the images; the recorder
    runs what only they feed for real), and so are the 3-D rotary positions the model would build from them; the
    labels and patches are fake."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    out = {"input_ids": torch.zeros((b, s), dtype=torch.long), "labels": torch.zeros((b, s), dtype=torch.long),
           "attention_mask": torch.ones((b, s), dtype=torch.long)}
    if settings is None or not settings.images or not settings.image_tokens:
        return out
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    v, k, n = config.vision_config, settings.image_tokens, settings.images
    with unset_fake_temporarily():
        row = (([config.image_token_id] * k + [config.vision_end_token_id]) * n + [0] * s)[:s]
        out["input_ids"] = torch.tensor([row] * b)
        out["attention_mask"] = torch.ones((b, s), dtype=torch.long)
        out["mm_token_type_ids"] = (out["input_ids"] == config.image_token_id).long()
        out["image_grid_thw"] = torch.tensor([[1, v.spatial_merge_size, v.spatial_merge_size * k]] * (b * n))
        out["position_ids"] = base.model.get_rope_index(
            out["input_ids"], image_grid_thw=out["image_grid_thw"], attention_mask=out["attention_mask"],
            mm_token_type_ids=out["mm_token_type_ids"])[0]
    out["pixel_values"] = torch.zeros((b * n * k * v.spatial_merge_size ** 2,
                                       v.in_channels * v.temporal_patch_size * v.patch_size ** 2))
    return out


def _tag_cpu_resident(rec, opt) -> None:
    """Tag the optimizer's step counters: a GPU run keeps them on the CPU (not in the device allocator)."""
    import torch

    sids = set()
    for st in opt.state.values():
        t = st.get("step")
        if isinstance(t, torch.Tensor):
            sid = rec.sid_of(t)
            if sid is not None:
                sids.add(sid)
    rec.events[:] = [Event(e.kind, e.sid, e.size, e.phase, e.op, "step_counter") if e.sid in sids else e
                     for e in rec.events]


# --- the estimate ------------------------------------------------------------------------------------------


def traced_estimate(spec, settings: RunSettings, device: Device, *, seq_len: int,
                    cache: dict | None = None) -> Estimate:
    """The estimate from the traced step: exact tensor peak, per-phase peaks; on CUDA the CUDA-kernel rules and
    the caching-allocator replay give reserved, and the device total is reserved + CUDA context; on CPU the
    tensor peak plus the runtime floor; on MPS the tensor peak with the analytic estimate's MPS heap terms.
    ``method`` is "traced" (its error band in :mod:`fitburst.memory.calibration`). Each estimate is kept on disk
    (:mod:`fitburst.memory.trace_cache`); ``cache`` keeps traces by settings across calls in this process (a trace
    depends on the device through its kind: the optimizer's fused or foreach path, its autocast, MPS's SDPA; the SDPA
    kernels a CUDA device picks and whether the loader expands grouped-query k/v there)."""
    from . import trace_cache

    k = trace_cache.key(config_dict(spec.model.name), settings, seq_len, device, model=spec.model.name,
                        trust_remote_code=spec.model.trust_remote_code, max_grad_norm=spec.training.max_grad_norm,
                        expandable_segments=allocator_mode() == "expandable_segments")
    if (kept := trace_cache.load(k)) is not None:
        kept.notes.append("from the trace cache (same config, settings, device, libraries and tracing code)")
        return kept
    est = _traced_estimate(spec, settings, device, seq_len=seq_len, cache=cache)
    trace_cache.store(k, est)
    return est


def _traced_estimate(spec, settings: RunSettings, device: Device, *, seq_len: int,
                     cache: dict | None) -> Estimate:
    from . import allocator, cuda_kernels
    from .host import traced_host_bytes

    s = settings
    adamw = cuda_kernels.adamw_impl(device.kind, s.world_size, s.adamw)
    # whether this device would expand a grouped-query model's k/v (the trace records whether this model's were)
    expands = s.attention == "sdpa" and cuda_kernels.expands_kv(device, s.precision, gqa=True)
    key = (json.dumps(asdict(s), sort_keys=True), seq_len, device.kind, expands, adamw, device.supports_bf16)
    trace = cache.get(key) if cache is not None else None
    if trace is None:
        trace = trace_step(spec, s, seq_len=seq_len, adamw=adamw, autocast_of=device.kind, device=device)
        if cache is not None:
            cache[key] = trace
    notes = [f"traced: {len(trace.events)} allocation events in {trace.seconds:.1f} s"]
    if s.world_size > 1:
        notes.append(f"traced as rank 0 of {s.world_size} (FSDP2 in a fake process group): per-GPU figures")
    if trace.kv_expanded:
        notes.append(cuda_kernels.expanded_kv_note(device))
    events = trace.events
    if device.kind == "cuda":
        if cuda_kernels.sdpa_kernel_of(trace, device, s) == "math":  # grouped-query k/v the loader cannot expand
            raise TraceUnsupported(f"{spec.model.name}: on {device.name} its custom attention code would hand SDPA "
                                   "grouped-query heads, which this torch runs with the math kernel (not traced); "
                                   "the analytic estimate and its wider error band decide")
        # fitburst.models.load_model always loads with a device map: caching_allocator_warmup runs for 16 bits too
        events, start = cuda_kernels.apply(trace, device, s, seq_len, device_map=True)
        peak, peak_phase, phases = live_peaks(events, start)
        components = peak_components(events, start)
        replay = allocator.replay(events, start=start, expandable=allocator_mode() == "expandable_segments")
        alloc, reserved = replay.peak_allocated, replay.peak_reserved
        total = reserved + device.outside_allocator
    else:
        peak, peak_phase, phases = trace.live_peaks()
        components = peak_components(events, trace.measured_start)
        alloc = peak
        if device.kind == "mps":
            reserved = int(peak * RESERVED_FACTOR["mps"]) + RESERVED_FLOOR["mps"]  # as the analytic estimate
            total = reserved
        else:
            reserved = peak + CPU_RUNTIME_FLOOR
            total = reserved + device.outside_allocator
    return Estimate(
        allocated_peak_bytes=int(alloc), reserved_peak_bytes=int(reserved), device_total_bytes=int(total),
        components=components, peak_phase=peak_phase, device=device.name,
        budget_bytes=device.budget_bytes,
        params={"total": trace.params["total"], "trainable": trace.params["trainable"],
                "base": trace.params["total"] - (trace.params["trainable"] if s.method != "full" else 0),
                "loaded": trace.params.get("loaded", 0)},  # 0: a trace cached before it was counted
        phases=phases, settings=asdict(s), model=spec.model.name, notes=notes, method="traced", world_size=s.world_size,
        vocab=trace.vocab, offloaded_host_bytes=traced_host_bytes(trace.events, trace.measured_start),
        host_table_bytes=traced_host_bytes(trace.events, tag="host_weight"))
