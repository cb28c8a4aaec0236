"""The pipelines.yaml schema: pydantic models, loading with located errors, overrides.

A file holds shared ``defaults`` and named ``pipelines``; each pipeline is the defaults deep-merged with its own
keys. Secrets are written as ``${ENV_VAR}`` references and stay unresolved in the spec (and so in everything
logged from it); :func:`resolve_env` turns one into its value at the moment of use.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from fitburst.errors import UserError
from fitburst.hardware import check_gpus
from fitburst.located import compose_lines, deep_merge, explain
from fitburst.model_folder import model_folder_problems
from fitburst.rules import ModelFacts, declared_device, problems
from fitburst.settings import (
    Attention,
    Distributed,
    Loss,
    Method,
    Optimizer,
    Precision,
    Quant,
    Vision,
    resolve_quant,
    settings_from_spec,
)
from fitburst.spec_sections import ENV_REF, BurstSpec, NotifySpec, ScheduleSpec, Strict, TrackingSpec

# What ``data.template: chatml`` renders a conversation with (and the demo tokenizer's own template)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_PIPELINES_FILE = os.environ.get("FITBURST_PIPELINES", "pipelines.yaml")
# method.init_from as a registered version: models:/NAME/VERSION or models:/NAME@ALIAS
MODEL_VERSION_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w-]+))$")


class ModelSpec(Strict):
    """Which base model: a hub id, a local directory, or the built-in ``fitburst/tiny-demo``."""

    name: str = Field(description="hub id (org/name), a local directory, or fitburst/tiny-demo")
    revision: str | None = None
    trust_remote_code: bool = False
    hf_token: str | None = Field(default=None, description="a ${ENV_VAR} reference, never a literal token")

    @field_validator("hf_token")
    @classmethod
    def _token_is_reference(cls, v: str | None) -> str | None:
        if v is not None and not ENV_REF.match(v):
            raise ValueError("write the token as an environment reference such as ${HF_TOKEN}, not the literal")
        return v


RECORD_FIELDS = ("messages", "conversations", "instruction", "input", "output", "prompt", "completion",
                 "target")


class DataSpec(Strict):
    """Where the records live (``path`` or ``dataset``) and how they become training samples."""

    path: str | None = Field(default=None, description="a local .jsonl/.json/.csv/.parquet/.arrow file, a folder of "
                             "them, or a folder written by Dataset.save_to_disk; relative to pipelines.yaml")
    dataset: str | None = Field(default=None, description="a Hugging Face dataset id (org/name) or a hub-style local "
                                "folder, read with datasets.load_dataset")
    subset: str | None = Field(default=None, description="the dataset's configuration (load_dataset's name)")
    split: str = "train"
    revision: str | None = Field(default=None, description="a hub branch, tag or commit")
    streaming: bool = Field(default=False, description="read and tokenize in one bounded-memory pass (sets too "
                            "large for memory)")
    columns: dict[str, str] = Field(default_factory=dict, description="record field <- column in the data, e.g. "
                                    "{instruction: prompt, output: answer}")
    format: Literal["auto", "messages", "alpaca", "sharegpt", "prompt_completion", "input_target"] = "auto"
    template: Literal["auto", "chatml", "alpaca", "none"] = "auto"
    max_seq_len: int = Field(default=512, ge=8, le=1_048_576)
    max_target_len: int | None = Field(default=None, ge=1, le=1_048_576, description="encoder-decoder models: "
                                       "target tokens kept (eos included); default max_seq_len")
    val_split: float = Field(default=0.1, ge=0.0, lt=1.0)
    seed: int = 42
    skip_invalid: bool = False
    train_on_prompt: bool = False
    image_max_pixels: int | None = Field(default=None, ge=28 * 28, le=16384 * 28 * 28, description="vision-language "
                                         "models: no image has more pixels than this (resized keeping its aspect); "
                                         "image tokens per image follow from it (Qwen2-VL: pixels / 28**2). None: "
                                         "the model's image processor's own limit")

    @field_validator("columns")
    @classmethod
    def _known_fields(cls, v: dict[str, str]) -> dict[str, str]:
        for key, col in v.items():
            if key not in RECORD_FIELDS:
                close = difflib.get_close_matches(key, RECORD_FIELDS, n=1)
                hint = f"did you mean '{close[0]}'?" if close else f"record fields: {', '.join(RECORD_FIELDS)}"
                raise ValueError(f"'{key}' is not a record field ({hint}); write {{field: column in your data}}")
            if not col.strip():
                raise ValueError(f"columns.{key} names no column")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if (self.path is None) == (self.dataset is None):
            raise ValueError("set exactly one of data.path (local file or folder) and data.dataset (hub id or "
                             "hub-style folder)")
        if self.path is not None and (self.subset or self.revision):
            raise ValueError("subset and revision belong to a hub dataset: use data.dataset, or drop them")
        return self


class MethodSpec(Strict):
    type: Method = "lora"
    rank: int = Field(default=8, ge=1, le=4096)
    alpha: float = Field(default=16, gt=0)
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    # peft's all-linear: every linear layer but the output head (a vision-language model's language model only,
    # unless ``vision`` says otherwise); the QLoRA paper's recipe, and valid for every architecture
    target_modules: list[str] | Literal["all-linear"] = Field(default="all-linear", min_length=1)
    quant: Quant | None = Field(
        default=None, description="weight quantization; defaults to nf4 for qlora and none otherwise"
    )
    double_quant: bool = True
    frozen_fp32: bool = Field(
        default=False, description="k-bit only: keep fp32 copies of the frozen input embeddings and output head, as "
        "peft's prepare_model_for_kbit_training makes them (true); false keeps them in the compute dtype they were "
        "loaded in (the same values, half the bytes: 2.1 GB less for Llama-3.1-8B) and casts the embedding output to "
        "fp32, so the residual stream, the norms and the adapters stay fp32 as peft makes them")
    vision: Vision = Field(
        default="frozen", description="vision-language models: the vision tower stays frozen, or its projector "
        "(the merger) trains too, or all of it (LoRA on those layers, or full weights with type: full)")
    init_from: str = Field(
        default="none", description="none: a fresh LoRA; champion: the adapter of the 'champion' version of "
        "tracking.register_as; or a models:/NAME/VERSION (models:/NAME@ALIAS) URI or an adapter folder: training "
        "starts from that adapter (same base model, method and rank)")

    @field_validator("init_from")
    @classmethod
    def _init_source(cls, v: str) -> str:
        v = v.strip()
        if v.startswith("models:/"):
            if MODEL_VERSION_URI.match(v):
                return v
            raise ValueError(f"{v!r} is not models:/NAME/VERSION or models:/NAME@ALIAS (e.g. models:/my-model/3, "
                             "models:/my-model@champion): write it so")
        if v in ("none", "champion") or v.startswith(("/", ".", "~")) or "/" in v:
            return v
        raise ValueError("init_from is none, champion, a models:/NAME/VERSION (or models:/NAME@ALIAS) URI, or the "
                         "path of an adapter folder")

    @model_validator(mode="after")
    def _quant_matches_type(self) -> MethodSpec:
        if self.type == "qlora" and self.quant == "none":
            raise ValueError("qlora needs a quantized base: set quant to nf4, fp4 or int8 (or use type: lora)")
        object.__setattr__(self, "quant", resolve_quant(self.type, self.quant))
        return self  # full fine-tuning of quantized weights: a row of fitburst.rules


class FsdpSpec(Strict):
    """How FSDP2 shards a run over several GPUs (``training.distributed``), torch's own knobs."""

    reshard_after_forward: bool = Field(default=True, description="free each block's gathered weights after its "
                                        "forward and gather them again for backward (ZeRO-3, the least memory); "
                                        "false keeps them until backward (ZeRO-2: less traffic, more memory)")
    cpu_offload: bool = Field(default=False, description="keep the sharded parameters, gradients and optimizer "
                              "state in host RAM, moved to the GPU per block (needs that much host RAM; slower)")


