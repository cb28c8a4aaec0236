"""Liger Kernel's model kernels (``training.liger_kernels``) in the traced estimate.

The loop patches the model with Liger's own ``apply_liger_kernel_to_<model_type>`` (:func:`fitburst.models.
apply_liger_kernels`). Its Triton kernels cannot run on fake tensors, so the trace applies the same patch with
Liger's autograd Functions replaced by stand-ins that allocate and keep for backward what Liger's Python wrappers
do, the kernel launches aside (liger-kernel 0.8.5; tests/test_liger_kernels.py runs both, the launches stubbed):

- RMSNorm (``LigerRMSNormFunction``, ops/rms_norm.py): forward makes ``Y`` (X's shape and dtype) and ``RSTD`` (one
  per row: fp32 in the llama and gemma casting modes, else X's dtype) and keeps X as it is, W and RSTD. Backward
  writes dX into dY (``in_place``, Liger's default) or a new zeroed tensor; a trained weight's gradient goes through
  an (SMs x hidden) fp32 buffer (one row off CUDA, as here; 132 on an H100: 2 MiB at hidden 4,096).
- SwiGLU / GEGLU (``LigerSiLUMulFunction``, ``LigerGELUMulFunction``, ops/swiglu.py, ops/geglu.py): forward makes
  the product and keeps gate and up (a contiguous copy of one that is not: Phi-3's chunks of its fused gate_up);
  backward writes their gradients into the kept gate and up and returns them.
- RoPE (``LigerRopeFunction``, ops/rope.py): rotates q and k in place in their (batch, seq, heads, dim) layout
  (a copy where that is not contiguous) and keeps cos and sin, which the model made once for every layer; backward
  rotates dq and dk the same way.

Liger's patch also replaces module globals of transformers (a model's ``apply_rotary_pos_emb`` and its norm and MLP
classes): :func:`liger_stand_ins` puts them back when the trace ends, so that nothing else in this process runs
Liger's kernels. Torch is imported only inside.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

_ACTIVE: list[bool] = []


def standing_in() -> bool:
    """Whether this process traces with :func:`liger_stand_ins` now."""
    return bool(_ACTIVE)


def _contiguous(*ts):
    """Liger's ``ensure_contiguous``: each tensor contiguous (a copy of one that is not)."""
    return [t.contiguous() for t in ts]


