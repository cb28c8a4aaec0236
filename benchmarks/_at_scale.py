"""The at-scale configurations of ``benchmarks/gpu_check.py --at-scale``: real-size models built with random weights
from fitburst's bundled configs (memory does not depend on the values), saved, and trained through fitburst's own
loading path and loop; the same settings through Hugging Face's Trainer + peft for speed. ``tiny``: each model
shrunk to a stand-in of its architecture (same model type, tying, sliding window; a few thousand parameters per
layer), sequences 16 times shorter, so that a CPU runs every code path (``--dry-run``).

Run by gpu_check.py: :func:`run_all` in the parent (no CUDA context there), one child process per model build,
configuration and Trainer run (each a fresh CUDA context, as a user's run).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gzip
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
TINY = 16  # the dry run's sequences: this many times shorter
MAX_SNAPSHOTS = 5  # with the CSV, the JSON and the log: the 8 files a device run brings back
HISTORY = 200_000  # allocator events a snapshot keeps (Python stacks): the warm-up and measured steps of a 7B model
SNAPSHOT_LIMIT = 15 * MiB  # a file over 16 MiB does not come back from a device run
LIBRARIES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "liger-kernel",
             "cut-cross-entropy", "datasets", "triton", "safetensors", "tokenizers")
FIELDS = ["config", "role", "stage", "loop", "status", "model", "gpu", "world_size", "seq_len", "micro_batch",
          "device_total_bytes", "context_bytes", "capability", "allocated", "reserved", "max_allocated",
          "max_reserved", "device_used", "adamw", "loss_kernel", "sdpa_backend", "steps_per_s", "tokens_per_s",
          "mfu", "seconds", "snapshot", "others_bytes", "cap_bytes", "plan"]

LORA = {"method.type": "lora", "method.rank": 16, "method.alpha": 32, "method.dropout": 0.0,
        "method.target_modules": "all-linear"}
QLORA = {**LORA, "method.type": "qlora", "method.quant": "nf4", "method.double_quant": True}
GC = {"training.gradient_checkpointing": True}
B2 = {"training.micro_batch_size": 2}


@dataclass(frozen=True)
class Case:
    """One configuration: ``model`` a bundled config (fitburst/configs/<model>.json), ``seq`` tokens per sample at
    full size, ``over`` overrides of pipelines.yaml's demo pipeline."""

    name: str
    model: str
    seq: int
    over: dict = field(default_factory=dict)
    speed: bool = False  # also Hugging Face's Trainer + peft on the same settings, for tokens/s
    cuda_only: bool = False  # refused off CUDA (the dry run skips it and says so)
    resume: bool = False  # trains half the steps, stops (a checkpoint saved), and resumes: the resumed run's peak
    cap_gib: int = 0  # > 0: the card capped to this many GiB, and the run planned for it (:func:`capped_plan`)
    planned_seq: int = 0  # > 0 (with cap_gib): the planned settings trained at this length, not the planned longest
    capped: bool = True  # with cap_gib: the allocator held to the plan's budget (False: the whole card, the peak read)


