"""One run over several processes with FSDP2 (torchrun, gloo on this CPU), through the commands a user and a cloud
node run: ``fitburst train`` under torchrun, the local path's launcher, and SkyPilot's run block.

Tolerances, against one process training the same samples per step (N ranks x micro-batch b vs one process x N*b):
fp32 losses within 1e-5 relative (they differ only in the order sums are taken: measured up to 2e-7) and trained
weights within 1 % of the learning rate (:func:`assert_same_run`); QLoRA's bf16 step within 5e-3 relative, since
FSDP's mixed precision gathers every weight in bf16 where one process keeps the norms and LoRA weights in fp32 under
autocast (measured 1e-3)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fitburst.cache import cache_root
from fitburst.data import prepare
from fitburst.models import tokenizer_for
from fitburst.spec import load_pipeline

ROOT = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).with_name("rank_hooks")  # sitecustomize: test instrumentation inside the ranks
CHILD = Path(__file__).with_name("fault_child.py")
FP32_REL, BF16_REL = 1e-5, 5e-3
BASE = {"training.max_steps": 4, "training.log_every": 1, "training.checkpoint_every": 100, "eval.enabled": False,
        "preflight.device": "cpu"}


def rank_env(hooks: dict | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *([str(HOOKS)] if hooks else [])])}
    if hooks:
        env["FITBURST_TEST_RANK_HOOKS"] = json.dumps(hooks)
    return env


def spec_for(pipelines_file, pipeline: str, **overrides):
    return load_pipeline(pipelines_file, pipeline, {**BASE, **{k.replace("__", "."): v for k, v in overrides.items()}})


def prepared_for(spec):
    return prepare(spec.data, spec.data_path(), tokenizer_for(spec.model), cache_root() / "data")


LAUNCHERS = {"fitburst": "fitburst.torchrun",  # what `fitburst train --nproc-per-node` starts: ranks forked
             "torchrun": "torch.distributed.run"}  # a user's own torchrun: each rank a new Python


def torchrun(nproc: int, spec, prepared, run_dir: Path, hooks: dict | None = None, launcher: str = "fitburst") -> dict:
    """``fitburst train`` on ``nproc`` ranks started by ``launcher`` (:data:`LAUNCHERS`), with test ``hooks`` in
    the ranks (tests/rank_hooks); the run's train_result.json."""
    spec_path = run_dir.with_suffix(".yaml")
    spec_path.write_text(spec.to_yaml())
    cmd = [sys.executable, "-m", LAUNCHERS[launcher], "--standalone", f"--nproc-per-node={nproc}",
           "-m", "fitburst.cli", "train", "--spec", str(spec_path), "--prepared", prepared.dir,
           "--run-dir", str(run_dir), "--quiet"]
    proc = subprocess.run(cmd, env=rank_env(hooks), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads((run_dir / "train_result.json").read_text())


def one_process(spec, prepared, run_dir: Path):
    from fitburst.recipe import train

    return train(spec, prepared, run_dir, device="cpu", progress=False)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train_loss"] for r in rows}


def trained(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    folder = run_dir / "adapter"
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(str(folder / name))


def assert_same_run(one: Path, many: Path, lr: float) -> None:
    """The same loss curve (:data:`FP32_REL`) and the same trained weights, within 1 % of the largest update one
    step can make: AdamW moves a weight by about the learning rate at most, and where a gradient is near zero its
    normalised update turns on the gradient's last bits (measured: 2e-8 .. 1.1e-5, T5 at lr 5e-3 the largest)."""
    rel, atol = FP32_REL, 1e-2 * lr
    a, b = losses(one), losses(many)
    assert a.keys() == b.keys() and len(a) >= 2
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=rel), (step, a, b)
    wa, wb = trained(one), trained(many)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k].float() - wb[k].float()).abs().max().item() <= atol, k


# --- refused before the model loads -------------------------------------------------------------------------

