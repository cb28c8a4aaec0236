"""Model and tokenizer loading: the one place that calls ``from_pretrained`` (the demo models it may be asked for
are built by :mod:`fitburst.demo_models`).

transformers, peft and bitsandbytes are imported inside the functions that use them: data prep, the CLI and the
instant estimate import this module without loading them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from fitburst import collector
from fitburst.demo_models import LOCAL_MODELS, VL_MODEL, demo_model_dir, tiny_vl_dir
from fitburst.device import weight_dtype
from fitburst.families import Family, family_for
from fitburst.hardware import Device, expands_kv, probe_local
from fitburst.memory.shapes import ModelShape, UnmodelledArchitecture, bundled_config, load_shape
from fitburst.spec import PipelineSpec, resolve_env, resolve_quant


def resolve_model_ref(name: str) -> str:
    """A path or hub id that ``from_pretrained`` accepts; builds the demo model when asked for it."""
    if name == VL_MODEL:
        return str(tiny_vl_dir())
    if name in LOCAL_MODELS:
        return str(demo_model_dir(family=LOCAL_MODELS[name]))
    return name


@dataclass(frozen=True)
class ResolvedModel:
    """A pipeline's model, looked up once before it loads (:func:`resolve_model`) and passed down typed to what
    builds, loads, steps and times it: where ``from_pretrained`` finds it (``ref``: a demo model's folder, built on
    first use), its family and its shape (None: an architecture the analytic estimate does not model)."""

    ref: str
    family: Family
    shape: ModelShape | None


def resolve_model(spec: PipelineSpec) -> ResolvedModel:
    """``spec``'s model resolved: its reference (:func:`resolve_model_ref`), family (:func:`model_family`) and
    shape (:func:`spec_shape`), each looked up once."""
    ref = resolve_model_ref(spec.model.name)
    return ResolvedModel(ref, model_family(spec.model), _shape_of(ref, spec.model.revision))


def spec_with_model_ref(spec: PipelineSpec) -> PipelineSpec:
    """``spec`` with ``model.name`` as :func:`resolve_model_ref` resolves it (a demo model's folder, built on first
    use): what the traced and sliced estimates build the model from, outside this module."""
    return spec.model_copy(update={"model": spec.model.model_copy(update={"name": resolve_model_ref(
        spec.model.name)})})


def load_tokenizer(name: str, revision: str | None = None, token: str | None = None,
                   trust_remote_code: bool = False):
    """Load the tokenizer; give it a pad token when it has none (the eos token)."""
    from transformers import AutoTokenizer  # transformers: heavy, loaded only to load a model

    tok = AutoTokenizer.from_pretrained(resolve_model_ref(name), revision=revision, token=token,
                                        trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def auto_model_class(config):
    """The transformers Auto class that loads (or, for the trace, builds) a model of this config's family."""
    return family_for(config).auto_class()


def model_family(model) -> Family:
    """The family of a pipeline's ``model`` section, from its config.json (its ${ENV} token resolved at use); a
    locally built model's from its architecture, so asking builds nothing (bad data is refused before that)."""
    if model.name in LOCAL_MODELS:
        arch = LOCAL_MODELS[model.name]
        return family_for(SimpleNamespace(model_type=arch, is_encoder_decoder=arch == "t5"))
    if (local := local_config(model.name, model.revision)) is not None:  # no transformers import (about 2 s)
        return family_for(SimpleNamespace(model_type=local.get("model_type"),
                                          is_encoder_decoder=bool(local.get("is_encoder_decoder"))))
    return family_for(load_config(model.name, model.revision, resolve_env(model.hf_token), model.trust_remote_code))


def local_config(name: str, revision: str | None = None) -> dict | None:
    """config.json of a model folder or of a bundled config of the same name (fitburst/configs), read as JSON;
    None for a hub model with no bundled config."""
    p = Path(name).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix == ".json"):
        path = p / "config.json" if p.is_dir() else p
        return json.loads(path.read_text()) if path.is_file() else None
    bundled = bundled_config(name, revision)
    return json.loads(bundled.read_text()) if bundled is not None else None


def tokenizer_for(model, ref: str | None = None):
    """The tokenizer of a pipeline's ``model`` section (its ${ENV} token resolved only here, at use); ``ref``: the
    model's resolved reference (:attr:`ResolvedModel.ref`), default ``model.name``."""
    return load_tokenizer(ref or model.name, model.revision, resolve_env(model.hf_token), model.trust_remote_code)


