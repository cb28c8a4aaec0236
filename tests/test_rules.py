"""The rule table (fitburst.rules): each row refuses what it must and accepts its nearest neighbour; validate, the
ladder, the loop and the cloud ranking give the same answer for the same row."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import replace

import pytest
from conftest import config_folder, fake_cuda_card

from fitburst.families import CAUSAL, SEQ2SEQ, VISION_LANGUAGE
from fitburst.hardware import resolve_device
from fitburst.memory.shapes import load_shape
from fitburst.rules import RULE_KEYS, ModelFacts, declared_device, device_of_kind, new_problems, problems
from fitburst.settings import RunSettings

T4, A6000 = resolve_device("T4"), resolve_device("A6000")
MPS, CPU, CUDA = device_of_kind("mps"), device_of_kind("cpu"), device_of_kind("cuda")
PLANNED = resolve_device("cuda:24GiB")  # a card planned from here (fitburst estimate --device, a burst's GPU)

LLAMA, PHI = ModelFacts.of(load_shape("meta-llama/llama-3.1-8b")), ModelFacts.of(load_shape("microsoft/phi-1.5"))
MIXTRAL, T5 = ModelFacts.of(load_shape("mistralai/mixtral-8x7b")), ModelFacts.of(load_shape("google/flan-t5-xl"))
TIED = ModelFacts.of(load_shape("llama-3.2-3b"))


def on(settings: dict, device=None, family=None, model=None) -> tuple:
    return settings, device, family, model


# rule: (settings it refuses, device, family, model), (the neighbour it accepts, device, family, model)
CASES = {
    "full_quantized": (on(dict(method="full", quant="nf4")), on(dict(method="full"))),
    "bf16_unsupported": (on(dict(precision="bf16"), T4), on(dict(precision="bf16"), A6000)),
    "kbit_needs_bnb": (on(dict(method="qlora"), MPS), on(dict(method="qlora"), CUDA)),
    "optimizer_8bit_needs_bnb": (on(dict(optimizer="adamw8bit"), MPS), on(dict(optimizer="adamw"), MPS)),
    "fsdp_on_mps": (on(dict(distributed="fsdp"), MPS), on(dict(distributed="fsdp"), CUDA)),
    "processes_without_fsdp": (on(dict(world_size=2, distributed="none")),
                               on(dict(world_size=2, distributed="auto"))),
    "fsdp_int8": (on(dict(method="qlora", quant="int8", world_size=2)),
                  on(dict(method="qlora", quant="nf4", world_size=2))),
    "fsdp_optimizer_8bit": (on(dict(optimizer="paged_adamw8bit", distributed="fsdp")),
                            on(dict(optimizer="paged_adamw8bit"))),
    "fsdp_fused_loss": (on(dict(loss="fused", world_size=4)), on(dict(loss="fused"))),
    "cpu_offload_without_fsdp": (on(dict(cpu_offload=True, distributed="none")),
                                 on(dict(cpu_offload=True, distributed="auto"))),
    "activation_offloading_off_cuda": (on(dict(activation_offloading=True), CPU),
                                       on(dict(activation_offloading=True), CUDA)),
    "packing_images": (on(dict(packed_fill=1.0, images=1, image_tokens=64)), on(dict(packed_fill=1.0))),
    "family_packing": (on(dict(packed_fill=1.0), None, SEQ2SEQ), on(dict(packed_fill=1.0), None, CAUSAL)),
    "family_fused_loss": (on(dict(loss="fused"), None, SEQ2SEQ), on(dict(loss="fused"), None, CAUSAL)),
    "fused_loss_head_bias": (on(dict(loss="fused"), None, None, PHI), on(dict(loss="fused"), None, None, LLAMA)),
    "tiled_mlp_model": (on(dict(tiled_mlp=True), None, None, PHI), on(dict(tiled_mlp=True), None, None, LLAMA)),
    # the lean libraries, hidden here (HIDDEN): refused for this machine's GPU, not for a planned one (a burst node)
    "tiled_mlp_missing": (on(dict(tiled_mlp=True), CUDA), on(dict(tiled_mlp=True), PLANNED)),
    "activation_offloading_missing": (on(dict(activation_offloading=True), CUDA),
                                      on(dict(activation_offloading=True), PLANNED)),
    "fused_loss_missing": (on(dict(loss="fused", precision="bf16"), CUDA),
                           on(dict(loss="fused", precision="bf16"), PLANNED)),
    "flash_attention_missing": (on(dict(attention="flash"), CUDA), on(dict(attention="sdpa"), CUDA)),
    "liger_kernels_off_cuda": (on(dict(liger_kernels=True), CPU), on(dict(liger_kernels=True), CUDA)),
    "liger_kernels_missing": (on(dict(liger_kernels=True), CUDA), on(dict(liger_kernels=True), CUDA)),
    "liger_kernels_model": (on(dict(liger_kernels=True), None, None, MIXTRAL),
                            on(dict(liger_kernels=True), None, None, LLAMA)),
    "embeddings_on_host_mps": (on(dict(embeddings_on_host=True), MPS), on(dict(embeddings_on_host=True), CPU)),
    "embeddings_on_host_trained": (on(dict(method="full", embeddings_on_host=True)),
                                   on(dict(method="lora", embeddings_on_host=True))),
    "fsdp_embeddings_on_host": (on(dict(embeddings_on_host=True, distributed="fsdp")),
                                on(dict(embeddings_on_host=True, distributed="none"))),
    "embeddings_on_host_tied": (on(dict(embeddings_on_host=True), None, None, TIED),
                                on(dict(embeddings_on_host=True), None, None, LLAMA)),
    "embeddings_on_host_model": (on(dict(embeddings_on_host=True), None, None, T5),
                                 on(dict(embeddings_on_host=True), None, None, LLAMA)),
}

# Liger's rows also read this install (fitburst.rules' probe of liger-kernel: installed, and the model types its
# MODEL_TYPE_TO_APPLY_LIGER_FN patches). Linux CI has it, a Mac dev install has not (the lean extra is Linux-only):
# each case sets the probe's answer, the same on both. Liger patches Llama and Mixtral (tests/test_liger_kernels.py
# checks the probe against Liger's own mapping where it is installed).
LIGER_INSTALLED = (frozenset({"llama", "mixtral"}), None)
LIGER_MISSING = (frozenset(), "liger-kernel is not installed")
# rule: the probe's answer for the case it refuses, for the neighbour it accepts (every other row: installed)
PROBED = {"liger_kernels_missing": (LIGER_MISSING, LIGER_INSTALLED)}
# rule: the module hidden from this install in both its cases (what `import` then finds: nothing)
HIDDEN = {"tiled_mlp_missing": "liger_kernel", "fused_loss_missing": "cut_cross_entropy",
          "activation_offloading_missing": "trl", "flash_attention_missing": "flash_attn"}


def _probe(monkeypatch, answer: tuple) -> None:
    import fitburst.rules as rules

    monkeypatch.setattr(rules, "_liger_model_types", lambda: answer)


def test_every_row_has_a_case():
    assert set(CASES) == RULE_KEYS


@pytest.mark.parametrize("rule", sorted(CASES))
def test_each_row_refuses_what_it_must_and_accepts_its_neighbour(rule, monkeypatch):
    (bad, *bad_facts), (good, *good_facts) = CASES[rule]
    probe_bad, probe_good = PROBED.get(rule, (LIGER_INSTALLED, LIGER_INSTALLED))
    if rule in HIDDEN:
        monkeypatch.setitem(sys.modules, HIDDEN[rule], None)
    _probe(monkeypatch, probe_good)
    assert problems(RunSettings(**good), *good_facts) == []
    _probe(monkeypatch, probe_bad)
    found = problems(RunSettings(**bad), *bad_facts)
    assert [p.rule for p in found] == [rule], found
    assert found[0].field[0] in ("method", "training") and str(found[0])
    # a fact the row needs that is not known: the row is not checked
    for i, fact in enumerate(bad_facts):
        if fact is not None:
            unknown = [None if j == i else f for j, f in enumerate(bad_facts)]
            assert rule not in {p.rule for p in problems(RunSettings(**bad), *unknown)}


@pytest.mark.parametrize("model, why", [(PHI, "plain MLP"), (MIXTRAL, "experts"), (T5, "encoder-decoder"),
                                        (LLAMA, None)])
def test_the_tiled_mlp_runs_on_a_dense_decoders_gated_mlp_only(model, why):
    found = problems(RunSettings(tiled_mlp=True), model=model)
    assert [why in str(p) for p in found] == ([] if why is None else [True]), found
    assert problems(RunSettings(), model=model) == []  # the model alone breaks nothing


def test_liger_missing_here_decides_only_for_a_run_that_trains_here(monkeypatch, demo_spec):
    """A CUDA card planned from a machine without liger-kernel (a Mac: `fitburst estimate --device cuda:24GiB`, a
    burst's GPU): its machine installs the lean extra, so neither the row, the rung nor the analytic estimate reads
    this install (the model types from LIGER_MODEL_TYPES); the loop's device, the preflight's, validate's and the
    OOM step-down's (this machine's, named or sized) are refused with the missing row, and the trace, which runs
    Liger's own patch, says it cannot run here."""
    from fitburst.hardware import resolve_gpus
    from fitburst.memory import estimate
    from fitburst.memory.ladder import RUNGS
    from fitburst.memory.trace import TraceUnsupported, trace_step
    from fitburst.supervisor import training_device

    _probe(monkeypatch, LIGER_MISSING)
    s = RunSettings(method="qlora", quant="nf4", precision="bf16", seq_len=4096, dropout=0.0)
    on, llama = replace(s, liger_kernels=True), load_shape("meta-llama/llama-3.1-8b")
    target = resolve_device("cuda:24GiB")
    assert problems(on, target, model=LLAMA) == []
    (p,) = problems(on, target, model=PHI)  # phi is no type Liger patches
    assert p.rule == "liger_kernels_model" and "not installed here" in str(p)
    rung = RUNGS["liger_kernels"]
    assert rung.allowed(s, target, shape=llama)
    # measured 45.5 GiB against 52.5 GiB without Liger (no checkpointing: every block's norms and MLP saved)
    assert estimate(llama, on, target).allocated_peak_bytes < 0.9 * estimate(llama, s, target).allocated_peak_bytes
    named = demo_spec.model_copy(update={"preflight": demo_spec.preflight.model_copy(update={"device": "cuda:24GiB"})})
    for here in (device_of_kind("cuda"), resolve_gpus("cuda:24GiB").device, declared_device("cuda:24GiB"),
                 training_device(named, "cuda")):
        assert [p.rule for p in problems(on, here, model=LLAMA)] == ["liger_kernels_missing"]
        assert not rung.allowed(s, here, shape=llama)
        assert estimate(llama, on, here).allocated_peak_bytes == estimate(llama, s, here).allocated_peak_bytes
    with pytest.raises(TraceUnsupported, match="not installed here"):
        trace_step(demo_spec, replace(on, method="lora", quant="none"), seq_len=64, device=target)