def test_what_cannot_be_sharded_is_refused_before_the_model_loads(pipelines_file, monkeypatch):
    import fitburst.builders as builders
    from fitburst.distributed import World
    from fitburst.errors import UserError
    from fitburst.families import CAUSAL
    from fitburst.memory.fsdp_terms import offload_host_bytes
    from fitburst.models import spec_shape
    from fitburst.settings import settings_from_spec

    four = World(rank=0, size=4, local_rank=0, local_size=4)
    with pytest.raises(UserError, match="training.distributed is none but torchrun started 4"):
        builders.refuse_problems(spec_for(pipelines_file, "demo", training__distributed="none"), CAUSAL, four.size)
    offload = spec_for(pipelines_file, "qwen7b-lora", training__distributed="fsdp", training__fsdp__cpu_offload=True)
    shape, s = spec_shape(offload), settings_from_spec(offload)
    assert shape is not None
    need = offload_host_bytes(shape, s, 4, 8)  # two nodes of four ranks
    # half of 15.2 GB of bf16 weights and of 161M LoRA weights' fp32 gradients and AdamW moments (12 bytes each)
    assert need == pytest.approx((15.23e9 + 161.5e6 * 12) / 2, rel=0.01)
    assert offload_host_bytes(shape, s, 4, 4) == pytest.approx(2 * need, abs=1)  # one node holds it all
    two_nodes = World(rank=0, size=8, local_rank=0, local_size=4)
    monkeypatch.setattr(builders, "available_host_bytes", lambda: need - 1)
    with pytest.raises(UserError, match=r"training.fsdp.cpu_offload .* about 8.0 GiB .*cpu_offload: false"):
        builders.refuse_offload_beyond_host_ram(offload, shape, two_nodes)
    monkeypatch.setattr(builders, "available_host_bytes", lambda: need)
    builders.refuse_offload_beyond_host_ram(offload, shape, two_nodes)


def test_a_refusal_in_the_ranks_reaches_the_launcher_as_its_one_line(tmp_path, pipelines_file, demo_prepared):
    from fitburst.ranks import Ranks, RanksFailed

    spec = spec_for(pipelines_file, "demo", training__distributed="none")
    with pytest.raises(RanksFailed, match="training.distributed is none but torchrun started 2 processes") as e:
        Ranks(2).run(spec, demo_prepared.dir, tmp_path / "run")
    assert e.value.oom_kind is None
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_distributed_settings_go_through_the_one_conversion(pipelines_file):
    from fitburst.settings import RunSettings, settings_from_spec, spec_with_settings

    spec = spec_for(pipelines_file, "demo", training__distributed="fsdp", training__fsdp__reshard_after_forward=False)
    s = settings_from_spec(spec)
    assert (s.distributed, s.reshard_after_forward, s.cpu_offload) == ("fsdp", False, False)
    assert s.describe().endswith("adamw sdpa fsdp keep-gathered")
    back = spec_with_settings(spec, s)
    assert back.training.distributed == "fsdp" and back.training.fsdp == spec.training.fsdp
    assert spec.config_hash() == spec_for(pipelines_file, "demo").config_hash()  # the same run folder, any sharding
    from fitburst.rules import problems

    assert [str(p) for p in problems(RunSettings(method="qlora", quant="int8", distributed="fsdp"))] == [
        "int8 weights cannot be sharded by FSDP (bitsandbytes Int8Params): use quant: nf4 (its 4-bit weights shard "
        "in the compute dtype), or training.distributed: none"]


# --- N ranks x b train as one process x N*b ----------------------------------------------------------------

# the causal demo's settings for each method: LoRA with SGD and no clipping (a gradient averaged instead of summed
# across ranks would halve every update), full with AdamW and the gradient norm clipped at 1
CAUSAL = {"lora": {"training.optimizer": "sgd", "training.max_grad_norm": None, "training.learning_rate": 0.05,
                   "training.warmup_steps": 0},
          "full": {"method.type": "full", "training.learning_rate": 1e-4}}


