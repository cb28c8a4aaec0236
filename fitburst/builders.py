"""The builders a run's set-up chooses from its config: the model (loaded, sharded over ranks, prepared for the
method: k-bit, checkpointing, LoRA), the optimizer, the loss kernel, the activation-offloading context, and the
refusals made before a model loads. The recipe (:mod:`fitburst.recipe`), the probe and the preflight's trace build
with these same functions, so estimate and training cannot drift."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

from fitburst import distributed
from fitburst.distributed import SINGLE, World
from fitburst.families import Family, family_for
from fitburst.hardware import Device, available_host_bytes
from fitburst.memory.fsdp_terms import loads_once
from fitburst.memory.shapes import ModelShape
from fitburst.models import ResolvedModel, embeddings_to_host, load_pipeline_model, prepare_kbit, tokenizer_for
from fitburst.rules import ModelFacts, explain, problems
from fitburst.settings import settings_from_spec
from fitburst.spec import PipelineSpec, resolve_quant
from fitburst.train import TrainError

log = logging.getLogger(__name__)


def build_model(spec: PipelineSpec, device: str, precision: str, *, world: World = SINGLE,
                resolved: ResolvedModel | None = None):
    """Load the base model once (:func:`fitburst.models.load_pipeline_model`) and wrap it for the configured
    method (:func:`prepare_for_training`; ``resolved``: the model as the recipe resolved it before the load).
    Several ranks (``world``): shard it with FSDP2 over the process group (:func:`fitburst.distributed.shard`), each
    rank's shards on ``device``. Unless its weights are 4-bit (:func:`fitburst.memory.fsdp_terms.loads_once`),
    only rank 0 reads the checkpoint: the other ranks build the same model without weights, LoRA adapters included,
    and receive every weight, the adapters' initial ones too, from rank 0 (:func:`fitburst.distributed.
    fill_from_rank0`). Returns (model, tokenizer)."""
    ref = resolved.ref if resolved is not None else None
    if not world.sharded:
        model = prepare_for_training(load_pipeline_model(spec, device, precision, resolved=resolved), spec, resolved)
        if spec.training.embeddings_on_host:
            host_embeddings(model, spec)
        return model, tokenizer_for(spec.model, ref)
    fs = spec.training.fsdp
    once = loads_once(resolve_quant(spec.method.type, spec.method.quant))
    model = prepare_for_training(load_pipeline_model(spec, device, precision, resolved=resolved, sharded=True,
                                                     empty=once and not world.main), spec, resolved)
    distributed.same_layout(model)
    full = model.state_dict() if once and world.main else {}  # references to rank 0's weights, no copy
    distributed.shard(model, precision, reshard_after_forward=fs.reshard_after_forward,
                      cpu_offload=fs.cpu_offload, pure_bf16=spec.training.pure_bf16)
    if once:  # offloaded shards live in host memory, as FSDP's CPU offload keeps them
        distributed.fill_from_rank0(model, full, "cpu" if fs.cpu_offload else device)
        del full  # rank 0's whole copy goes: each rank now holds its shards only
    else:
        _quant_states_to(model, device)
    return model, tokenizer_for(spec.model, ref)


def host_embeddings(model, spec: PipelineSpec) -> None:
    """``training.embeddings_on_host``: the loaded model's input embeddings to host RAM
    (:func:`fitburst.models.embeddings_to_host`); where they cannot go, a TrainError naming the field."""
    try:
        embeddings_to_host(model)
    except ValueError as e:
        raise TrainError(f"pipeline '{spec.name}': training.embeddings_on_host: {e}: set it false") from None


def _quant_states_to(model, device: str) -> None:
    """A 4-bit layer's quantization state (absmax, code) stays on the module when FSDP turns its weight into a
    shard (bitsandbytes restores it onto the gathered weight in forward); it goes to the rank's device with the
    shards. Nothing to do for an unquantized model."""
    for m in model.modules():
        state = getattr(m, "quant_state", None)
        if state is not None and hasattr(state, "to"):
            state.to(device)


def prepare_for_training(model, spec: PipelineSpec, resolved: ResolvedModel | None = None):
    """Wrap a loaded base model for the configured method (k-bit prep, checkpointing, LoRA). The preflight's
    trace applies this same function to a model built on the meta device, so estimate and training cannot drift.
    ``resolved``: the model's family and shape as the recipe resolved them, its settings refused before the load
    for its world and device (:func:`refuse_problems`); None (the trace): the family looked up from the model's
    config and the settings refused here."""
    import torch  # heavy: loaded only when training

    method, tr = spec.method, spec.training
    model.config.use_cache = False
    if resolved is None:  # the settings refused before anything is patched or prepared
        family = family_for(model.config)
        refuse_problems(spec, family)
    else:
        family = resolved.family
    if tr.liger_kernels:  # the model's own modules, before k-bit preparation and peft wrap them
        from fitburst.models import apply_liger_kernels

        apply_liger_kernels(model)
    if method.quant != "none":
        # FSDP's mixed precision gathers every weight in 16 bits: a sharded run keeps peft's preparation as it is
        model = prepare_kbit(model, gradient_checkpointing=tr.gradient_checkpointing,
                             frozen_fp32=not settings_from_spec(spec).frozen_16bit)
    elif tr.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if method.type != "full":
            model.enable_input_require_grads()
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

        shape = resolved.shape if resolved is not None else spec_shape(spec)
        if shape is None:  # its gated MLP's layer names come from the shape (a model the table checked)
            raise TrainError(f"pipeline '{spec.name}': training.tiled_mlp needs an architecture the estimate models "
                             "(its gated MLP's layer names): set it false")
        tile_mlps(model, shape)
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
    from fitburst.hardware import library_missing_here

    if (missing := library_missing_here("trl")) is not None:  # refused before (activation_offloading_missing)
        raise TrainError(f"training.activation_offloading runs TRL's offloading context, and {missing}: "
                         "pip install 'fitburst[lean]'")
    from trl.models.activation_offloading import get_act_offloading_ctx_manager  # heavy, optional: lean extra

    return get_act_offloading_ctx_manager(model, warn_if_no_head=False)


def refuse_problems(spec: PipelineSpec, family: Family, world_size: int = 1, device: Device | None = None, *,
                    resolved: ResolvedModel | None = None) -> None:
    """A TrainError naming each field and its fix where what this process runs (``world_size`` processes on
    ``device``: this process's, :func:`fitburst.device.probed_device`; None: not known) breaks a row of the rule table
    (:func:`fitburst.rules.problems`), for the model's family and architecture (``resolved``: its shape as the
    recipe resolved it; None: read from its config.json)."""
    s = replace(settings_from_spec(spec), world_size=world_size)
    facts = ModelFacts.of(resolved.shape) if resolved is not None else _model_facts(spec)
    found = problems(s, device, family, facts)
    if found:
        raise TrainError(explain(spec.name, found))


def _model_facts(spec: PipelineSpec) -> ModelFacts | None:
    """The architecture the table's rows read, from the model's config.json (None: not one the estimate models)."""
    from fitburst.memory.shapes import ModelConfigError
    from fitburst.models import spec_shape

    try:
        return ModelFacts.of(spec_shape(spec))
    except ModelConfigError:  # an unreadable config: loading the model says why
        return None


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


def refuse_offload_beyond_host_ram(spec: PipelineSpec, shape: ModelShape | None, w: World) -> None:
    """FSDP's CPU offload refused before the model loads where this node's host RAM cannot hold its ranks' shards
    of the model of ``shape`` (what cannot be sharded at all is the rule table's: :func:`refuse_problems`)."""
    if spec.training.fsdp.cpu_offload:
        from fitburst.memory.fsdp_terms import offload_host_bytes
        need = (offload_host_bytes(shape, settings_from_spec(spec), w.local_size, w.size) if shape is not None
                else None)
        have = available_host_bytes()
        if need is not None and have is not None and need > have:
            gib = 2**30
            raise TrainError(f"pipeline '{spec.name}': training.fsdp.cpu_offload keeps this node's shards of the "
                             f"weights, gradients and optimizer state in host RAM: about {need / gib:.1f} GiB for "
                             f"its {w.local_size} rank(s), but {have / gib:.1f} GiB is available: set "
                             "training.fsdp.cpu_offload: false, or spread the run over more nodes")
