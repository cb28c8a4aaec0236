"""fitburst.memory: formulas pinned to exact counts, a measured step, devices, planner seeds, CLI."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fitburst.memory import (
    Budget,
    RunSettings,
    estimate,
    load_shape,
    plan_fit,
    resolve_device,
)
from fitburst.memory.params import lora_params, optimizer_bytes, weight_bytes
from fitburst.memory.shapes import bundled_names

ROOT = Path(__file__).resolve().parent.parent
# published shapes and parameter counts (a copy of ../shared/memory/architectures.csv, kept with the tests)
ARCH_CSV = ROOT / "tests" / "fixtures" / "architectures.csv"
GiB = 1 << 30


# --- shapes and bundled configs --------------------------------------------------------------------------


def _csv_params() -> dict[str, float]:
    out = {}
    for r in csv.DictReader(open(ARCH_CSV)):
        p = r["params"].split("B")[0]
        out[r["model"].lower()] = float(p) * 1e9
        if "LLM +" in r["params"]:  # "7.6B LLM + 0.676B ViT"
            out[r["model"].lower()] += float(r["params"].split("+")[1].strip().split("B")[0]) * 1e9
    return out


def test_bundled_configs_match_published_param_counts():
    want = _csv_params()
    alias = {"mistral-7b": "mistral-7b-v0.1", "phi-3-mini": "phi-3-mini-4k"}
    checked = 0
    for name in bundled_names():
        key = alias.get(name, name)
        if key not in want:
            continue
        got = load_shape(name).param_count()
        tol = 0.025 if name.startswith("qwen2-vl") else 0.012  # the csv rounds the VL LLM part to 1.5B / 7.6B
        assert abs(got / want[key] - 1) < tol, (name, got, want[key])
        checked += 1
    assert checked >= 18


@pytest.mark.parametrize(
    "ref,expect",
    [
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("google/gemma-3-270m-it", "gemma-3-270m"),
        ("microsoft/Phi-3-mini-4k-instruct", "phi-3-mini"),
        ("microsoft/phi-1_5", "phi-1.5"),
        ("meta-llama/Llama-2-7b-hf", "llama-2-7b"),
        ("QWEN2.5-0.5B", "qwen2.5-0.5b"),
    ],
)
def test_hub_ids_map_to_bundled_configs(ref, expect):
    assert Path(load_shape(ref).source).stem.startswith(expect)


def test_unknown_model_names_what_was_tried(tmp_path):
    with pytest.raises(ValueError, match="not a bundled config"):
        load_shape("no-such-model-7b")
    with pytest.raises(ValueError, match="cannot fetch config.json of 'nobody/no-such-model-7b'.*offline"):
        load_shape("nobody/no-such-model-7b")  # a hub id: the suite runs with HF_HUB_OFFLINE=1
    cfg = json.loads((ROOT / "fitburst/configs/llama-3.2-1b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_shape(str(tmp_path)).hidden == 2048
    assert load_shape(str(tmp_path / "config.json")).layers == 16


def test_nested_text_config_and_vision_tower():
    cfg = json.loads((ROOT / "fitburst/configs/qwen2-vl-7b.json").read_text())
    s = load_shape("Qwen2-VL-7B")
    assert abs(s.extra_params - 0.676e9) < 0.002e9
    nested = {
        "model_type": "qwen2_vl",
        "vision_config": cfg["vision_config"],
        "text_config": {k: v for k, v in cfg.items() if k != "vision_config"},
    }
    from fitburst.memory import ModelShape

    assert ModelShape.from_config(nested).param_count() == s.param_count()


# --- exact counts against transformers / peft on the meta device ----------------------------------------


def _meta_model(name: str):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(ROOT / "fitburst/configs" / f"{name}.json"))
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.2-1b", "gemma-3-270m", "phi-3-mini", "mistral-7b"])
def test_param_count_and_weight_bytes_match_meta_model(name):
    model = _meta_model(name)
    model.tie_weights()
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    shape = load_shape(name)
    assert shape.param_count() == n
    s = RunSettings(method="lora", precision="bf16")
    assert weight_bytes(shape, s)["weights"] == 2 * n


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["k_proj", "o_proj", "down_proj"], "all-linear"])
def test_lora_param_count_matches_peft(targets):
    from peft import LoraConfig, get_peft_model

    model = _meta_model("qwen2.5-0.5b")
    pm = get_peft_model(model, LoraConfig(r=16, target_modules=targets))
    n = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    assert lora_params(load_shape("qwen2.5-0.5b"), RunSettings(rank=16, target_modules=targets)) == n


def _storages(obj, seen: dict[int, int]) -> None:
    """Every tensor storage reachable from ``obj`` (a Params4bit, its QuantState and nested state2), by address."""
    import torch

    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            _storages(v, seen)


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_weight_bytes_match_bitsandbytes(tmp_path, double_quant):
    """The estimate's weight bytes against a model really quantized by bitsandbytes on CPU (loaded through
    fitburst's own loader, then k-bit preparation): packed 4-bit weights with every absmax, code and nested
    double-quant state bitsandbytes keeps, and the fp32 remainder (embeddings, lm_head, norms)."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM

    from fitburst.models import load_model

    cfg = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4, vocab_size=1000)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = prepare_model_for_kbit_training(load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu",
                                                       quant="nf4", double_quant=double_quant))
    quantized: dict[int, int] = {}
    weights = set()
    for m in model.modules():
        if type(m).__name__ == "Linear4bit":
            assert m.weight.quant_state is not None and m.weight.dtype == torch.uint8  # really quantized
            _storages(m.weight, quantized)
            _storages(m.weight.quant_state, quantized)
            weights.add(id(m.weight))
    assert len(weights) == 2 * 7
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in weights)
    est = weight_bytes(load_shape(str(tmp_path)), RunSettings(method="qlora", quant="nf4",
                                                               double_quant=double_quant))
    # within 1 %: the estimate counts double quant's 1 KiB code table once, bitsandbytes keeps one per layer
    assert est["weights_quantized"] == pytest.approx(sum(quantized.values()), rel=0.01)
    assert est["weights_fp32"] == rest


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "paged_adamw8bit", "sgd"])
def test_optimizer_state_bytes_match_the_real_optimizer_on_cpu(name):
    """The state the estimate counts against the state fitburst's own optimizer (make_optimizer: torch's, or
    bitsandbytes' 8-bit ones with their small-tensor rule and block-wise absmax) really holds after one step on
    CPU, counted by unique storage (bitsandbytes shares its quantization maps between tensors). Paged AdamW falls
    back to plain 8-bit AdamW on CPU, and the estimate says the same."""
    import torch

    from fitburst.builders import make_optimizer

    sizes = [100, 4095, 4096, 70_000, 1 << 20]  # either side of bitsandbytes' 4096-element 8-bit threshold
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = make_optimizer(name, params, 1e-3, 0.0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)}
    state, _, paged = optimizer_bytes(RunSettings(optimizer=name), sizes, 4, resolve_device("cpu:16GiB"))
    assert paged == 0
    assert state == pytest.approx(sum(storages.values()), rel=0.001), (state, sum(storages.values()))