def quantization_config(quant: str, double_quant: bool, compute_dtype, *, sharded: bool = False):
    """The bitsandbytes config for a quant setting, or None for unquantized weights. ``sharded`` (FSDP): the packed
    4-bit weights are stored in the compute dtype (``bnb_4bit_quant_storage``) instead of uint8, so that FSDP shards
    them as ordinary weights of the block's one dtype, the setup PEFT documents for FSDP QLoRA (FSDP1 needs one dtype
    per flat parameter and its mixed precision would cast the packed bytes into garbage numbers; FSDP2 on torch 2.13
    was measured to cope with uint8 too)."""
    if quant == "none":
        return None
    from transformers import BitsAndBytesConfig  # transformers: heavy

    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    storage = {"bnb_4bit_quant_storage": compute_dtype} if sharded else {}
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant,
                              bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=compute_dtype, **storage)


# SDPA with grouped-query k/v expanded first, for GPUs with no FlashAttention for the run's dtype (T4, V100, fp32):
# there transformers' unmasked SDPA call (enable_gqa) falls to the math kernel (fitburst.hardware.sdpa_kernel_for)
EXPANDED_KV = "sdpa_expanded_kv"


def _sdpa_expanded_kv(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with k/v expanded to the query heads where transformers would hand SDPA the
    grouped ones (``use_gqa_in_sdpa``: no mask, head dims <= 256; otherwise it expands them itself), so that SDPA's
    memory-efficient kernel can run the call."""
    from transformers.integrations.sdpa_attention import (  # transformers: heavy
        repeat_kv,
        sdpa_attention_forward,
        use_gqa_in_sdpa,
    )

    if key.shape[1] < query.shape[1] and use_gqa_in_sdpa(attention_mask, key, value):
        groups = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def attn_implementation(attention: str, config, target: Device | None, precision: str,
                        trust_remote_code: bool = False) -> str | None:
    """transformers' ``attn_implementation`` for ``training.attention`` (None: transformers' default, SDPA) on the
    ``target`` device computing in ``precision``: SDPA becomes :data:`EXPANDED_KV` where a grouped-query model's
    unmasked call would fall to the math kernel (:func:`fitburst.hardware.expands_kv`), for models
    whose own code takes SDPA and a named attention implementation (not custom code); the estimate traces the same
    choice."""
    impl = {"flash": "flash_attention_2", "auto": None}.get(attention, attention)
    if impl not in (None, "sdpa") or target is None or trust_remote_code:
        return impl
    text = config.get_text_config()
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    gqa = 0 < int(getattr(text, "num_key_value_heads", None) or heads) < heads
    if not expands_kv(target, precision, gqa):
        return impl
    try:
        cls = auto_model_class(config)._model_mapping[type(config)]
    except KeyError:
        return impl
    if not (getattr(cls, "_supports_sdpa", False) and cls._can_set_attn_implementation()):
        return impl
    from transformers import AttentionInterface  # transformers: heavy
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EXPANDED_KV, _sdpa_expanded_kv)
    AttentionMaskInterface.register(EXPANDED_KV, sdpa_mask)
    return EXPANDED_KV


def load_model(name: str, *, dtype, device: str, quant: str = "none", double_quant: bool = True,
               attention: str = "auto", revision: str | None = None, token: str | None = None,
               trust_remote_code: bool = False, target: Device | None = None, precision: str = "fp32",
               sharded: bool = False, empty: bool = False, family: Family | None = None):
    """Load the model once, straight into ``dtype`` and onto ``device`` (no second copy, no re-cast): a causal LM,
    an encoder-decoder (T5, FLAN-T5) or a vision-language model (:mod:`fitburst.families`): :func:`auto_model_class`.
    ``target``: the GPU it trains on, computing in ``precision`` (:func:`attn_implementation`). ``sharded``: FSDP
    will shard it (:func:`quantization_config`). ``family``: the model's, when resolved already (default: told from
    its config).

    ``empty``: the same model from the same config.json with its weights on the meta device and nothing read from
    the checkpoint (accelerate's ``init_empty_weights``, which keeps the buffers real: a rotary embedding's
    ``inv_freq`` is computed from the config as on load), tied as loading ties it; the ranks of a sharded run that
    receive their shards from rank 0 build this (:func:`fitburst.distributed.fill_from_rank0`). Unquantized only."""
    config = load_config(name, revision=revision, token=token, trust_remote_code=trust_remote_code)
    auto = (family or family_for(config)).auto_class()
    if empty:
        if quant != "none":
            raise ValueError(f"an empty {quant} model has no quantization state to receive (load it instead)")
        from accelerate import init_empty_weights  # accelerate: heavy

        impl = attn_implementation(attention, config, target, precision, trust_remote_code)
        with init_empty_weights():
            model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                     **({"attn_implementation": impl} if impl is not None else {}))
        model.tie_weights()  # init_empty_weights re-creates each parameter it registers, the tied head's too
        return model
    # device_map puts each weight straight onto the device in its final dtype: no CPU copy to move afterwards
    kwargs = dict(config=config, dtype=dtype, revision=revision, token=token, trust_remote_code=trust_remote_code,
                  device_map={"": device})
    impl = attn_implementation(attention, config, target, precision, trust_remote_code)
    if impl is not None:
        kwargs["attn_implementation"] = impl
    qconf = quantization_config(quant, double_quant, dtype, sharded=sharded)
    if qconf is not None:
        kwargs["quantization_config"] = qconf
    model = auto.from_pretrained(resolve_model_ref(name), **kwargs)
    if quant in ("nf4", "fp4") and device == "cpu":
        _disable_bnb_cpu_repack(model)
    return model


def load_config(name: str, revision: str | None = None, token: str | None = None, trust_remote_code: bool = False):
    """The model's transformers config (``config.json``)."""
    from transformers import AutoConfig  # transformers: heavy

    return AutoConfig.from_pretrained(resolve_model_ref(name), revision=revision, token=token,
                                      trust_remote_code=trust_remote_code)


