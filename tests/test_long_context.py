"""The analytic estimate of the best plan at long context (issue 35) against the trace: checkpointing with offloaded
checkpoints, the tiled MLP, frozen 16-bit embeddings and the fused loss together, and each of the first three off.

The terms this holds (fitburst.memory.estimator / activations): TRL's forward stash keeps the device originals of
the last five offloaded checkpoints and the model's forward the first block's input; the embeddings' output is a leaf
held by autograd; the last block's attention is the forward's peak once the MLP is tiled, and the MLP norm's backward
the backward's. That a fused loss adds no logits term to the allocator's reserve is checked against the allocator's
replay in tests/test_trace.py (test_analytic_reserved_of_a_fused_loss_has_no_logits_segments)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fitburst.memory import RunSettings, estimate, load_shape, resolve_device
from fitburst.memory.trace import traced_estimate

# 6 layers (more than the stash's 5), a sequence 32 times the width (32 MLP shards): the activations dominate
CFG = dict(model_type="llama", hidden_size=128, intermediate_size=344, num_hidden_layers=6, num_attention_heads=4,
           num_key_value_heads=2, head_dim=32, vocab_size=3000, tie_word_embeddings=False,
           max_position_embeddings=8192)
BEST = RunSettings(method="qlora", quant="nf4", rank=8, micro_batch_size=1, seq_len=4096, precision="bf16",
                   attention="sdpa", dropout=0.0, keep_logits=False, loss="fused", gradient_checkpointing=True,
                   activation_offloading=True, tiled_mlp=True, frozen_fp32=False, target_modules="all-linear")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the model's shape, the trace of a plan on the A100 stand-in): each plan is traced once per module (about
    20 s each here), so Liger's test reads the trace of :data:`BEST` that the first test made."""
    from fitburst.spec import PipelineSpec

    d = tmp_path_factory.mktemp("long")
    (d / "config.json").write_text(json.dumps(CFG))
    spec = PipelineSpec.model_validate(dict(name="t", model=dict(name=str(d)), data=dict(path="x.jsonl")))
    traces: dict[str, object] = {}

    def traced(s: RunSettings):
        if repr(s) not in traces:
            traces[repr(s)] = traced_estimate(spec, s, resolve_device("A100-80GB"), seq_len=s.seq_len)
        return traces[repr(s)]

    return load_shape(str(d)), traced


@pytest.mark.parametrize("off", ["", "tiled_mlp", "activation_offloading", "frozen_16bit"])
def test_the_analytic_estimate_follows_the_trace_of_the_best_plan(tiny, off):
    """traced / analytic - 1, allocated (measured): +0.2 % with every rung, -1.0 % without the tiled MLP, -0.1 %
    without offloading, +1.3 % without frozen 16-bit embeddings; device total -2.8 %, -3.2 %, -1.2 %, -0.4 %."""
    shape, traced = tiny
    s = {"": BEST, "tiled_mlp": replace(BEST, tiled_mlp=False),
         "activation_offloading": replace(BEST, activation_offloading=False),
         "frozen_16bit": replace(BEST, frozen_fp32=True)}[off]
    dev = resolve_device("A100-80GB")
    a = estimate(shape, s, dev, calibrate=False)
    t = traced(s)
    assert -0.02 <= t.allocated_peak_bytes / a.allocated_peak_bytes - 1 <= 0.02, (a.phases, t.phases)
    assert -0.05 <= t.device_total_bytes / a.device_total_bytes - 1 <= 0.02


def test_ligers_kernels_leave_the_best_plans_forward_peak_where_it_was(tiny):
    """The best plan takes Liger's model kernels on CUDA. Its forward peaks in the last block's attention (a
    checkpointed block, the MLP tiled), where Liger changes no tensor: on k-bit's fp32 stream Liger's RMSNorm leaves
    the same fp32 output as Hugging Face's, and the RoPE temporaries Liger does without are freed before the peak.
    So both estimates put the forward's peak at the same bytes with and without Liger, and with Liger the analytic
    estimate follows the trace within the fixed bounds of the test above (measured: allocated +0.2 %, device total
    -2.8 %, as without Liger). A rule counting an fp32 tensor of the hidden width less at that peak (2 MiB here)
    moves the analytic peak into the backward and reads the trace 4.0 % over it: it fails. At full size the trace's
    device total drops with Liger by 1.40 GiB where its allocated peak does not move: that is the caching
    allocator's reserve, which neither rule here models (benchmarks/results/liger_reserve.txt)."""
    shape, traced = tiny
    dev = resolve_device("A100-80GB")
    on = replace(BEST, liger_kernels=True)
    a_on, a_off = (estimate(shape, s, dev, calibrate=False) for s in (on, BEST))
    t_on, t_off = traced(on), traced(BEST)
    assert a_on.peak_phase == t_on.peak_phase == "forward"
    assert a_on.phases["forward"] == a_off.phases["forward"]
    assert t_on.phases["forward"] == t_off.phases["forward"]
    assert -0.02 <= t_on.allocated_peak_bytes / a_on.allocated_peak_bytes - 1 <= 0.02, (a_on.phases, t_on.phases)
    assert -0.05 <= t_on.device_total_bytes / a_on.device_total_bytes - 1 <= 0.02