@pytest.fixture(scope="module")
def causal_runs(tmp_path_factory, pipelines_file):
    """For each method of :data:`CAUSAL`, built on first use: one process at micro-batch 8 and two ranks at 4, the
    ranks recording the parameter bytes each holds (tests/rank_hooks: held). Shared by the two tests below, which
    check the same runs for different things. Returns (spec, prepared, one process's result, the two ranks'
    train_result.json, the folder holding one/, two/ and held/)."""
    runs: dict = {}

    def run(method: str):
        if method not in runs:
            root = tmp_path_factory.mktemp(f"causal-{method}")
            spec = spec_for(pipelines_file, "demo", **{k.replace(".", "__"): v for k, v in CAUSAL[method].items()},
                            training__micro_batch_size=8)
            prepared = prepared_for(spec)
            one = one_process(spec, prepared, root / "one")
            (root / "held").mkdir()
            # full fine-tuning's ranks through a user's own torchrun, LoRA's through fitburst's
            two = torchrun(2, spec.with_overrides({"training.micro_batch_size": 4, "training.distributed": "fsdp"}),
                           prepared, root / "two", hooks={"held": str(root / "held")},
                           launcher="torchrun" if method == "full" else "fitburst")
            runs[method] = (spec, prepared, one, two, root)
        return runs[method]

    return run


def two_ranks_against_one_process(tmp_path, pipelines_file, pipeline):
    """``pipeline`` at micro-batch 8 in one process and at 4 on two ranks: (spec, one's result, the ranks' result,
    the folder holding one/ and two/)."""
    spec = spec_for(pipelines_file, pipeline, training__micro_batch_size=8)
    prepared = prepared_for(spec)
    one = one_process(spec, prepared, tmp_path / "one")
    sharded = spec.with_overrides({"training.micro_batch_size": 4, "training.distributed": "fsdp"})
    return spec, one, torchrun(2, sharded, prepared, tmp_path / "two"), tmp_path


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_ranks_train_as_one_process_with_their_combined_micro_batch(causal_runs, method):
    spec, _, one, result, root = causal_runs(method)
    assert_trained_as_one_process(spec, one, result, root)


@pytest.mark.parametrize("pipeline", ["t5-demo", "moe-demo"])
def test_two_ranks_of_t5_and_moe_train_as_one_process_with_their_combined_micro_batch(tmp_path, pipelines_file,
                                                                                     pipeline):
    assert_trained_as_one_process(*two_ranks_against_one_process(tmp_path, pipelines_file, pipeline))


def assert_trained_as_one_process(spec, one, result, root: Path) -> None:
    """Two ranks at micro-batch b trained as one process at 2b: the same losses and weights, the same tokens, each
    rank's peak recorded, and an ordinary folder at the end."""
    assert_same_run(root / "one", root / "two", spec.training.learning_rate)
    assert result["tokens"] == one.tokens  # the same samples, counted over both ranks
    assert result["world_size"] == 2 and len(result["rank_peaks"]) == 2
    assert all(p["allocated_bytes"] > 0 for p in result["rank_peaks"])
    assert result["peak"]["allocated_bytes"] == max(p["allocated_bytes"] for p in result["rank_peaks"])
    # an ordinary folder: a peft adapter, or (full) a model folder transformers loads
    if spec.method.type == "full":
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(root / "two" / "adapter").config.architectures == [
            "LlamaForCausalLM"]
    else:
        from peft import PeftConfig

        assert PeftConfig.from_pretrained(str(root / "two" / "adapter")).peft_type == "LORA"


