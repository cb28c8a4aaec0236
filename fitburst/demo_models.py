"""The models fitburst builds locally and reproducibly on first use (the tiny demo Llama, MoE, T5 and Qwen2-VL),
and the shipped demo image set. Each is saved as an ordinary Hugging Face model folder in the cache and then loaded
through the same ``from_pretrained`` path a hub model takes (:func:`fitburst.models.resolve_model_ref`).

torch, transformers, tokenizers and PIL are imported inside the builders: importing this module stays light, and a
build runs once per cache.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from fitburst.cache import build_once, cache_root
from fitburst.families.vision_language import IMAGE_TOKEN
from fitburst.spec import CHATML_TEMPLATE

if TYPE_CHECKING:  # heavy: builders import transformers when they run
    from transformers import PreTrainedTokenizerBase

DEMO_MODEL = "fitburst/tiny-demo"
MOE_MODEL = "fitburst/tiny-moe"  # the demo's tokenizer and data on a tiny Mixtral (4 experts, 2 per token)
T5_MODEL = "fitburst/tiny-t5"  # encoder-decoder: a tiny T5 (gated-gelu, as FLAN-T5) with a byte-level BPE vocabulary
VL_MODEL = "fitburst/tiny-vl"  # a tiny Qwen2-VL with a small vision tower
# name -> architecture of the models built locally
LOCAL_MODELS = {DEMO_MODEL: "llama", MOE_MODEL: "mixtral", T5_MODEL: "t5", VL_MODEL: "qwen2_vl"}
DEMO_DATA = Path(__file__).parent / "demo" / "instructions.jsonl"
DEMO_VERSION = 1

SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]

# Architecture of the demo model; demo_model_dir(hidden_size=...) widens it for benchmarks that need a heavier step.
DEMO_ARCH = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024)

VL_DATA = Path(__file__).parent / "demo" / "vl" / "shapes.jsonl"
VL_VERSION = 2
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
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20)}
QUESTIONS = ("What is in the picture?", "Describe the image.", "What do you see?", "What shape is this?")


# --- causal and encoder-decoder demo models ------------------------------------------------------------------

def demo_model_dir(hidden_size: int | None = None, num_hidden_layers: int | None = None,
                   family: str = "llama") -> Path:
    """Path of the demo model folder (``family``: llama, or mixtral for the tiny MoE), building it on first use
    (atomic, so concurrent callers are safe)."""
    arch = dict(DEMO_ARCH)
    if hidden_size:
        arch.update(hidden_size=hidden_size, intermediate_size=3 * hidden_size,
                    num_attention_heads=max(4, hidden_size // 64), num_key_value_heads=max(2, hidden_size // 128))
    if num_hidden_layers:
        arch["num_hidden_layers"] = num_hidden_layers
    # scaled variants are for speed/memory benchmarks, and the tiny MoE is there to show the expert path trains
    # (its expert loop makes pretraining slow on a CPU): random weights will do
    pretrain = arch == DEMO_ARCH and family == "llama"
    tag = f"h{arch['hidden_size']}-l{arch['num_hidden_layers']}-v{DEMO_VERSION}"
    dest = cache_root() / "models" / (f"tiny-demo-{tag}" if family == "llama" else f"tiny-{family}-{tag}")
    if family == "t5":
        return build_once(dest, build_tiny_t5)
    return build_once(dest, lambda tmp: build_demo_model(tmp, pretrain=pretrain, family=family, **arch))


def build_demo_model(dest: Path, vocab_size: int, pretrain: bool = True, family: str = "llama", **arch: int) -> None:
    """Train a byte-level BPE tokenizer on the demo data and save a randomly initialised Llama-type model (or, for
    ``family`` mixtral, a Mixtral with 4 experts of which 2 run per token)."""
    import torch  # heavy: builders only
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    texts = demo_texts()
    tok = demo_tokenizer(vocab_size, texts)
    tok.save_pretrained(dest)

    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, **arch)
    model: MixtralForCausalLM | LlamaForCausalLM
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    if pretrain:
        _pretrain(model, tok, [t for t in texts if t])
    model.save_pretrained(dest)


def demo_tokenizer(vocab_size: int, texts: list[str] | None = None):
    """The demo's chat tokenizer: byte-level BPE of ``vocab_size`` trained on the demo data (``texts``), ChatML."""
    from transformers import PreTrainedTokenizerFast  # heavy: builders only

    tok = PreTrainedTokenizerFast(tokenizer_object=demo_bpe(texts or demo_texts(), vocab_size, SPECIAL_TOKENS),
                                  eos_token="<|im_end|>", pad_token="<|pad|>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


def demo_texts() -> list[str]:
    """The demo data's sentences, the corpus the demo tokenizers are trained on."""
    texts = []
    for line in DEMO_DATA.read_text().splitlines():
        rec = json.loads(line)
        texts += [rec["instruction"], rec.get("input", ""), rec["output"], "user assistant system"]
    return texts


def demo_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE tokenizer (``tokenizers``) trained on ``texts``; ``special_tokens`` get the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # heavy: builders only

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    return bpe


T5_SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]  # T5's ids: pad 0 (also the decoder start), eos 1, unk 2