# in priority order: a run out of time keeps the first ones
CASES = [
    Case("qwen7b-lora-1024", "qwen2.5-7b", 1024, LORA, speed=True),
    Case("qwen7b-lora-1024-gc", "qwen2.5-7b", 1024, {**LORA, **GC}),
    Case("qwen7b-lora-2048", "qwen2.5-7b", 2048, LORA, speed=True),
    Case("qwen7b-lora-2048-gc", "qwen2.5-7b", 2048, {**LORA, **GC}),
    Case("llama8b-qlora-nf4-dq-gc-2048", "llama-3.1-8b", 2048, {**QLORA, **GC}),
    # issue 35's 24 GB row as a real step: Unsloth's settings (r32, dropout 0.05, batch 1), fitburst's plan and
    # longest length for cuda:24GiB (context_fit.txt's "planned" column), on the card capped to 24 GiB
    Case("llama8b-qlora-r32-planned-24gib", "llama-3.1-8b", 2048, {**QLORA, "method.rank": 32, "method.dropout": 0.05},
         cuda_only=True, cap_gib=24),
    # the same plan on the whole card: the planned run's peak, read where no cap can end it (the CSV's plan column
    # holds the settings; its cap_bytes is empty)
    Case("llama8b-qlora-r32-planned-24gib-uncapped", "llama-3.1-8b", 2048,
         {**QLORA, "method.rank": 32, "method.dropout": 0.05}, cuda_only=True, cap_gib=24, capped=False),
    # the same plan at 4,096 tokens: whether a failure of llama8b-qlora-r32-planned-24gib follows the length
    # (memory) or the settings
    Case("llama8b-qlora-r32-planned-24gib-4096", "llama-3.1-8b", 2048,
         {**QLORA, "method.rank": 32, "method.dropout": 0.05}, cuda_only=True, cap_gib=24, planned_seq=4096),
    Case("llama1b-full-2x1024", "llama-3.2-1b", 1024, {"method.type": "full", **B2}, speed=True),
    Case("gemma1b-lora-2x2048", "gemma-3-1b", 2048, {**LORA, **B2}),
    Case("gemma1b-lora-2x2048-fused", "gemma-3-1b", 2048, {**LORA, **B2, "training.loss": "fused"}),
    # as time allows
    Case("gemma1b-lora-fp32-2x2048-liger", "gemma-3-1b", 2048,  # fp32: the fused loss is Liger's (hardware.py)
         {**LORA, **B2, "training.loss": "fused", "training.precision": "fp32"}, cuda_only=True),
    Case("llama1b-full-paged8bit-2x1024", "llama-3.2-1b", 1024,
         {"method.type": "full", **B2, "training.optimizer": "paged_adamw8bit"}),
    Case("llama1b-lora-fp16-2x1024", "llama-3.2-1b", 1024, {**LORA, **B2, "training.precision": "fp16"}),
    Case("qwen7b-lora-2048-gc-offload", "qwen2.5-7b", 2048, {**LORA, **GC, "training.activation_offloading": True},
         cuda_only=True),
    Case("llama1b-lora-2x1024-resume", "llama-3.2-1b", 1024, {**LORA, **B2}, resume=True),
]


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


# --- models -----------------------------------------------------------------------------------------------------


def tiny_config(cfg: dict) -> dict:
    """A stand-in of ``cfg``'s architecture small enough for a CPU: its model type, tying and attention pattern,
    64 wide, 2 layers, the demo tokenizer's 1,024-token vocabulary."""
    small = {**cfg, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 1 if cfg.get("num_key_value_heads") == 1 else 2, "head_dim": 16,
             "vocab_size": 1024, "max_position_embeddings": 4096}
    if "sliding_window" in cfg:
        small["sliding_window"] = 32
    if "query_pre_attn_scalar" in cfg:
        small["query_pre_attn_scalar"] = 16
    return small


def model_dir(models: Path, model: str, tiny: bool) -> Path:
    return models / (f"{model}-tiny" if tiny else model)


