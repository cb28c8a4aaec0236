"""Encoder-decoder models (T5): (input, target) data prep from every record format, the token-weighted loss over an
accumulation window, the traced estimate on the real model, and a tiny T5 trained end to end through the DAG."""

from __future__ import annotations

import json

import pytest

from fitburst.data import IGNORE_INDEX, DataError, collate, content_hash, prepare
from fitburst.families import SEQ2SEQ
from fitburst.spec import DataSpec


@pytest.fixture(scope="module")
def t5_tokenizer():
    from fitburst.demo_models import T5_MODEL
    from fitburst.models import load_tokenizer

    return load_tokenizer(T5_MODEL)


def _prepare(tmp_path, rows, tok, **data):
    path = tmp_path / "d.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    spec = DataSpec(path=str(path), val_split=0.0, **data)
    return prepare(spec, path, tok, tmp_path / "cache", family=SEQ2SEQ)


def test_every_format_becomes_an_input_target_pair(tmp_path, t5_tokenizer):
    """input/target records as they are; alpaca's instruction + input as the input; a conversation's turns before
    the last reply as the input, that reply as the target. Both sides end with eos; labels are not masked."""
    from fitburst.data import load_split

    tok = t5_tokenizer
    rows = [
        {"input": "Add 2 and 3.", "target": "2 + 3 = 5."},
        {"instruction": "Sort these words.", "input": "pear, apple", "output": "apple, pear"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Name a color."},
                      {"role": "assistant", "content": "Blue"}]},
    ]
    prepared = _prepare(tmp_path, rows, tok)
    assert prepared.family == "seq2seq" and prepared.n_train == 3
    got = load_split(prepared, "train").to_list()
    pairs = {(tok.decode(r["input_ids"]), tok.decode(r["labels"])) for r in got}
    assert pairs == {
        ("Add 2 and 3.</s>", "2 + 3 = 5.</s>"),
        ("Sort these words.\n\npear, apple</s>", "apple, pear</s>"),
        ("system: Be brief.\nuser: Hi\nassistant: Hello\nuser: Name a color.</s>", "Blue</s>"),
    }
    assert all(IGNORE_INDEX not in r["labels"] for r in got)


def test_truncation_keeps_eos_and_the_cache_tells_causal_from_seq2seq(tmp_path, t5_tokenizer):
    tok = t5_tokenizer
    row = {"input": "one two three four five six seven eight", "target": "alpha beta gamma delta epsilon zeta"}
    p = _prepare(tmp_path, [row], tok, max_seq_len=8, max_target_len=4)
    from fitburst.data import load_split

    r = load_split(p, "train")[0]
    assert len(r["input_ids"]) == 8 and len(r["labels"]) == 4
    assert r["input_ids"][-1] == r["labels"][-1] == tok.eos_token_id
    assert p.stats["n_truncated"] == 1
    spec = DataSpec(path=str(tmp_path / "d.jsonl"), val_split=0.0, max_seq_len=8, max_target_len=4)
    assert content_hash(tmp_path / "d.jsonl", spec, tok) != p.content_hash  # a causal prepare is cached apart


def test_bad_records_are_located(tmp_path, t5_tokenizer):
    with pytest.raises(DataError, match=r"d\.jsonl:2: 'input' and 'target' must be strings"):
        _prepare(tmp_path, [{"input": "a", "target": "b"}, {"input": "a", "target": 3}], t5_tokenizer,
                 format="input_target")
    with pytest.raises(DataError, match=r"d\.jsonl: record 1: .*no input before it"):
        _prepare(tmp_path, [{"messages": [{"role": "assistant", "content": "alone"}]}], t5_tokenizer)


