"""Vision-language models (Qwen2-VL style): the image processor, image tokens per image, the batches that carry
pixels, and which layers train (the tiny local model and its shipped image set: :mod:`fitburst.demo_models`).

The image side is transformers' own Qwen2-VL image processor (its PIL backend: the processor class and
``AutoProcessor`` need torchvision, which this stack does not carry). The processor's one text rule is applied here
as it applies it: each ``<|image_pad|>`` becomes ``grid_t * grid_h * grid_w / merge_size**2`` copies of itself.
"""

from __future__ import annotations

from typing import Literal

VL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # model types whose image side is Qwen2-VL's processor
IMAGE_TOKEN = "<|image_pad|>"
Vision = Literal["frozen", "projector", "tower"]


# --- the family ------------------------------------------------------------------------------------------

def is_vision_language(config) -> bool:
    """A transformers config of a Qwen2-VL-style model (the family this module handles)."""
    return getattr(config, "model_type", None) in VL_TYPES


def load_image_processor(ref: str, revision: str | None = None, token: str | None = None):
    """The model's Qwen2-VL image processor (preprocessor_config.json), PIL backend."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # transformers: heavy
        Qwen2VLImageProcessorPil,
    )

    # the hub's default branch when no revision is pinned (what None means to the hub client)
    return Qwen2VLImageProcessorPil.from_pretrained(ref, revision=revision or "main", token=token)


def image_inputs(processor, images: list, max_pixels: int | None) -> dict:
    """pixel_values (patches x channels*temporal*patch**2) and image_grid_thw (images x 3) of ``images``, resized so
    no image has more than ``max_pixels`` pixels (the processor's own limit when None)."""
    size = None
    if max_pixels is not None:
        lo = processor.size.shortest_edge or 0
        size = {"shortest_edge": min(lo, max_pixels), "longest_edge": max_pixels}
    return dict(processor(images=images, return_tensors="np", size=size))


def image_token_counts(processor, grid_thw) -> list[int]:
    """Image tokens each image takes in the language sequence (the merger joins merge_size**2 patches)."""
    return [int(g[0] * g[1] * g[2]) // processor.merge_size ** 2 for g in grid_thw]


def expand_image_tokens(text: str, counts: list[int]) -> tuple[str, int]:
    """``text`` with its k-th ``<|image_pad|>`` repeated counts[k] times (Qwen2VLProcessor's rule); returns the text
    and how many images it used."""
    parts = text.split(IMAGE_TOKEN)
    if len(parts) - 1 > len(counts):
        raise ValueError(f"the conversation has {len(parts) - 1} image placeholders but {len(counts)} image(s)")
    out = parts[0]
    for k, rest in enumerate(parts[1:]):
        out += IMAGE_TOKEN * counts[k] + rest
    return out, len(parts) - 1


def collate_images(batch: list[dict], n: int) -> dict:
    """The image side of a collated batch: every sample's patches in one tensor, their grids, and the
    image-token marks (padded to the batch's ``n`` tokens) the model's 3-D rotary positions are built from."""
    import torch  # torch: heavy, only when batches are built

    out: dict = {}
    marks = torch.zeros((len(batch), n), dtype=torch.long)
    for i, b in enumerate(batch):
        marks[i, : len(b["mm_token_type_ids"])] = torch.tensor(b["mm_token_type_ids"])
    out["mm_token_type_ids"] = marks
    with_images = [b for b in batch if b["image_grid_thw"]]
    if with_images:
        out["pixel_values"] = torch.cat([torch.tensor(b["pixel_values"], dtype=torch.float32) for b in with_images])
        out["image_grid_thw"] = torch.cat([torch.tensor(b["image_grid_thw"], dtype=torch.long) for b in with_images])
    return out


# --- what trains -----------------------------------------------------------------------------------------

def lora_target_names(model, targets: list[str] | str, vision: Vision) -> list[str]:
    """Full names of the linear layers LoRA wraps in a vision-language model: the language model's ``targets``
    (every linear layer for ``all-linear``), plus the projector (the merger) with ``vision: projector`` or the
    whole vision tower with ``vision: tower``; the output head never (as peft's all-linear)."""
    import torch  # torch: heavy, only on a loaded model

    head = model.get_output_embeddings()
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or mod is head:
            continue
        if ".visual." in f".{name}.":
            if vision == "tower" or (vision == "projector" and ".merger." in f".{name}."):
                out.append(name)
        elif targets == "all-linear" or name.rsplit(".", 1)[-1] in targets:
            out.append(name)
    return out


def freeze_vision(model, vision: Vision) -> None:
    """Full fine-tuning: the vision tower stays frozen (``frozen``), only its projector trains (``projector``), or
    all of it trains (``tower``)."""
    for name, p in model.named_parameters():
        if ".visual." in f".{name}.":
            p.requires_grad_(vision == "tower" or (vision == "projector" and ".merger." in f".{name}."))
