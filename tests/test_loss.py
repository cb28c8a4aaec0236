"""The fused linear cross-entropy (training.loss: fused): the kernels that run on this CPU give the standard loss
and gradients (fp32 and bf16 autocast), the training step stays token-weighted over an accumulation window, the
families that cannot take it refuse it with a message, and each kernel's memory rule (fitburst.memory.loss_kernels)
agrees with what the library's own code allocates."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fitburst.demo_models import demo_model_dir
from fitburst.families import CAUSAL, IGNORE_INDEX, SEQ2SEQ
from fitburst.families.loss import FusedLossError, chunked_linear_cross_entropy, linear_cross_entropy
from fitburst.hardware import fused_loss_kernel, resolve_device
from fitburst.memory.loss_kernels import fused_eval_bytes, fused_loss_terms


def _standard(hidden, weight, labels, softcap=None):
    logits = (hidden @ weight.T).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _inputs(n=300, h=48, v=2000, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.1
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = IGNORE_INDEX
    return hidden, weight, labels


def _loss_and_grads(fn, hidden, weight, labels, autocast: bool, **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, labels, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


KERNELS = ["chunked", "cce_compile"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fused_kernels_give_the_standard_loss_and_gradients(kernel, autocast):
    if kernel == "cce_compile":
        pytest.importorskip("cut_cross_entropy")
    hidden, weight, labels = _inputs(n=1100 if kernel == "chunked" else 300)  # chunked: two chunks of 1024

    def standard(h, w, y):  # the head as autocast runs it, then the fp32 loss
        return _standard(h, w, y)

    ref = _loss_and_grads(standard, hidden, weight, labels, autocast)
    got = _loss_and_grads(linear_cross_entropy, hidden, weight, labels, autocast, kernel=kernel)
    for what, a, b in zip(("loss", "hidden grad", "head grad"), got, ref, strict=True):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        # the chunked head gradient under bf16 autocast is rounded to bf16 once per chunk, the standard one once
        # over all rows: they differ by bf16's rounding (2**-8); everything else agrees to 1e-4
        limit = 2**-8 if (kernel, what, autocast) == ("chunked", "head grad", True) else 1e-4
        assert rel <= limit, (what, rel)


def test_softcap_is_applied_as_the_model_applies_it():
    hidden, weight, labels = _inputs()
    ref = _standard(hidden, weight, labels, softcap=3.0)
    got = chunked_linear_cross_entropy(hidden, weight, labels, softcap=3.0)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    assert got.item() != pytest.approx(_standard(hidden, weight, labels).item(), rel=1e-3)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fused_training_step_equals_the_standard_one(autocast):
    """Two micro-batches of a LoRA-free tiny Llama with padding: the window's token-weighted loss and every
    gradient match the model's own loss (chunked kernel, which runs everywhere)."""
    from transformers import AutoModelForCausalLM

    from fitburst.train import optimizer_step

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir())
    model.config.use_cache = False
    twin = copy.deepcopy(model)
    micro = []
    for b in range(2):
        ids = torch.randint(5, 300, (2, 12 + 4 * b))
        labels = ids.clone()
        labels[0, :5] = IGNORE_INDEX
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        labels[1, -3:] = IGNORE_INDEX
        micro.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    class Amp:
        scaler = None
        skipped_steps = 0
        last_step_skipped = False

        def autocast(self):
            return torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)

    grads = []
    for m, kernel in ((model, "standard"), (twin, "chunked")):
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        captured = {}
        opt.step = lambda captured=captured, m=m: captured.update(  # type: ignore[method-assign]
            {n: p.grad.clone() for n, p in m.named_parameters()})
        loss = optimizer_step(m, opt, list(m.parameters()), micro, device="cpu", max_grad_norm=None, amp=Amp(),
                              loss=kernel)
        grads.append((loss, captured))
    (l0, g0), (l1, g1) = grads
    assert l1 == pytest.approx(l0, rel=1e-4)
    tol = 2e-2 if autocast else 1e-4  # bf16 matmuls: the two heads' bf16 roundings differ per element
    for name, ref in g0.items():
        torch.testing.assert_close(g1[name], ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_encoder_decoder_refuses_the_fused_loss():
    assert CAUSAL.fused_loss_refusal is None
    assert "encoder-decoder" in (SEQ2SEQ.fused_loss_refusal or "")
    with pytest.raises(FusedLossError, match="training.loss: standard"):
        SEQ2SEQ.train_loss(None, {}, torch.tensor(1), "cce_compile")


def test_kernel_per_device():
    assert fused_loss_kernel(resolve_device("A6000"), "bf16")[0] == "cce"
    assert fused_loss_kernel(resolve_device("A6000"), "fp32")[0] == "liger"  # CCE's backward takes 16 bits only
    assert fused_loss_kernel(resolve_device("T4"), "fp16")[0] == "liger"
    assert fused_loss_kernel(resolve_device("M2-Max-32GB"), "bf16")[0] == "cce_compile"
    assert fused_loss_kernel(resolve_device("cpu"), "fp32")[0] in ("cce_compile", "chunked")


# --- the memory rules against the libraries' own code --------------------------------------------------------


def _allocations(fn) -> list[int]:
    """The torch profiler's allocator events (bytes, + allocated, - freed) of ``fn()``, in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.nbytes() for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
            if e.name() == "[memory]"]


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("head_grad", [False, True], ids=["lora", "full"])
def test_cce_compile_rule_matches_inductors_allocations(head_grad, softcap):
    """CCE's torch_compile path, run for real on this CPU as the loop runs it (the hidden states are the body's
    output, which nothing but the loss holds): what it keeps after its forward, its forward's peak with the hidden
    states alive, and the whole call's peak (its backward runs after the hidden states were freed) are the rule's,
    to a row of the bound (the rule counts every row; the last one has no label)."""
    pytest.importorskip("cut_cross_entropy")
    n, h, v = 512, 64, 3000
    base = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.05).requires_grad_(head_grad)
    labels = torch.randint(0, v, (n,))
    labels[-1] = IGNORE_INDEX
    marks = []

    def step() -> None:
        hidden = base * 1.0  # the body's output
        loss = linear_cross_entropy(hidden, weight, labels, kernel="cce_compile", softcap=softcap)
        del hidden
        marks.append(torch.empty(999_983, dtype=torch.uint8))  # an allocation that marks the forward's end
        marks.clear()
        loss.backward()

    step()  # compiled before the measured call
    base.grad = weight.grad = None
    events = _allocations(step)
    mark = events.index(999_983)
    events[mark:mark + 2] = [0, 0]  # the mark and its free
    cur, curve = 0, []
    for b in events:
        cur += b
        curve.append(cur)
    hidden = n * h * 4
    fwd_peak, kept = max(curve[:mark]), curve[mark - 1]
    rule = fused_loss_terms("cce_compile", n, h, v, 4, head_grad=head_grad, softcap=softcap is not None)
    assert rule.released == hidden
    assert kept == pytest.approx(rule.kept, rel=0.005)  # the hidden states already freed
    assert fwd_peak == pytest.approx(hidden + rule.kept + rule.forward, rel=0.005)
    assert max(curve) == pytest.approx(hidden + rule.peak, rel=0.005)
    assert curve[-1] == hidden + (v * h * 4 if head_grad else 0)  # base.grad and weight.grad, left by the call


def test_cce_compile_eval_rule_matches_inductors_allocations():
    """The eval's call (no_grad): the gathered rows and their logits coexist, as in the training forward."""
    pytest.importorskip("cut_cross_entropy")
    n, h, v = 512, 64, 3000
    hidden, weight = torch.randn(n, h), torch.randn(v, h) * 0.05
    labels = torch.randint(0, v, (n,))
    labels[-1] = IGNORE_INDEX

    def call() -> None:
        with torch.no_grad():
            linear_cross_entropy(hidden, weight, labels, kernel="cce_compile")

    call()  # compiled before the measured call
    cur = peak = 0
    for b in _allocations(call):
        cur += b
        peak = max(peak, cur)
    assert peak == pytest.approx(fused_eval_bytes("cce_compile", n, h, v, 4, softcap=False), rel=0.005)


def test_eval_loss_with_the_fused_kernel_equals_the_standard_one(demo_spec, demo_prepared):
    """The eval runs the same loss kernel as training: the chunked one gives the eval's standard figure."""
    from fitburst.data import load_split
    from fitburst.models import load_pipeline_model, load_tokenizer

    rows = load_split(demo_prepared, "val").to_list()[:16]
    model = load_pipeline_model(demo_spec, "cpu", "fp32")
    pad = load_tokenizer(demo_spec.model.name).pad_token_id
    std = CAUSAL.eval_loss(model, rows, pad, 4, "cpu", chunk_tokens=64)
    fused = CAUSAL.eval_loss(model, rows, pad, 4, "cpu", chunk_tokens=64, kernel="chunked")
    assert fused[1] == std[1] > 64
    assert fused[0] == pytest.approx(std[0], rel=1e-5)