def build(model: str, dest: Path, tiny: bool, layers: int | None = None) -> None:
    """``model``'s bundled config (``layers``: cut to that many layers) with random weights (bf16) and the demo
    tokenizer, saved to ``dest`` (built in GPU memory where there is one: seconds, where a CPU takes minutes for 8B
    weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fitburst.demo_models import demo_tokenizer
    from fitburst.memory.shapes import CONFIG_DIR

    if (dest / "config.json").exists():
        return
    cfg = json.loads((CONFIG_DIR / f"{model}.json").read_text())
    cfg = {**cfg, "num_hidden_layers": layers} if layers else cfg
    cfg = tiny_config(cfg) if tiny else cfg
    tok = demo_tokenizer(1024)
    cfg.update(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        built = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    built.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del built
    tmp.rename(dest)


# --- one configuration, in a child process -------------------------------------------------------------------


def fixed_length_data(dest: Path, n: int = 64, words: int = 6000) -> Path:
    """Records longer than ``words`` tokens (each word one or more): each sample is cut to exactly
    ``data.max_seq_len`` tokens."""
    text = " ".join(f"word{i % 97}" for i in range(words))
    with dest.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"instruction": f"Repeat {i}.", "input": "", "output": text}) + "\n")
    return dest


def spec_of(c: Case, model: str, data: Path, steps: int, tiny: bool):
    """pipelines.yaml's demo pipeline with the case's settings, training ``model`` (a folder or a bundled name)."""
    from fitburst.spec import load_pipeline

    over = {"model.name": model, "data.path": str(data), "data.val_split": 0.0, "data.max_seq_len":
            c.seq // TINY if tiny else c.seq, "eval.enabled": False, "training.max_steps": steps,
            "training.checkpoint_every": 10_000, "training.log_every": steps, "training.grad_accum": 1,
            "training.micro_batch_size": 1, "training.warmup_steps": 1, "burst.policy": "never",
            "preflight.device": "cpu" if tiny else "cuda", "training.precision": "auto" if tiny else "bf16",
            **c.over}
    if tiny and over["training.precision"] != "auto":
        over["training.precision"] = "fp32" if over["training.precision"] == "fp32" else "auto"
    return load_pipeline(REPO / "pipelines.yaml", "demo", over)


def capped_plan(c: Case, spec):
    """``spec`` as fitburst plans it for a ``cuda:<c.cap_gib>GiB`` card with this host's RAM: the longest length
    its planner finds a plan for (the analytic estimate at its band's upper edge, as ``fitburst estimate`` prints
    it) and that plan's settings. Returns (the planned spec, the plan)."""
    from fitburst.hardware import resolve_device
    from fitburst.memory.host import this_host_limit
    from fitburst.memory.planner import longest_planned
    from fitburst.memory.shapes import load_shape
    from fitburst.settings import settings_from_spec, spec_with_settings

    device = resolve_device(f"cuda:{c.cap_gib}GiB")
    length, plan = longest_planned(load_shape(c.model), settings_from_spec(spec, device), device,
                                   host_limit=this_host_limit())
    if plan is None:
        raise SystemExit(f"{c.name}: fitburst plans no length of {c.model} on {device.name}")
    return spec_with_settings(spec.with_overrides({"data.max_seq_len": length}), plan.settings), plan


def sdpa_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> str:
    """The backend SDPA picks for these arguments (``torch._fused_sdp_choice``), asked with the tensors the kernel
    receives: SDPA is on autocast's lower-precision list, so under autocast its floating-point arguments (not
    float64) arrive in autocast's dtype. A call made with fp32 tensors (k-bit training's fp32 stream, fp32 rotary
    tables) can therefore run FlashAttention, which takes bf16 but not fp32."""
    import torch
    from torch.nn.attention import SDPBackend

    kind = q.device.type
    if torch.is_autocast_enabled(kind):
        low = torch.get_autocast_dtype(kind)

        def cast(t):
            eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            return t.to(low) if eligible else t

        q, k, v, attn_mask = map(cast, (q, k, v, attn_mask))
    choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return SDPBackend(choice).name.lower()


@contextlib.contextmanager
def sdpa_backends(seen: list[str]):
    """SDPA's first call recorded: the backend torch picks for it (:func:`sdpa_choice`), appended to ``seen``."""
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
        if not seen:
            seen.append(sdpa_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, **kw)

    torch.nn.functional.scaled_dot_product_attention = recorded
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