def test_messages_name_the_device_and_the_fix():
    (p,) = problems(RunSettings(method="qlora"), MPS)
    assert (p.path, str(p)) == ("method.quant", "nf4 weights need bitsandbytes, which has no MPS backend: use "
                                                "method.type: lora with quant: none on MPS, or a CUDA device")
    (p,) = problems(RunSettings(precision="bf16"), T4)
    assert str(p) == "T4 has no bf16 support: set training.precision: fp16 (or auto, which picks fp16 there)"
    (p,) = problems(RunSettings(packed_fill=1.0), None, VISION_LANGUAGE)
    assert str(p) == VISION_LANGUAGE.packing_refusal


def test_a_change_is_refused_only_for_the_problems_it_brings():
    sharded = RunSettings(distributed="fsdp", cpu_offload=True)
    assert [p.rule for p in new_problems(sharded, replace(sharded, loss="fused"), A6000)] == ["fsdp_fused_loss"]
    user = RunSettings(activation_offloading=True)  # already refused on the CPU: the user's, not the change's
    assert new_problems(user, replace(user, gradient_checkpointing=True), CPU) == []


def test_declared_device_knows_kinds_without_probing():
    assert declared_device("auto") is None and declared_device("cuda:0,1") is None
    assert (declared_device("mps").kind, declared_device("mps").supports_bnb) == ("mps", False)
    assert declared_device("cpu").kind == "cpu" and declared_device("T4").name == "T4"
    assert not declared_device("T4 x2").supports_bf16