@pytest.mark.parametrize("method", ["lora", "full"])
def test_rank_0_alone_loads_the_weights_and_the_others_receive_their_shards(causal_runs, method):
    """One copy of the model per node while loading: rank 1 builds it on the meta device (no parameter bytes) and
    holds only its shards once built; rank 0 loaded it all. The run trains as one process does (the demo's head
    is tied to its embeddings, its rotary inv_freq is a buffer rank 1 computes, LoRA's initial weights come from
    rank 0)."""
    spec, _, _, _, root = causal_runs(method)
    rank = [json.loads((root / "held" / f"rank-{r}.json").read_text()) for r in (0, 1)]
    whole = rank[0]["loaded"]
    assert whole > 1_000_000 and rank[1]["loaded"] == 0
    # built: each rank half of the weights, and of LoRA's (added after loading: 16 % of the demo's weights in fp32)
    assert rank[0]["built"] == pytest.approx(rank[1]["built"], rel=0.02)
    assert whole / 2 <= rank[1]["built"] <= 0.6 * whole
    assert rank[0]["imported"] == rank[1]["imported"] == []  # fitburst.unused_imports: neither package is used
    started = {"lora": "-m fitburst.torchrun ", "full": "-u -m fitburst.cli train "}[method]  # forked; a new Python
    assert rank[0]["command"].startswith(started) and rank[1]["command"].startswith(started), rank
    assert_same_run(root / "one", root / "two", spec.training.learning_rate)


