"""The one family dispatch and the interface every family provides (a new family: one module plus a test here)."""

from __future__ import annotations

import inspect

import pytest

from fitburst.families import CAUSAL, FAMILIES, SEQ2SEQ, VISION_LANGUAGE, Family, family_for, family_named


def _members() -> set[str]:
    own = {n for n, v in vars(Family).items() if inspect.isfunction(v) and not n.startswith("_")}
    return own | set(Family.__annotations__)


@pytest.mark.parametrize(("model_type", "family"), [("llama", CAUSAL), ("mixtral", CAUSAL), ("t5", SEQ2SEQ),
                                                    ("qwen2_vl", VISION_LANGUAGE)])
def test_family_for_a_config(model_type, family):
    from transformers import AutoConfig

    assert family_for(AutoConfig.for_model(model_type)) is family
    assert family_named(family.name) is family


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=list(FAMILIES))
def test_each_family_provides_every_member(family):
    members = _members()
    assert {"name", "tokenize", "collate", "label_tokens", "eval_loss", "generate_samples"} <= members
    for name in members:
        assert hasattr(family, name), f"{family.name} lacks {name}"
        if callable(getattr(Family, name, None)):
            assert callable(getattr(family, name)), f"{family.name}.{name} is not callable"
    assert family.auto_class().__name__.startswith("AutoModelFor")
    assert (family.packing_refusal is None) == (family is CAUSAL)


def test_the_trainer_refuses_packing_where_the_family_does(demo_spec):
    from fitburst.train import TrainError, refuse_problems

    packed = demo_spec.model_copy(update={"training": demo_spec.training.model_copy(update={"packing": True})})
    refuse_problems(packed, CAUSAL)
    refuse_problems(demo_spec, SEQ2SEQ)
    with pytest.raises(TrainError, match=r"pipeline 'demo': field 'training.packing': packed batches are for "
                                         "decoder-only models"):
        refuse_problems(packed, SEQ2SEQ)
    with pytest.raises(TrainError, match=r"packed batches carry no images"):
        refuse_problems(packed, VISION_LANGUAGE)


def test_samples_are_collated_by_their_family():
    """Text samples pad alike in either text family; image samples carry their marks (and pixels when they have
    images) through the vision-language family's collate."""
    from fitburst.families import collate

    text = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [5], "labels": [5]}]
    b = collate(text, 0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]] and b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert CAUSAL.label_tokens(b).item() == 2 and SEQ2SEQ.label_tokens(b).item() == 3
    marked = [dict(t, mm_token_type_ids=[0] * len(t["input_ids"]), pixel_values=[], image_grid_thw=[]) for t in text]
    assert collate(marked, 0)["mm_token_type_ids"].shape == (2, 3)
