"""What a fused linear cross-entropy allocates: one rule per kernel, read from the library's source, for both
estimates. The kernels cannot run on fake tensors (Triton launches; CCE's torch_compile path runs inductor's
compiled code), so the trace runs :func:`traced_fused_loss`'s stand-in, which allocates what the rule says, in
the order the library does; the analytic estimate sums the same terms (:func:`fused_loss_terms`).

``n``: the rows the loss gets (every position of the micro-batch: the bound, as if every label counted),
``h``: hidden size, ``v``: vocabulary, ``a``: bytes of an element of the dtype the head's matmul runs in (the
autocast dtype, else the weights'), ``head_bytes``: the head weight's own element size, ``head_grad``: the head
trains (full fine-tuning).

- ``cce`` (cut-cross-entropy 25.1, ``cce.py``, ``utils.py``, ``cce_lse_forward.py``, ``indexed_dot.py``,
  ``cce_backward.py``; checked by running that code with the Triton launches stubbed out,
  tests/test_cuda_loss_rules.py): forward keeps ``lse`` (n fp32), the per-vocabulary ``logit_avg`` (v fp32) and the
  labelled rows' indices (``valids``, n int32 at most: fitburst's shifted labels always ignore some rows); the lock
  array is freed before ``neg_dot`` (n fp32, and its soft-capped copy) is made. Backward: ``sort_logit_avg``'s
  argsort (sort's v fp32 values and v int64 indices, then the v int32 ordering), then ``de`` (n x h, the hidden
  states' dtype: the gradient it returns), the two lock arrays (n and v int32, rounded to ``ceil(h / 64)``) and with
  a trained head ``dc`` (v x h in the hidden dtype); a head of another dtype gets ``dc`` cast to it by autograd once
  CCE's saved tensors (and fitburst's cast copy of the head, the estimate's ``head16``) are freed. No autotuning
  copies: CCE tunes only with ``CCE_AUTOTUNE`` set (its fixed configs otherwise).
- ``liger`` (liger-kernel 0.8.5, ``ops/fused_linear_cross_entropy.py``; checked by running that code with the
  Triton launches stubbed out, on the branch CUDA takes, tests/test_cuda_loss_rules.py): the gradients are computed
  in the forward and kept for backward: ``grad_input`` (n x h) and, when the head trains, ``grad_weight`` (v x h in
  the matmul dtype: Liger gets fitburst's cast of the head); ``loss_1d`` (n fp32) and the ignore mask (n bytes)
  live through the forward only. The logits exist one chunk at a time, in one buffer of chunk =
  next_pow2(ceil(n / ceil(v / h))) rows (at most n) of v in the matmul dtype that CUDA's matmuls write into
  (``torch.mm(out=)``, also for the hidden-state gradient); a trained head adds each chunk's v x h gradient and,
  in 16 bits, its fp32 copy (the branch a T4 or V100 and fp32 take). Backward: autograd's cast of ``grad_weight``
  to an fp32 master head.
- ``cce_compile`` (CCE's ``torch_compile`` path, inductor): the compiled graph keeps the logits of the rows it
  computes, in the matmul dtype, for its backward, and writes their gradient in place; a head cast to that dtype
  first (autocast of an fp32 head) leaves one more v x h copy. Measured on this project's CPU box with the torch
  profiler's allocator counts (tests/test_loss.py), not read from a source.
- ``chunked`` (fitburst's own, :func:`fitburst.families.loss.chunked_linear_cross_entropy`): runs on fake
  tensors, so the trace runs it as it is; here, ``EVAL_CHUNK_TOKENS`` rows of standard cross-entropy at a time, each
  recomputed in backward, and the hidden-state gradient accumulated over the chunks.

Pure Python; torch is imported only by the stand-in.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

from fitburst.runconfig import EVAL_CHUNK_TOKENS


@dataclass(frozen=True)
class LossTerms:
    """Bytes of one loss call: ``kept`` from its forward to the end of its backward, ``forward`` and ``backward``
    transient peaks on top of ``kept`` (the backward's includes the hidden-state gradient it returns)."""

    kept: int
    forward: int
    backward: int

    @property
    def peak(self) -> int:
        return self.kept + max(self.forward, self.backward)


def liger_chunk_rows(n: int, h: int, v: int) -> int:
    """Liger's chunk: the logits of one chunk stay about as large as the hidden states (``chunk_mem_const`` 1)."""
    inc = -(-v // h)
    rows = -(-n // inc)
    return min(1 << max(0, math.ceil(math.log2(rows))), n) if rows > 0 else 0


def fused_loss_terms(kernel: str, n: int, h: int, v: int, a: int, *, head_grad: bool = False,
                     head_bytes: int | None = None, softcap: bool = True) -> LossTerms:
    """The rule of ``kernel`` (see the module docstring) for one training call over ``n`` rows. ``softcap``: the
    model soft-caps its logits (the estimate does not know, and counts it: 4n bytes at most)."""
    hb = head_bytes or a
    if kernel == "cce":
        kept = 4 * n + 4 * v + 4 * n  # lse, logit_avg, valids
        fwd = 4 * n * (2 if softcap else 1)  # neg_dot (and its soft-capped copy)
        sort = 12 * v  # argsort: v fp32 values + v int64 indices, then indices + the v int32 ordering
        nd = -(-h // 64)  # CCE's lock arrays: (ceil(rows / nd), nd) int32 for de and for dc
        locks = 4 * nd * (-(-n // nd) + -(-v // nd))
        kernel_phase = 4 * v + n * h * a + locks + (v * h * a if head_grad else 0)  # ordering, de, locks, dc
        # autograd's cast of dc to the head's dtype, once the saved tensors and the head's cast copy (v x h x a,
        # counted by the estimate as head16) are gone; valids lives on in ctx.params
        cast = n * h * a + v * h * hb + 4 * n - kept if head_grad and hb != a else 0
        return LossTerms(kept, fwd, max(sort, kernel_phase, cast))
    if kernel == "liger":
        c = liger_chunk_rows(n, h, v)
        # the gradients, computed in forward and returned by backward: grad_input, and grad_weight in the dtype of
        # the weight Liger gets (fitburst's cast of the head: the matmul dtype)
        kept = n * h * a + (v * h * a if head_grad else 0)
        # loss_1d (n fp32) and the ignore mask (n bool) until forward returns; the one (chunk x v) logits buffer
        # the chunks' matmuls write into (torch.mm(out=): the hidden-state gradient needs no chunk temporary);
        # a trained head's chunk gradient (torch.mm(...).float(): v x h, and its fp32 copy when 16-bit), added
        # into grad_weight
        head_chunk = v * h * a + (4 * v * h if a != 4 else 0) if head_grad else 0
        fwd = 5 * n + c * v * a + head_chunk
        # autograd's cast of grad_weight to a head of another dtype (fp32 master weights), beside it
        return LossTerms(kept, fwd, v * h * hb if head_grad and hb != a else 0)
    if kernel == "cce_compile":  # a head cast to the matmul dtype first (autocast) leaves one more copy of it
        return LossTerms(n * v * a + 4 * n + (v * h * a if hb != a else 0), 0,
                         n * h * a + (v * h * hb if head_grad else 0))
    if kernel == "chunked":
        c = min(n, EVAL_CHUNK_TOKENS)
        upcast = 4 * c * v if a != 4 else 0
        # backward of a chunk: its recomputed logits (and fp32 copy) and log-softmax output, and their gradients
        return LossTerms(0, a * c * v + upcast + 4 * c * v, n * h * a + a * c * v + upcast + 8 * c * v)
    raise ValueError(f"unknown fused loss kernel {kernel!r}")


def hidden_cast(kernel: str, n: int, h: int, a: int, hidden_bytes: int) -> LossTerms:
    """What fitburst's cast of the hidden states to the matmul dtype (``a`` bytes) adds to a training call when they
    come in ``hidden_bytes`` (fp32 under autocast: a k-bit model's stream, CUDA autocast's LayerNorm output):
    the n x h copy, which CCE's Triton kernel saves for its backward and Liger and the compiled graph use in forward
    only; backward, autograd's cast of the hidden-state gradient back beside it (an upper bound: CCE's and the
    compiled graph's peaks come before it). Measured against the three kernels (tests/test_cuda_loss_rules.py)."""
    if hidden_bytes == a or kernel == "chunked":  # the chunked loss casts inside each chunk
        return LossTerms(0, 0, 0)
    copy, grad = n * h * a, n * h * hidden_bytes
    return LossTerms(copy, 0, grad) if kernel == "cce" else LossTerms(0, copy, grad)


def fused_eval_bytes(kernel: str, n: int, h: int, v: int, a: int, *, head_grad: bool = False,
                     head_bytes: int | None = None, softcap: bool = True) -> int:
    """What the eval's loss adds for ``n`` labelled rows at a time under no_grad (fitburst.families.causal);
    ``head_grad``, ``head_bytes``, ``softcap`` as for :func:`fused_loss_terms`."""
    if kernel == "cce":
        valids = 12 * n  # nonzero's int64 row indices and their int32 copy (then dropped: every row is labelled)
        # lse and neg_dot (and its soft-capped copy), the lock array freed before neg_dot; a head that trains and
        # needs no cast reaches CCE with requires_grad even under no_grad: logit_avg too
        loss = 4 * n * (3 if softcap else 2) + (4 * v if head_grad and (head_bytes or a) == a else 0)
        return max(valids, loss)
    if kernel == "liger":  # grad_input is allocated (and left empty) with no gradient asked for; loss_1d, the
        # ignore mask and the logits buffer as in training
        c = liger_chunk_rows(n, h, v)
        return n * h * a + 5 * n + c * v * a
    if kernel == "cce_compile":
        return n * v * a + 4 * n
    return a * n * v + (4 * n * v if a != 4 else 0) + 4 * n * v  # chunked: one chunk of the standard loss


@contextlib.contextmanager
def traced_fused_loss(kernel: str) -> Iterator[None]:
    """While tracing: the library kernels (which cannot run on fake tensors) replaced by a stand-in that allocates
    what :func:`fused_loss_terms` says, in the library's order, and returns a loss and gradients of the right
    shapes. ``chunked`` runs as it is."""
    if kernel == "chunked":
        yield
        return
    from unittest import mock

    import torch

    from fitburst.families import loss as family_loss

    class StandIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, labels):
            n, h = hidden.shape
            v = weight.shape[0]
            a, hb = hidden.element_size(), weight.element_size()
            t = fused_loss_terms(kernel, n, h, v, a, head_grad=weight.requires_grad, head_bytes=hb)
            kept = torch.empty(t.kept, dtype=torch.uint8)
            if t.forward:
                del_me = torch.empty(t.forward, dtype=torch.uint8)
                del del_me
            ctx.save_for_backward(kept)
            ctx.shapes = (hidden, weight, t)
            return hidden.new_zeros((), dtype=torch.float32)

        @staticmethod
        def backward(ctx, grad):
            (kept,) = ctx.saved_tensors
            hidden, weight, t = ctx.shapes
            nbytes = hidden.numel() * hidden.element_size()
            if kernel == "liger":  # the gradient computed in the forward is what backward returns
                grad_hidden = kept[:nbytes].view(hidden.dtype).view(hidden.shape)
            else:
                grad_hidden = torch.empty_like(hidden)
                if t.backward > nbytes:
                    tmp = torch.empty(t.backward - nbytes, dtype=torch.uint8)
                    del tmp
            grad_weight = None
            if weight.requires_grad and kernel == "liger":
                w = weight.numel() * weight.element_size()
                grad_weight = kept[nbytes:nbytes + w].view(weight.dtype).view(weight.shape)
            elif weight.requires_grad:
                grad_weight = torch.empty_like(weight)
            return grad_hidden, grad_weight, None

    def run(hidden, weight, labels, *, kernel: str, softcap: float | None = None):
        return StandIn.apply(hidden, weight, labels)

    with mock.patch.object(family_loss, "_library_loss", run):
        yield


def loss_kernel_of(settings, device) -> str:
    """The loss a run of ``settings`` trains with on ``device``: "standard", or the fused kernel that runs there
    (:func:`fitburst.hardware.fused_loss_kernel`)."""
    from fitburst.hardware import fused_loss_kernel

    return fused_loss_kernel(device, settings.dtype)[0] if settings.fused_loss else "standard"


def describe_lean(settings, device) -> str:
    """Which loss and whether activation offloading a run of ``settings`` trains with on ``device``, in words (the
    preflight report, its artifact and MLflow)."""
    from fitburst.hardware import fused_loss_kernel

    if settings.fused_loss:
        kernel, why = fused_loss_kernel(device, settings.dtype)
        loss = f"fused linear cross-entropy, {kernel} ({why})"
    else:
        loss = "standard (the model's head and cross-entropy over full logits)"
    return f"loss: {loss}; activation offloading: {'on' if settings.offload else 'off'}"
