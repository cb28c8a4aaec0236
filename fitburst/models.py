"""Model and tokenizer loading (the one place that calls ``from_pretrained``), and the tiny demo model builder.

The demo model is built locally and reproducibly on first use, saved as an ordinary Hugging Face model folder,
and then loaded through the same ``from_pretrained`` path a hub model takes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from fitburst.memory.devices import Device
    from fitburst.spec import PipelineSpec

DEMO_MODEL = "fitburst/tiny-demo"
MOE_MODEL = "fitburst/tiny-moe"  # the demo's tokenizer and data on a tiny Mixtral (4 experts, 2 per token)
T5_MODEL = "fitburst/tiny-t5"  # encoder-decoder: a tiny T5 (gated-gelu, as FLAN-T5) with a byte-level BPE vocabulary
VL_MODEL = "fitburst/tiny-vl"  # a tiny Qwen2-VL with a small vision tower (fitburst.vision)
# name -> architecture of the models built locally
LOCAL_MODELS = {DEMO_MODEL: "llama", MOE_MODEL: "mixtral", T5_MODEL: "t5", VL_MODEL: "qwen2_vl"}
DEMO_DATA = Path(__file__).parent / "demo" / "instructions.jsonl"
DEMO_VERSION = 1

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]

# Architecture of the demo model; `scale` multiplies width for benchmarks that need a heavier step.
DEMO_ARCH = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024)


def cache_root() -> Path:
    return Path(os.environ.get("FITBURST_CACHE", Path.home() / ".cache" / "fitburst"))


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


def build_once(dest: Path, build: Callable[[Path], None]) -> Path:
    """``dest``, built by ``build`` into a temporary folder beside it on first use and renamed into place (atomic,
    so concurrent callers are safe: the first rename wins)."""
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".build-"))
    try:
        build(tmp)
        try:
            tmp.rename(dest)
        except OSError:  # someone else finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build_demo_model(dest: Path, vocab_size: int, pretrain: bool = True, family: str = "llama", **arch: int) -> None:
    """Train a byte-level BPE tokenizer on the demo data and save a randomly initialised Llama-type model (or, for
    ``family`` mixtral, a Mixtral with 4 experts of which 2 run per token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

    texts = demo_texts()
    tok = PreTrainedTokenizerFast(tokenizer_object=demo_bpe(texts, vocab_size, SPECIAL_TOKENS),
                                  eos_token="<|im_end|>", pad_token="<|pad|>")
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(dest)

    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, **arch)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    if pretrain:
        _pretrain(model, tok, [t for t in texts if t])
    model.save_pretrained(dest)


def demo_texts() -> list[str]:
    """The demo data's sentences, the corpus the demo tokenizers are trained on."""
    texts = []
    for line in DEMO_DATA.read_text().splitlines():
        rec = json.loads(line)
        texts += [rec["instruction"], rec.get("input", ""), rec["output"], "user assistant system"]
    return texts


def demo_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]):
    """A byte-level BPE tokenizer (``tokenizers``) trained on ``texts``; ``special_tokens`` get the first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    return bpe


# The tiny T5: FLAN-T5's layout (gated-gelu feed-forward, untied head, relative attention bias) at demo size.
T5_ARCH = dict(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4,
               feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=32,
               relative_attention_max_distance=128, dropout_rate=0.0)
T5_SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]  # T5's ids: pad 0 (also the decoder start), eos 1, unk 2


def build_tiny_t5(dest: Path, vocab_size: int = 1024) -> None:
    """Train a byte-level BPE tokenizer on the demo data (T5's pad/eos/unk, eos appended to every encoded text as
    T5's tokenizer does) and save a randomly initialised T5ForConditionalGeneration beside it."""
    import torch
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

    bpe = demo_bpe(demo_texts(), vocab_size, T5_SPECIAL_TOKENS)
    eos = T5_SPECIAL_TOKENS[1]
    bpe.post_processor = processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                                                       special_tokens=[(eos, bpe.token_to_id(eos))])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token=eos, unk_token="<unk>")
    tok.save_pretrained(dest)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id, **T5_ARCH))
    _pretrain(model, tok, [t for t in demo_texts() if t], steps=150, batch=16, add_eos=False)
    model.save_pretrained(dest)


