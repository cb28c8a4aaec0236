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