def load_pipeline_model(spec: PipelineSpec, device: str, precision: str, *, path: str | None = None,
                        resolved: ResolvedModel | None = None, sharded: bool = False, empty: bool = False):
    """The one way train, probe and eval load a pipeline's model: its name (or ``path``, a saved full fine-tune;
    ``resolved``: its reference and family as the run resolved them), revision, token, quantization and attention,
    weights in :func:`fitburst.device.weight_dtype`. ``sharded``: for FSDP (:mod:`fitburst.distributed`), loaded
    into host memory, from where each rank's shards go to ``device``; ``empty``: built without weights
    (:func:`load_model`). What the settings may not do on ``device`` its callers refuse before they load
    (:func:`fitburst.builders.refuse_problems`: the Recipe, the probe); evaluation loads after the run trained there.
    From here the process collects its garbage as it did before it started (:mod:`fitburst.collector`)."""
    collector.collect_as_before()
    m, method, tr = spec.model, spec.method, spec.training
    quant = resolve_quant(method.type, method.quant)
    dtype = weight_dtype(precision, method.type, tr.pure_bf16)
    target = probe_local("cuda") if device.startswith("cuda") else None
    load_on = "cpu" if sharded else device
    name, family = (resolved.ref, resolved.family) if resolved is not None else (m.name, None)
    if path is not None:
        return load_model(path, dtype=dtype, device=load_on, attention=tr.attention, target=target,
                          precision=precision, empty=empty, family=family)
    return load_model(name, dtype=dtype, device=load_on, quant=quant, double_quant=method.double_quant,
                      attention=tr.attention, revision=m.revision, token=resolve_env(m.hf_token),
                      trust_remote_code=m.trust_remote_code, target=target, precision=precision, sharded=sharded,
                      empty=empty, family=family)


def prepare_kbit(model, *, gradient_checkpointing: bool, frozen_fp32: bool = True):
    """peft's ``prepare_model_for_kbit_training`` (base frozen, unquantized weights cast to fp32, checkpointing on).

    ``frozen_fp32`` false: the frozen input embeddings and output head (tied or not) keep the 16-bit dtype they were
    loaded in: the same values as the fp32 copies peft would make of them, in half the bytes. The embeddings' output
    is cast to fp32, so the residual stream, the norms and the adapters stay fp32 as peft makes them; under autocast
    the head's matmul takes the 16-bit weight that autocast would otherwise copy from the fp32 one. peft 0.21 has no
    argument for it, and casting back afterwards would still hold every fp32 copy at once while loading (4.2 GB for
    Llama-3.1-8B beside its 3.9 GB of 4-bit weights): peft's own function runs with those weights viewed as int16 (no
    copy), which its cast passes by, and they are viewed back after it."""
    import torch
    from peft import prepare_model_for_kbit_training  # heavy: loaded only when training

    kept = [] if frozen_fp32 else [(p, p.dtype) for p in _frozen_16bit_weights(model)]
    for p, _ in kept:
        p.requires_grad_(False)
        p.data = p.data.view(torch.int16)
    try:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    finally:
        for p, dtype in kept:
            p.data = p.data.view(dtype)
    if kept:
        model.get_input_embeddings().register_forward_hook(_to_fp32)
    return model


