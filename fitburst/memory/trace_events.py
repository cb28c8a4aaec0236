"""A trace's events: each storage allocation and free of a traced step in program order, and what they add up to
(the live peak, per phase, and the tensors live at the peak by where they came from). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    """One storage allocation (``alloc``) or free, in program order."""

    kind: str  # alloc | free | empty_cache (torch.cuda.empty_cache(), added by a CUDA rule)
    sid: int  # storage id (unique over the trace)
    size: int  # bytes
    phase: str  # load | warmup.<phase> | <phase> (measured step)
    op: str = ""  # aten op that allocated it (alloc events)
    tag: str = ""  # what a CUDA rule needs to know (adapter, step_counter, softmax_upcast, sdpa_fwd ...)


@dataclass
class StepTrace:
    events: list[Event]
    measured_start: int  # index of the measured step's first event
    params: dict[str, int]
    seconds: float
    dtype_bytes: int
    heads: int = 0
    notes: list[str] = field(default_factory=list)
    load_bytes: int = 0  # what from_pretrained's caching_allocator_warmup reserves (:func:`warmup_bytes`)
    kv_heads: int = 0  # key/value heads (fewer than ``heads``: grouped-query attention)
    kv_expanded: bool = False  # grouped-query k/v expanded before SDPA (fitburst.models.EXPANDED_KV)
    vocab: int = 0  # the text model's vocabulary (config vocab_size)

    def live_peaks(self) -> tuple[int, str, dict[str, int]]:
        """(peak live bytes in the measured step, its phase, peak per phase of the measured step)."""
        return live_peaks(self.events, self.measured_start)


def live_peaks(events: list[Event], start: int) -> tuple[int, str, dict[str, int]]:
    cur = peak = 0
    peak_phase = ""
    phases: dict[str, int] = {}
    for i, e in enumerate(events):
        cur += e.size if e.kind == "alloc" else -e.size
        if i < start:
            continue
        if i == start:
            phases["load"] = cur - (e.size if e.kind == "alloc" else -e.size)
        if cur > phases.get(e.phase, -1):
            phases[e.phase] = cur
        if cur > peak:
            peak, peak_phase = cur, e.phase
    return peak, peak_phase, phases


def peak_components(events: list[Event], start: int) -> dict[str, int]:
    """The tensors live at the measured step's peak, by where they came from: base ``weights`` and
    ``lora_weights`` (loaded), ``optimizer_states`` (left by the warm-up step), ``cuda_workspaces`` (cuBLAS's,
    on CUDA), ``fsdp_buffers`` (a sharded run's gathered weights and gradient reductions, the sharded gradients
    they leave included), ``step_tensors`` (activations, gradients and temporaries of the measured step). They sum
    to the peak of :func:`live_peaks`."""
    cur = peak = 0
    at = -1
    for i, e in enumerate(events):
        cur += e.size if e.kind == "alloc" else -e.size
        if i >= start and cur > peak:
            peak, at = cur, i
    live: dict[int, tuple[int, str]] = {}
    for e in events[: at + 1]:
        if e.kind == "alloc":
            kind = ("lora_weights" if e.tag == "adapter" else "weights") if e.phase == "load" else (
                "cuda_workspaces" if e.tag == "workspace" else
                "fsdp_buffers" if e.tag.startswith("fsdp_") else
                "optimizer_states" if e.phase.startswith("warmup.") else "step_tensors")
            live[e.sid] = (e.size, kind)
        else:
            live.pop(e.sid, None)
    out: dict[str, int] = {}
    for size, kind in live.values():
        out[kind] = out.get(kind, 0) + size
    return out
