"""Measure the peak memory of real training steps of small random models on CPU (the fitburst training stack:
transformers + peft + bitsandbytes, a plain loop), with torch's MemTracker (tensor storages, exact bytes).

Run one configuration per process: python benchmarks/_measure.py '<json settings>' prints a JSON result.
"""

import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

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


def build(arch: str, root: str) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(root, arch)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    kw = dict(ARCHS[arch])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def run(cfg: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = build(cfg["arch"], cfg.get("root") or tempfile.gettempdir())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["dtype"]]
    kw = dict(dtype=dtype, attn_implementation=cfg.get("attention", "sdpa"))
    quant = cfg.get("quant", "none")
    if quant in ("nf4", "fp4"):
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant,
            bnb_4bit_use_double_quant=cfg.get("double_quant", True),
            bnb_4bit_compute_dtype=dtype,
        )
    elif quant == "int8":
        kw["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    ckpt = cfg.get("grad_checkpointing", False)
    if quant != "none":
        import bitsandbytes as bnb
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=ckpt, gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        for m in model.modules():  # stack notes: the avx512_bf16 repack bug
            if isinstance(m, bnb.nn.Linear4bit):
                m.support_avx512bf16_for_cpu = False
    elif ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if cfg["method"] != "full":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=cfg["rank"],
                lora_alpha=cfg.get("alpha", 16),
                lora_dropout=cfg.get("dropout", 0.0),
                target_modules=cfg["targets"],
                task_type="CAUSAL_LM",
            ),
        )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt_name = cfg.get("optimizer", "adamw")
    if opt_name == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4)
    elif opt_name == "sgd":
        opt = torch.optim.SGD(params, lr=1e-4)
    else:
        import bitsandbytes as bnb

        opt = (bnb.optim.AdamW8bit if opt_name == "adamw8bit" else bnb.optim.PagedAdamW8bit)(params, lr=1e-4)
    b, s = cfg["batch"], cfg["seq_len"]
    V = (
        model.config.vocab_size
        if hasattr(model.config, "vocab_size")
        else model.config.get_text_config().vocab_size
    )
    ids = torch.randint(0, V, (b, s))
    am = torch.ones(b, s, dtype=torch.long)
    if b > 1:  # padded to the longest sample: the others end in padding
        am[1:, s - max(1, s // 8) :] = 0
    labels = ids.masked_fill(am == 0, -100)
    tr = Tracker()
    tr.add(list(model.parameters()) + list(model.buffers()) + [ids, am, labels])
    base = tr.cur
    losses = []
    with tr:
        for _ in range(cfg.get("steps", 2)):
            out = model(input_ids=ids, attention_mask=am, labels=labels)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(out.loss))
            del out
    return {"peak": tr.peak, "base": base, "losses": losses}


class _TrackerBase:
    pass


def _make_tracker():
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Tracker(TorchDispatchMode):
        """Live tensor storages seen by the dispatcher (exact bytes, like the CUDA allocator's allocated)."""

        def __init__(self):
            super().__init__()
            self.live: dict[int, tuple] = {}
            self.cur = self.peak = 0

        def _purge(self):
            dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
            for k in dead:
                self.cur -= self.live.pop(k)[1]

        def add(self, tensors):
            self._purge()
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                st = t.untyped_storage()
                k = st.data_ptr()
                if k == 0 or k in self.live:
                    continue
                self.live[k] = (StorageWeakRef(st), st.nbytes())
                self.cur += st.nbytes()
            self.peak = max(self.peak, self.cur)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.add(tree_leaves(out))
            return out

    return Tracker


def Tracker():  # noqa: N802
    return _make_tracker()()


if __name__ == "__main__":
    arg = json.loads(sys.argv[1])
    for one in arg if isinstance(arg, list) else [arg]:
        try:
            res = run(one)
        except Exception as e:  # report, keep going
            res = {"error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps(res), flush=True)