def test_collate_pads_inputs_and_labels_each_to_their_longest():
    b = collate([{"input_ids": [5, 6, 1], "labels": [7, 1]}, {"input_ids": [5, 1], "labels": [7, 8, 9, 1]}], 0)
    assert b["input_ids"].tolist() == [[5, 6, 1], [5, 1, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b["labels"].tolist() == [[7, 1, IGNORE_INDEX, IGNORE_INDEX], [7, 8, 9, 1]]


@pytest.fixture(scope="module")
def random_t5(tmp_path_factory):
    """A small random T5 folder (dropout off, so two forwards of the same batch agree)."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    path = tmp_path_factory.mktemp("t5")
    torch.manual_seed(0)
    T5ForConditionalGeneration(T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                        feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                        dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                                        decoder_start_token_id=0)).save_pretrained(path)
    return path


@pytest.mark.parametrize("method", ["full", "lora"])
def test_accumulated_micro_batches_train_as_one_batch(random_t5, method):
    """T5 returns its micro-batch's mean loss and takes no num_items_in_batch: the step weights each micro-batch by
    its share of the window's label tokens, so 2 x 2 uneven samples give the loss and gradients of one batch of 4."""
    import torch

    from fitburst.builders import build_model
    from fitburst.spec import PipelineSpec
    from fitburst.train import optimizer_step

    spec = PipelineSpec.model_validate(dict(
        name="t5", model={"name": str(random_t5)}, data={"path": "unused.jsonl"},
        method={"type": method, "target_modules": "all-linear", "dropout": 0.0}, training={"precision": "fp32"}))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, 96, (n,), generator=g).tolist(),
             "labels": torch.randint(3, 96, (m,), generator=g).tolist()} for n, m in ((9, 2), (4, 7), (6, 3), (5, 8))]
    results = []
    for micro in ([collate(rows, 0)], [collate(rows[:2], 0), collate(rows[2:], 0)]):
        torch.manual_seed(0)
        model, _ = build_model(spec, "cpu", "fp32")
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.0)  # lr 0: keeps the gradients to compare after the step
        opt.zero_grad = lambda set_to_none=True: None
        loss = optimizer_step(model, opt, params, micro, device="cpu", max_grad_norm=None)
        results.append((loss, [p.grad.clone() for p in params]))
    (one, g1), (two, g2) = results
    assert two == pytest.approx(one, rel=1e-5)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# FLAN-T5's layout at test size: gated-gelu, dropout 0.1 as shipped, a separate lm_head (tie_word_embeddings false)