def test_validate_the_ladder_the_loop_and_the_cloud_give_one_answer(pipelines_file, demo_spec):
    """FSDP and bitsandbytes' 8-bit optimizers: one row, four askers, one message."""
    from fitburst.builders import refuse_problems
    from fitburst.memory.ladder import RUNGS
    from fitburst.settings import settings_from_spec
    from fitburst.spec import SpecError, load_pipeline
    from fitburst.train import TrainError

    (row,) = problems(RunSettings(optimizer="adamw8bit", world_size=2))
    with pytest.raises(SpecError) as e:  # validate: located, with the fix
        load_pipeline(pipelines_file, "demo", {"training.distributed": "fsdp", "training.optimizer": "adamw8bit"})
    assert f"field 'training.optimizer' (from overrides) (got 'adamw8bit'): {row}" in str(e.value)

    sharded = demo_spec.model_copy(update={"training": demo_spec.training.model_copy(
        update={"distributed": "fsdp", "optimizer": "adamw8bit"})})
    with pytest.raises(TrainError) as t:  # the loop: refused before the model loads
        refuse_problems(sharded, CAUSAL, 2, CUDA)
    assert f"field 'training.optimizer': {row}" in str(t.value)

    rung = RUNGS["optimizer_8bit"]  # the ladder: the rung that would make it is not offered when sharded
    s = settings_from_spec(demo_spec)
    assert rung.allowed(s, A6000) and not rung.allowed(replace(s, world_size=2), A6000)
    assert not rung.allowed(s, MPS)  # and not where bitsandbytes does not run (another row)

    from fitburst.cloud.rank import _plan_on  # the cloud: a GPU where the settings cannot run is refused so

    plan, _, reason = _plan_on("A6000", None, replace(s, optimizer="adamw8bit"), demo_spec, None,
                               [2], 2, None)
    assert plan is None and f"training.optimizer: {row}" in reason