def test_paged_8bit_optimizer_state_leaves_the_cuda_allocator():
    gpu = resolve_device("A100-40GB")
    state, _, paged = optimizer_bytes(RunSettings(optimizer="paged_adamw8bit"), [4096], 4, gpu)
    assert state == 0 and paged > 0  # unified memory: outside torch's allocator, evicted under pressure
    adamw8 = optimizer_bytes(RunSettings(optimizer="adamw8bit"), [4096], 4, gpu)[0]
    assert paged == adamw8


# --- one real step measured against the estimate ------------------------------------------------------------


def test_measured_cpu_step_matches_estimate(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _measure

    cfg = dict(
        arch="llama",
        dtype="bf16",
        method="lora",
        rank=8,
        targets=["q_proj", "v_proj"],
        batch=1,
        seq_len=128,
        dropout=0.0,
        root=str(tmp_path),
    )
    m = _measure.run(cfg)
    s = RunSettings(method="lora", rank=8, target_modules=["q_proj", "v_proj"], micro_batch_size=1, seq_len=128,
                    dropout=0.0,
                      keep_logits=False)  # _measure runs fitburst's loop step: the model output is dropped
    e = estimate(load_shape(str(tmp_path / "llama")), s, resolve_device("cpu:8GiB"))
    assert abs(e.allocated_peak_bytes / m["peak"] - 1) < 0.03, (e.allocated_peak_bytes, m["peak"])
    assert e.peak_phase == "loss"


# --- devices ----------------------------------------------------------------------------------------------


def test_named_and_sized_devices():
    t4 = resolve_device("t4")
    assert t4.kind == "cuda" and not t4.supports_bf16 and t4.total_bytes == 14912 << 20
    assert t4.budget_bytes == t4.total_bytes - t4.context_bytes - t4.runtime_bytes and t4.runtime_bytes > 0
    c = resolve_device("cuda:24GiB")
    assert c.total_bytes == 24 * GiB and c.budget_bytes < c.total_bytes
    m = resolve_device("mps:36GiB")
    assert m.kind == "mps" and m.budget_bytes == 36 * GiB and not m.supports_bnb
    assert resolve_device("cpu:64GiB").kind == "cpu"
    assert resolve_device("M2-Max-64GB").budget_bytes == 48 * GiB
    assert resolve_device("RTX-4090").name == "RTX4090"
    with pytest.raises(ValueError, match="A100-80GB"):
        resolve_device("Z9000")
    local = resolve_device("auto")
    assert local.budget_bytes > 0 and local.kind in ("cpu", "cuda", "mps")


# --- planner: the seeds' cases ---------------------------------------------------------------------------


def test_seed_qwen7b_lora_r128_on_24gb():
    shape = load_shape("Qwen/Qwen2.5-7B-Instruct")
    s = RunSettings(method="lora", rank=128, alpha=256, target_modules="all-linear", micro_batch_size=4, seq_len=512)
    dev = resolve_device("RTX4090")
    assert not Budget(dev, 0.1).judge(estimate(shape, s, dev)).fits
    plan = plan_fit(shape, s, dev)
    assert plan.fits and plan.changes
    assert plan.needed_bytes <= plan.limit_bytes < dev.budget_bytes  # the band's upper edge within budget less headroom
    assert plan.estimate.band is not None and plan.needed_bytes > plan.estimate.reserved_peak_bytes
    assert plan.settings.micro_batch_size * plan.settings.grad_accum == 4
    # the pipeline forbids quantization and checkpointing: still a plan, or the longest length that fits
    p2 = plan_fit(
        shape, s, dev, allow={"quantize": False, "gradient_checkpointing": False, "reduce_batch": False}
    )
    assert p2.settings.method == "lora" and not p2.settings.gradient_checkpointing
    if not p2.fits:
        assert any("sequence" in c for c in p2.changes)


def test_seed_gemma_270m_at_131072_tokens_on_16gb():
    shape = load_shape("google/gemma-3-270m")
    s = RunSettings(method="full", precision="bf16", micro_batch_size=1, seq_len=131072, attention="sdpa")
    dev = resolve_device("cuda:16GB")
    e = Budget(dev, 0.1).judge(estimate(shape, s, dev))
    assert not e.fits and e.components["logits_loss"] > 100 * GiB  # 131072 x 262144 logits, fp32 copies
    eager = Budget(dev, 0.1).judge(estimate(shape, replace(s, attention="eager"), dev))
    assert eager.allocated_peak_bytes > e.allocated_peak_bytes  # seq x seq probabilities per layer
    # the planner fits it by the fused loss (no logits) and activations offloaded to the host (87 GiB of them:
    # planned where the host is not limited)
    plan = plan_fit(shape, s, dev)
    assert plan.fits and plan.settings.fused_loss and plan.settings.activation_offloading
    assert plan.estimate.offloaded_host_bytes > 64 * GiB
    # fp32 master weights (the loop's mixed precision): 2048 tokens peak at 11.7 GiB traced, over budget with the
    # margin; 1024 tokens fit
    fine = Budget(dev, 0.1).judge(estimate(shape, replace(s, seq_len=1024), dev))
    assert fine.fits


def test_seed_qwen2_vl_7b_fp32_lora_on_mps_42gib():
    shape = load_shape("Qwen/Qwen2-VL-7B-Instruct")
    s = RunSettings(method="lora", precision="fp32", rank=8, micro_batch_size=1, seq_len=1024)
    dev = resolve_device("mps:42GiB")
    assert not Budget(dev, 0.1).judge(estimate(shape, s, dev)).fits
    plan = plan_fit(shape, s, dev)
    # no bitsandbytes on MPS: the planner must not quantize
    assert plan.settings.quant == "none"


def test_quantize_only_where_bnb_and_when_allowed():
    shape = load_shape("Llama-3.1-8B")
    # 512 tokens: at 1024 the fp16 copy autocast makes of k-bit's fp32 head (1 GiB, kept for backward) puts the
    # band's upper edge over a T4
    s = RunSettings(method="lora", rank=16, micro_batch_size=1, seq_len=512, gradient_checkpointing=True)
    plan = plan_fit(shape, s, resolve_device("T4"))
    assert plan.fits and plan.settings.quant == "nf4"
    nq = plan_fit(shape, s, resolve_device("T4"), allow={"quantize": False})
    assert nq.settings.quant == "none" and not nq.fits


def test_fitting_run_is_left_alone_and_phases_are_monotone_in_batch():
    shape = load_shape("Qwen2.5-0.5B")
    s = RunSettings(micro_batch_size=1, seq_len=512)
    plan = plan_fit(shape, s, resolve_device("A100-80GB"))
    assert plan.fits and plan.changes == [] and plan.settings == s
    e1 = estimate(shape, s, resolve_device("A100-80GB"))
    e2 = estimate(shape, replace(s, micro_batch_size=2), resolve_device("A100-80GB"))
    assert e2.allocated_peak_bytes > e1.allocated_peak_bytes
    ck = estimate(shape, replace(s, micro_batch_size=8, seq_len=2048, gradient_checkpointing=True),
                  resolve_device("H100"))
    no = estimate(shape, replace(s, micro_batch_size=8, seq_len=2048), resolve_device("H100"))
    assert ck.components["activations"] < no.components["activations"] / 5


# --- CLI and import hygiene -----------------------------------------------------------------------------


def test_estimate_cli_json_contract():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fitburst.memory.cli",
            "--model",
            "Llama-3.1-70B",
            "--method",
            "qlora",
            "--rank",
            "16",
            "--seq-len",
            "1024",
            "--device",
            "A100-80GB",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    d = json.loads(r.stdout)
    for k in (
        "allocated_peak_bytes",
        "reserved_peak_bytes",
        "device_total_bytes",
        "components",
        "peak_phase",
        "device",
        "budget_bytes",
        "fits",
        "plan",
    ):
        assert k in d
    assert d["reserved_peak_bytes"] >= d["allocated_peak_bytes"]
    assert d["device_total_bytes"] > d["reserved_peak_bytes"]
    assert sum(d["components"].values()) == d["allocated_peak_bytes"]
    assert d["fits"] == (not d["plan"])


def test_the_70b_estimate_imports_neither_torch_nor_transformers():
    """The instant estimate stays instant by importing no heavy library (its time: benchmarks/estimate_speed.py)."""
    code = (
        "import sys; import fitburst.memory as m; "
        "e=m.plan_fit(m.load_shape('Llama-3.1-70B'), m.RunSettings(micro_batch_size=4, seq_len=4096), "
        "m.resolve_device('RTX4090')); "
        "print(sorted(n for n in ('torch', 'transformers', 'peft', 'mlflow', 'prefect') if n in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