T5_CFG = dict(model_type="t5", d_model=128, d_kv=32, d_ff=320, num_layers=2, num_decoder_layers=2, num_heads=4,
              vocab_size=2000, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.1,
              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


@pytest.fixture(scope="module")
def t5_config_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("t5cfg")
    (d / "config.json").write_text(json.dumps(T5_CFG))
    return d


def test_trace_builds_the_t5_a_flan_checkpoint_loads(t5_config_dir, tmp_path):
    """The traced step runs the encoder-decoder (AutoModelForSeq2SeqLM on meta, encoder input + labels) and counts
    the separate lm_head a FLAN-T5 checkpoint holds, which transformers keeps untied on loading: the same count as
    the analytic shape and as the real model loaded from such a checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from fitburst.memory import RunSettings, load_shape
    from fitburst.memory.trace import trace_step
    from fitburst.spec import PipelineSpec

    spec = PipelineSpec.model_validate(dict(name="t5", model={"name": str(t5_config_dir)}, data={"path": "x.jsonl"}))
    trace = trace_step(spec, RunSettings(method="full", micro_batch_size=2, seq_len=32, precision="fp32"), seq_len=32)
    cfg = dict(T5_CFG)
    AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")  # a checkpoint with its own lm_head, as FLAN-T5's
    save_file({**weights, "lm_head.weight": torch.randn(2000, 128)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    assert trace.params["total"] == load_shape(str(t5_config_dir)).param_count() == sum(
        p.numel() for p in loaded.parameters())


@pytest.mark.parametrize("kw", [
    dict(method="lora", target_modules="all-linear", micro_batch_size=2, seq_len=96, precision="fp32"),
    dict(method="lora", target_modules=["q", "v"], micro_batch_size=2, seq_len=96, precision="bf16",
         gradient_checkpointing=True),
    dict(method="full", micro_batch_size=2, seq_len=64, precision="bf16"),
    dict(method="lora", target_modules=["q", "v"], micro_batch_size=1, seq_len=512, precision="fp16", device="T4"),
    dict(method="lora", target_modules="all-linear", micro_batch_size=2, seq_len=512, precision="bf16", device="L4"),
])
def test_analytic_t5_terms_match_the_traced_step(t5_config_dir, kw):
    """The analytic T5 terms (encoder and decoder stacks, cross-attention, dropout masks, the position-bias masks
    checkpointing keeps, fp32 master weights; on CUDA the memory-efficient kernel and the bias each of its calls
    keeps) against the traced real step: within 6 %."""
    from fitburst.memory import RunSettings, estimate, load_shape, resolve_device
    from fitburst.memory.trace import traced_estimate
    from fitburst.spec import PipelineSpec

    kw = dict(kw)
    device = resolve_device(kw.pop("device", "cpu:8GiB"))
    s = RunSettings(rank=8, dropout=0.0, attention="sdpa", keep_logits=False, **kw)
    spec = PipelineSpec.model_validate(dict(name="t5", model={"name": str(t5_config_dir)}, data={"path": "x.jsonl"}))
    traced = traced_estimate(spec, s, device, seq_len=s.seq_len).allocated_peak_bytes
    analytic = estimate(load_shape(str(t5_config_dir)), s, device, calibrate=False)
    assert analytic.allocated_peak_bytes == pytest.approx(traced, rel=0.06)


@pytest.mark.parametrize("device", ["T4", "mps:16GiB"])
def test_t5_loss_on_a_gpu_keeps_16_bit_log_probabilities(tmp_path, device):
    """T5 takes cross_entropy of its 16-bit logits with no upcast first. CPU autocast runs the whole loss in fp32
    (an fp32 copy of the logits, fp32 log-probabilities); a GPU's autocast runs log_softmax in 16 bits and copies
    only its output to fp32 for nll_loss. With FLAN-T5's vocabulary the loss is most of the peak: the trace for a
    GPU makes 16-bit log-probabilities, and the analytic estimate follows it within 2 % (it followed CPU autocast
    there: +14 % on a T4 before)."""
    from fitburst.memory import RunSettings, estimate, load_shape, resolve_device
    from fitburst.memory.trace import traced_estimate
    from fitburst.spec import PipelineSpec

    (tmp_path / "config.json").write_text(json.dumps(dict(T5_CFG, vocab_size=32128)))
    S, dev = 512, resolve_device(device)
    s = RunSettings(method="lora", rank=8, micro_batch_size=2, seq_len=S,
                    precision="fp16" if device == "T4" else "bf16",
                      attention="sdpa", dropout=0.0, target_modules=["q", "v"], keep_logits=False)
    spec = PipelineSpec.model_validate(dict(name="t5", model={"name": str(tmp_path)}, data={"path": "x.jsonl"}))
    cache: dict = {}
    traced = traced_estimate(spec, s, dev, seq_len=S, cache=cache).allocated_peak_bytes
    (tr,) = cache.values()
    log_probs = [e.size for e in tr.events[tr.measured_start:] if e.kind == "alloc" and e.op == "_log_softmax.default"]
    assert log_probs == [2 * S * 2 * 32128]  # b x s x vocab, 16 bits
    analytic = estimate(load_shape(str(tmp_path)), s, dev, calibrate=False).allocated_peak_bytes
    assert analytic == pytest.approx(traced, rel=0.02)


def test_t5_traced_for_cuda_keeps_each_attention_bias_not_its_scores(t5_config_dir):
    """T5 trains with dropout 0.1 in attention and its position bias as the mask: the CPU runs that with SDPA's math
    kernel (b*h*s*s scores, probabilities and dropout noise per layer), a CUDA device with the memory-efficient
    kernel, which keeps only each call's bias for its backward. Torch's composite pads a bias whose rows are not
    contiguous (the permuted relative-position bias of each self-attention) and keeps the padded copy. Traced for a
    T4: one efficient call per attention, no score-sized fp32 tensor, one padded bias per self-attention layer, and
    a peak below the CPU trace's by more than one fp32 score tensor per layer."""
    from fitburst.memory import RunSettings, resolve_device
    from fitburst.memory.trace import trace_step
    from fitburst.spec import PipelineSpec

    S, h = 256, T5_CFG["num_heads"]
    s = RunSettings(method="lora", rank=8, micro_batch_size=1, seq_len=S, precision="fp16", attention="sdpa",
                    dropout=0.0,
                      target_modules=["q", "v"], keep_logits=False)
    spec = PipelineSpec.model_validate(dict(name="t5", model={"name": str(t5_config_dir)}, data={"path": "x.jsonl"}))
    cuda = trace_step(spec, s, seq_len=S, adamw="foreach", autocast_of="cuda", device=resolve_device("T4"))
    cpu = trace_step(spec, s, seq_len=S)
    step = cuda.events[cuda.measured_start:]
    calls = [e for e in step if e.kind == "alloc" and e.op == "_scaled_dot_product_efficient_attention.default"
             and e.size == S * h * T5_CFG["d_kv"] * 2]
    layers = T5_CFG["num_layers"] + T5_CFG["num_decoder_layers"]
    assert len(calls) == layers + T5_CFG["num_decoder_layers"]  # encoder self, decoder self and cross
    def scores32(events):  # fp32 (1, h, s, s) tensors made in a forward: scores, probabilities, dropout noise
        return [e for e in events if e.kind == "alloc" and e.phase.endswith("forward") and e.size == h * S * S * 4]

    assert not scores32(cuda.events) and len(scores32(cpu.events)) >= 2 * 3 * (layers + T5_CFG["num_decoder_layers"])
    assert len([e for e in step if e.kind == "alloc" and e.op == "constant_pad_nd.default"
                and e.size == h * S * (S + 8) * 2]) == layers
    assert any(e.op.startswith("_safe_softmax") for e in cpu.events)
    assert cuda.live_peaks()[0] < cpu.live_peaks()[0] - layers * h * S * S * 4


def test_oom_step_down_resumes_a_t5_run_with_checkpointing(tmp_path, pipelines_file, monkeypatch):
    """The loop's OOM ladder on an encoder-decoder run: an out-of-memory error in a step (micro-batch 1 already)
    turns gradient checkpointing on, the run resumes from the checkpoint written on the way out and finishes."""
    import torch

    import fitburst.recipe as train_mod  # the loop looks its step up in the recipe
    from fitburst.data import prepare_pipeline
    from fitburst.spec import load_pipeline
    from fitburst.supervisor import STEPDOWN_FILE, train_stepping_down

    spec = load_pipeline(pipelines_file, "t5-demo").with_overrides({
        "training.max_steps": 6, "training.micro_batch_size": 1, "training.grad_accum": 2,
        "training.checkpoint_every": 2, "training.log_every": 1, "preflight.allow.optimizer_8bit": False})
    calls, checkpointing = {"n": 0}, []
    real = train_mod.optimizer_step

    def step(model, optimizer, params, micro, **kw):
        calls["n"] += 1
        checkpointing.append(model.get_base_model().is_gradient_checkpointing)
        if calls["n"] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, optimizer, params, micro, **kw)

    monkeypatch.setattr(train_mod, "optimizer_step", step)
    result = train_stepping_down(spec, prepare_pipeline(spec), tmp_path, device="cpu", progress=False)
    assert json.loads((tmp_path / STEPDOWN_FILE).read_text())["rungs"] == ["gradient_checkpointing"]
    assert result.steps == 6 and result.resumed_from == 3
    assert checkpointing[0] is False and checkpointing[-1] is True
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))