def _pipeline(tmp_path, model: str, training: str):
    (tmp_path / "d.jsonl").write_text("")
    (tmp_path / "p.yaml").write_text(f"pipelines:\n  a:\n    model: {{name: {model}}}\n    data: {{path: d.jsonl}}\n"
                                     f"    training: {{{training}}}\n")
    return tmp_path / "p.yaml"


@pytest.mark.parametrize("training, field, rule", [
    ("tiled_mlp: true", "training.tiled_mlp", "tiled_mlp_model"),
    ("loss: fused", "training.loss", "fused_loss_head_bias")])
def test_validate_and_the_loop_refuse_a_models_architecture_alike(tmp_path, training, field, rule):
    """phi-1.5 (a plain MLP, a biased head): validate reads its bundled config, the loop its config before the model
    loads; both give the table's row, with the field and its fix."""
    from fitburst.builders import refuse_problems
    from fitburst.spec import PipelineSpec, SpecError, load_pipeline
    from fitburst.train import TrainError

    path = _pipeline(tmp_path, "microsoft/phi-1.5", training)
    key, value = training.split(": ")
    (row,) = problems(RunSettings(**{key: value == "true" if value == "true" else value}), model=PHI)
    assert row.rule == rule
    with pytest.raises(SpecError) as e:
        load_pipeline(path, "a")
    assert f"line 5: field '{field}' (got {True if value == 'true' else value!r}): {row}" in str(e.value)
    spec = PipelineSpec.model_validate({"name": "a", "model": {"name": "microsoft/phi-1.5"},
                                        "data": {"path": "d.jsonl"}, "training": {key: value}})
    with pytest.raises(TrainError) as t:
        refuse_problems(spec, CAUSAL, 1, CPU)
    assert f"pipeline 'a': field '{field}': {row}" == str(t.value)
    llama = spec.model_copy(update={"model": spec.model.model_copy(update={"name": "meta-llama/llama-3.1-8b"})})
    refuse_problems(llama, CAUSAL, 1, CPU)  # its neighbour: a gated MLP, a bias-free head