def stand_in_functions() -> dict[str, Any]:
    """The stand-ins by the name of the Liger Function each replaces."""
    import torch

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
            (X,) = _contiguous(X)
            shape = X.shape
            X = X.view(-1, shape[-1])
            Y = torch.empty(X.shape, dtype=X.dtype, device=X.device)
            fp32 = casting_mode in ("llama", "gemma", 0, 1)  # Liger's _CASTING_MODE_LLAMA / _GEMMA
            RSTD = torch.empty(X.shape[0], dtype=torch.float32 if fp32 else X.dtype, device=X.device)
            ctx.in_place, ctx.shape, ctx.affine = in_place, shape, W is not None
            ctx.save_for_backward(*((X, W, RSTD) if W is not None else (X, RSTD)))
            return Y.view(*shape)

        @staticmethod
        def backward(ctx, dY):
            (dY,) = _contiguous(dY)
            W = ctx.saved_tensors[1] if ctx.affine else None
            dY = dY.view(-1, dY.shape[-1])
            dw = W is not None and ctx.needs_input_grad[1]
            _dW = torch.empty((1, dY.shape[1]), dtype=torch.float32, device=dY.device) if dw else None
            dX = dY if ctx.in_place else torch.zeros_like(dY)
            dW = _dW.sum(dim=0).to(W.dtype) if _dW is not None and W is not None else None
            return dX.view(*ctx.shape), dW, None, None, None, None, None

    def mul_forward(ctx, a, b, down: float):
        a, b = _contiguous(a, b)
        shape = a.shape
        a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
        c = torch.empty_like(a).view(*shape)
        if down != 1.0:
            c = c * down
        ctx.down, ctx.shape = down, shape
        ctx.save_for_backward(a, b)
        return c

    def mul_backward(ctx, dc):
        (dc,) = _contiguous(dc)
        if ctx.down != 1.0:
            dc = dc * ctx.down
        a, b = ctx.saved_tensors
        return a.view(*ctx.shape), b.view(*ctx.shape)

    class SiLUMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, gate_multiplier=1.0, down_multiplier=1.0):
            return mul_forward(ctx, a, b, float(down_multiplier))

        @staticmethod
        def backward(ctx, dc):
            return *mul_backward(ctx, dc), None, None

    class GELUMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return mul_forward(ctx, a, b, 1.0)

        @staticmethod
        def backward(ctx, dc):
            return mul_backward(ctx, dc)

    class Rope(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
            if cos.ndim == 4:  # Liger's squeeze of a per-head axis of size 1
                axis = unsqueeze_dim if cos.shape[unsqueeze_dim] == 1 else 1
                cos, sin = cos.squeeze(axis), sin.squeeze(axis)
            if cos.ndim == 2:
                cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
            q, k, cos, sin = _contiguous(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            ctx.save_for_backward(cos, sin)
            return q.transpose(1, 2), k.transpose(1, 2)

        @staticmethod
        def backward(ctx, dq, dk):
            dq, dk = _contiguous(dq.transpose(1, 2), dk.transpose(1, 2))
            return dq.transpose(1, 2), dk.transpose(1, 2), None, None, None, None, None

    return {"LigerRMSNormFunction": RMSNorm, "LigerSiLUMulFunction": SiLUMul, "LigerGELUMulFunction": GELUMul,
            "LigerRopeFunction": Rope}


@contextlib.contextmanager
def liger_stand_ins() -> Iterator[None]:
    """While tracing: Liger's model patch calls the stand-ins (:func:`stand_in_functions`) where it would launch its
    Triton kernels; on leaving, the transformers module globals its patch replaced are restored."""
    from unittest import mock

    from liger_kernel.transformers import geglu, rms_norm, rope, swiglu

    fns = stand_in_functions()

    def dispatch(op, *args, rotary_dim=None, **kwargs):
        assert op == "rope", op  # the only op Liger's model patch dispatches
        return fns["LigerRopeFunction"].apply(*args, rotary_dim)

    _ACTIVE.append(True)
    try:
        with (transformers_restored(), mock.patch.object(rms_norm, "LigerRMSNormFunction", fns["LigerRMSNormFunction"]),
              mock.patch.object(swiglu, "LigerSiLUMulFunction", fns["LigerSiLUMulFunction"]),
              mock.patch.object(geglu, "LigerGELUMulFunction", fns["LigerGELUMulFunction"]),
              mock.patch.object(rope, "dispatch", dispatch)):
            yield
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def transformers_restored() -> Iterator[None]:
    """On leaving, the globals of transformers' model modules (``transformers.models.*``) as they were right before
    each :func:`fitburst.models.apply_liger_kernels` call inside (the model built by then: its modeling module is
    imported): what Liger's patch replaced there (``apply_rotary_pos_emb``, norm and MLP classes) is put back."""
    from unittest import mock

    from fitburst import models

    snapshots: list[dict[str, dict]] = []
    apply = models.apply_liger_kernels

    def snapshot_then_apply(model) -> None:
        snapshots.append({name: dict(vars(m)) for name, m in list(sys.modules.items())
                          if name.startswith("transformers.models.") and m is not None})
        apply(model)

    try:
        with mock.patch.object(models, "apply_liger_kernels", snapshot_then_apply):
            yield
    finally:
        for before in reversed(snapshots):
            for name, saved in before.items():
                module = sys.modules.get(name)
                for key, value in saved.items() if module is not None else ():
                    if vars(module).get(key) is not value:
                        setattr(module, key, value)