def build_tiny_t5(dest: Path, vocab_size: int = 1024) -> None:
    """Train a byte-level BPE tokenizer on the demo data (T5's pad/eos/unk, eos appended to every encoded text as
    T5's tokenizer does) and save a randomly initialised T5ForConditionalGeneration beside it."""
    import torch  # heavy: builders only
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

    bpe = demo_bpe(demo_texts(), vocab_size, T5_SPECIAL_TOKENS)
    eos = T5_SPECIAL_TOKENS[1]
    bpe.post_processor = processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                                                       special_tokens=[(eos, bpe.token_to_id(eos))])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token=eos, unk_token="<unk>")
    tok.save_pretrained(dest)
    torch.manual_seed(0)
    # FLAN-T5's layout (gated-gelu feed-forward, untied head, relative attention bias) at demo size.
    # transformers' T5Config signature names only T5's own fields; the config still takes the generic
    # tie_word_embeddings and decoder_start_token_id at construction (set later they derive differently).
    config = T5Config(  # type: ignore[call-arg]
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id, d_model=128, d_kv=32, d_ff=256, num_layers=2,
        num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0)
    model = T5ForConditionalGeneration(config)
    _pretrain(model, tok, [t for t in demo_texts() if t], steps=150, batch=16, add_eos=False)
    model.save_pretrained(dest)


def _pretrain(model, tok, texts: list[str], steps: int = 300, batch: int = 32, add_eos: bool = True) -> None:
    """A few seconds of plain training on the demo sentences, with no chat or instruction format, so the base model
    knows the words but not the task the pipeline then teaches it: next-token prediction for a causal LM; for T5
    (``add_eos`` false: its tokenizer appends eos) copying, encoder input = decoder target."""
    import torch  # heavy: builders only

    ids = [tok(t).input_ids[:48] + ([tok.eos_token_id] if add_eos else []) for t in texts]
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(ids), (batch,), generator=g).tolist()
        n = max(len(ids[i]) for i in pick)
        x = torch.full((batch, n), tok.pad_token_id)
        for row, i in enumerate(pick):
            x[row, : len(ids[i])] = torch.tensor(ids[i])
        mask = (x != tok.pad_token_id).long()
        model(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


# --- the vision-language demo -------------------------------------------------------------------------------

def tiny_vl_dir() -> Path:
    """The tiny Qwen2-VL's folder, built on first use."""
    return build_once(cache_root() / "models" / f"tiny-vl-v{VL_VERSION}", build_tiny_vl)


def _token_id(tok: PreTrainedTokenizerBase, token: str) -> int:
    """The id of one token (transformers types the lookup for a list of tokens too)."""
    i = tok.convert_tokens_to_ids(token)
    assert isinstance(i, int), token
    return i


def build_tiny_vl(dest: Path, vocab_size: int = 400) -> None:
    """Save a Qwen2-VL (2 text layers of width 64, a 2-block vision tower on 14-pixel patches) pretrained for a few
    seconds on the demo set's sentences alone, a byte-level BPE tokenizer trained on them with Qwen's pre-tokenizer,
    special tokens and the Qwen2-VL chat template, and the Qwen2-VL image processor: a model folder
    ``from_pretrained`` reads."""
    import torch  # heavy: builders only
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

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

    ids = {t: _token_id(tok, t) for t in VL_SPECIAL_TOKENS}
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


def write_shapes_demo(dest: Path, per_pair: int = 4, seed: int = 0) -> Path:
    """Generate the demo set reproducibly: one coloured shape per PNG (size and place drawn from ``seed``) and an
    image + conversation record for each, in ``dest/shapes.jsonl`` with images under ``dest/images/``."""
    from PIL import Image, ImageDraw  # heavy: builders only

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
