"""Checkpoints offloaded to pinned host memory: the GPU holds only the layers in flight (both estimates), the host
RAM they take is estimated (both estimates), planned against the host's RAM and refused by `fitburst validate`
where it does not fit; `fitburst estimate --host-ram` and the longest sequence the chosen plan fits."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from fitburst.hardware import GiB
from fitburst.memory import RunSettings, estimate, load_shape, plan_fit, resolve_device
from fitburst.memory.budget import Budget
from fitburst.memory.host import host_limit, parse_host_ram, traced_host_bytes
from fitburst.memory.planner import longest_planned, max_seq_len_that_fits, most_frugal
from fitburst.memory.trace import traced_estimate
from fitburst.memory.trace_events import Event

CFG = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, vocab_size=3000, tie_word_embeddings=True,
           max_position_embeddings=1024)
B, S = 2, 512


def _settings(**kw) -> RunSettings:
    base = dict(method="qlora", quant="nf4", rank=8, micro_batch_size=B, seq_len=S, precision="bf16",
                attention="sdpa", dropout=0.0, keep_logits=False, loss="fused", gradient_checkpointing=True,
                activation_offloading=True)
    return RunSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def by_layers(tmp_path_factory):
    """{layers: (analytic, traced)} of the same offloaded, checkpointed QLoRA step at 3 and 6 layers (A100)."""
    from fitburst.spec import PipelineSpec

    dev = resolve_device("A100-80GB")
    out = {}
    for n in (3, 6):
        d = tmp_path_factory.mktemp(f"l{n}")
        (d / "config.json").write_text(json.dumps({**CFG, "num_hidden_layers": n}))
        spec = PipelineSpec.model_validate(dict(name="t", model=dict(name=str(d)), data=dict(path="x.jsonl")))
        s = _settings()
        out[n] = (estimate(load_shape(str(d)), s, dev, calibrate=False), traced_estimate(spec, s, dev, seq_len=S))
    return out


def test_offloaded_checkpoints_leave_the_gpu_with_the_layers_in_flight_only(by_layers):
    """Three more layers add their adapters (weights, gradients, 16-bit copies), not their checkpoints: the GPU's
    activations do not grow by tokens x hidden per layer in either estimate, while the host's grow by exactly
    that (a QLoRA stream is fp32 under autocast: 4 bytes)."""
    checkpoint = 4 * B * S * CFG["hidden_size"]  # one layer's input
    (a3, t3), (a6, t6) = by_layers[3], by_layers[6]
    adapters = a6.components["lora_weights"] - a3.components["lora_weights"]
    assert a6.components["activations"] - a3.components["activations"] < checkpoint
    assert t6.components["step_tensors"] - t3.components["step_tensors"] <= adapters < checkpoint
    assert a6.offloaded_host_bytes - a3.offloaded_host_bytes == 3 * checkpoint
    assert t6.offloaded_host_bytes - t3.offloaded_host_bytes == 3 * checkpoint


def test_the_analytic_host_figure_follows_the_trace(by_layers):
    """Per layer both count the checkpoint (above); beside the layers the trace's host copies hold ~284 bytes a
    token more than the analytic head terms (the final norm's and the fused loss's saved inputs): measured
    -11.0 % at 3 layers, -6.9 % at 6; at 32 layers of 4,096 that is under 0.1 %."""
    for n in (3, 6):
        a, t = by_layers[n]
        assert t.offloaded_host_bytes > 0
        assert -0.12 <= a.offloaded_host_bytes / t.offloaded_host_bytes - 1 <= 0, n


def test_host_ram_sizes_parse_and_bad_ones_say_the_forms():
    assert parse_host_ram("64GiB") == 64 * GiB == parse_host_ram("64 g") == parse_host_ram("64")
    assert parse_host_ram("65536MiB") == 64 * GiB
    assert parse_host_ram("64GB") == 64 * 10**9
    for bad in ("lots", "-4GiB", "0", ""):
        with pytest.raises(ValueError, match="--host-ram: .* e.g. 64GiB"):
            parse_host_ram(bad)


def _llama8b():
    return load_shape("llama-3.1-8b")


def test_the_planner_refuses_offloaded_checkpoints_the_host_cannot_hold():
    """Llama-3.1-8B QLoRA at 20,480 tokens on a 24 GiB card: the plan offloads its checkpoints (10.5 GiB of fp32
    layer inputs) where the host holds them, and plans without offloading, or nothing, where it does not."""
    shape, dev = _llama8b(), resolve_device("cuda:24GiB")
    s = _settings(micro_batch_size=1, seq_len=20480, loss="auto", activation_offloading=False, rank=32)
    frugal = estimate(shape, most_frugal(s, dev), dev)
    assert frugal.settings["activation_offloading"] and frugal.offloaded_host_bytes > 10 * GiB
    roomy = plan_fit(shape, s, dev, host_limit=host_limit(256 * GiB))
    assert roomy.fits and roomy.settings.activation_offloading, roomy.changes
    assert roomy.estimate.host_bytes == roomy.estimate.offloaded_host_bytes > 10 * GiB
    small = host_limit(8 * GiB)
    tight = plan_fit(shape, s, dev, host_limit=small)
    assert not tight.settings.activation_offloading or not tight.fits, tight.changes
    assert tight.estimate.host_bytes <= small or not tight.fits
    # the budget's rule: an offloaded estimate that fits the GPU fails the host
    offloaded = roomy.estimate
    assert Budget(dev, host_limit=host_limit(256 * GiB)).judge(offloaded).fits
    assert not Budget(dev, host_limit=small).judge(offloaded).fits


def test_the_longest_planned_sequence_fits_and_the_next_step_does_not():
    shape, dev = _llama8b(), resolve_device("cuda:24GiB")
    s = _settings(micro_batch_size=1, seq_len=2048, loss="auto", activation_offloading=False, rank=32, dropout=0.05)
    host = host_limit(512 * GiB)
    n, plan = longest_planned(shape, s, dev, host_limit=host)
    assert plan is not None and plan.fits and plan.settings.seq_len == n
    as_configured = max_seq_len_that_fits(shape, s, dev, longest=1 << 20, host_limit=host)
    assert n > 2 * as_configured > 0
    budget = Budget(dev, host_limit=host)
    assert not budget.judge(estimate(shape, most_frugal(replace(s, seq_len=n + 64), dev), dev)).fits
    # a host that cannot hold the checkpoints: the longest plan does not offload, and is shorter
    m, small = longest_planned(shape, s, dev, host_limit=host_limit(4 * GiB))
    assert small is not None and not small.settings.activation_offloading and 0 < m < n


def _estimate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fitburst.memory.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_estimate_takes_host_ram_and_reports_the_host_side_and_the_longest_plan():
    base = ["--model", "llama-3.1-8b", "--method", "qlora", "--rank", "32", "--seq-len", "4096", "--device",
            "cuda:24GiB", "--grad-checkpointing", "--activation-offloading"]
    d = json.loads(_estimate_cli(*base, "--host-ram", "64GiB", "--json").stdout)
    assert d["host_ram"]["ram_bytes"] == 64 * GiB and d["host_ram"]["limit_bytes"] == host_limit(64 * GiB)
    assert d["host_ram"]["offloaded_bytes"] == d["host_bytes"] > 32 * 4096 * 4096 * 4 - 1
    assert d["longest_seq_len"]["planned"] > d["longest_seq_len"]["as_configured"] > 0
    human = _estimate_cli(*base, "--host-ram", "64GiB")
    assert "pinned host RAM" in human.stdout and "with the plan it would choose" in human.stdout
    bad = _estimate_cli(*base, "--host-ram", "lots")
    assert bad.returncode == 2 and "--host-ram: 'lots'" in bad.stderr and "Traceback" not in bad.stderr


def test_estimate_says_how_long_the_chosen_plan_runs_beside_the_plan_chosen_at_each_length():
    """Llama-3.1-8B QLoRA at 2,048 tokens on 24 GiB does not fit as configured: the plan chosen at 2,048 tokens,
    its settings kept, fits at 2,048 and more (the same analytic estimate chose it), short of the plan the planner
    chooses at the longest length (other rungs); the printed line names each."""
    base = ["--model", "llama-3.1-8b", "--method", "qlora", "--rank", "32", "--batch", "1", "--seq-len", "2048",
            "--device", "cuda:24GiB", "--host-ram", "256GiB"]
    d = json.loads(_estimate_cli(*base, "--json").stdout)
    longest = d["longest_seq_len"]
    planned = RunSettings(**{**d["planned_settings"], "seq_len": 2048})
    dev = resolve_device("cuda:24GiB")
    assert longest["chosen_plan"] == max_seq_len_that_fits(_llama8b(), planned, dev, longest=1 << 20,
                                                           host_limit=host_limit(256 * GiB))
    assert longest["as_configured"] < 2048 <= longest["chosen_plan"] < longest["planned"]
    assert longest["chosen_plan_by"] == "analytic"
    line = " ".join(_estimate_cli(*base).stdout.split())
    assert (f"as configured {longest['as_configured']:,} tokens; with the plan above, its settings kept (chosen at "
            f"2,048 tokens) {longest['chosen_plan']:,} tokens; with the plan it would choose at that length "
            f"{longest['planned']:,} tokens") in line


def test_validate_refuses_offloaded_checkpoints_the_host_cannot_hold(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    body = ("pipelines:\n  big:\n    model: {name: llama-3.1-8b}\n    data: {path: d.jsonl, max_seq_len: %d}\n"
            "    method: {type: qlora, rank: 32}\n    preflight: {device: A100-80GB}\n    training:\n"
            "      gradient_checkpointing: true\n      loss: fused\n      activation_offloading: true\n")
    f = tmp_path / "pipelines.yaml"
    f.write_text(body % 1048576)  # 32 layers x 1M tokens x 4,096 x 4 bytes: 512 GiB of checkpoints
    r = subprocess.run([sys.executable, "-m", "fitburst.cli", "validate", str(f), "--no-data"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "line 10: field 'training.activation_offloading'" in r.stderr, r.stderr
    assert "activation_offloading: false" in r.stderr and "pinned host RAM" in r.stderr
    f.write_text(body % 1024)
    ok = subprocess.run([sys.executable, "-m", "fitburst.cli", "validate", str(f), "--no-data"], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_the_traced_host_peak_counts_host_copies_of_the_measured_step_only():
    ev = [Event("alloc", 1, 100, "warmup.forward", tag="host"), Event("free", 1, 100, "warmup.backward"),
          Event("alloc", 2, 7, "forward"), Event("alloc", 3, 40, "forward", tag="host"),
          Event("alloc", 4, 50, "forward", tag="host"), Event("free", 3, 40, "backward"),
          Event("alloc", 5, 30, "backward", tag="host"), Event("free", 4, 50, "backward")]
    assert traced_host_bytes(ev, start=2) == 90  # 40 + 50 at once; the warm-up's 100 and the device's 7 are not
    assert traced_host_bytes(ev, start=0) == 100


def test_the_planner_combines_rungs_by_fit_then_time():
    """Llama-3.1-8B QLoRA r32 on a 24 GiB card: a short run keeps checkpointing alone, a longer one adds a cheap
    rung, not offloading nor the 8-bit optimizer, and at the longest length the planner finds it takes every rung
    that saves memory here (checkpointing, offloaded checkpoints, the fused loss, dropout 0, the 8-bit optimizer)
    at once."""
    shape, dev, host = _llama8b(), resolve_device("cuda:24GiB"), host_limit(256 * GiB)
    s = _settings(micro_batch_size=1, loss="auto", activation_offloading=False, rank=32, dropout=0.05,
                  optimizer="adamw")

    def planned(n: int) -> RunSettings:
        p = plan_fit(shape, replace(s, seq_len=n), dev, host_limit=host)
        assert p.fits, (n, p.changes)
        return p.settings

    short, mid = planned(2048), planned(4096)
    assert (short.loss, short.activation_offloading, short.optimizer) == ("auto", False, "adamw")
    # a cheap rung (the fused loss, or frozen weights kept 16-bit where that rung exists), not a slow one
    assert mid != replace(short, seq_len=4096) and not mid.activation_offloading and mid.optimizer == "adamw"
    n, plan = longest_planned(shape, replace(s, seq_len=2048), dev, host_limit=host)
    assert plan is not None
    p = plan.settings
    assert (p.gradient_checkpointing, p.activation_offloading, p.loss, p.dropout, p.optimizer) == (
        True, True, "fused", 0.0, "adamw8bit"), p
    assert 4096 < n < 1 << 20


def test_a_plan_that_offloads_more_than_the_host_holds_says_so_and_how_long_fits():
    """Offloading asked for, with every other rung switched off: the host decides, and the miss names it, the fix
    and the longest sequence whose offloaded checkpoints the host holds."""
    shape, dev = _llama8b(), resolve_device("A100-80GB")
    s = _settings(micro_batch_size=1, seq_len=65536, rank=32)
    off = {k: False for k in ("attention", "packing", "dropout", "fused_loss", "optimizer_8bit", "reduce_batch",
                              "gradient_checkpointing", "activation_offloading", "quantize", "precision",
                              "resolution")}
    small = host_limit(24 * GiB)
    plan = plan_fit(shape, s, dev, allow=off, host_limit=small)
    assert not plan.fits and plan.estimate.host_bytes > small
    text = " ".join(plan.changes)
    assert "the host RAM does not" in text and "(offloaded activations)" in text
    assert "training.activation_offloading off" in text and "longest sequence that fits" in text, text
    n = int(text.split("as configured: ")[1].split(" tokens")[0])
    assert 0 < n < 65536
    assert Budget(dev, host_limit=small).judge(estimate(shape, replace(s, seq_len=n), dev)).fits


@pytest.mark.parametrize("device", ["cpu", "M2-Max-64GB"])
def test_validate_refuses_offloading_off_cuda_with_field_and_fix(tmp_path, device):
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    f = tmp_path / "pipelines.yaml"
    f.write_text("pipelines:\n  a:\n    model: {name: llama-3.2-1b}\n    data: {path: d.jsonl}\n"
                 f"    method: {{type: lora}}\n    preflight: {{device: {device}}}\n    training:\n"
                 "      activation_offloading: true\n")
    r = subprocess.run([sys.executable, "-m", "fitburst.cli", "validate", str(f), "--no-data"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "line 8: field 'training.activation_offloading'" in r.stderr and "set it false" in r.stderr, r.stderr
