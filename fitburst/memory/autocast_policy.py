"""The device's autocast, on the CPU tensors the trace runs: the loop's AMP runs CPU autocast there, and CUDA's and
MPS's autocast treat some ops differently (torch's ``aten/src/ATen/autocast_mode.cpp``). :func:`device_autocast`
makes those ops behave under CPU autocast as under the device's: 16-bit floating arguments cast to fp32 (the "fp32"
policy), an unset ``dtype`` set to fp32 ("fp32_set_opt_dtype": no fp32 copy of the input), or, for ops CPU
autocast casts and the GPU's does not (``cross_entropy_loss``, ``cat``), no cast at the op itself (a composite's
inner ops are still autocast). A 16-bit consumer of an fp32 output casts it again (autocast's own rule), so a
LayerNorm model keeps fp32 norm copies and gelu_new's ``pow(x, 3)`` makes its whole tail fp32, as on the GPU.

torch registers its AutocastCUDA and AutocastMPS kernels in every build and runs them on fake CUDA and MPS tensors:
``tests/test_trace.py`` checks each op below against them, in fp16 and bf16: the ops each call dispatches, their
input dtypes and their ``dtype`` argument. The registrations are process-wide while the context is open (a trace
holds it): CPU autocast in another thread of the process would follow them too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

# "fp32" on both devices: floating 16-bit arguments cast to fp32
FP32 = ("layer_norm", "native_layer_norm", "group_norm", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
        "exp", "expm1", "log", "log1p", "log2", "log10", "rsqrt", "reciprocal", "softplus", "acos", "asin", "cosh",
        "sinh", "tan", "erfinv", "logsumexp", "cosine_similarity", "nll_loss")
# reductions and softmax: CUDA sets their dtype to fp32 ("fp32_set_opt_dtype", CPU autocast copied prod's input),
# MPS casts their input to fp32 even when a dtype is given
REDUCTIONS = ("softmax.int", "log_softmax.int", "sum", "sum.dim_IntList", "cumsum", "cumprod", "prod",
              "prod.dim_int", "linalg_vector_norm")
POLICY = {
    "cuda": {"fp32": FP32 + ("rms_norm",), "set_dtype": REDUCTIONS},
    "mps": {"fp32": FP32 + ("batch_norm",) + REDUCTIONS, "set_dtype": ()},
}
# CPU autocast only: cross_entropy_loss in fp32 (on a GPU only its inner ops are autocast), cat's promotion of
# mixed 16-bit / fp32 inputs to fp32 copies (a GPU's cat kernel promotes as it writes)
NOT_AUTOCAST = ("cross_entropy_loss", "cat")
KINDS = tuple(POLICY)


@contextlib.contextmanager
def device_autocast(kind: str) -> Iterator[None]:
    """Under CPU autocast, the ops of :data:`POLICY` and :data:`NOT_AUTOCAST` behave as under ``kind``'s autocast
    ("cpu": nothing changes). Outside autocast, on fp32 or fp64 arguments, or with a dtype given (set_dtype ops),
    nothing changes; on exit the registrations are gone."""
    if kind not in KINDS:
        yield
        return
    import torch

    low = (torch.float16, torch.bfloat16)
    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def up(a):
        return a.float() if isinstance(a, torch.Tensor) and a.dtype in low else a

    def fp32(op):
        def run(*args, **kwargs):  # reached only with CPU autocast on (its key is then in the dispatch set)
            with torch._C._ExcludeDispatchKeyGuard(below):
                return op(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
        return run

    def set_dtype(op):
        at = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")

        def run(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(below):
                given = args[at] if len(args) > at else kwargs.get("dtype")
                if given is None and args[0].is_floating_point() and args[0].dtype != torch.float64:
                    args, kwargs = args[:at], {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
        return run

    def as_is(op):
        def run(*args, **kwargs):  # a composite runs with autocast still on for the ops inside
            if op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
                return op.decompose(*args, **kwargs)
            with torch._C._ExcludeDispatchKeyGuard(below):
                return op(*args, **kwargs)
        return run

    def overload(name: str):
        base, _, ov = name.partition(".")
        return getattr(getattr(torch.ops.aten, base), ov or "default")

    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # replacing CPU autocast's own kernels (nll_loss, prod, cat, ...) is the point
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            for name in POLICY[kind]["fp32"]:
                lib.impl(name, fp32(overload(name)), "AutocastCPU")
            for name in POLICY[kind]["set_dtype"]:
                lib.impl(name, set_dtype(overload(name)), "AutocastCPU")
            for name in NOT_AUTOCAST:
                lib.impl(name, as_is(overload(name)), "AutocastCPU")
        yield
    finally:
        lib._destroy()
