"""The CUDA fused-loss rule of Cut Cross-Entropy's Triton kernel (fitburst.memory.loss_kernels, ``cce``) against
CCE's own code, on this CPU:

- memory: CCE's Python autograd Function (cce.py and the kernel wrappers), called as fitburst calls it, with the three
  Triton launches stubbed out (they write into buffers the wrappers allocate, and allocate nothing themselves); the
  torch profiler counts every allocation of the CPU allocator;
- numbers: the kernels themselves under Triton's interpreter (``TRITON_INTERPRET=1``), in fp16 (the interpreter
  computes no bf16: it stores it as uint16 and multiplies the bit patterns), against the standard loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import op_outputs_mode

from fitburst.families.loss import linear_cross_entropy, shifted_labels
from fitburst.memory.loss_kernels import LossTerms, fused_eval_bytes, fused_loss_terms, hidden_cast

pytest.importorskip("cut_cross_entropy")
pytest.importorskip("triton")

KERNELS = (("cut_cross_entropy.cce_lse_forward", "_cce_lse_forward_kernel"),
           ("cut_cross_entropy.indexed_dot", "_indexed_neg_dot_forward_kernel"),
           ("cut_cross_entropy.cce_backward", "_cce_backward_kernel"))
B, S, H, V = 4, 250, 64, 3000  # n = 1000 rows; small enough that every term of the rule shows
PAD = 20  # padded positions at the end of each sequence (labels -100)


class _NoLaunch:
    """A Triton kernel whose launch (``kernel[grid](...)``) does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.fixture
def stubbed(monkeypatch):
    import importlib

    for module, name in KERNELS:
        monkeypatch.setattr(importlib.import_module(module), name, _NoLaunch())


def _profiled(fn):
    """(peak, end) of the bytes the CPU allocator holds during ``fn()`` above what it held before, and its result."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    cur = peak = 0
    for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if e.name() == "[memory]":
            cur += e.nbytes()
            peak = max(peak, cur)
    return peak, cur, out


def _inputs(dtype, head: str):
    """The hidden states (leaf, as the body hands them) and the head's weight: ``frozen`` (LoRA), ``trained`` (full
    fine-tune in the 16-bit dtype) or ``fp32`` (full fine-tune with fp32 master weights under autocast); the
    causal family's shifted labels of a padded batch, flattened."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B * S, H, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.1).to(torch.float32 if head == "fp32" else dtype)
    weight.requires_grad_(head != "frozen")
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, S - PAD:] = -100
    return hidden, weight, shifted_labels(labels).reshape(-1)