def test_the_ladder_asks_the_models_rows_with_the_shape():
    """The planner and the OOM step-down (both through Rung.allowed) take neither the tiled MLP nor the fused loss
    where the model's architecture refuses them; without the shape the tiled MLP is not taken (the table cannot
    check it) and the fused loss is (no row reads the model then). An A6000 planned from here: its burst node installs
    both libraries, whatever this machine has."""
    from fitburst.memory.ladder import RUNGS

    s = RunSettings(precision="bf16", optimizer="adamw8bit", gradient_checkpointing=True)
    phi, llama = load_shape("microsoft/phi-1.5"), load_shape("meta-llama/llama-3.1-8b")
    tiled, fused = RUNGS["tiled_mlp"], RUNGS["fused_loss"]
    assert tiled.allowed(s, A6000, shape=llama) and not tiled.allowed(s, A6000, shape=phi)
    assert not tiled.allowed(s, A6000)
    assert fused.allowed(s, A6000, shape=llama) and not fused.allowed(s, A6000, shape=phi)
    assert fused.allowed(s, A6000)


@pytest.mark.parametrize("module, rung, rule", [("liger_kernel", "tiled_mlp", "tiled_mlp_missing"),
                                                ("cut_cross_entropy", "fused_loss", "fused_loss_missing")])
def test_a_lean_library_missing_here_decides_only_for_a_run_that_trains_here(monkeypatch, tmp_path_factory, module,
                                                                              rung, rule):
    """The tiled MLP (liger-kernel) and the fused loss (CCE on a bf16 card) with their library missing here (a Mac,
    a preflight-only install): a CUDA card planned from here gets the rung and its saving in the analytic estimate
    (its burst node installs NODE_PACKAGES); this machine's device (the loop's, the preflight's, validate's) is
    refused with the row and the rung is not taken; the trace, which runs liger-kernel's apply_tiled_mlp, says it
    cannot run here (the fused loss's trace runs a stand-in, no library)."""
    from fitburst.hardware import LIBRARIES, NODE_PACKAGES, resolve_gpus
    from fitburst.memory import estimate
    from fitburst.memory.ladder import RUNGS
    from fitburst.memory.trace import TraceUnsupported, trace_step
    from fitburst.spec import PipelineSpec

    assert LIBRARIES[module] in NODE_PACKAGES
    monkeypatch.setitem(sys.modules, module, None)
    # the tiled MLP's saving shows where the loss's logits are not the peak: with the fused loss
    s = RunSettings(method="qlora", quant="nf4", precision="bf16", seq_len=16384, dropout=0.0,
                    gradient_checkpointing=True, loss="fused" if rung == "tiled_mlp" else "auto")
    llama, on = load_shape("meta-llama/llama-3.1-8b"), RUNGS[rung].take(s, PLANNED)
    assert RUNGS[rung].allowed(s, PLANNED, shape=llama) and problems(on, PLANNED, model=LLAMA) == []
    # measured: tiled 18.9 GiB against 22.7 untiled (fused loss on); fused 22.7 GiB against 44.2 (standard loss)
    assert estimate(llama, on, PLANNED).allocated_peak_bytes < 0.9 * estimate(llama, s, PLANNED).allocated_peak_bytes
    for here in (CUDA, resolve_gpus("cuda:24GiB").device, declared_device("cuda:24GiB")):
        assert [p.rule for p in problems(on, here, model=LLAMA)] == [rule]
        assert not RUNGS[rung].allowed(s, here, shape=llama)
    tiny = config_folder(tmp_path_factory, "tiny", dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                                        num_hidden_layers=2, num_attention_heads=4, vocab_size=256))
    spec = PipelineSpec.model_validate(dict(name="t", model=dict(name=str(tiny)), data=dict(path="x.jsonl")))
    small = replace(on, method="lora", quant="none")
    if rung == "tiled_mlp":
        with pytest.raises(TraceUnsupported, match="liger-kernel is not installed here"):
            trace_step(spec, small, seq_len=64, device=PLANNED)
    else:
        assert trace_step(spec, small, seq_len=64, device=PLANNED).live_peaks()[0] > 0


