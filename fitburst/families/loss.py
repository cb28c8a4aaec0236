"""The fused linear cross-entropy: the output head and the cross-entropy in one call that never holds the logits of
a whole micro-batch. Which kernel runs on a device is :func:`fitburst.hardware.fused_loss_kernel`'s choice; what
each allocates is :mod:`fitburst.memory.loss_kernels`'s rule.

- ``cce``: Apple's Cut Cross-Entropy Triton kernel (``cut_cross_entropy.linear_cross_entropy(impl="cce")``);
- ``liger``: Liger Kernel's ``liger_fused_linear_cross_entropy``;
- ``cce_compile``: Cut Cross-Entropy's ``torch_compile`` implementation (CPU, MPS). It keeps the logits of every
  labelled row: cut-cross-entropy 25.1.1 has no option to chunk it (``linear_cross_entropy`` passes only
  ignore_index, softcap, reduction and shift to ``torch_compile.torch_compile_linear_cross_entropy``, whose
  compiled ``torch_compile_linear_cross_entropy_apply`` computes ``e @ c.T`` for all rows at once; ``filter_eps``
  is the Triton kernel's), and Liger's torch-only chunked losses are preference and distillation losses;
- ``chunked``: :func:`chunked_linear_cross_entropy`, where none of those runs.

Every kernel gets the hidden states and the head weight in the dtype the head's matmul would run in (the autocast
dtype under autocast), and returns the fp32 sum of the token losses, so a family divides by the window's label
tokens as transformers' ``num_items_in_batch`` does. torch and the libraries are imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from fitburst.errors import UserError
from fitburst.families.base import IGNORE_INDEX
from fitburst.hardware import FUSED_MODULES, library_missing_here
from fitburst.settings import EVAL_CHUNK_TOKENS


class FusedLossError(UserError, ValueError):
    """The fused loss cannot run this model or on this machine; the message says why and what to set."""


def check_installed(kernel: str) -> None:
    """A FusedLossError naming the package (fitburst's ``lean`` extra) when ``kernel``'s library is missing here."""
    module = FUSED_MODULES.get(kernel)
    if module is not None and (missing := library_missing_here(module)) is not None:
        raise FusedLossError(f"training.loss: fused runs {kernel} here, and {missing}: pip install 'fitburst[lean]' "
                             "(or set training.loss: standard)")


def head_of(model) -> Any:
    """The output head's weight, for a model whose head is a plain bias-free linear layer (what every kernel
    takes); a FusedLossError otherwise (a LoRA-adapted or biased head, or a head that scales its input)."""
    import torch

    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise FusedLossError(f"training.loss: fused takes a bias-free linear output head; this model's is "
                             f"{type(head).__name__} (an adapted or biased head, e.g. lm_head in "
                             "method.target_modules): set training.loss: standard or leave the head out")
    return head.weight


def shifted_labels(labels) -> Any:
    """The next-token targets of every position, as transformers' causal-LM loss builds them: labels shifted
    left by one, the last position ignored."""
    import torch.nn.functional as F

    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def _matmul_dtype(hidden, weight):
    """The dtype the head's matmul runs in: the autocast dtype of the hidden states' device, else the weight's."""
    import torch

    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


def linear_cross_entropy(hidden, weight, labels, *, kernel: str, softcap: float | None = None):
    """Sum over the rows of ``hidden`` (n x h) with a label other than -100 of cross-entropy(hidden @ weight.T,
    label), in fp32, by ``kernel``. The matmul runs in the autocast dtype (as the head under autocast would),
    the softmax in fp32; ``softcap``: Gemma-style final-logit soft-capping."""
    dtype = _matmul_dtype(hidden, weight)
    if kernel == "chunked":  # casts inside each chunk, so a gradient summed over chunks adds up in its own dtype
        return chunked_linear_cross_entropy(hidden, weight, labels, softcap=softcap, dtype=dtype)
    return _library_loss(hidden.to(dtype), weight.to(dtype), labels, kernel=kernel, softcap=softcap)


def _library_loss(hidden, weight, labels, *, kernel: str, softcap: float | None = None):
    """The kernel call itself (the trace replaces it: :func:`fitburst.memory.loss_kernels.traced_fused_loss`)."""
    if kernel in ("cce", "cce_compile"):
        from cut_cross_entropy import linear_cross_entropy as cce  # heavy, optional: the lean extra

        impl = "cce" if kernel == "cce" else "torch_compile"
        return cce(hidden, weight, labels, ignore_index=IGNORE_INDEX, softcap=softcap, reduction="sum",
                   impl=impl).float()
    if kernel == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # heavy, optional

        return liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE_INDEX,
                                                reduction="sum", softcap=softcap).float()
    raise ValueError(f"unknown fused loss kernel {kernel!r}")


def chunked_linear_cross_entropy(hidden, weight, labels, *, softcap: float | None = None, dtype=None):
    """The standard loss over ``EVAL_CHUNK_TOKENS`` rows (the eval's chunk) at a time, each chunk recomputed in
    backward (non-reentrant checkpoint): one chunk's logits exist at once. Only where no library kernel runs (a CPU
    with no C++ compiler for inductor). ``dtype``: the matmul's (default: the inputs')."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    def chunk(x, y):
        logits = (x.to(dtype or x.dtype) @ weight.to(dtype or weight.dtype).T).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, labels.numel(), EVAL_CHUNK_TOKENS):
        total = total + checkpoint(chunk, hidden[s:s + EVAL_CHUNK_TOKENS], labels[s:s + EVAL_CHUNK_TOKENS],
                                   use_reentrant=False)
    return total