@pytest.mark.parametrize("head", ["frozen", "trained", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cce_rule_matches_what_cce_allocates(stubbed, dtype, head, softcap):
    """Forward (what it keeps, its transient peak) and backward (its peak, the gradients it returns included) of
    CCE's Function as fitburst's causal family calls it: the rule's figures, up to the bound it takes (every row
    labelled: lse, valids, neg_dot, its capped copy and the de lock array are sized by the labelled rows)."""
    hidden, weight, labels = _inputs(dtype, head)
    a, n = hidden.element_size(), hidden.shape[0]
    labelled = int((labels != -100).sum())
    slack = 16 * (n - labelled) + 16  # the bound: up to 4 arrays of rows; the loss and its gradient (0-dim)

    def forward():
        with torch.autocast("cpu", dtype=dtype, enabled=head == "fp32"):
            return linear_cross_entropy(hidden, weight, labels, kernel="cce", softcap=softcap)

    forward().backward()  # compiles CCE's sort_logit_avg before the measured step
    hidden.grad = weight.grad = None
    f_peak, kept, loss = _profiled(forward)
    b_peak, _, _ = _profiled(loss.backward)
    rule = fused_loss_terms("cce", n, H, V, a, head_grad=head != "frozen", head_bytes=weight.element_size(),
                            softcap=softcap is not None)
    head16 = V * H * a if head == "fp32" else 0  # fitburst's cast of the head: the estimate's head16, not the rule's
    assert 0 <= rule.kept + head16 - kept <= slack, (kept, rule)
    assert 0 <= rule.kept + head16 + rule.forward - f_peak <= slack, (f_peak, rule)
    assert 0 <= rule.kept + head16 + rule.backward - (kept + b_peak) <= slack, (kept + b_peak, rule)


@pytest.mark.parametrize("head", ["frozen", "trained", "fp32"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cce_eval_rule_matches_what_cce_allocates(stubbed, head, softcap):
    """The eval's call (fitburst.families.causal.eval_loss): labelled rows only, under no_grad, hidden states with
    no gradient; a trained head that needs no cast still reaches CCE with requires_grad."""
    hidden, weight, labels = _inputs(torch.bfloat16, head)
    keep = labels != -100
    hidden, labels = hidden.detach()[keep], labels[keep]
    n = hidden.shape[0]

    def forward():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=head == "fp32"):
            return linear_cross_entropy(hidden, weight, labels, kernel="cce", softcap=softcap)

    forward()
    peak, _, _ = _profiled(forward)
    head16 = V * H * 2 if head == "fp32" else 0  # fitburst's cast of the head, freed with the call
    rule = fused_eval_bytes("cce", n, H, V, 2, head_grad=head != "frozen", head_bytes=weight.element_size(),
                            softcap=softcap is not None)
    assert abs(rule + head16 - peak) <= 16, (peak, rule)  # the loss and its sum (0-dim fp32)


def test_cce_kernels_are_not_autotuned():
    """CCE tunes its kernels only with CCE_AUTOTUNE set; the tuner would clone LSE (``restore_value``) and
    Triton's benchmark would allocate its 256 MiB L2-flush buffer on the first call of each shape, which the rule
    leaves out. Unset, the kernels run one fixed configuration (a Heuristics, not an Autotuner)."""
    import importlib

    from triton.runtime.autotuner import Autotuner, Heuristics

    if os.environ.get("CCE_AUTOTUNE", "0") != "0":
        pytest.skip("CCE_AUTOTUNE is set here")
    for module, name in KERNELS:
        kernel = getattr(importlib.import_module(module), name)
        assert isinstance(kernel, Heuristics) and not isinstance(kernel, Autotuner), (name, type(kernel))


_INTERPRETED = textwrap.dedent("""
    import types, sys, torch
    import triton.language as tl
    import cut_cross_entropy.tl_utils as tl_utils
    # the interpreter runs no extern (libdevice) call: log1p and tanh from triton.language's own functions
    tl_utils.tl_libdevice = types.SimpleNamespace(log1p=lambda x: tl.log(1.0 + x),
                                                  tanh=lambda x: 2.0 * tl.sigmoid(2.0 * x) - 1.0)
    from fitburst.families.loss import linear_cross_entropy, shifted_labels
    from torch.nn.functional import cross_entropy

    def rel(x, ref):
        return float((x.float() - ref).abs().max() / ref.abs().max())

    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for softcap in (None, 30.0):
        for train_head in (False, True):
            hidden = torch.randn(96, 64, generator=g).half().requires_grad_(True)
            weight = (torch.randn(300, 64, generator=g) * 0.2).half().requires_grad_(train_head)
            labels = torch.randint(0, 300, (2, 48), generator=g)
            labels[:, -6:] = -100
            labels = shifted_labels(labels).reshape(-1)
            loss = linear_cross_entropy(hidden, weight, labels, kernel="cce", softcap=softcap)
            loss.backward()
            h32 = hidden.detach().float().requires_grad_(True)
            w32 = weight.detach().float().requires_grad_(True)
            logits = h32 @ w32.T
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            ref = cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            ref.backward()
            errs = [rel(loss.detach(), ref.detach()), rel(hidden.grad, h32.grad)]
            if train_head:
                errs.append(rel(weight.grad, w32.grad))
            print(softcap, train_head, errs)
            worst = max(worst, *errs)
    print("worst", worst)
    sys.exit(0 if worst < 1e-2 else 1)
""")


# One process runs the three interpreted checks below, one after another, each script as it would run alone (its
# own sys.argv, its exit status caught): a process here spends ~7 s of CPU importing torch, Triton, the kernels and
# fitburst's loss before the kernels run in a few seconds. CCE's check runs first, before Liger's script widens the
# interpreter's float arguments; Liger's CUDA branch runs last, since its script patches Liger's module for the
# rest of the process.
_DRIVER = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    for name, source, argv in json.loads(sys.argv[1]):
        sys.argv, out, code = ["-c", *argv], io.StringIO(), None
        with contextlib.redirect_stdout(out):
            try:
                exec(compile(source, name, "exec"), {"__name__": "__main__"})
            except SystemExit as e:
                code = e.code
            except BaseException:
                code = traceback.format_exc()
        print(json.dumps({"check": name, "code": code, "out": out.getvalue()}), flush=True)
""")


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """check name -> its exit code and output, from one process running every check under Triton's interpreter."""
    checks = [("cce", _INTERPRETED, [])]
    try:
        import liger_kernel  # noqa: F401

        checks += [("liger-cpu", _LIGER_INTERPRETED, ["cpu"]), ("liger-cuda", _LIGER_INTERPRETED, ["cuda"])]
    except ImportError:
        pass
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("CCE_AUTOTUNE", None)
    run = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(checks)], env=env, capture_output=True,
                         text=True, timeout=600)
    results = {r["check"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert run.returncode == 0 and len(results) == len(checks), run.stdout + run.stderr[-3000:]
    return results


def test_cce_triton_kernels_under_the_interpreter_give_the_standard_loss(interpreted):
    """CCE's three Triton kernels run for real (Triton's interpreter, on CPU tensors), called as fitburst calls them
    (shifted labels with ignored rows, soft-capping or not, a frozen or trained head): the loss and the gradients of
    the hidden states and the head equal the standard loss's to 1e-2 relative (fp16 inputs, fp32 reference)."""
    run = interpreted["cce"]
    assert run["code"] in (0, None), run["out"] + str(run["code"])


# Liger Kernel's fused linear cross-entropy (fitburst.memory.loss_kernels, ``liger``; liger-kernel 0.8.5): the
# kernel fitburst runs on CUDA cards older than Ampere (a T4, a V100: fp16 under autocast) and in fp32

_LIGER_INTERPRETED = textwrap.dedent("""
    import sys, types, torch
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter
    import liger_kernel.ops.cross_entropy as liger_ce
    import liger_kernel.ops.fused_linear_cross_entropy as flce
    # the interpreter runs no extern (libdevice) call: tanh from triton.language's own sigmoid
    liger_ce.tanh = lambda x: 2.0 * tl.sigmoid(2.0 * x) - 1.0
    # the interpreter hands a Python float argument (the soft-cap) to a kernel as a Python float (its _implicit_cvt
    # converts bools, ints and tensors only), where compiled Triton passes an fp32 scalar, which Liger's kernel
    # casts (softcap.to(tl.float32))
    _cvt = interpreter._implicit_cvt
    def _cvt_float(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return _cvt(arg)
    interpreter._implicit_cvt = _cvt_float
    from fitburst.families.loss import linear_cross_entropy, shifted_labels
    from torch.nn.functional import cross_entropy

    def rel(x, ref):
        return float((x.float() - ref).abs().max() / ref.abs().max())

    CUDA_PATH = sys.argv[1] == "cuda"
    if CUDA_PATH:  # the branch CUDA takes: the matmuls write into Liger's buffers (torch.mm(out=...))
        _can = flce._can_use_mm_out
        cuda = types.SimpleNamespace(type="cuda")
        flce._can_use_mm_out = lambda x, w: _can(types.SimpleNamespace(device=cuda, dtype=x.dtype), w)
        with torch.no_grad():  # as in Liger's Function.forward
            assert flce._can_use_mm_out(torch.zeros(1), torch.zeros(1))
    g = torch.Generator().manual_seed(0)
    worst = {}
    for dtype in (torch.float16, torch.float32):
        for head in ("frozen", "trained", "fp32"):
            if head == "fp32" and dtype == torch.float32:
                continue
            for softcap in (None, 30.0):
                n, h, v = 96, 64, 300  # 3 chunks of 32 rows
                wide = torch.float32 if head == "fp32" else dtype  # fp32 master weights and hidden states
                hidden = torch.randn(n, h, generator=g).to(wide).requires_grad_(True)
                weight = (torch.randn(v, h, generator=g) * 0.2).to(wide).requires_grad_(head != "frozen")
                labels = torch.randint(0, v, (2, n // 2), generator=g)
                labels[:, -6:] = -100
                labels = shifted_labels(labels).reshape(-1)
                count = int((labels != -100).sum())
                with torch.autocast("cpu", dtype=torch.float16, enabled=head == "fp32"):
                    loss = linear_cross_entropy(hidden, weight, labels, kernel="liger", softcap=softcap)
                (loss / count).backward()  # divided as the family does: Liger's element_mul_kernel runs
                h32 = hidden.detach().to(dtype).float().requires_grad_(True)
                w32 = weight.detach().to(dtype).float().requires_grad_(True)
                logits = h32 @ w32.T
                if softcap:
                    logits = torch.tanh(logits / softcap) * softcap
                ref = cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
                (ref / count).backward()
                errs = [rel(loss.detach(), ref.detach()), rel(hidden.grad, h32.grad)]
                assert hidden.grad.dtype == hidden.dtype
                if head != "frozen":
                    assert weight.grad.dtype == weight.dtype
                    errs.append(rel(weight.grad, w32.grad))
                print(dtype, head, softcap, errs)
                worst[dtype] = max(worst.get(dtype, 0.0), *errs)
    print("worst", worst)
    sys.exit(0 if worst[torch.float16] < 2e-3 and worst[torch.float32] < 1e-5 else 1)
""")


@pytest.mark.parametrize("path", ["cuda", "cpu"])
def test_liger_triton_kernels_under_the_interpreter_give_the_standard_loss(interpreted, path):
    """Liger's two Triton kernels (the cross-entropy that writes the logits' gradient in place, and the gradient
    scaling of backward) run for real under Triton's interpreter, called as fitburst calls them (shifted labels
    with ignored rows, soft-capping or not, a frozen, trained or fp32 head under fp16 autocast, 3 chunks): the loss
    and the gradients of the hidden states and the head equal the standard loss's, to 2e-3 relative in fp16
    (fp32 reference) and 1e-5 in fp32; on the branch CUDA takes (its matmuls into Liger's buffers) and CPU's."""
    pytest.importorskip("liger_kernel")
    run = interpreted[f"liger-{path}"]
    assert run["code"] in (0, None), run["out"] + str(run["code"])


LIGER_SHAPES = [(1000, 64, 3000), (777, 64, 3000), (96, 64, 300), (40, 128, 100)]  # chunks of 32, 32, 32 rows;
# one chunk of all 40 rows (v < h: the logits of every row are smaller than the hidden states)


@pytest.fixture
def liger_stubbed(monkeypatch):
    """Liger's Function with its two Triton launches made no-ops (they write in place into Liger's buffers), on the
    branch CUDA takes: ``_can_use_mm_out`` (Liger's own test) sees the input as a CUDA tensor, so the logits chunk
    and the hidden-state gradient are written by ``torch.mm(out=...)`` into Liger's buffers; the head-gradient
    accumulation takes its portable branch (``torch.mm(...).float()``), which is CUDA's on a T4 or V100 and in fp32
    (the addmm branches need compute capability 8 and a 16-bit gradient: CCE's case, not Liger's)."""
    import types

    flce = pytest.importorskip("liger_kernel.ops.fused_linear_cross_entropy")
    monkeypatch.setattr(flce, "liger_cross_entropy_kernel", _NoLaunch())
    monkeypatch.setattr(flce, "element_mul_kernel", _NoLaunch())
    can = flce._can_use_mm_out
    cuda = types.SimpleNamespace(type="cuda")
    monkeypatch.setattr(flce, "_can_use_mm_out",
                        lambda x, w: can(types.SimpleNamespace(device=cuda, dtype=x.dtype), w))


def _op_outputs(fn, inputs):
    """Runs ``fn(mark)`` counting the storages its ops create beyond ``inputs``: (bytes live when it calls
    ``mark()``, peak before that, peak after it, its result)."""
    # what a CUDA run allocates through the caching allocator, where the profiler on this CPU also counts the
    # workspaces its 16-bit matmuls make inside the op (cuBLAS's are not the loss's)
    rec = op_outputs_mode(inputs)
    split: list[tuple[int, int]] = []
    with rec:
        out = fn(lambda: split.append((len(rec.trail), rec.cur)))
    at, kept = split[0]
    return kept, max(rec.trail[:at], default=0), max(rec.trail[at:], default=kept), out


def _liger_inputs(n, h, v, dtype, head, hidden32=False):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(torch.float32 if hidden32 else dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.1).to(torch.float32 if head == "fp32" else dtype)
    weight.requires_grad_(head != "frozen")
    labels = torch.randint(0, v, (1, n), generator=g)
    labels[:, n - 5:] = -100
    return hidden, weight, shifted_labels(labels).reshape(-1)


def _liger_step(hidden, weight, labels, amp: bool):
    """fitburst's call under fp16 autocast or none, and its backward as the family runs it (divided by the labelled
    tokens): (kept after forward, forward peak, backward peak) of what its ops create."""
    count = int((labels != -100).sum())

    def step(mark):
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = linear_cross_entropy(hidden, weight, labels, kernel="liger")
        mark()
        (loss / count).backward()

    kept, fwd, bwd, _ = _op_outputs(step, (hidden, weight, labels))
    return kept, fwd, bwd


LIGER_CASES = [(torch.float16, "frozen"), (torch.float16, "trained"), (torch.float16, "fp32"),
               (torch.float32, "frozen"), (torch.float32, "trained")]


@pytest.mark.parametrize("shape", LIGER_SHAPES)
@pytest.mark.parametrize(("dtype", "head"), LIGER_CASES)
def test_liger_rule_matches_what_liger_allocates(liger_stubbed, shape, dtype, head):
    """Liger's forward (what it keeps for backward, its transient peak) and backward, called as fitburst calls it
    (fp16 under autocast with a frozen, trained or fp32 master head; fp32), on shapes of several chunks, a ragged
    last chunk and one chunk: the rule's figures, to 64 bytes (the 0-dim losses and sums)."""
    n, h, v = shape
    hidden, weight, labels = _liger_inputs(n, h, v, dtype, head)
    amp = head == "fp32"
    a = hidden.element_size()
    kept, fwd, bwd = _liger_step(hidden, weight, labels, amp)
    rule = fused_loss_terms("liger", n, h, v, a, head_grad=head != "frozen", head_bytes=weight.element_size())
    head16 = v * h * a if amp else 0  # fitburst's cast of the head (the estimate's head16), freed after forward
    assert abs(rule.kept - kept) <= 64, (kept, rule)
    assert abs(rule.kept + head16 + rule.forward - fwd) <= 64, (fwd, rule)
    assert abs(rule.kept + rule.backward - bwd) <= 64, (bwd, rule)


@pytest.mark.parametrize("shape", LIGER_SHAPES)
@pytest.mark.parametrize(("dtype", "head"), LIGER_CASES)
def test_liger_eval_rule_matches_what_liger_allocates(liger_stubbed, shape, dtype, head):
    """The eval's call: labelled rows only, under no_grad, hidden states with no gradient (Liger still allocates
    the hidden-state gradient buffer, and computes nothing into it)."""
    n, h, v = shape
    hidden, weight, labels = _liger_inputs(n, h, v, dtype, head)
    keep = labels != -100
    hidden, labels = hidden.detach()[keep], labels[keep]
    amp = head == "fp32"

    def ev(mark):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            out = linear_cross_entropy(hidden, weight, labels, kernel="liger")
        mark()
        return out

    _, peak, _, _ = _op_outputs(ev, (hidden, weight, labels))
    a = hidden.element_size()
    head16 = v * h * a if amp else 0
    rule = fused_eval_bytes("liger", hidden.shape[0], h, v, a, head_grad=head != "frozen",
                            head_bytes=weight.element_size())
    assert abs(rule + head16 - peak) <= 64, (peak, rule)


def test_liger_op_outputs_are_the_allocators_in_fp32(liger_stubbed):
    """The count the Liger tests take (op outputs) against the torch profiler's allocator count, in fp32 where the
    CPU's matmuls allocate no workspace of their own: the same forward peak."""
    hidden, weight, labels = _liger_inputs(1000, 64, 3000, torch.float32, "trained")
    _, fwd, _ = _liger_step(hidden, weight, labels, False)
    hidden.grad = weight.grad = None
    peak, _, _ = _profiled(lambda: linear_cross_entropy(hidden, weight, labels, kernel="liger"))
    assert abs(peak - fwd) <= 64, (peak, fwd)


# fitburst's own cast of fp32 hidden states (a k-bit model's fp32 stream, CUDA autocast's fp32 LayerNorm output)
# to the matmul dtype before the kernel (fitburst.families.loss.linear_cross_entropy)

@pytest.mark.parametrize("kernel", ["liger", "cce", "cce_compile"])
def test_the_hidden_state_cast_is_what_the_estimate_adds(liger_stubbed, stubbed, kernel):
    """A frozen head (LoRA) under fp16 autocast, hidden states in fp32 against the same in fp16: what the cast
    adds to the call's kept bytes, forward peak and backward peak is within ``hidden_cast``'s terms, which hold
    it to 256 bytes where it is the peak (CCE keeps the copy for backward; Liger and the compiled graph use it in
    forward only). Liger's is counted by op outputs, CCE's by the profiler (its compiled argsort refuses a dispatch
    mode; it makes no matmul), the compiled path runs for real."""
    n, h, v = 1000, 64, 3000
    got = []
    for wide in (False, True):
        hidden, weight, labels = _liger_inputs(n, h, v, torch.float16, "frozen", hidden32=wide)

        def step(mark, hidden=hidden, weight=weight, labels=labels):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = linear_cross_entropy(hidden, weight, labels, kernel=kernel)
            mark()
            loss.backward()

        step(lambda: None)  # compiles what CCE compiles before the measured call
        hidden.grad = None
        if kernel == "liger":
            kept, fwd, bwd, _ = _op_outputs(step, (hidden, weight, labels))
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                fwd, kept, loss = _profiled(lambda h=hidden, w=weight, y=labels: linear_cross_entropy(
                    h, w, y, kernel=kernel))
            bwd = kept + _profiled(loss.backward)[0]
        got.append((kept, fwd, bwd))
    (k0, f0, b0), (k1, f1, b1) = got
    cast = hidden_cast(kernel, n, h, 2, 4)
    assert abs(k1 - k0 - cast.kept) <= 256, (k1 - k0, cast)
    assert abs(f1 - f0 - cast.kept - cast.forward) <= 256, (f1 - f0, cast)
    assert 0 <= cast.kept + cast.backward - (b1 - b0) <= n * h * 4, (b1 - b0, cast)
    assert hidden_cast(kernel, n, h, 2, 2) == LossTerms(0, 0, 0)


@pytest.mark.parametrize(("device", "kernel"), [("A100-80GB", "cce"), ("T4", "liger")])
def test_the_estimate_counts_the_cast_of_a_qlora_models_fp32_hidden_states(monkeypatch, device, kernel):
    """QLoRA under autocast: the k-bit model's stream (and so its final hidden states) is fp32, and fitburst casts
    them to the 16-bit matmul dtype for the fused kernel: the estimate's loss phase holds that n x h 16-bit copy
    (CCE keeps it for backward, Liger uses it in forward); a LoRA run's 16-bit hidden states need no cast."""
    from fitburst.hardware import resolve_device
    from fitburst.memory import estimator, load_shape
    from fitburst.settings import RunSettings

    shape = load_shape("Qwen/Qwen2.5-7B")
    dtype = "bf16" if kernel == "cce" else "fp16"
    dev = resolve_device(device)
    n = 2 * 1024
    for quant, copy in (("nf4", 2 * n * shape.hidden), ("none", 0)):
        s = RunSettings(method="lora", quant=quant, precision=dtype, micro_batch_size=2, seq_len=1024, loss="fused")
        with_cast = estimator.estimate(shape, s, dev, calibrate=False).phases["loss"]
        with monkeypatch.context() as m:
            m.setattr(estimator, "hidden_cast", lambda *a, **k: LossTerms(0, 0, 0))
            without = estimator.estimate(shape, s, dev, calibrate=False).phases["loss"]
        assert with_cast - without >= copy and (copy or with_cast == without), (quant, with_cast - without)