def test_a_bf16_precision_the_probed_gpu_lacks_is_refused_as_validate_refuses_it(pipelines_file, monkeypatch):
    """The same row, asked by validate of the device preflight.device names and at load time of the GPU torch
    probes (a T4: torch says it has bf16, emulated), gives one message."""
    from fitburst.device import DeviceError, resolve_precision
    from fitburst.spec import SpecError, load_pipeline

    (row,) = problems(RunSettings(precision="bf16"), T4)
    with pytest.raises(SpecError) as e:
        load_pipeline(pipelines_file, "demo", {"preflight.device": "T4", "training.precision": "bf16"})
    assert f"field 'training.precision' (from overrides) (got 'bf16'): {row}" in str(e.value)

    T4Props = fake_cuda_card(monkeypatch, "T4", 7, 5)
    with pytest.raises(DeviceError) as d:
        resolve_precision("bf16", "cuda")
    assert str(d.value) == f"field 'training.precision': {row}"
    assert resolve_precision("auto", "cuda") == "fp16" and resolve_precision("fp16", "cuda") == "fp16"
    T4Props.major = 8  # its neighbour: an Ampere card
    assert resolve_precision("bf16", "cuda") == "bf16"


def test_k_bit_weights_where_bitsandbytes_does_not_run_are_refused_as_validate_refuses_them(pipelines_file):
    """The same row, asked by validate of the device preflight.device names and before the load (the Recipe's and
    the probe's refusal) of the device the run found, gives one message."""
    from fitburst.builders import refuse_problems
    from fitburst.spec import SpecError, load_pipeline
    from fitburst.train import TrainError

    (row,) = problems(RunSettings(method="qlora"), MPS)
    with pytest.raises(SpecError) as e:
        load_pipeline(pipelines_file, "demo", {"preflight.device": "mps", "method.type": "qlora"})
    assert f"field 'method.quant' (got 'nf4'): {row}" in str(e.value)
    qlora = load_pipeline(pipelines_file, "demo", {"preflight.device": "auto", "method.type": "qlora"})
    with pytest.raises(TrainError) as t:
        refuse_problems(qlora, CAUSAL, 1, MPS)
    assert str(t.value) == f"pipeline 'demo': field 'method.quant': {row}"
    refuse_problems(qlora, CAUSAL, 1, CPU)  # its neighbours: bitsandbytes on the CPU, no k-bit weights on MPS
    refuse_problems(qlora.with_overrides({"method.type": "lora", "method.quant": "none"}), CAUSAL, 1, MPS)


def test_ranks_on_mps_are_refused_by_the_loop_and_the_process_group_alike(demo_spec):
    from fitburst.builders import refuse_problems
    from fitburst.distributed import DistributedError, World, start
    from fitburst.train import TrainError

    (row,) = problems(RunSettings(world_size=2), MPS)
    with pytest.raises(TrainError, match="field 'training.distributed'") as t:
        refuse_problems(demo_spec, CAUSAL, 2, MPS)
    with pytest.raises(DistributedError) as d:
        start(World(0, 2, 0, 2), "mps")
    assert str(row) in str(t.value) and str(d.value) == f"2 processes were started: field 'training.distributed': {row}"


def test_frozen_16bit_under_fsdp_is_the_rungs_precondition_not_a_conflict(pipelines_file):
    """method.frozen_fp32: false (pipelines.yaml's default) under FSDP is valid and changes nothing (the loader keeps
    peft's preparation: RunSettings.frozen_16bit is false there), so the frozen_16bit rung has nothing to take under
    FSDP; on one device it takes it."""
    from fitburst.memory.ladder import RUNGS
    from fitburst.settings import settings_from_spec
    from fitburst.spec import load_pipeline

    spec = load_pipeline(pipelines_file, "demo", {"method.type": "qlora", "training.distributed": "fsdp"})
    s = settings_from_spec(spec)
    assert not s.frozen_fp32 and not s.frozen_16bit and problems(s, A6000) == []
    rung, peft = RUNGS["frozen_16bit"], replace(s, frozen_fp32=True)
    assert not rung.applies(peft, A6000) and not rung.applies(replace(peft, distributed="auto", world_size=2), A6000)
    one = replace(peft, distributed="auto")  # its neighbour: one device
    assert rung.applies(one, A6000) and rung.take(one, A6000).frozen_16bit


def test_the_analytic_estimate_refuses_what_the_fsdp_int8_row_refuses():
    """It asks the row (its own shorter words: tests/fixtures' golden estimates record them)."""
    from fitburst.memory import estimate

    shape, s = load_shape("meta-llama/llama-3.1-8b"), RunSettings(method="qlora", quant="int8", world_size=2)
    with pytest.raises(ValueError, match="int8 weights cannot be sharded by FSDP"):
        estimate(shape, s, A6000)
    assert estimate(shape, replace(s, quant="nf4"), A6000).allocated_peak_bytes > 0  # its neighbour