def test_qlora_ranks_each_load_the_4bit_model_and_train_as_one_process(tmp_path, pipelines_file, demo_prepared):
    """4-bit weights are loaded by every rank (bitsandbytes quantizes on load; a rank built without weights has no
    quantization state to receive: fitburst.memory.fsdp_terms.loads_once), and the two ranks still train as one
    process at the combined batch (bf16: :data:`BF16_REL`). Their launcher finds that a forked rank could not use
    CUDA (as where bitsandbytes asked the driver at import), so it spawns them."""
    spec = spec_for(pipelines_file, "demo", method__type="qlora", training__precision="bf16",
                    training__micro_batch_size=8)
    one_process(spec, demo_prepared, tmp_path / "one")
    (held := tmp_path / "held").mkdir()
    torchrun(2, spec.with_overrides({"training.micro_batch_size": 4, "training.distributed": "fsdp"}),
             demo_prepared, tmp_path / "two", hooks={"held": str(held), "cuda_asked": True})
    rank = [json.loads((held / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert "spawn_main" in rank[0]["command"] and "spawn_main" in rank[1]["command"], rank  # not forked
    assert rank[0]["loaded"] == rank[1]["loaded"] > 0
    assert rank[0]["imported"] == rank[1]["imported"] == ["bitsandbytes"]  # 4-bit weights need it; not sklearn
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert a.keys() == b.keys()
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=BF16_REL), (step, a, b)


def test_a_four_rank_checkpoint_resumes_at_two_ranks_and_in_one_process(tmp_path, pipelines_file, demo_prepared):
    spec = spec_for(pipelines_file, "demo", training__checkpoint_every=2, training__distributed="fsdp")
    four = torchrun(4, spec.with_overrides({"training.micro_batch_size": 2}), demo_prepared, tmp_path / "four")
    assert four["world_size"] == 4
    ckpt = tmp_path / "four" / "checkpoints" / "step-2"
    assert len(list((ckpt / "sharded").glob("*.distcp"))) == 4 and (ckpt / "sharded" / ".metadata").exists()
    assert json.loads((ckpt / "state.json").read_text()) == {"step": 2, "samples": 16, "world_size": 4,
                                                             "samples_per_step": 8}
    one_process(spec.with_overrides({"training.micro_batch_size": 8}), demo_prepared, tmp_path / "one")
    assert_same_run(tmp_path / "one", tmp_path / "four", spec.training.learning_rate)  # 4 ranks x 2 as 1 x 8

    for name, nproc, batch in (("two", 2, 4), ("single", 1, 8)):
        resumed = tmp_path / name
        shutil.copytree(ckpt, resumed / "checkpoints" / "step-2")
        respec = spec.with_overrides({"training.micro_batch_size": batch})
        result = torchrun(nproc, respec, demo_prepared, resumed) if nproc > 1 else one_process(
            respec, demo_prepared, resumed).__dict__
        assert result["resumed_from"] == 2 and result["steps"] == 4
        got, want = losses(resumed), losses(tmp_path / "four")
        assert list(got) == [3, 4]  # the samples of steps 3 and 4, as the 4-rank run took them
        for step in got:
            assert got[step] == pytest.approx(want[step], rel=FP32_REL)


def test_a_resume_at_another_world_size_keeps_the_effective_batch(tmp_path, pipelines_file, demo_prepared):
    """A one-process checkpoint (micro-batch 4 x 2 accumulated: 8 samples per step) resumed by two ranks with the
    same spec: grad_accum becomes 1, so steps 3 and 4 take the samples, and reach the losses, of the one-process
    run (which would otherwise have gone on with 16 samples per step)."""
    spec = spec_for(pipelines_file, "demo", training__checkpoint_every=2, training__micro_batch_size=4,
                    training__grad_accum=2, training__distributed="fsdp")
    one_process(spec, demo_prepared, tmp_path / "one")
    ckpt = tmp_path / "one" / "checkpoints" / "step-2"
    assert json.loads((ckpt / "state.json").read_text())["samples_per_step"] == 8
    shutil.copytree(ckpt, tmp_path / "two" / "checkpoints" / "step-2")
    result = torchrun(2, spec, demo_prepared, tmp_path / "two")
    assert result["resumed_from"] == 2 and result["grad_accum"] == 1 and result["samples_per_step"] == 8
    got, want = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert list(got) == [3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=FP32_REL)


def test_a_resume_no_grad_accum_can_keep_is_refused_with_what_to_set(pipelines_file):
    from fitburst.checkpoints import spec_keeping_effective_batch as keep
    from fitburst.distributed import World
    from fitburst.errors import UserError

    spec = spec_for(pipelines_file, "demo", training__micro_batch_size=4, training__grad_accum=2)
    four = {"step": 6, "samples": 96, "world_size": 4, "samples_per_step": 16}
    two, three = World(rank=0, size=2, local_size=2), World(rank=0, size=3, local_size=3)
    assert keep(spec, four, two).training.grad_accum == 2  # 2 x 4 x 2: already 16
    assert keep(spec, four, World()).training.grad_accum == 4  # one process: 1 x 4 x 4
    assert keep(spec, {**four, "world_size": 2}, two) is spec  # same world size: as the spec says
    assert keep(spec, {"step": 6, "samples": 48, "world_size": 1}, two).training.grad_accum == 1  # 8 per step
    with pytest.raises(UserError, match=r"16 samples per optimizer step on 4 rank.*on 3 ranks.*resume on a number "
                                        r"of ranks that divides 16"):
        keep(spec, four, three)
    six = spec_for(pipelines_file, "demo", training__micro_batch_size=6)
    with pytest.raises(UserError, match=r"training.micro_batch_size 6 takes no whole training.grad_accum to 16: set "
                                        r"training.micro_batch_size: 4 and training.grad_accum: 2"):
        keep(six, four, two)


# --- QLoRA: 4-bit weights that shard, and the traps ------------------------------------------------------------

@pytest.fixture
def process_group(tmp_path):
    """A real one-rank gloo process group in this process (FSDP's sharding, mixed precision and state handling
    all run; there is no second rank to talk to)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _qlora_step(spec, model, batch):
    """One forward and backward of ``batch`` under the run's autocast: the loss and the LoRA gradients."""
    from fitburst.device import make_amp
    from fitburst.families import family_for

    family = family_for(model.config)
    with make_amp("bf16", "cpu").autocast():
        loss = family.train_loss(model, batch, family.label_tokens(batch))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def test_qlora_under_fsdp_keeps_its_quantization_state_and_trains_like_one_process(
        pipelines_file, demo_prepared, process_group):
    """The known FSDP + bitsandbytes traps, named: the quantization state lost when FSDP turns each 4-bit weight into
    a shard (a layer that then cannot dequantize: shown below by taking it away), and with it a run that "trains"
    with a loss of 0 or NaN / zero LoRA gradients; packed weights stored as uint8 (FSDP1 needs one dtype per flat
    parameter and its mixed precision casts them: fitburst stores them in the compute dtype, as PEFT documents for
    FSDP QLoRA; FSDP2 on torch 2.13 all-gathers mixed dtypes as bytes and casts only floating weights, so uint8 was
    measured to train identically here). Memory saved: the next test."""
    import bitsandbytes as bnb
    import torch

    import fitburst.models as models
    from fitburst import distributed
    from fitburst.builders import prepare_for_training
    from fitburst.data import load_split
    from fitburst.families import CAUSAL

    spec = spec_for(pipelines_file, "demo", method__type="qlora", training__precision="bf16")
    rows = load_split(demo_prepared, "train").to_list()[:4]
    batch = CAUSAL.collate(rows, tokenizer_for(spec.model).pad_token_id)

    def build(sharded: bool):
        torch.manual_seed(0)
        model = prepare_for_training(models.load_pipeline_model(spec, "cpu", "bf16", sharded=sharded), spec)
        if sharded:
            distributed.shard(model, "bf16")
        return model

    ref_loss, ref_grads = _qlora_step(spec, build(False), batch)
    assert 1 < ref_loss < 20

    model = build(True)
    packed = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert packed and all(m.weight.dtype == torch.bfloat16 for m in packed)  # stored in the compute dtype
    assert all(type(m.weight).__name__ == "DTensor" and not hasattr(m.weight, "quant_state") for m in packed)
    loss, grads = _qlora_step(spec, model, batch)
    assert loss == pytest.approx(ref_loss, rel=BF16_REL)
    assert grads.keys() == ref_grads.keys()
    b_grads = [g.to_local() if hasattr(g, "to_local") else g for n, g in grads.items() if "lora_B" in n]
    assert b_grads and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in b_grads)  # B starts at 0

    for m in packed:  # what bitsandbytes restores the sharded weight's state from
        m.quant_state = None
    with pytest.raises(ValueError, match="quant_state is required"):
        _qlora_step(spec, model, batch)


def test_qlora_4bit_weights_are_split_across_ranks(pipelines_file):
    """Memory saved: rank 0 of 2 (torch's fake process group, which runs no collective) holds half of every 4-bit
    layer's packed weight."""
    import bitsandbytes as bnb
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fitburst.models as models
    from fitburst import distributed
    from fitburst.builders import prepare_for_training

    spec = spec_for(pipelines_file, "demo", method__type="qlora", training__precision="bf16")
    whole = models.load_pipeline_model(spec, "cpu", "bf16", sharded=True)
    full = {n: m.weight.numel() for n, m in whole.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        model = prepare_for_training(models.load_pipeline_model(spec, "cpu", "bf16", sharded=True), spec)
        distributed.shard(model, "bf16")
        local = {n.removeprefix("base_model.model.").removesuffix(".base_layer"): m.weight.to_local().numel()
                 for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    finally:
        dist.destroy_process_group()
    assert local.keys() == full.keys()
    for name, n in full.items():
        assert local[name] == -(-n // 2), name  # rows split in two (the first rank holds the rounded-up half)
    assert torch.bfloat16 == next(m.weight.dtype for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))


# --- a rank that stops: killed, or out of memory -----------------------------------------------------------------

def _ranks_of(folder: Path) -> dict[int, int]:
    """rank -> pid of the training processes, as each wrote it there (tests/rank_hooks: pids)."""
    return {int(p.stem.split("-")[1]): int(p.read_text()) for p in folder.glob("rank-*.pid")}


def test_a_killed_rank_ends_the_run_failed_and_the_rerun_resumes_from_the_sharded_checkpoint(
        tmp_path, pipelines_file, demo_prepared, monkeypatch):
    import psutil
    from mlflow.tracking import MlflowClient
    from test_crash_resume import saved_checkpoint

    from fitburst.supervisor import train_local_run
    from fitburst.tracking import Tracker

    overrides = {**BASE, "training.max_steps": 30, "training.checkpoint_every": 4, "training.log_every": 2,
                 "training.micro_batch_size": 4, "training.distributed": "fsdp",
                 "tracking.experiment": "distributed-kill"}
    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path / "runs"))
    env = {**rank_env({"step_sleep": 0.2, "pids": str(tmp_path)}), "FITBURST_RUNS_DIR": str(tmp_path / "runs")}
    launcher = subprocess.Popen([sys.executable, str(CHILD), json.dumps(
        {"pipelines_file": str(pipelines_file), "overrides": overrides, "mlflow": True, "nproc": 2})],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = json.loads(launcher.stdout.readline())["mlflow_run_id"]
    deadline = time.monotonic() + 180
    while not saved_checkpoint(tmp_path / "runs" / "demo"):
        assert launcher.poll() is None, launcher.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    ranks = _ranks_of(tmp_path)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGKILL)
    assert launcher.wait(timeout=120) != 0  # torchrun ends rank 0, the launcher fails the run
    out = launcher.stderr.read()
    assert "RanksFailed" in out or "training on 2 processes stopped" in out, out[-3000:]
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in ranks.values())
    client = MlflowClient()
    assert client.get_run(first).info.status == "FAILED"  # closed by the launcher, not left RUNNING

    spec = load_pipeline(pipelines_file, "demo", overrides)
    run_dir = next((tmp_path / "runs" / "demo").iterdir())
    newest = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*")
                 if not p.name.endswith(".tmp"))
    tracker = Tracker.start(spec)
    rerun = train_local_run(spec, demo_prepared, tracker, progress=False, nproc=2)
    tracker.end("FINISHED")
    assert rerun.resumed_from == newest >= 4 and rerun.steps == 30 and rerun.world_size == 2
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    logged = sorted(int(m.step) for m in client.get_metric_history(tracker.run_id, "train_loss"))
    assert logged == [s for s in range(2, 31, 2) if s > newest]  # rank 0's curve, relayed while it trained


