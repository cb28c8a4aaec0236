"""Where MPS allocates differently from the CPU kernels the trace runs: one explicit rule each.

- :func:`mps_sdpa_math`: a training step's SDPA on MPS runs torch's math composite
  (``_scaled_dot_product_attention_math``): MPS has no fused attention with a backward (its fused kernels, where a
  torch has them, refuse inputs that require grad), so 16-bit q, k and v are upcast to fp32 (kept for backward, q
  and k scaled), and the b*h*s*s fp32 probabilities are kept beside them (the scores they come from are transient).
  The CPU runs its flash kernel, which keeps none of them.
- autocast: MPS's autocast runs layer norms and elementwise math in fp32 as CUDA's does (not rms_norm), and copies
  the input of reductions and softmax to fp32 where CUDA sets their dtype
  (:func:`fitburst.memory.autocast_policy.device_autocast`, ``"mps"``).
- Same as the CPU, so no rule: ``softmax(x16, dtype=fp32)`` makes an fp32 copy of ``x16`` first (only CUDA's fp16
  kernel converts on the fly), dropout draws a noise tensor (the fused kernel that keeps a bool mask is CUDA's),
  AdamW runs its per-tensor loop (MPS is not among torch's foreach devices).
- Reserved memory: MPS heaps are coarser than tensors (``estimator.RESERVED_FACTOR`` / ``RESERVED_FLOOR``, not
  measured); no model of MPS's allocator.
"""

from __future__ import annotations

import contextlib


def mps_sdpa_math() -> contextlib.AbstractContextManager:
    """A context in which SDPA runs its math composite, as a training step runs it on MPS."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)
