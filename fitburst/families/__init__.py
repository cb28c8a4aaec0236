"""Model families behind one interface (:class:`Family`): causal LMs (mixture-of-experts included), encoder-decoder
models and vision-language models, one module each. Data prep, training, eval and publish ask the family object
of a model (:func:`family_for`) for what differs between them; a new family is one module here plus its tests.

Layer 2: the families import spec, settings and errors, never data, models or train (those import them)."""

from __future__ import annotations

from fitburst.families.base import IGNORE_INDEX, Family, pad_collate
from fitburst.families.causal import CAUSAL
from fitburst.families.seq2seq import SEQ2SEQ
from fitburst.families.vision_language import VISION_LANGUAGE, is_vision_language

__all__ = ["CAUSAL", "FAMILIES", "IGNORE_INDEX", "SEQ2SEQ", "VISION_LANGUAGE", "Family", "collate", "family_for",
           "family_named", "pad_collate"]

FAMILIES: dict[str, Family] = {f.name: f for f in (CAUSAL, SEQ2SEQ, VISION_LANGUAGE)}


def family_for(config) -> Family:
    """The family of a transformers config (or anything with its ``model_type`` and ``is_encoder_decoder``): the
    one dispatch. Vision-language by model type, encoder-decoder by the config's flag, causal otherwise."""
    if is_vision_language(config):
        return VISION_LANGUAGE
    return SEQ2SEQ if getattr(config, "is_encoder_decoder", False) else CAUSAL


def family_named(name: str) -> Family:
    """The family called ``name`` (:attr:`Family.name`)."""
    return FAMILIES[name]


def collate(batch: list[dict], pad_id: int, packed: bool = False) -> dict:
    """Prepared samples collated by their family's collate, told from the samples themselves (image marks: a
    vision-language sample; text samples of either text family pad alike), for callers that hold samples but no
    model."""
    family = VISION_LANGUAGE if "mm_token_type_ids" in batch[0] else CAUSAL
    return family.collate(batch, pad_id, packed)