def test_a_rank_out_of_memory_steps_every_rank_down_together(tmp_path, pipelines_file, demo_prepared, monkeypatch):
    from fitburst.supervisor import STEPDOWN_FILE, train_local_run

    spec = spec_for(pipelines_file, "demo", training__max_steps=6, training__checkpoint_every=2,
                    training__micro_batch_size=4, training__distributed="fsdp",
                    **{f"preflight__allow__{k}": False for k in (
                        "gradient_checkpointing", "quantize", "attention", "dropout", "packing", "resolution",
                        "precision", "activation_offloading")})  # left: the two FSDP cannot take, and the batch
    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path / "runs"))
    for k, v in rank_env({"oom": {"rank": 1, "call": 3, "marker": str(tmp_path / "oom-once")}}).items():
        monkeypatch.setenv(k, v)
    records = []
    result = train_local_run(spec, demo_prepared, None, progress=False, nproc=2, on_stepdown=records.append)
    assert (tmp_path / "oom-once").exists()  # rank 1 ran out of memory in its 4th step
    assert [r.oom_kind for r in records] == ["cpu"] and records[0].rung == "reduce_batch"
    assert records[0].step == 2 and records[0].measured_peak_bytes  # rank 1's own peak, from its record
    state = json.loads((Path(result.run_dir) / STEPDOWN_FILE).read_text())
    assert state["rungs"] == ["reduce_batch"]
    relaunched = load_pipeline_yaml(Path(result.run_dir) / "ranks-spec.yaml")
    assert relaunched["training"]["micro_batch_size"] == 2 and relaunched["training"]["grad_accum"] == 2
    assert result.resumed_from == 2 and result.steps == 6 and result.world_size == 2