def _pretrain(model, tok, texts: list[str], steps: int = 300, batch: int = 32, add_eos: bool = True) -> None:
    """A few seconds of plain training on the demo sentences, with no chat or instruction format, so the base model
    knows the words but not the task the pipeline then teaches it: next-token prediction for a causal LM; for T5
    (``add_eos`` false: its tokenizer appends eos) copying, encoder input = decoder target."""
    import torch

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


def resolve_model_ref(name: str) -> str:
    """A path or hub id that ``from_pretrained`` accepts; builds the demo model when asked for it."""
    from fitburst.vision import tiny_vl_dir

    if name == VL_MODEL:
        return str(tiny_vl_dir())
    if name in LOCAL_MODELS:
        return str(demo_model_dir(family=LOCAL_MODELS[name]))
    return name


def load_tokenizer(name: str, revision: str | None = None, token: str | None = None,
                   trust_remote_code: bool = False):
    """Load the tokenizer; give it a pad token and a ChatML template when it has none."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_ref(name), revision=revision, token=token,
                                        trust_remote_code=trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


Family = Literal["causal", "seq2seq", "vision_language"]


def config_family(config) -> Family:
    """The family of a transformers config: data prep, training, eval and the trace part on it (one switch)."""
    from fitburst.vision import is_vision_language

    if is_vision_language(config):
        return "vision_language"
    return "seq2seq" if config.is_encoder_decoder else "causal"


def auto_model_class(config):
    """The transformers Auto class that loads (or, for the trace, builds) a model of this config's family."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    return {"causal": AutoModelForCausalLM, "seq2seq": AutoModelForSeq2SeqLM,
            "vision_language": AutoModelForImageTextToText}[config_family(config)]


def model_family(model) -> Family:
    """The family of a pipeline's ``model`` section, from its config.json (its ${ENV} token resolved at use); a
    locally built model's from its architecture, so asking builds nothing (bad data is refused before that)."""
    from fitburst.spec import resolve_env

    if model.name in LOCAL_MODELS:
        return {"t5": "seq2seq", "qwen2_vl": "vision_language"}.get(LOCAL_MODELS[model.name], "causal")
    return config_family(load_config(model.name, model.revision, resolve_env(model.hf_token),
                                     model.trust_remote_code))


def tokenizer_for(model):
    """The tokenizer of a pipeline's ``model`` section (its ${ENV} token resolved only here, at use)."""
    from fitburst.spec import resolve_env

    return load_tokenizer(model.name, model.revision, resolve_env(model.hf_token), model.trust_remote_code)


def quantization_config(quant: str, double_quant: bool, compute_dtype):
    """The bitsandbytes config for a quant setting, or None for unquantized weights."""
    if quant == "none":
        return None
    from transformers import BitsAndBytesConfig

    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant,
                              bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=compute_dtype)


# SDPA with grouped-query k/v expanded first, for GPUs with no FlashAttention for the run's dtype (T4, V100, fp32):
# there transformers' unmasked SDPA call (enable_gqa) falls to the math kernel (fitburst.memory.cuda_kernels)
EXPANDED_KV = "sdpa_expanded_kv"