def run_case(c: Case, models: Path, out: Path, steps: int, tiny: bool, snapshot: bool) -> list[dict]:
    """One configuration through ``fitburst.recipe.train`` with gpu_check's readings (an allocator snapshot at the
    peak only, gzipped into ``out`` when ``snapshot``), its pace and the SDPA backend that ran."""
    import torch
    from gpu_check import Readings, device_facts

    from fitburst.data import prepare_pipeline
    from fitburst.hardware import resolve_device
    from fitburst.memory.cuda_kernels import adamw_impl
    from fitburst.recipe import train

    cuda = torch.cuda.is_available()
    device = resolve_device("cuda" if cuda else "cpu")
    seen: list[str] = []
    plan, cap = None, 0
    with tempfile.TemporaryDirectory() as d:
        spec = spec_of(c, str(model_dir(models, c.model, tiny)), fixed_length_data(Path(d) / "long.jsonl"), steps,
                       tiny)
        if c.cap_gib:  # the planned length, in records long enough for it, two steps (warm-up, measured), no
            # snapshot; when ``capped``, the allocator held to the budget the plan was judged against (the card less
            # its context and the CUDA runtime: fitburst.hardware.Device.budget_bytes) before the model loads
            spec, plan = capped_plan(c, spec)
            if c.planned_seq:  # shorter than the planned longest: the same settings, less memory
                assert c.planned_seq <= spec.data.max_seq_len, (c.planned_seq, spec.data.max_seq_len)
                spec = spec.with_overrides({"data.max_seq_len": c.planned_seq})
            print(f"{c.name}: {spec.data.max_seq_len} tokens, planned: {'; '.join(plan.changes)}", flush=True)
            data = fixed_length_data(Path(d) / "longer.jsonl", n=8, words=spec.data.max_seq_len)
            steps, snapshot, cap = 2, False, (c.cap_gib << 30) if c.capped else 0
            spec = spec.with_overrides({"data.path": str(data), "training.max_steps": steps,
                                        "training.log_every": steps})
            if c.capped:
                budget = resolve_device(f"cuda:{c.cap_gib}GiB").budget_bytes
                torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.mem_get_info()[1])
        prepared = prepare_pipeline(spec)
        readings = Readings(Path(d), snapshots={"peak"} if snapshot and cuda else set(), history=HISTORY)
        t0 = time.perf_counter()
        with readings.around_training(), sdpa_backends(seen):
            if c.resume:  # half the steps, a checkpoint, then the rest from it: the resumed run is measured
                train(spec, prepared, Path(d) / "run", device=device.kind, progress=False, stop_after=steps // 2)
                readings.restart()
            result = train(spec, prepared, Path(d) / "run", device=device.kind, progress=False)
        seconds = time.perf_counter() - t0
        snap = keep_snapshot(readings.rows.get("peak", {}).get("snapshot"), out / f"snap-{c.name}.pickle.gz")
    facts = {"config": c.name, "role": "at-scale", "loop": "fitburst", "status": "ok", "gpu": device.name,
             "model": c.model if not tiny else str(model_dir(models, c.model, tiny)), "world_size": 1,
             "seq_len": prepared.stats["max"], "micro_batch": spec.training.micro_batch_size, **device_facts(device),
             "adamw": adamw_impl(device.kind), "loss_kernel": result.loss, "sdpa_backend": seen[0] if seen else "",
             "seconds": round(seconds, 1), "cap_bytes": cap or "",
             "plan": json.dumps(dataclasses.asdict(dataclasses.replace(plan.settings, seq_len=spec.data.max_seq_len)))
             if plan else ""}
    rows = [{**facts, "stage": stage, **r} for stage, r in readings.rows.items()]
    peak = next((r for r in rows if r["stage"] == "peak"), None)
    if peak is None:  # no CUDA: the readings are of the GPU; the run's pace is recorded all the same
        peak = {**facts, "stage": "peak"}
        rows.append(peak)
    peak.update(steps_per_s=result.steps_per_sec, tokens_per_s=result.tokens_per_sec, mfu=result.mfu, snapshot=snap)
    return rows


def keep_snapshot(src: str | None, dest: Path) -> str:
    """The peak's allocator snapshot gzipped to ``dest``, if one was taken and it comes back from a device run
    (under SNAPSHOT_LIMIT); what happened to it, for the CSV."""
    if not src:
        return ""
    with open(src, "rb") as f, gzip.open(dest, "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g)
    size = dest.stat().st_size
    if size > SNAPSHOT_LIMIT:
        dest.unlink()
        return f"dropped: {size / MiB:.0f} MiB gzipped"
    return dest.name


# --- Hugging Face's Trainer + peft on the same settings ------------------------------------------------------------


def trainer_speed(c: Case, models: Path, steps: int, tiny: bool) -> list[dict]:
    """The case's settings through Hugging Face's Trainer + peft (the model loaded as fitburst loads it: dtype,
    SDPA; LoRA as fitburst's; fused AdamW on CUDA, as the Trainer's default; the same batches): steps/s, tokens/s
    and MFU after the warm-up step (fitburst's :class:`fitburst.pace.Pace`), its peak memory."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from fitburst.data import collate, load_split, prepare_pipeline
    from fitburst.device import resolve_precision, weight_dtype
    from fitburst.hardware import resolve_device
    from fitburst.models import spec_shape
    from fitburst.pace import pace_for

    cuda = torch.cuda.is_available()
    device = resolve_device("cuda" if cuda else "cpu")
    with tempfile.TemporaryDirectory() as d:
        folder = str(model_dir(models, c.model, tiny))
        spec = spec_of(c, folder, fixed_length_data(Path(d) / "long.jsonl"), steps, tiny)
        tr, m = spec.training, spec.method
        prepared = prepare_pipeline(spec)
        precision = resolve_precision(tr.precision, device.kind)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=weight_dtype(precision, m.type),
                                                     attn_implementation="sdpa", device_map=device.kind)
        if m.type != "full":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=m.rank, lora_alpha=m.alpha, lora_dropout=m.dropout,
                                                     target_modules=m.target_modules, task_type="CAUSAL_LM"))
        pace = pace_for(spec_shape(spec), device.kind, sum(p.numel() for p in model.parameters()))
        batches: list[dict] = []
        pad = model.config.pad_token_id

        def collated(rows: list[dict]) -> dict:
            batches.append(collate(rows, pad))
            return batches[-1]

        class Timed(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                if state.global_step == 1:
                    pace.start()
                else:
                    pace.add(batches[-tr.grad_accum:])

        args = TrainingArguments(
            output_dir=str(Path(d) / "hf"), per_device_train_batch_size=tr.micro_batch_size,
            gradient_accumulation_steps=tr.grad_accum, max_steps=steps, learning_rate=tr.learning_rate,
            lr_scheduler_type=tr.lr_scheduler, warmup_steps=tr.warmup_steps, max_grad_norm=tr.max_grad_norm or 0.0,
            bf16=precision == "bf16", fp16=precision == "fp16", gradient_checkpointing=tr.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False}, logging_steps=steps, save_strategy="no",
            report_to=[], remove_unused_columns=False, dataloader_num_workers=0, use_cpu=not cuda,
            optim="adamw_torch_fused" if cuda else "adamw_torch", seed=tr.seed)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        Trainer(model=model, args=args, train_dataset=load_split(prepared, "train").to_list(),
                data_collator=collated, callbacks=[Timed()]).train()
        from fitburst.pace import synchronize

        synchronize(device.kind)
        rates = pace.rates()
    return [{"config": c.name, "role": "at-scale", "stage": "speed", "loop": "hf_trainer", "status": "ok",
             "gpu": device.name, "model": c.model, "world_size": 1, "seq_len": spec.data.max_seq_len,
             "micro_batch": tr.micro_batch_size, "steps_per_s": rates.get("steps_per_s"),
             "tokens_per_s": rates.get("tokens_per_s"), "mfu": rates.get("mfu"),
             "max_allocated": torch.cuda.max_memory_allocated() if cuda else None,
             "max_reserved": torch.cuda.max_memory_reserved() if cuda else None}]


# --- the parent: builds, configurations and the Trainer, in priority order, to a deadline -----------------------


def versions() -> dict:
    """The libraries and the machine the run had."""
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    smi = shutil.which("nvidia-smi")
    gpu = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip() if smi else ""
    return {"libraries": found, "python": platform.python_version(), "nvidia_smi": gpu}


@dataclass
class Log:
    """What the parent writes after each step: the CSV of every row so far and a JSON of versions and statuses."""

    out: Path
    rows: list[dict] = field(default_factory=list)
    status: dict[str, dict] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def write(self) -> None:
        with (self.out / "at_scale.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(self.rows)
        (self.out / "at_scale.json").write_text(json.dumps({**self.meta, "configs": self.status}, indent=1))


def child(args: list[str], timeout: float) -> tuple[int, str]:
    """gpu_check.py in a process of its own with ``args``, for at most ``timeout`` s: (exit status, last output)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), *args]
    try:
        p = subprocess.run(cmd, timeout=max(timeout, 1), capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return -1, f"over {timeout:.0f} s, stopped"
    sys.stdout.write(p.stdout)
    err = _without_progress_bars(p.stderr)
    sys.stderr.write(err[-30_000:])  # a failure's first traceback too
    return p.returncode, (err.strip().splitlines() or [""])[-1][:300]


PROGRESS_BAR = re.compile(r"(it/s|s/it|examples/s)\]\s*$")


def _without_progress_bars(text: str) -> str:
    """``text`` less tqdm's bars (their lines, split at their carriage returns, end in a rate) and blank lines."""
    return "".join(line + "\n" for line in text.splitlines()
                   if line.strip() and not PROGRESS_BAR.search(line))


def run_all(out: Path, models: Path, budget: float, steps: int, tiny: bool, only: list[str] | None = None) -> int:
    """Every case in priority order (``only``: these), each model built first (once), then the case, then, for a
    speed case, the Trainer; each a child process with what is left of ``budget`` seconds; the CSV and JSON
    rewritten after each. Returns 0 when every case that started ran."""
    deadline = time.monotonic() + budget
    log = Log(out, meta={"versions": versions(), "tiny": tiny, "steps": steps, "budget_s": budget})
    log.write()
    common = ["--out", str(out), "--models", str(models), "--steps", str(steps)] + (["--dry-run"] if tiny else [])
    snapshots, failed = 0, 0
    for c in [c for c in CASES if not only or c.name in only]:
        left = deadline - time.monotonic()
        if left < 20:
            log.status[c.name] = {"status": "not run: out of time"}
            continue
        if c.cuda_only and tiny:
            log.status[c.name] = {"status": "not run: CUDA only"}
            continue
        print(f"== {c.name} ({left:.0f} s left)", flush=True)
        t0 = time.monotonic()
        rc, why = child(["--build", c.model, *common], left)
        if rc == 0:
            snap = snapshots < MAX_SNAPSHOTS
            rc, why = child(["--case", c.name, *common] + (["--snapshot"] if snap else []), deadline - time.monotonic())
            snapshots += snap
        done = Path(models, f"{c.name}.rows.json")
        if rc == 0 and done.exists():
            log.rows.extend(json.loads(done.read_text()))
        log.status[c.name] = {"status": "ok" if rc == 0 else f"failed: {why}", "seconds": round(time.monotonic() - t0)}
        failed += rc != 0
        if rc == 0 and c.speed and deadline - time.monotonic() > 20:
            rc, why = child(["--trainer", c.name, *common], deadline - time.monotonic())
            done = Path(models, f"{c.name}.trainer.json")
            if rc == 0 and done.exists():
                log.rows.extend(json.loads(done.read_text()))
            log.status[c.name]["trainer"] = "ok" if rc == 0 else f"failed: {why}"
        log.write()
    log.write()  # the configurations left out at the end, with why
    print_speed(log.rows)
    return 1 if failed else 0


def print_speed(rows: list[dict]) -> None:
    """tokens/s and MFU of fitburst's loop and of the Trainer, per configuration."""
    print(f"\n{'config':<34} {'loop':<11} {'tokens/s':>10} {'MFU':>7} {'peak alloc MiB':>15}")
    for r in rows:
        if r.get("tokens_per_s") is not None and r["stage"] in ("peak", "speed"):
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
            alloc = f"{r['max_allocated'] / MiB:.0f}" if r.get("max_allocated") else "-"
            print(f"{r['config']:<34} {r['loop']:<11} {r['tokens_per_s']:>10.0f} {mfu:>7} {alloc:>15}")


def child_main(kind: str, name: str, out: Path, models: Path, steps: int, tiny: bool, snapshot: bool) -> int:
    """The child processes' side: ``build`` a model, run a ``case``, or time the ``trainer``; rows to ``models``."""
    models.mkdir(parents=True, exist_ok=True)
    if kind == "build":
        build(name, model_dir(models, name, tiny), tiny)
        return 0
    if kind == "case":
        rows = run_case(case(name), models, out, steps, tiny, snapshot)
        (models / f"{name}.rows.json").write_text(json.dumps(rows))
        return 0
    rows = trainer_speed(case(name), models, steps, tiny)
    (models / f"{name}.trainer.json").write_text(json.dumps(rows))
    return 0


# --- replay on the CPU box ------------------------------------------------------------------------------------------


def replay(csv_path: Path) -> int:
    """The traced and analytic estimates of each measured configuration of an at-scale CSV, on the GPU its rows
    record (a dry run's CPU rows: on an H100 stand-in), against the peaks measured there."""
    os.environ.setdefault("FITBURST_TRACE_CACHE", "0")
    from gpu_check import estimates

    from fitburst.hardware import cuda_gpu, resolve_device
    from fitburst.settings import RunSettings, spec_with_settings

    with csv_path.open() as f:
        peaks = [r for r in csv.DictReader(f) if r["stage"] == "peak" and r["loop"] == "fitburst"]
    print(f"{'config':<34} {'est':<9} {'alloc MiB':>9} {'est':>8} {'err':>7} {'resv MiB':>9} {'est':>8} {'err':>7}")
    with tempfile.TemporaryDirectory() as d:
        data = fixed_length_data(Path(d) / "long.jsonl")
        for r in peaks:
            cap = tuple(int(x) for x in r["capability"].split(".")) if r["capability"] else None
            total = int(r.get("cap_bytes") or r["device_total_bytes"] or 0)  # a capped run: the card it stood for
            device = (cuda_gpu(r["gpu"], total, int(r["context_bytes"]), (cap[0], cap[1]) if cap else None)
                      if r["max_allocated"] else resolve_device("H100"))
            c = case(r["config"])
            spec = spec_of(c, r["model"], data, 4, tiny=r["model"] != c.model)
            if r.get("plan"):  # the settings the run was planned with
                spec = spec_with_settings(spec, RunSettings.from_dict(json.loads(r["plan"])))
            spec = spec.with_overrides({"preflight.device": "cpu"})
            for method, e in estimates(spec, int(r["seq_len"]), device, adamw=r["adamw"] or "auto").items():
                print(f"{r['config']:<34} {method:<9} " + " ".join(
                    f"{_mib(r['max_' + k]):>9} {getattr(e, f'{k}_peak_bytes') / MiB:>8.0f} "
                    f"{_err(r['max_' + k], getattr(e, f'{k}_peak_bytes')):>7}" for k in ("allocated", "reserved")))
    return 0


def _mib(v: str) -> str:
    return f"{int(v) / MiB:.0f}" if v else "-"


def _err(v: str, est: int) -> str:
    return f"{int(v) / est - 1:+.1%}" if v else "-"