def load_pipeline_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


# --- the cloud node's run block: torchrun from SkyPilot's node variables -------------------------------------------

def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive loopback ports free now, below the kernel's ephemeral range: a port bind(0)
    found free in that range may be taken by any connection's local end before the run binds it (it failed so once,
    EADDRINUSE on torchrun's port: the store's port + 1)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    bases = range(20000, max(low, 20000 + n + 1) - n)
    for base in random.sample(bases, min(200, len(bases))):
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} free consecutive ports from 20000 up")


def test_the_multi_node_run_block_trains_two_ranks_here_and_the_nodes_folders_make_one_checkpoint(
        tmp_path, pipelines_file, demo_prepared, monkeypatch):
    """Two nodes of one GPU each, both on this machine (two HOMEs: two disks): each runs the task's run block with
    the variables SkyPilot sets on a node; the nodes' supervisors and torchrun's static rendezvous make them one run
    of two ranks. Rank 1, on node 1, runs out of memory in its 4th step: node 0's supervisor steps both nodes down
    together and each node's rank resumes from the checkpoint on its own disk. Copied together (as the launcher
    pulls every node home), their checkpoint folders resume in one process."""
    from test_cloud_node import _node_env
    from test_cloud_sky import _candidates

    from fitburst import cloud
    from fitburst.cloud.launch import every_node
    from fitburst.supervisor import STEPDOWN_FILE

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = spec_for(pipelines_file, "demo", training__checkpoint_every=2, training__micro_batch_size=4,
                    **{f"preflight__allow__{k}": False for k in (
                        "gradient_checkpointing", "quantize", "attention", "dropout", "packing", "resolution",
                        "precision", "activation_offloading")})  # left for a sharded run: the batch
    task = cloud.build_task(spec, _candidates(), prepared_dir=demo_prepared.dir, gpus_per_node=1, nodes=2)
    assert task.num_nodes == 2
    port = free_port_block(4)  # the supervisors' store, then torchrun's rendezvous: one port per attempt
    hooks = {"oom": {"rank": 1, "call": 3, "marker": str(tmp_path / "oom-once")}}
    nodes = []
    for rank in (0, 1):
        home = tmp_path / f"node{rank}"
        for dest, src in task.file_mounts.items():
            target = home / dest.removeprefix("~/")
            target.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if Path(src).is_dir() else shutil.copy)(src, target)
        env = {**_node_env(task, home), "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": "2",
               "SKYPILOT_NUM_GPUS_PER_NODE": "1", "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
               "FITBURST_RDZV_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(HOOKS), "FITBURST_TEST_RANK_HOOKS": json.dumps(hooks)}
        nodes.append(subprocess.Popen(["bash", "-c", task.run], cwd=task.workdir, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    logs = [f"{log}:\n{log.read_text()[-3000:]}" for log in sorted(tmp_path.glob("node*/**/*.log"))]
    assert all(n.returncode == 0 for n in nodes), "\n---\n".join([o[-3000:] for o in outputs] + logs)
    assert "(2 ranks)" in outputs[0]
    assert (tmp_path / "oom-once").exists()  # rank 1 ran out of memory once
    node_run = [tmp_path / f"node{r}" / "fitburst-job" / "run" for r in (0, 1)]
    assert json.loads((node_run[0] / STEPDOWN_FILE).read_text())["rungs"] == ["reduce_batch"]
    for run, name in zip(node_run, ("ranks-spec.yaml", "ranks-spec-node1.yaml"), strict=True):
        trained_with = load_pipeline_yaml(run / name)["training"]  # the last attempt's, on each node
        assert (trained_with["micro_batch_size"], trained_with["grad_accum"]) == (2, 2)

    home = tmp_path / "home"  # the launcher's pull: every node's RUN_DIR into one folder
    every_node(lambda host, run_dir, log: shutil.copytree(
        tmp_path / f"node{0 if host == 'c' else 1}" / "fitburst-job" / "run", run_dir, dirs_exist_ok=True), 2)(
        "c", home, print)
    result = json.loads((home / "train_result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 4 and result["resumed_from"] == 2
    shards = [len(list((tmp_path / f"node{r}/fitburst-job/run/checkpoints/step-2/sharded").glob("*.distcp")))
              for r in (0, 1)]
    assert shards == [1, 1]  # each node's disk holds its rank's part
    resumed = tmp_path / "resumed"
    shutil.copytree(home / "checkpoints", resumed / "checkpoints")
    again = one_process(spec.with_overrides({"training.micro_batch_size": 8}), demo_prepared, resumed)
    assert again.resumed_from == 2
    for step, loss in losses(resumed).items():
        assert loss == pytest.approx(losses(home)[step], rel=FP32_REL)