def _sdpa_expanded_kv(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with k/v expanded to the query heads where transformers would hand SDPA the
    grouped ones (``use_gqa_in_sdpa``: no mask, head dims <= 256; otherwise it expands them itself), so that SDPA's
    memory-efficient kernel can run the call."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa

    if key.shape[1] < query.shape[1] and use_gqa_in_sdpa(attention_mask, key, value):
        groups = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def attn_implementation(attention: str, config, target: Device | None, precision: str,
                        trust_remote_code: bool = False) -> str | None:
    """transformers' ``attn_implementation`` for ``training.attention`` (None: transformers' default, SDPA) on the
    ``target`` device computing in ``precision``: SDPA becomes :data:`EXPANDED_KV` where a grouped-query model's
    unmasked call would fall to the math kernel (:func:`fitburst.memory.cuda_kernels.expands_kv`), for models
    whose own code takes SDPA and a named attention implementation (not custom code); the estimate traces the same
    choice."""
    from fitburst.memory.cuda_kernels import expands_kv

    impl = {"flash": "flash_attention_2", "auto": None}.get(attention, attention)
    if impl not in (None, "sdpa") or target is None or trust_remote_code:
        return impl
    text = config.get_text_config()
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    gqa = 0 < int(getattr(text, "num_key_value_heads", None) or heads) < heads
    if not expands_kv(target, precision, gqa):
        return impl
    try:
        cls = auto_model_class(config)._model_mapping[type(config)]
    except KeyError:
        return impl
    if not (getattr(cls, "_supports_sdpa", False) and cls._can_set_attn_implementation()):
        return impl
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(EXPANDED_KV, _sdpa_expanded_kv)
    AttentionMaskInterface.register(EXPANDED_KV, sdpa_mask)
    return EXPANDED_KV


def load_model(name: str, *, dtype, device: str, quant: str = "none", double_quant: bool = True,
               attention: str = "auto", revision: str | None = None, token: str | None = None,
               trust_remote_code: bool = False, target: Device | None = None, precision: str = "fp32"):
    """Load the model once, straight into ``dtype`` and onto ``device`` (no second copy, no re-cast): a causal LM,
    an encoder-decoder (T5, FLAN-T5) or a vision-language model (:mod:`fitburst.vision`): :func:`auto_model_class`.
    ``target``: the GPU it trains on, computing in ``precision`` (:func:`attn_implementation`)."""
    config = load_config(name, revision=revision, token=token, trust_remote_code=trust_remote_code)
    auto = auto_model_class(config)
    # device_map puts each weight straight onto the device in its final dtype: no CPU copy to move afterwards
    kwargs = dict(config=config, dtype=dtype, revision=revision, token=token, trust_remote_code=trust_remote_code,
                  device_map={"": device})
    impl = attn_implementation(attention, config, target, precision, trust_remote_code)
    if impl is not None:
        kwargs["attn_implementation"] = impl
    qconf = quantization_config(quant, double_quant, dtype)
    if qconf is not None:
        kwargs["quantization_config"] = qconf
    model = auto.from_pretrained(resolve_model_ref(name), **kwargs)
    if quant in ("nf4", "fp4") and device == "cpu":
        _disable_bnb_cpu_repack(model)
    return model


def load_config(name: str, revision: str | None = None, token: str | None = None, trust_remote_code: bool = False):
    """The model's transformers config (``config.json``)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_ref(name), revision=revision, token=token,
                                      trust_remote_code=trust_remote_code)


def load_pipeline_model(spec: PipelineSpec, device: str, precision: str, *, path: str | None = None):
    """The one way train, probe and eval load a pipeline's model: its name (or ``path``, a saved full fine-tune),
    revision, token, quantization and attention, weights in :func:`fitburst.device.weight_dtype`."""
    from fitburst.device import check_quant_supported, weight_dtype
    from fitburst.memory.devices import probe_local
    from fitburst.spec import resolve_env

    m, method, tr = spec.model, spec.method, spec.training
    check_quant_supported(method.quant, device)
    dtype = weight_dtype(precision, method.type, tr.pure_bf16)
    target = probe_local("cuda") if device.startswith("cuda") else None
    if path is not None:
        return load_model(path, dtype=dtype, device=device, attention=tr.attention, target=target,
                          precision=precision)
    return load_model(m.name, dtype=dtype, device=device, quant=method.quant, double_quant=method.double_quant,
                      attention=tr.attention, revision=m.revision, token=resolve_env(m.hf_token),
                      trust_remote_code=m.trust_remote_code, target=target, precision=precision)


def _disable_bnb_cpu_repack(model) -> None:
    """bitsandbytes on CPUs with avx512_bf16 repacks 4-bit weights after an eval forward, which breaks later
    training steps (see shared stack notes); turn that path off on every 4-bit layer."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
