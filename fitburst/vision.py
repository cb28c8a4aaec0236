"""Vision-language models (Qwen2-VL style): the tiny local model and its shipped image set, the image processor,
image tokens per image, the batches that carry pixels, and which layers train.

The image side is transformers' own Qwen2-VL image processor (its PIL backend: the processor class and
``AutoProcessor`` need torchvision, which this stack does not carry). The processor's one text rule is applied here
as it applies it: each ``<|image_pad|>`` becomes ``grid_t * grid_h * grid_w / merge_size**2`` copies of itself.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

VL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # model types whose image side is Qwen2-VL's processor
VL_DATA = Path(__file__).parent / "demo" / "vl" / "shapes.jsonl"
VL_VERSION = 2
IMAGE_TOKEN = "<|image_pad|>"
VL_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                     IMAGE_TOKEN, "<|video_pad|>"]
# Qwen2-VL's chat template, image and text parts of a message (video and tool calls left out)
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_TEXT_ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
VL_VISION_ARCH = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2)
DEMO_IMAGE_SIDE = 112  # 8 x 8 patches of 14 -> 16 image tokens at full resolution
DEMO_MIN_PIXELS = 28 * 28

Vision = Literal["frozen", "projector", "tower"]

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20)}
QUESTIONS = ("What is in the picture?", "Describe the image.", "What do you see?", "What shape is this?")


# --- the shipped image set -------------------------------------------------------------------------------

def write_shapes_demo(dest: Path, per_pair: int = 4, seed: int = 0) -> Path:
    """Generate the demo set reproducibly: one coloured shape per PNG (size and place drawn from ``seed``) and an
    image + conversation record for each, in ``dest/shapes.jsonl`` with images under ``dest/images/``."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    (dest / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for shape in SHAPES:
        for colour, rgb in COLOURS.items():
            for k in range(per_pair):
                side = DEMO_IMAGE_SIDE
                r = rng.randint(18, 34)
                cx, cy = rng.randint(r + 4, side - r - 4), rng.randint(r + 4, side - r - 4)
                img = Image.new("RGB", (side, side), (245, 245, 240))
                draw = ImageDraw.Draw(img)
                box = [cx - r, cy - r, cx + r, cy + r]
                if shape == "circle":
                    draw.ellipse(box, fill=rgb)
                elif shape == "square":
                    draw.rectangle(box, fill=rgb)
                else:
                    draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=rgb)
                name = f"images/{shape}-{colour}-{k}.png"
                img.save(dest / name, optimize=True)
                question = QUESTIONS[rng.randrange(len(QUESTIONS))]
                lines.append(json.dumps({"messages": [
                    {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": question}]},
                    {"role": "assistant", "content": f"A {colour} {shape}."}]}))
    rng.shuffle(lines)
    out = dest / "shapes.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out


# --- the tiny model --------------------------------------------------------------------------------------

def tiny_vl_dir() -> Path:
    """The tiny Qwen2-VL's folder, built on first use."""
    from fitburst.models import build_once, cache_root

    return build_once(cache_root() / "models" / f"tiny-vl-v{VL_VERSION}", build_tiny_vl)


def build_tiny_vl(dest: Path, vocab_size: int = 400) -> None:
    """Save a Qwen2-VL (2 text layers of width 64, a 2-block vision tower on 14-pixel patches) pretrained for a few
    seconds on the demo set's sentences alone, a byte-level BPE tokenizer trained on them with Qwen's pre-tokenizer,
    special tokens and the Qwen2-VL chat template, and the Qwen2-VL image processor: a model folder
    ``from_pretrained`` reads."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from fitburst.models import _pretrain

    texts = ["user assistant system"]
    for line in VL_DATA.read_text().splitlines():
        for m in json.loads(line)["messages"]:
            c = m["content"]
            texts += [c] if isinstance(c, str) else [p["text"] for p in c if p.get("type") == "text"]
    bpe = Tokenizer(models.BPE())  # as transformers' Qwen2Tokenizer sets it up, so ids survive a reload
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=VL_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = VL_CHAT_TEMPLATE
    tok.save_pretrained(dest)
    Qwen2VLImageProcessorPil(min_pixels=DEMO_MIN_PIXELS, max_pixels=DEMO_IMAGE_SIDE ** 2,
                             patch_size=VL_VISION_ARCH["patch_size"],
                             merge_size=VL_VISION_ARCH["spatial_merge_size"]).save_pretrained(dest)

    ids = {t: tok.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS}
    head_dim = VL_TEXT_ARCH["hidden_size"] // VL_TEXT_ARCH["num_attention_heads"]
    section = [head_dim // 8, 3 * head_dim // 16, head_dim // 2 - head_dim // 8 - 3 * head_dim // 16]  # t, h, w
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tok), max_position_embeddings=2048, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0},
                         **VL_TEXT_ARCH),
        vision_config=dict(hidden_size=VL_TEXT_ARCH["hidden_size"], **VL_VISION_ARCH),
        image_token_id=ids[IMAGE_TOKEN], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    _pretrain(model, tok, texts)  # the words, with no images and no chat format: what LoRA then teaches
    model.save_pretrained(dest)


# --- the family ------------------------------------------------------------------------------------------

def is_vision_language(config) -> bool:
    """A transformers config of a Qwen2-VL-style model (the family this module handles)."""
    return getattr(config, "model_type", None) in VL_TYPES


def load_image_processor(ref: str, revision: str | None = None, token: str | None = None):
    """The model's Qwen2-VL image processor (preprocessor_config.json), PIL backend."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(ref, revision=revision, token=token)


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
    import torch

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
    import torch

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