def test_flash_attention_is_planned_only_where_flash_attn_is_installed(monkeypatch):
    """FlashAttention-2 needs the flash-attn package where the run trains: a GPU here with it installed gets the
    attention rung's flash and passes the row; a burst node (a planned card) does not install it, so its plan keeps
    SDPA and the row refuses flash there, whatever this machine has."""
    from fitburst.memory.ladder import _fast_attention

    flash_attn = types.ModuleType("flash_attn")
    flash_attn.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)  # installed here
    s = RunSettings(attention="eager", precision="bf16")
    here, planned = replace(A6000, local=True), replace(A6000, local=False)
    assert _fast_attention(s, here) == "flash" and _fast_attention(s, planned) == "sdpa"
    assert problems(replace(s, attention="flash"), here) == []
    for elsewhere in (planned, MPS, CPU):
        assert [p.rule for p in problems(replace(s, attention="flash"), elsewhere)] == ["flash_attention_missing"]
    # the card and the precision: the rung and the row read one rule (an older card, fp32 compute: neither)
    for t, d in ((replace(s, precision="fp16"), replace(T4, local=True)), (replace(s, precision="fp32"), here)):
        assert _fast_attention(t, d) == "sdpa"
        assert [p.rule for p in problems(replace(t, attention="flash"), d)] == ["flash_attention_missing"]


def test_the_loop_asks_the_fused_loss_row_of_the_gpu_it_probed(pipelines_file, monkeypatch):
    """Before the load the Recipe asks the table of the GPU torch probes: on a T4 (no native bf16) the fused loss is
    Liger's, so a T4 with liger-kernel and without cut-cross-entropy trains it; a generic CUDA device (bf16 assumed)
    would have asked for CCE and refused the run."""
    from fitburst.builders import refuse_problems
    from fitburst.device import probed_device
    from fitburst.spec import load_pipeline
    from fitburst.train import TrainError

    fake_cuda_card(monkeypatch, "T4", 7, 5)
    import torch

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)
    _liger_importable(monkeypatch)
    spec = load_pipeline(pipelines_file, "demo", {"preflight.device": "auto", "training.loss": "fused",
                                                  "training.precision": "fp16"})
    t4 = probed_device("cuda")
    assert not t4.supports_bf16 and t4.local
    refuse_problems(spec, CAUSAL, 1, t4)  # Liger's kernel, installed here
    with pytest.raises(TrainError, match="fused_loss|cut-cross-entropy"):
        refuse_problems(spec, CAUSAL, 1, CUDA)  # the old question: an Ampere-like card, CCE's kernel


def test_the_planner_leaves_out_rungs_that_break_a_row_together(monkeypatch):
    """fp32 -> bf16 and the fused loss each pass the table on an Ampere card with Liger Kernel and without
    cut-cross-entropy (in fp32 the fused loss is Liger's); together they make it CCE's, which is not installed: the
    planner never offers that combination, so no plan is refused before the load."""
    from fitburst.memory.ladder import LADDER
    from fitburst.memory.planner import _combinations

    monkeypatch.setitem(sys.modules, "cut_cross_entropy", None)
    _liger_importable(monkeypatch)
    here = replace(A6000, local=True)
    s = RunSettings(precision="fp32", loss="auto")
    allowed = {r.key: True for r in LADDER}
    combos = list(_combinations(s, here, allowed, load_shape("meta-llama/llama-3.1-8b")))
    keys = [c.keys for c in combos]
    assert any("fused_loss" in k for k in keys) and any("precision" in k for k in keys)
    assert not any({"fused_loss", "precision"} <= k for k in keys)
    assert all(problems(c.settings, here) == [] for c in combos)


def _liger_importable(monkeypatch) -> None:
    """liger-kernel importable here, as on Linux CI (a Mac dev install has none: a module spec stands in)."""
    if importlib.util.find_spec("liger_kernel") is None:
        liger = types.ModuleType("liger_kernel")
        liger.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
        monkeypatch.setitem(sys.modules, "liger_kernel", liger)
