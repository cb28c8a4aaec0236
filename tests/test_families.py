"""Model families beyond dense causal LMs: mixture-of-experts counted exactly, LoRA on experts as peft does it,
and a tiny MoE trained end to end through the DAG."""

from __future__ import annotations

import json

import pytest

from fitburst.memory.shapes import CONFIG_DIR, ModelConfigError, ModelShape, load_shape

MOE_CONFIGS = ["mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b"]


def _meta_model(cfg: dict):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))


@pytest.mark.parametrize("name", MOE_CONFIGS)
def test_moe_parameter_count_matches_the_real_model(name):
    """experts, router and shared experts: the count from config.json equals transformers' model, built on meta."""
    shape = load_shape(name)
    model = _meta_model(json.loads((CONFIG_DIR / f"{name}.json").read_text()))
    assert shape.param_count() == sum(p.numel() for p in model.parameters())


def test_mixtral_is_counted_as_the_moe_it_is():
    shape = load_shape("mistralai/Mixtral-8x7B-v0.1")
    assert shape.param_count() == pytest.approx(46.7e9, rel=0.01)  # published size
    assert shape.active_param_count() == pytest.approx(12.9e9, rel=0.01)  # published per-token size


def test_unknown_moe_is_refused_never_estimated_dense():
    cfg = dict(model_type="olmoe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
               num_experts=64, num_experts_per_tok=8, intermediate_size=1024, vocab_size=50304)
    with pytest.raises(ModelConfigError, match="mixture-of-experts.*64 experts.*--exact"):
        ModelShape.from_config(cfg, name="allenai/OLMoE")
    with pytest.raises(ModelConfigError, match="decoder_sparse_step"):
        ModelShape.from_config(dict(json.loads((CONFIG_DIR / "qwen1.5-moe-a2.7b.json").read_text()),
                                    decoder_sparse_step=2))


TINY = {
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=300, num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, num_experts=4, num_experts_per_tok=2,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=300),
}


@pytest.mark.parametrize("arch,targets", [
    ("mixtral", "all-linear"), ("mixtral", ["w1", "w2", "w3"]), ("mixtral", ["q_proj", "v_proj", "gate"]),
    ("qwen2_moe", "all-linear"), ("qwen2_moe", ["gate_proj", "up_proj", "down_proj"]),
    ("qwen3_moe", "all-linear"), ("qwen3_moe", ["gate_proj", "up_proj", "down_proj"]),
])
def test_lora_on_experts_counts_what_peft_trains(arch, targets, tmp_path):
    """LoRA parameters per target set equal peft's own (experts via its ParamWrapper, the fused gate_up_proj
    at twice the rank, routers where peft wraps them)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from fitburst.memory import RunSettings
    from fitburst.memory.params import lora_params

    kw = dict(TINY[arch])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path), LoraConfig(r=4, target_modules=targets))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = load_shape(str(tmp_path))
    assert shape.param_count() == sum(p.numel() for p in model.parameters()) - trained
    assert lora_params(shape, RunSettings(method="lora", rank=4, target_modules=targets)) == trained


@pytest.fixture(scope="module")
def moe_run(prefect_server, pipelines_file):
    from flows.finetune import finetune

    return finetune(pipeline="moe-demo", pipelines_file=str(pipelines_file))


def test_tiny_moe_trains_through_the_dag(moe_run):
    """data prep -> preflight -> train -> eval -> MLflow on a tiny Mixtral built locally: LoRA on its experts
    lowers the validation loss, and the preflight estimate is recorded next to the measured peak."""
    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(moe_run["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["pipeline"] == "moe-demo"
    m = run.data.metrics
    assert m["memory.estimated_peak_bytes"] > 0 and m["memory.measured_peak_bytes"] > 0
    assert m["eval.tuned_loss"] < m["eval.base_loss"] - 0.5


def test_qlora_leaves_experts_unquantized_and_the_estimate_counts_them_fp32(tmp_path):
    """bitsandbytes quantizes nn.Linear only: transformers 5's 3-D expert parameters stay, and k-bit preparation
    casts them to fp32. The weight bytes the estimate counts equal what the loaded, prepared model holds."""
    import torch
    from peft import prepare_model_for_kbit_training
    from transformers import AutoConfig, AutoModelForCausalLM

    from fitburst.memory import RunSettings
    from fitburst.memory.params import weight_bytes
    from fitburst.models import load_model

    kw = dict(TINY["mixtral"], hidden_size=128, intermediate_size=256)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = prepare_model_for_kbit_training(load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu",
                                                       quant="nf4", double_quant=False))
    experts = [p for n, p in model.named_parameters() if "experts" in n]
    assert experts and all(p.dtype == torch.float32 for p in experts)
    quantized = {id(p) for m in model.modules() if type(m).__name__ == "Linear4bit" for p in m.parameters()}
    fp32 = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in quantized)
    est = weight_bytes(load_shape(str(tmp_path)), RunSettings(method="qlora", quant="nf4", double_quant=False))
    assert est["weights_fp32"] == pytest.approx(fp32, rel=0.01)


@pytest.mark.parametrize("name", ["fitburst/tiny-demo", "fitburst/tiny-moe", "fitburst/tiny-t5", "fitburst/tiny-vl"])
def test_a_local_models_family_is_known_before_it_is_built_and_matches_its_config(name):
    """Data prep asks the family before reading records (so bad data is refused before any model is built): for
    the locally built models it comes from their architecture, and must be what their built config says."""
    from fitburst.families import family_for
    from fitburst.models import load_config, model_family
    from fitburst.spec import ModelSpec

    assert model_family(ModelSpec(name=name)) is family_for(load_config(name))
