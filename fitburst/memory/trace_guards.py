"""What the traced estimate cannot run, and the attention kernel it runs for a device: the checks
:func:`fitburst.memory.trace.trace_step` makes before and around the traced step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fitburst.errors import UserError
from fitburst.hardware import Device, library_missing_here
from fitburst.rules import liger_missing_here
from fitburst.settings import RunSettings


class TraceUnsupported(UserError, ValueError):
    """This configuration cannot be traced; the message says which part and what to do instead."""


def untraceable(s: RunSettings) -> str | None:
    """Why the trace cannot run ``s`` on this machine, or None: int8 weights, and Liger's patch or its tiled MLP
    where liger-kernel is not installed here (a plan for another machine: the analytic estimate models both)."""
    if s.quant == "int8":
        return ("the traced estimate does not cover int8 quantization yet (bitsandbytes 8-bit layers on the meta "
                "device): use the analytic estimate (fitburst estimate without --exact), or quant nf4")
    if s.liger_kernels and (missing := liger_missing_here()) is not None:
        return (f"the traced estimate applies Liger Kernel's own patch (its kernels on stand-ins), and {missing} "
                "here: the analytic estimate models it")
    if s.tiled_mlp and (missing := library_missing_here("liger_kernel")) is not None:
        return (f"the traced estimate runs liger-kernel's apply_tiled_mlp, and {missing}: the analytic estimate "
                "models it")
    return None


def device_sdpa(device: Device | None) -> contextlib.AbstractContextManager:
    """SDPA as ``device`` runs it: CUDA's fused kernel of that device, MPS's math composite, else the CPU's own."""
    from . import cuda_kernels, mps_kernels

    if device is not None and device.kind == "cuda":
        return cuda_kernels.cuda_sdpa_dispatch(device.supports_bf16)
    return mps_kernels.mps_sdpa_math() if device is not None and device.kind == "mps" else contextlib.nullcontext()


@contextlib.contextmanager
def fake_kernels_of(model_name: str) -> Iterator[None]:
    """A step whose op has no fake kernel for this case (e.g. MoE mm) is a :class:`TraceUnsupported`."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as e:
        raise TraceUnsupported(f"{model_name}: a kernel of this model cannot run on fake tensors in this "
                               f"configuration ({str(e).splitlines()[0][:160]}); the analytic estimate and its "
                               "wider error band decide") from None
