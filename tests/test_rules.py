"""The rule table (fitburst.rules): each row refuses what it must and accepts its nearest neighbour; validate, the
ladder, the loop and the cloud ranking give the same answer for the same row."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fitburst.families import CAUSAL, SEQ2SEQ, VISION_LANGUAGE
from fitburst.hardware import resolve_device
from fitburst.rules import RULE_KEYS, declared_device, device_of_kind, new_problems, problems
from fitburst.settings import RunSettings

T4, A6000 = resolve_device("T4"), resolve_device("A6000")
MPS, CPU, CUDA = device_of_kind("mps"), device_of_kind("cpu"), device_of_kind("cuda")

# rule: (settings it refuses, device, family), (the neighbour it accepts, device, family)
CASES = {
    "full_quantized": ((dict(method="full", quant="nf4"), None, None), (dict(method="full"), None, None)),
    "bf16_unsupported": ((dict(precision="bf16"), T4, None), (dict(precision="bf16"), A6000, None)),
    "kbit_needs_bnb": ((dict(method="qlora"), MPS, None), (dict(method="qlora"), CUDA, None)),
    "optimizer_8bit_needs_bnb": ((dict(optimizer="adamw8bit"), MPS, None), (dict(optimizer="adamw"), MPS, None)),
    "fsdp_on_mps": ((dict(distributed="fsdp"), MPS, None), (dict(distributed="fsdp"), CUDA, None)),
    "processes_without_fsdp": ((dict(world_size=2, distributed="none"), None, None),
                               (dict(world_size=2, distributed="auto"), None, None)),
    "fsdp_int8": ((dict(method="qlora", quant="int8", world_size=2), None, None),
                  (dict(method="qlora", quant="nf4", world_size=2), None, None)),
    "fsdp_optimizer_8bit": ((dict(optimizer="paged_adamw8bit", distributed="fsdp"), None, None),
                            (dict(optimizer="paged_adamw8bit"), None, None)),
    "fsdp_fused_loss": ((dict(loss="fused", world_size=4), None, None), (dict(loss="fused"), None, None)),
    "cpu_offload_without_fsdp": ((dict(cpu_offload=True, distributed="none"), None, None),
                                 (dict(cpu_offload=True, distributed="auto"), None, None)),
    "activation_offloading_off_cuda": ((dict(activation_offloading=True), CPU, None),
                                       (dict(activation_offloading=True), CUDA, None)),
    "embeddings_on_host_mps": ((dict(embeddings_on_host=True), MPS, None),
                               (dict(embeddings_on_host=True), CPU, None)),
    "embeddings_on_host_trained": ((dict(method="full", embeddings_on_host=True), None, None),
                                   (dict(method="lora", embeddings_on_host=True), None, None)),
    "fsdp_embeddings_on_host": ((dict(embeddings_on_host=True, distributed="fsdp"), None, None),
                                (dict(embeddings_on_host=True, distributed="none"), None, None)),
    "packing_images": ((dict(packed_fill=1.0, images=1, image_tokens=64), None, None),
                       (dict(packed_fill=1.0), None, None)),
    "family_packing": ((dict(packed_fill=1.0), None, SEQ2SEQ), (dict(packed_fill=1.0), None, CAUSAL)),
    "family_fused_loss": ((dict(loss="fused"), None, SEQ2SEQ), (dict(loss="fused"), None, CAUSAL)),
}


def test_every_row_has_a_case():
    assert set(CASES) == RULE_KEYS


@pytest.mark.parametrize("rule", sorted(CASES))
def test_each_row_refuses_what_it_must_and_accepts_its_neighbour(rule):
    (bad, bad_dev, bad_fam), (good, good_dev, good_fam) = CASES[rule]
    found = problems(RunSettings(**bad), bad_dev, bad_fam)
    assert [p.rule for p in found] == [rule], found
    assert found[0].field[0] in ("method", "training") and str(found[0])
    assert problems(RunSettings(**good), good_dev, good_fam) == []
    # a fact the row needs that is not known: the row is not checked
    if bad_dev is not None:
        assert rule not in {p.rule for p in problems(RunSettings(**bad), None, bad_fam)}
    if bad_fam is not None:
        assert problems(RunSettings(**bad), bad_dev, None) == []


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
        refuse_problems(sharded, CAUSAL, 2, "cuda")
    assert f"field 'training.optimizer': {row}" in str(t.value)

    rung = RUNGS["optimizer_8bit"]  # the ladder: the rung that would make it is not offered when sharded
    s = settings_from_spec(demo_spec)
    assert rung.allowed(s, A6000) and not rung.allowed(replace(s, world_size=2), A6000)
    assert not rung.allowed(s, MPS)  # and not where bitsandbytes does not run (another row)

    from fitburst.cloud.rank import _plan_on  # the cloud: a GPU where the settings cannot run is refused so

    plan, _, reason = _plan_on("A6000", None, replace(s, optimizer="adamw8bit"), demo_spec, None,
                               [2], 2, None)
    assert plan is None and f"training.optimizer: {row}" in reason
