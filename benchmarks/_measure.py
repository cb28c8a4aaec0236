"""Measure the peak memory of real training steps of small random models on CPU through fitburst's own stack
(fitburst.builders.build_model, make_optimizer, and the training loop's step), with a dispatch-level tracker of
live tensor storages (exact bytes, what CUDA's max_memory_allocated counts).

Run one configuration per process: python benchmarks/_measure.py '<json settings>' prints a JSON result.
"""

import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARCHS = {
    # small but not toy: vocab / hidden / intermediate ratios like real models, so every term shows
    "llama": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=8000,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "llama_deep": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=2000,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=192,
        intermediate_size=1024,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=12000,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
}
# architectures beyond the bundled configs (small random configs, real proportions of their families)
_SMALL = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, vocab_size=6000, max_position_embeddings=4096)
ARCHS.update({
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=192, intermediate_size=768, num_hidden_layers=2,
                     num_attention_heads=6, vocab_size=6000, max_position_embeddings=4096, tie_word_embeddings=False),
    "olmo2": dict(model_type="olmo2", tie_word_embeddings=False, **_SMALL),
    "starcoder2": dict(model_type="starcoder2", tie_word_embeddings=True, **_SMALL),
    "granite": dict(model_type="granite", tie_word_embeddings=True, **_SMALL),
    "gemma": dict(model_type="gemma", head_dim=32, tie_word_embeddings=True, **_SMALL),
    "phi3": dict(model_type="phi3", tie_word_embeddings=False, pad_token_id=0, **{**_SMALL, "num_key_value_heads": 6}),
})
# architectures no accuracy figure was taken on before the fresh held-out rows (preflight_accuracy.py --fresh)
ARCHS.update({
    "mistral": dict(model_type="mistral", head_dim=32, tie_word_embeddings=False, **_SMALL),
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True, **_SMALL),
    "stablelm": dict(model_type="stablelm", tie_word_embeddings=False, **_SMALL),
    "smollm3": dict(model_type="smollm3", tie_word_embeddings=True, pad_token_id=0, **_SMALL),
})
NEW_ARCHS = ("mistral", "qwen3", "stablelm", "smollm3")


def build(arch: str, root: str) -> str:
    """A random model folder (config, weights, a minimal tokenizer) that fitburst.builders.build_model loads."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from fitburst.models import auto_model_class

    path = os.path.join(root, arch)
    if os.path.exists(os.path.join(path, "tokenizer_config.json")):
        return path
    kw = dict(ARCHS[arch])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    auto_model_class(cfg).from_config(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, "<eos>": 2}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)
    return path


def spec_of(cfg: dict, path: str):
    """The PipelineSpec fitburst would run for a benchmark case (model.name = the random model's folder)."""
    from fitburst.spec import PipelineSpec

    method = dict(type=cfg["method"], rank=cfg.get("rank", 8), alpha=cfg.get("alpha", 16),
                  dropout=cfg.get("dropout", 0.0), target_modules=cfg.get("targets", ["q_proj", "v_proj"]),
                  vision=cfg.get("vision", "frozen"))
    if cfg["method"] != "full":
        method.update(quant=cfg.get("quant", "none"), double_quant=cfg.get("double_quant", True))
    if method.get("quant", "none") != "none":
        method["type"] = "qlora"
    return PipelineSpec.model_validate(dict(
        name=f"bench-{cfg['arch']}",
        model=dict(name=path),
        data=dict(path="unused.jsonl", max_seq_len=max(8, cfg["seq_len"])),
        method=method,
        training=dict(max_steps=cfg.get("steps", 2), micro_batch_size=cfg["batch"], grad_accum=1,
                      precision=cfg["dtype"], gradient_checkpointing=cfg.get("grad_checkpointing", False),
                      optimizer=cfg.get("optimizer", "adamw"), attention=cfg.get("attention", "auto")),
    ))


def run(cfg: dict) -> dict:
    """Build with fitburst.builders.build_model / make_optimizer and run fitburst's training step (the loop's
    body under the loop's AMP: loss = model(**batch).loss, backward, clip, step, zero_grad(set_to_none=True))."""
    import torch

    from fitburst.builders import build_model, make_optimizer
    from fitburst.data import collate
    from fitburst.device import make_amp
    from fitburst.probe import TensorTracker as Tracker
    from fitburst.train import optimizer_step

    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = build(cfg["arch"], cfg.get("root") or tempfile.gettempdir())
    spec = spec_of(cfg, path)
    tr = spec.training
    model, tok = build_model(spec, "cpu", cfg["dtype"])
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(tr.optimizer, params, tr.learning_rate, tr.weight_decay)
    b, s = cfg["batch"], cfg["seq_len"]
    V = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(b):  # padded to the longest sample: the others are shorter
        n = s if i == 0 else s - max(1, s // 8)
        ids = torch.randint(3, V, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    if cfg.get("images"):  # each sample opens with its images' tokens, the batch carries their patches
        rows = [_with_images(model.config, r, cfg["images"], cfg["image_tokens"], g) for r in rows]
    batch = collate(rows, tok.pad_token_id)
    tr_ = Tracker()
    tr_.add(list(model.parameters()) + list(model.buffers()) + list(batch.values()))
    base = tr_.cur
    losses = []
    amp = make_amp(cfg["dtype"], "cpu")
    steps = []  # per step: the tracker's and the OS's view (benchmarks/tracker_vs_os.py)
    with tr_:
        for _ in range(cfg.get("steps", 2)):
            tr_.peak = tr_.cur
            start, rss_before = tr_.cur, _reset_hwm()
            losses.append(optimizer_step(model, opt, params, [batch], device="cpu",
                                         max_grad_norm=tr.max_grad_norm, amp=amp))
            # the process's resident high-water mark since just before the step, and its resident size then
            steps.append(dict(tracker_start=start, tracker_peak=tr_.peak, rss_before=rss_before,
                              rss_hwm=_status("VmHWM") if rss_before is not None else None))
    return {"peak": max(x["tracker_peak"] for x in steps), "base": base, "losses": losses, "steps": steps}


def _status(key: str) -> int | None:
    """A byte figure of /proc/self/status (VmRSS, VmHWM), None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> int | None:
    """Reset the resident high-water mark to the current resident size (Linux: 5 > /proc/self/clear_refs) and
    return that size; None where it cannot be reset."""
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status("VmRSS")


def _with_images(config, row: dict, images: int, tokens: int, g) -> dict:
    """``row`` with ``images`` images of ``tokens`` language tokens each (a 2 x 2*tokens grid of merged patches
    per image) at its start, and their random pixel values."""
    import torch

    v = config.vision_config
    one = [config.image_token_id] * tokens + [config.vision_end_token_id]  # a text token closes each image
    n = images * len(one)
    ids = one * images + row["input_ids"][n:]
    grid = [[1, v.spatial_merge_size, v.spatial_merge_size * tokens]] * images
    patches = images * tokens * v.spatial_merge_size ** 2
    pixels = torch.randn((patches, 3 * v.temporal_patch_size * v.patch_size ** 2), generator=g).tolist()
    return {"input_ids": ids, "labels": [-100] * n + row["labels"][n:], "pixel_values": pixels,
            "mm_token_type_ids": ([1] * tokens + [0]) * images + [0] * (len(ids) - n), "image_grid_thw": grid}


if __name__ == "__main__":
    arg = json.loads(sys.argv[1])
    for one in arg if isinstance(arg, list) else [arg]:
        try:
            res = run(one)
        except Exception as e:  # report, keep going
            res = {"error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps(res), flush=True)
