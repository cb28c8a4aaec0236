"""The quick estimate of an architecture the analytic estimate does not model: its real model traced at full width
with two and with three of its blocks, scaled to its depth.

A decoder stack repeats one block: every per-block term (weights, adapters, gradients, optimizer state, the
activations kept for backward) grows by the same bytes per block, and what does not (embeddings, the head, the
logits and the loss) stays put. So the figures of the two- and three-block models, traced as the full model is
(:func:`fitburst.memory.trace.traced_estimate`: transformers builds them, fake tensors, the allocator model), give
the full depth by a line: ``x(L) = x(3) + (L - 3) * (x(3) - x(2))``. Not so the caching allocator's overhead on CUDA
(reserved less allocated): the rounding of its large segments jumps from one depth to the next (Llama-3.2-1B,
LoRA on an A100: 178, 282, 168, 172 MiB at two to five blocks, 203 MiB at sixteen), so the reserved figure is the
line's allocated one plus the larger overhead of the two slices; and the allocated figure is the largest of the
phases' lines, not the line of the slices' peaks (where one phase overtakes another with depth). Two small traces
take seconds where the full one takes up to minutes; both are kept in the trace cache. How far the line lies from
the full trace is measured by ``benchmarks/sliced_vs_traced.py`` (its band: :mod:`fitburst.memory.calibration`,
method "sliced").

Only a config whose depth is one number (``num_hidden_layers``, ``n_layer`` or ``num_layers``, at the top or in
its ``text_config``) and whose other per-layer fields are lists of that length is sliced; anything else (an
encoder-decoder with two depths, a vision tower, remote code) raises :class:`NotSliceable`, and the full trace
answers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

from fitburst.cache import cache_root
from fitburst.hardware import Device
from fitburst.settings import RunSettings

from .estimator import Estimate
from .planner import EstimateFn
from .trace import config_dict, traced_estimate

DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
SLICES = (2, 3)  # blocks of the two traced models (from 1 to 2 the allocator's reserved figure is not yet linear)


class NotSliceable(ValueError):
    """A config the sliced estimate cannot cut into blocks (the full trace answers instead)."""


def _depth_at(cfg: dict) -> tuple[dict, str, int]:
    """(the dict holding the depth, its key, the depth) of ``cfg``, or NotSliceable."""
    if cfg.get("auto_map"):
        raise NotSliceable("its model code comes with the checkpoint (auto_map)")
    if cfg.get("is_encoder_decoder") or "num_decoder_layers" in cfg:
        raise NotSliceable("an encoder-decoder has two stacks")
    if "vision_config" in cfg:
        raise NotSliceable("a vision tower has a depth of its own")
    holder = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    found = [k for k in DEPTH_KEYS if isinstance(holder.get(k), int)]
    if len(found) != 1 or holder[found[0]] <= max(SLICES):
        raise NotSliceable(f"no single depth among {', '.join(DEPTH_KEYS)} deeper than {max(SLICES)} blocks")
    return holder, found[0], holder[found[0]]


def depth(cfg: dict) -> int:
    """The number of blocks of ``cfg``'s stack (NotSliceable where it has no single one)."""
    return _depth_at(cfg)[2]


def sliced_config(cfg: dict, blocks: int) -> dict:
    """``cfg`` with ``blocks`` blocks: its depth set, and each per-layer list (as ``layer_types``) cut to fit."""
    out = json.loads(json.dumps(cfg))
    holder, key, n = _depth_at(out)
    holder[key] = blocks
    for k, v in list(holder.items()):
        if isinstance(v, list) and len(v) == n:
            holder[k] = v[:blocks]
    return out


def _folder(cfg: dict) -> Path:
    """A model folder holding ``cfg`` as its config.json (in the cache, by content: the trace builds from it)."""
    text = json.dumps(cfg, sort_keys=True)
    d = cache_root() / "sliced" / hashlib.sha256(text.encode()).hexdigest()[:16]
    if not (d / "config.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"config.json.{id(cfg)}.tmp"
        tmp.write_text(text)
        tmp.replace(d / "config.json")
    return d


def _line(one: int, two: int, n: int) -> int:
    return max(0, two + (n - SLICES[1]) * (two - one))


def sliced_estimate(spec, settings: RunSettings, device: Device, *, seq_len: int) -> Estimate:
    """The full-depth estimate of ``spec``'s run from traces of its two- and three-block models (see the module)."""
    cfg = config_dict(spec.model.name)
    n = depth(cfg)
    ests = []
    for blocks in SLICES:
        model = spec.model.model_copy(update={"name": str(_folder(sliced_config(cfg, blocks)))})
        ests.append(traced_estimate(spec.model_copy(update={"model": model}), settings, device, seq_len=seq_len))
    a, b = ests

    def line(x: dict[str, int], y: dict[str, int]) -> dict[str, int]:
        return {k: _line(x.get(k, 0), y.get(k, 0), n) for k in {*x, *y}}

    phases = line(a.phases, b.phases)
    # each phase's peak grows on its own line: at full depth another phase may peak (the optimizer step's
    # temporaries, which grow with every block's parameters, overtake backward's activations)
    allocated = max(_line(a.allocated_peak_bytes, b.allocated_peak_bytes, n), max(phases.values(), default=0))
    reserved = allocated + max(e.reserved_peak_bytes - e.allocated_peak_bytes for e in ests)
    return replace(
        b, allocated_peak_bytes=allocated, reserved_peak_bytes=reserved,
        device_total_bytes=reserved + b.device_total_bytes - b.reserved_peak_bytes,
        components=line(a.components, b.components), phases=phases, params=line(a.params, b.params),
        peak_phase=max(phases, key=lambda k: phases[k]) if phases else b.peak_phase,
        model=spec.model.name, method="sliced", band=None, fits=None,
        notes=[f"sliced: traced at {SLICES[0]} and {SLICES[1]} of its {n} blocks (full width) and scaled to {n}: "
               "seconds, where the full trace takes up to minutes"])


def quick_estimate(spec, seq_len: int) -> EstimateFn | None:
    """:func:`sliced_estimate` of ``spec``'s runs as the planner's quick estimate (each settings and device traced
    once in this process); None where the config cannot be sliced."""
    try:
        depth(config_dict(spec.model.name))
    except NotSliceable:
        return None
    memo: dict[tuple[str, str], Estimate] = {}

    def fn(s: RunSettings, d: Device) -> Estimate:
        k = (json.dumps(asdict(s), sort_keys=True), d.name)
        if k not in memo:
            memo[k] = sliced_estimate(spec, s, d, seq_len=min(seq_len, s.seq_len))
        return replace(memo[k], notes=list(memo[k].notes), band=None, fits=None)

    return fn
