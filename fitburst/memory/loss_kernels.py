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
- ``cce_compile`` (CCE's ``torch_compile`` path, ``torch_compile.py`` and ``utils._build_flat_valids``, compiled by
  inductor): the rows with a label are gathered first (``e[valids]``: a copy of the hidden states, the int32 row
  indices and the int64 targets; fitburst's shifted labels always ignore the last position, so it always gathers),
  then one compiled graph computes the logits in the matmul dtype and keeps them, with the row maxima and
  log-sum-exps, for its backward, and the gathered copy too when the head trains (its gradient needs it). The
  library keeps no reference to the hidden states it was given (``released``). Backward writes the logits'
  gradient in place, allocates the head's gradient (a trained head) before freeing the gathered copy, then the
  gathered rows' gradient; after the logits go, the indexing's backward scatters it into a zeroed n x h gradient.
  :func:`cce_compile_steps` lists these allocations and frees in the library's order: the stand-in replays them,
  the analytic estimate takes their peaks. Read from the AOT graphs (``TORCH_LOGS=aot_graphs``) and the torch
  profiler's allocator events of real calls on this project's CPU (tests/test_loss.py).
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

from fitburst.settings import EVAL_CHUNK_TOKENS


@dataclass(frozen=True)
class LossTerms:
    """Bytes of one loss call: ``kept`` from its forward to the end of its backward, ``forward`` and ``backward``
    transient peaks on top of ``kept`` (the backward's includes the hidden-state gradient it returns);
    ``released``: bytes of the hidden states given to the kernel that it holds no reference to, so that (nothing
    else keeping the final norm's output) they are freed before its backward runs."""

    kept: int
    forward: int
    backward: int
    released: int = 0

    @property
    def peak(self) -> int:
        """The call's peak on top of what was live before it, the hidden states given to it included."""
        return self.kept + max(self.forward, self.backward - self.released)

    def plus(self, other: LossTerms) -> LossTerms:
        """Both calls' bytes together, at the same moments (``other``: fitburst's cast around the kernel)."""
        return LossTerms(self.kept + other.kept, self.forward + other.forward, self.backward + other.backward,
                         self.released + other.released)


Step = tuple[str, int]  # (name, bytes): an allocation of ``bytes``; (name, 0): the free of ``name``


def cce_compile_steps(n: int, h: int, v: int, a: int, *, head_grad: bool = False, head_bytes: int | None = None,
                      softcap: bool = False) -> tuple[list[Step], list[Step]]:
    """CCE's torch_compile path, allocation by allocation, (forward steps, backward steps) in the library's order
    (see the module docstring). ``head_bytes`` other than ``a``: a trained head of another dtype (an fp32 head under
    autocast) gets its gradient cast back by autograd once the logits are gone. fitburst's cast copy of such a head
    (kept by the compiled graph until then) is the estimate's ``head16``, as for the other kernels; the trace makes
    it itself. ``softcap``: the graph keeps the uncapped logits only; the capped ones (and their fp32 copy, for a
    16-bit matmul) exist in its forward, and the tanh's gradient in its backward."""
    hb = head_bytes or a
    fwd: list[Step] = [("valids", 4 * n), ("targets", 8 * n),  # the gather's int32 row indices, int64 targets
                       ("rows", n * h * a),  # the gathered hidden states
                       ("logits", n * v * a)]
    if softcap:
        fwd += ([("capped", n * v * a), ("capped32", 4 * n * v), ("capped", 0), ("capped32", 0)] if a != 4
                else [("capped", n * v * a), ("capped", 0)])
    fwd.append(("lse", 8 * n))  # the row maxima and log-sum-exps (fp32)
    if not head_grad:
        fwd.append(("rows", 0))  # only the head's gradient needs them
    bwd: list[Step] = [("targets", 0), ("lse", 0)]  # read into the logits' gradient first
    if softcap:
        bwd += [("capped_grad", n * v * a), ("capped_grad", 0)]
    if head_grad:
        bwd += [("grad_head", v * h * a), ("rows", 0)]
    bwd += [("grad_rows", n * h * a), ("logits", 0), ("grad_hidden", n * h * a), ("grad_rows", 0), ("valids", 0)]
    if head_grad and hb != a:
        bwd += [("grad_head_cast", v * h * hb), ("grad_head", 0)]
    return fwd, bwd


def _replay(steps: list[Step], live: dict[str, int]) -> int:
    """Apply ``steps`` to ``live`` (name: bytes); the peak of the live total over them."""
    peak = sum(live.values())
    for name, nbytes in steps:
        if nbytes:
            live[name] = nbytes
        else:
            del live[name]
        peak = max(peak, sum(live.values()))
    return peak


def _terms_of_steps(fwd: list[Step], bwd: list[Step], released: int) -> LossTerms:
    live: dict[str, int] = {}
    fwd_peak = _replay(fwd, live)
    kept = sum(live.values())
    return LossTerms(kept, fwd_peak - kept, _replay(bwd, live) - kept, released)


def liger_chunk_rows(n: int, h: int, v: int) -> int:
    """Liger's chunk: the logits of one chunk stay about as large as the hidden states (``chunk_mem_const`` 1)."""
    inc = -(-v // h)
    rows = -(-n // inc)
    return min(1 << max(0, math.ceil(math.log2(rows))), n) if rows > 0 else 0


def fused_loss_terms(kernel: str, n: int, h: int, v: int, a: int, *, head_grad: bool = False,
                     head_bytes: int | None = None, softcap: bool = True) -> LossTerms:
    """The rule of ``kernel`` (see the module docstring) for one training call over ``n`` rows. ``softcap``: the
    model soft-caps its logits (ModelShape.softcap; the default counts it)."""
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
    if kernel == "cce_compile":
        return _terms_of_steps(*cce_compile_steps(n, h, v, a, head_grad=head_grad, head_bytes=hb, softcap=softcap),
                               released=n * h * a)
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
    if kernel == "cce_compile":  # the forward's steps (cce_compile_steps) with nothing kept for a backward
        live: dict[str, int] = {}
        return _replay(cce_compile_steps(n, h, v, a, softcap=softcap)[0], live)
    return a * n * v + (4 * n * v if a != 4 else 0) + 4 * n * v  # chunked: one chunk of the standard loss


@contextlib.contextmanager
def traced_fused_loss(kernel: str) -> Iterator[None]:
    """While tracing: the library kernels (which cannot run on fake tensors) replaced by a stand-in that allocates
    what :func:`fused_loss_terms` says (``cce_compile``: :func:`cce_compile_steps`, step by step), in the library's
    order, and returns a loss and gradients of the right shapes. ``chunked`` runs as it is."""
    if kernel == "chunked":
        yield
        return
    from unittest import mock

    import torch

    from fitburst.families import loss as family_loss

    class StandIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, labels, softcap):
            n, h = hidden.shape
            v = weight.shape[0]
            a, hb = hidden.element_size(), weight.element_size()
            t = fused_loss_terms(kernel, n, h, v, a, head_grad=weight.requires_grad, head_bytes=hb, softcap=softcap)
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
            del ctx.shapes  # the step's loss tensor keeps this node alive through the optimizer step
            return grad_hidden, grad_weight, None, None

    class CompiledStandIn(torch.autograd.Function):
        """CCE's torch_compile path: :func:`cce_compile_steps` replayed, holding neither input."""

        @staticmethod
        def forward(ctx, hidden, weight, labels, softcap):
            (n, h), v = hidden.shape, weight.shape[0]
            fwd, bwd = cce_compile_steps(n, h, v, hidden.element_size(), head_grad=weight.requires_grad,
                                         softcap=softcap)
            ctx.live = {}
            _allocate(ctx.live, fwd)
            ctx.steps = bwd
            ctx.meta = (hidden.shape, hidden.dtype, weight.shape, weight.dtype)
            return hidden.new_zeros((), dtype=torch.float32)

        @staticmethod
        def backward(ctx, grad):
            shape, dtype, w_shape, w_dtype = ctx.meta
            live = ctx.live
            _allocate(live, ctx.steps, {"grad_hidden": (shape, dtype), "grad_head": (w_shape, w_dtype)})
            grad_hidden, grad_weight = live.pop("grad_hidden"), live.pop("grad_head", None)
            assert not live, live
            del ctx.live
            return grad_hidden, grad_weight, None, None

    def _allocate(live: dict, steps: list[Step], shaped: dict | None = None) -> None:
        for name, nbytes in steps:
            if not nbytes:
                del live[name]
            elif shaped and name in shaped:
                live[name] = torch.empty(shaped[name][0], dtype=shaped[name][1])
            else:
                live[name] = torch.empty(nbytes, dtype=torch.uint8)

    def run(hidden, weight, labels, *, kernel: str, softcap: float | None = None):
        if kernel == "cce_compile":
            return CompiledStandIn.apply(hidden, weight, labels, softcap is not None)
        return StandIn.apply(hidden, weight, labels, softcap is not None)

    with mock.patch.object(family_loss, "_library_loss", run):
        yield


def loss_kernel_of(settings, device) -> str:
    """The loss a run of ``settings`` trains with on ``device``: "standard", or the fused kernel that runs there
    (:func:`fitburst.hardware.fused_loss_kernel`)."""
    from fitburst.hardware import fused_loss_kernel

    return fused_loss_kernel(device, settings.precision)[0] if settings.fused_loss else "standard"


def describe_lean(settings, device) -> str:
    """Which loss and whether activation offloading a run of ``settings`` trains with on ``device``, in words (the
    preflight report, its artifact and MLflow)."""
    from fitburst.hardware import fused_loss_kernel

    if settings.fused_loss:
        kernel, why = fused_loss_kernel(device, settings.precision)
        loss = f"fused linear cross-entropy, {kernel} ({why})"
    else:
        loss = "standard (the model's head and cross-entropy over full logits)"
    return f"loss: {loss}; activation offloading: {'on' if settings.activation_offloading else 'off'}"