def _frozen_16bit_weights(model) -> list:
    """The input embeddings' and output head's 16-bit weights (a tied one once)."""
    import torch

    out: dict[int, torch.nn.Parameter] = {}
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        w = getattr(module, "weight", None)
        if isinstance(w, torch.nn.Parameter) and w.dtype in (torch.bfloat16, torch.float16):
            out[id(w)] = w
    return list(out.values())


def _to_fp32(module, args, output):
    """Forward hook: the 16-bit embeddings' output as fp32, the residual stream k-bit preparation makes."""
    return output.float()


def embeddings_to_host(model, host: str = "cpu") -> None:
    """The frozen input embedding table moved to ``host`` RAM, where its lookup runs: accelerate's
    ``AlignDevicesHook`` sends the ids there and the looked-up rows back to the device the ids came from (the
    hooks k-bit preparation put on the embeddings, the fp32 cast and the input-grad switch, then act on the device's
    rows). Saves the table's bytes of GPU memory (1 GB for Llama-3.1-8B in bf16). A ValueError for a table tied to
    the output head (its matmul must stay on the GPU), one another module looks up too (an encoder-decoder's, whose
    stacks read the shared table through their own modules, never through this hook), or one that trains."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module  # heavy: loaded only when training

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is getattr(emb, "weight", None):
        raise ValueError("the input embeddings are tied to the output head, which runs on the GPU")
    weight = getattr(emb, "weight", None)
    readers = [n for n, m in model.named_modules() if m is not emb and getattr(m, "weight", None) is weight]
    if weight is not None and readers:
        raise ValueError(f"the input embedding table is also looked up by {', '.join(readers)}, which would read it "
                         "in host RAM from the GPU")
    if any(p.requires_grad for p in emb.parameters()):
        raise ValueError("the input embeddings train here; only a frozen table can stay in host RAM")
    emb.to(host)
    add_hook_to_module(emb, AlignDevicesHook(execution_device=host, io_same_device=True), append=True)


def tile_mlps(model, shape: ModelShape) -> int:
    """Each decoder block's gated MLP run by liger-kernel's ``apply_tiled_mlp`` (pure torch: an autograd function
    that runs the MLP's own forward, LoRA adapters included, over ceil(seq / hidden) sequence shards without
    saving their intermediates, and again shard by shard in backward); returns how many MLPs it wraps. A model
    ``shape`` without a gated MLP is refused before (the rule table's ``tiled_mlp_model`` row)."""
    from liger_kernel.ops import apply_tiled_mlp  # heavy, optional: the lean extra

    names = {lin.name for lin in shape.mlp_linears()}
    mlps = [m for n, m in model.named_modules()
            if names <= {c for c, _ in m.named_children()} and not any(v in n for v in ("visual", "vision"))]
    for mlp in mlps:
        mlp.forward = _tiled(apply_tiled_mlp, mlp, mlp.forward)
    return len(mlps)


def _tiled(apply_tiled_mlp, mlp, forward):
    """``mlp``'s ``forward`` over sequence shards (Liger's default count: ceil(seq / hidden))."""
    return lambda x: apply_tiled_mlp(lambda _module, shard: forward(shard), mlp, x)


def apply_liger_kernels(model) -> None:
    """``training.liger_kernels``: Liger Kernel's model kernels patched into the loaded ``model`` by Liger's own
    ``_apply_liger_kernel_to_instance`` (what transformers' Trainer calls for ``use_liger_kernel``): the
    ``apply_liger_kernel_to_<model_type>`` of its config's model type (RMSNorm, SwiGLU / GEGLU, RoPE, and whatever
    else that function patches), with its loss kernels off (the loss is ``training.loss``'s). CUDA only, for a model
    type Liger patches: the rule table refused the rest before the model loaded. The trace runs the same call
    with stand-ins for Liger's Functions (:mod:`fitburst.memory.model_kernels`)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # heavy, optional: the lean extra

    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)


def _disable_bnb_cpu_repack(model) -> None:
    """bitsandbytes on CPUs with avx512_bf16 repacks 4-bit weights after an eval forward, which breaks later
    training steps (see shared stack notes); turn that path off on every 4-bit layer."""
    import bitsandbytes as bnb  # bitsandbytes: heavy, only for a 4-bit model on the CPU

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def spec_shape(spec: PipelineSpec) -> ModelShape | None:
    """The pipeline's model shape from its config.json (at ``model.revision`` when fetched from the hub; the demo
    models built first); None for an architecture the analytic estimate does not model (the trace plans it)."""
    return _shape_of(resolve_model_ref(spec.model.name), spec.model.revision)


def _shape_of(ref: str, revision: str | None) -> ModelShape | None:
    try:
        return load_shape(ref, revision)
    except UnmodelledArchitecture:
        return None