class TrainingSpec(Strict):
    epochs: float | None = Field(default=1.0, gt=0)
    max_steps: int | None = Field(default=None, ge=1, description="optimizer steps; overrides epochs when set")
    micro_batch_size: int = Field(default=1, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    learning_rate: float = Field(default=2e-4, gt=0, lt=1)
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    precision: Literal["auto", Precision] = "auto"
    pure_bf16: bool = Field(default=False, description="opt-in: step bf16 weights directly (no fp32 master copy)")
    gradient_checkpointing: bool = False
    optimizer: Optimizer = "adamw"
    attention: Literal["auto", Attention] = "auto"
    packing: bool = Field(default=False, description="padding-free batches: each micro-batch's samples in one row, "
                          "positions restarting and attention kept within each sample")
    loss: Loss = Field(
        default="auto", description="standard: the model's output head and cross-entropy (full logits); fused: a "
        "linear cross-entropy that never holds the logits (Cut Cross-Entropy or Liger Kernel on CUDA, CCE's "
        "torch.compile path elsewhere); auto: standard unless the preflight needs the memory (preflight.allow)")
    activation_offloading: bool = Field(default=False, description="CUDA only: keep the activations saved for "
                                        "backward in pinned host memory (TRL's offloading context)")
    tiled_mlp: bool = Field(default=False, description="run each block's gated MLP over sequence shards, its forward "
                            "recomputed in backward (liger-kernel's apply_tiled_mlp): backward never holds a whole "
                            "layer's MLP intermediates at full length; slower (one more MLP forward per step)")
    liger_kernels: bool = Field(default=False, description="CUDA only: Liger Kernel's Triton RMSNorm, SwiGLU / "
                                "GEGLU and RoPE in the model (apply_liger_kernel_to_<model_type>; its loss kernels "
                                "are training.loss's): fewer tensors kept for backward")
    embeddings_on_host: bool = Field(default=False, description="CUDA, LoRA / QLoRA: keep the frozen input "
                                     "embedding table in host RAM (only its lookup runs there; the looked-up rows "
                                     "go to the GPU): 1 GB less GPU memory for Llama-3.1-8B; not for tied embeddings")
    seed: int = 42
    checkpoint_every: int = Field(default=100, ge=1, description="optimizer steps between checkpoints")
    log_every: int = Field(default=10, ge=1)
    distributed: Distributed = Field(
        default="auto", description="auto: one device unless the plan needs more; none: one device; fsdp: shard "
        "the run over the GPUs it gets with torch's FSDP2 (one process per GPU, started by torchrun)")
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum

    @model_validator(mode="after")
    def _pure_bf16_needs_bf16(self):
        if self.pure_bf16 and self.precision != "bf16":
            raise ValueError("pure_bf16 keeps bf16 weights: set precision: bf16 (or pure_bf16: false)")
        return self


class EvalSpec(Strict):
    enabled: bool = True
    max_batches: int | None = Field(default=None, ge=1)
    batch_size: int = Field(default=8, ge=1)
    samples: int = Field(default=3, ge=0)
    max_new_tokens: int = Field(default=32, ge=1)


class AllowSpec(Strict):
    """What the planner may change to make a run fit."""

    gradient_checkpointing: bool = True
    optimizer_8bit: bool = True
    quantize: bool = True
    reduce_batch: bool = True
    attention: bool = True
    dropout: bool = True
    packing: bool = True
    resolution: bool = True  # vision-language: lower data.image_max_pixels (fewer image tokens)
    precision: bool = True  # fp32 -> bf16 mixed precision where the device has bf16
    fused_loss: bool = True  # training.loss: auto -> fused (a fused linear cross-entropy)
    activation_offloading: bool = True  # CUDA: saved activations to pinned host memory
    tiled_mlp: bool = True  # training.tiled_mlp false -> true (architectures with a gated MLP)
    frozen_16bit: bool = True  # k-bit: method.frozen_fp32 true -> false (frozen embeddings and head in 16 bits)
    embeddings_on_host: bool = True  # CUDA: training.embeddings_on_host false -> true (untied input embeddings)
    liger_kernels: bool = True  # CUDA: training.liger_kernels false -> true (architectures Liger patches)
    double_quant: bool = True  # 4-bit: method.double_quant false -> true (8-bit absmax per block)


# What the plan keeps free on top of the estimate's error band by default: the band covers the estimate's own
# error, this covers what no estimate sees (another process on the GPU, a driver update, fragmentation after a long
# run). 3 % of the budget is ~1.4 GiB of a 48 GB card.
SAFETY_MARGIN = 0.03


class PreflightSpec(Strict):
    device: str = Field(default="auto", description="auto (every visible CUDA GPU, else MPS or the CPU), cuda, mps, "
                        "cpu, a named device such as T4, cuda:24GiB, or several GPUs of this machine: RTX4090 x2, "
                        "cuda:24GiB x2, cuda:0,1")
    safety_margin: float = Field(default=SAFETY_MARGIN, ge=0.0, lt=0.9,
                                 description="headroom kept on top of the estimate's error band (fraction of budget)")
    allow: AllowSpec = Field(default_factory=AllowSpec)
    probe: bool = False
    exact: bool = Field(default=True, description="verify the chosen plan with the traced estimate (the real step "
                                                  "under FakeTensorMode, seconds; needs torch): its band is narrow")

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        check_gpus(v)  # a ValueError here lists the known names, the kind:SIZE form and the multi-GPU forms
        return v


class PipelineSpec(Strict):
    """One pipeline, with the file's defaults merged in."""

    name: str = ""
    description: str = ""
    model: ModelSpec
    data: DataSpec
    method: MethodSpec = Field(default_factory=MethodSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    preflight: PreflightSpec = Field(default_factory=PreflightSpec)
    burst: BurstSpec = Field(default_factory=BurstSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    notify: NotifySpec = Field(default_factory=NotifySpec)
    tags: dict[str, str] = Field(default_factory=dict)
    base_dir: str = Field(default=".", description="set by the loader: the folder of pipelines.yaml")

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> PipelineSpec:
        if self.training.max_steps is None and self.training.epochs is None:
            raise ValueError("training needs epochs or max_steps")
        if self.eval.enabled and self.data.val_split == 0:
            raise ValueError("eval.enabled needs a validation split: set data.val_split (e.g. 0.1) or eval.enabled: "
                             "false")
        return self

    @model_validator(mode="after")
    def _init_from_needs(self) -> PipelineSpec:
        init = self.method.init_from
        if init != "none" and self.method.type == "full":
            raise ValueError("method.init_from starts from a LoRA adapter: use method.type lora or qlora, or "
                             "init_from: none")
        if init == "champion" and not self.tracking.register_as:
            raise ValueError("method.init_from: champion needs tracking.register_as (the registered model whose "
                             "'champion' alias it starts from): set it, or give a models:/ URI or adapter folder")
        return self

    def init_folder(self) -> Path | None:
        """method.init_from as a local adapter folder (resolved against pipelines.yaml's folder); None for none,
        champion and a models:/ URI."""
        init = self.method.init_from
        if init in ("none", "champion") or init.startswith("models:/"):
            return None
        p = Path(init).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def data_path(self) -> Path | None:
        """data.path resolved against pipelines.yaml's folder; None for a hub dataset."""
        if self.data.path is None:
            return None
        p = Path(self.data.path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def data_source(self) -> Path | str:
        """Where the records are: a local path (data.path, or a data.dataset naming a local folder) or a hub id."""
        path = self.data_path()
        if path is not None:
            return path
        ref = self.data.dataset
        assert ref is not None  # DataSpec requires exactly one of path and dataset
        local = Path(ref).expanduser()
        local = local if local.is_absolute() else Path(self.base_dir) / local
        return local if ref.startswith((".", "/", "~")) or local.is_dir() else ref

    def config_hash(self, *, sources: bool = True) -> str:
        """A short hash of what decides the result (not tags, schedule or tracking; not how the run is spread over
        GPUs either: a sharded checkpoint resumes at another world size, in the same run folder).

        ``sources=False`` leaves out where the data lies and the adapter the run starts from (``method.init_from``):
        the run's fingerprint (:mod:`fitburst.history`) holds their contents as parts of their own."""
        exclude: dict[str, set[str]] = {"training": {"distributed", "fsdp"}}
        if not sources:
            exclude.update(data={"path", "dataset"}, method={"init_from"})
        d = self.model_dump(include={"model", "data", "method", "training"}, exclude=exclude)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def with_overrides(self, overrides: dict) -> PipelineSpec:
        """This spec with ``overrides`` (dotted or nested keys, as ``load_pipeline`` takes them) validated again."""
        return PipelineSpec.model_validate(deep_merge(self.model_dump(), expand_dotted(overrides)))

    def to_yaml(self) -> str:
        """The resolved spec as YAML; ${ENV} references stay references."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class SpecError(UserError, ValueError):
    """pipelines.yaml is wrong; ``problems`` holds one located message per mistake."""

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = problems
        head = f"{path}: {len(problems)} problem{'s' if len(problems) != 1 else ''}"
        super().__init__(head + "\n" + "\n".join(f"  - {p}" for p in problems))


# --- loading ---------------------------------------------------------------------------------------------

def load_file(path: str | os.PathLike) -> tuple[dict, dict[tuple, int]]:
    """Read pipelines.yaml into a dict and a key-path -> line map; raise SpecError on bad YAML."""
    p = Path(path)
    if not p.exists():
        raise SpecError(str(p), ["file not found (create it, or pass the path with --file)"])
    text = p.read_text()
    try:
        doc = yaml.safe_load(text) or {}
        lines = compose_lines(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark else ""
        raise SpecError(str(p), [f"{line}not valid YAML: {getattr(e, 'problem', e)}"]) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("pipelines"), dict) or not doc["pipelines"]:
        raise SpecError(str(p), ["line 1: expected a mapping with a non-empty 'pipelines:' section"])
    unknown = set(doc) - {"defaults", "pipelines"}
    if unknown:
        raise SpecError(
            str(p),
            [f"line {lines.get((k,), 1)}: unknown top-level key '{k}' (allowed: defaults, pipelines)" for k in unknown],
        )
    return doc, lines


def _check_defaults(doc: dict, lines: dict) -> list[str]:
    """The ``defaults`` section on its own: a bad value there is an error even while every pipeline overrides
    it (a pipeline added later would inherit it). Only errors inside keys the section sets are reported."""
    defaults = doc.get("defaults")
    if defaults is None:
        return []
    if not isinstance(defaults, dict):
        return [f"defaults: line {lines.get(('defaults',), 1)}: 'defaults' must be a mapping of pipeline fields"]
    placeholder = {"model": {"name": "placeholder/model"}, "data": {"path": "placeholder.jsonl"}}
    try:
        PipelineSpec.model_validate(deep_merge(placeholder, defaults))
        return []
    except ValidationError as e:
        out = []
        for err in e.errors():
            loc = tuple(err["loc"])
            if not loc or not _has_path(defaults, loc[:1]):  # () is a rule across sections pipelines complete
                continue
            line = next((lines[("defaults",) + loc[:n]] for n in range(len(loc), 0, -1)
                         if ("defaults",) + loc[:n] in lines), lines.get(("defaults",)))
            out.append("defaults: " + explain(PipelineSpec, err, f"line {line}: " if line else "", ""))
        return out


def _impossible(spec: PipelineSpec) -> list[tuple[tuple[str, ...], str]]:
    """Settings that validate one by one but cannot run together here (field path, what is wrong and the fix): the
    rule table's problems (:func:`fitburst.rules.problems`) on the device ``preflight.device`` names, for the model
    whose config.json is here, and a local model folder that cannot load."""
    device = declared_device(spec.preflight.device)
    found = problems(settings_from_spec(spec, device), device, model=_model_facts(spec.model))
    return [(p.field, str(p)) for p in found] + [(("model", "name"), why) for why in model_folder_problems(spec.model)]


def _model_facts(model: ModelSpec) -> ModelFacts | None:
    """The architecture of a model whose config.json is here (a local folder or a bundled config); None for a hub
    model's (not fetched here: the loop asks the table with it before the model loads,
    :func:`fitburst.builders.refuse_problems`) or an unreadable or unmodelled one (``model_folder_problems`` or the
    trainer says why)."""
    from fitburst.memory.shapes import ModelConfigError, bundled_config, load_shape

    p = Path(model.name).expanduser()
    if not ((p / "config.json").is_file() or bundled_config(model.name, model.revision) is not None):
        return None
    try:
        return ModelFacts.of(load_shape(str(p) if p.is_dir() else model.name, model.revision))
    except ModelConfigError:
        return None


def _build(
    name: str, doc: dict, lines: dict, path: Path, overrides: dict | None, skip_defaults: bool = False
) -> tuple[PipelineSpec | None, list[str]]:
    """Validate one pipeline; with ``skip_defaults`` errors that come only from the defaults section (already
    reported by :func:`_check_defaults`) are left out."""
    defaults = doc.get("defaults") or {}
    body = doc["pipelines"][name]
    if not isinstance(body, dict):
        return None, [f"line {lines.get(('pipelines', name), 1)}: pipeline '{name}' must be a mapping"]
    merged = deep_merge(defaults if isinstance(defaults, dict) else {}, body)
    if overrides:
        merged = deep_merge(merged, overrides)
    merged["name"] = name
    merged["base_dir"] = str(path.parent.resolve())
    try:
        spec = PipelineSpec.model_validate(merged)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(err["loc"])
            src = ""
            if overrides and _has_path(overrides, loc):
                where, src = "", " (from overrides)"
            elif skip_defaults and _has_path(defaults, loc) and not _has_path(body, loc):
                continue
            else:
                line = _locate(lines, name, loc)
                where = f"line {line}: " if line else ""
            problems.append(f"pipeline '{name}': " + explain(PipelineSpec, err, where, src))
        return None, problems
    problems = []
    for field, why in _impossible(spec):
        value = _get(spec, field)
        if overrides and _has_path(overrides, field):
            where, src = "", " (from overrides)"
        else:
            where, src = f"line {_locate(lines, name, field)}: ", ""
        problems.append(f"pipeline '{name}': {where}field '{'.'.join(field)}'{src} (got {value!r}): {why}")
    init = spec.init_folder()
    if init is not None and not (init / "adapter_config.json").is_file():
        problems.append(f"pipeline '{name}': line {_locate(lines, name, ('method', 'init_from'))}: field "
                        f"'method.init_from' (got {spec.method.init_from!r}): no adapter at {init} (a folder holding "
                        "adapter_config.json, such as a run folder's adapter/)")
    source = spec.data_source()
    if isinstance(source, Path) and not source.exists():
        key = "path" if spec.data.path is not None else "dataset"
        line = _locate(lines, name, ("data", key))
        problems.append(f"pipeline '{name}': line {line}: field 'data.{key}' (got {getattr(spec.data, key)!r}): "
                        f"{'file' if key == 'path' else 'folder'} not found at {source} (paths are relative to "
                        f"{path.name}'s folder)")
    return (None, problems) if problems else (spec, [])


def _get(obj: Any, loc: tuple) -> Any:
    for part in loc:
        obj = getattr(obj, part)
    return obj


def _has_path(d: Any, loc: tuple) -> bool:
    for part in loc:
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True


def _locate(lines: dict, name: str, loc: tuple) -> int | None:
    """Line of the most specific key on the error's path, in the pipeline or else in the defaults."""
    for n in range(len(loc), 0, -1):
        for root in (("pipelines", name), ("defaults",)):
            if hit := lines.get(root + loc[:n]):
                return hit
    return lines.get(("pipelines", name))


def load_pipeline(path: str | os.PathLike, name: str, overrides: dict | None = None) -> PipelineSpec:
    """Load and validate one pipeline, with optional overrides (nested or dotted keys)."""
    doc, lines = load_file(path)
    if name not in doc["pipelines"]:
        close = difflib.get_close_matches(name, list(doc["pipelines"]), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"pipelines here: {', '.join(doc['pipelines'])}"
        raise SpecError(str(path), [f"no pipeline named '{name}' ({hint})"])
    problems = _check_defaults(doc, lines)
    spec, errs = _build(name, doc, lines, Path(path), expand_dotted(overrides or {}), skip_defaults=bool(problems))
    problems += errs
    if problems:
        raise SpecError(str(path), problems)
    assert spec is not None
    return spec


def load_all(path: str | os.PathLike) -> dict[str, PipelineSpec]:
    """Validate every pipeline in the file; collect all problems into one SpecError."""
    doc, lines = load_file(path)
    specs, problems = {}, _check_defaults(doc, lines)
    for name in doc["pipelines"]:
        spec, errs = _build(name, doc, lines, Path(path), None, skip_defaults=bool(problems))
        problems += errs
        if spec:
            specs[name] = spec
    if problems:
        raise SpecError(str(path), problems)
    return specs


def expand_dotted(overrides: dict) -> dict:
    """``{"training.max_steps": 5}`` -> ``{"training": {"max_steps": 5}}``; nested dicts pass through."""
    out: dict = {}
    for key, value in overrides.items():
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = deep_merge(node.get(parts[-1], {}), value) if isinstance(value, dict) else value
    return out


def resolve_env(value: str | None) -> str | None:
    """Resolve a ``${ENV_VAR}`` reference at the moment of use; None when unset."""
    if value is None:
        return None
    m = ENV_REF.match(value)
    return os.environ.get(m.group(1)) if m else value


def load_resolved(path: str | os.PathLike) -> PipelineSpec:
    """Load one pipeline written by :meth:`PipelineSpec.to_yaml` (what the cloud node and ``fitburst train`` read)."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(str(p), ["file not found (pass the YAML written by PipelineSpec.to_yaml as --spec)"])
    try:
        return PipelineSpec.model_validate(yaml.safe_load(p.read_text()))
    except (ValidationError, yaml.YAMLError) as e:
        raise SpecError(str(p), [str(e)]) from None