@pytest.fixture(scope="module")
def t5_run(prefect_server, pipelines_file):
    from flows.finetune import finetune

    return finetune(pipeline="t5-demo", pipelines_file=str(pipelines_file))


def test_tiny_t5_trains_through_the_dag(t5_run):
    """data prep -> preflight (traced on the real encoder-decoder) -> train -> eval -> MLflow on the tiny T5:
    LoRA on encoder, decoder and cross-attention lowers the validation loss well below the base model's."""
    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(t5_run["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["pipeline"] == "t5-demo"
    m = run.data.metrics
    assert m["memory.estimated_peak_bytes"] > 0 and m["memory.measured_peak_bytes"] > 0
    assert m["eval.tuned_loss"] < m["eval.base_loss"] - 1.0


def test_merge_folds_a_t5_adapter_into_its_base(t5_run, tmp_path):
    """``fitburst merge`` of the DAG's T5 run: an ordinary seq2seq folder whose outputs equal base + adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSeq2SeqLM

    from fitburst.cli import main
    from fitburst.demo_models import T5_MODEL
    from fitburst.models import load_model

    assert main(["merge", t5_run["run_dir"], "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "merged").eval()
    direct = PeftModel.from_pretrained(load_model(T5_MODEL, dtype=torch.float32, device="cpu"),
                                       t5_run["adapter_dir"]).eval()
    ids, labels = torch.tensor([[5, 17, 42, 99, 1]]), torch.tensor([[7, 8, 1]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids, labels=labels).logits,
                                   direct(input_ids=ids, labels=labels).logits, atol=1e-4, rtol=1e-4)
