"""Host RAM a run needs beside its GPU memory: what activation offloading keeps in pinned host memory, the host's
limit it must fit, and the check `fitburst validate` runs before any compute.

With ``training.activation_offloading`` (TRL's ``OffloadActivations``, the torchtune design) every tensor saved for
backward of at least 1 KiB that is not a parameter is copied to pinned host memory in the forward and copied back
when its backward node runs: all of them wait on the host at the forward's end. Combined with gradient
checkpointing what is saved per layer is the layer's input, so the host holds the checkpoints (tokens x hidden per
layer) and the GPU only the layers in flight. The analytic figure is
:attr:`fitburst.memory.estimator.Activations.offloaded`'s sum; the trace's is the peak of the host copies its
offloading stand-in records (:func:`traced_host_bytes`). Pure Python: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from fitburst.hardware import CPU_CONTEXT, CPU_RESERVE, GiB, MiB, host_ram_bytes

# a size as `--host-ram` takes it: 64GiB, 64 GiB, 64G, 65536MiB, 68.7GB
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(gib|gb|g|mib|mb|m|tib|tb|t)?\s*$", re.I)
_UNITS = {"gib": GiB, "g": GiB, "gb": 10**9, "mib": MiB, "m": MiB, "mb": 10**6, "tib": 1024 * GiB, "t": 1024 * GiB,
          "tb": 10**12}


def parse_host_ram(text: str) -> int:
    """Bytes of a host RAM size (``64GiB``; a bare number is GiB). ValueError names the forms it takes."""
    m = _SIZE.match(text or "")
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--host-ram: {text!r} is not a size: write e.g. 64GiB, 128G or 65536MiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "gib").lower()])


def host_limit(ram_bytes: int, processes: int = 1) -> int:
    """What a node's run may keep in host RAM beside its processes: the RAM less the system's reserve and each
    training process (torch and transformers imported)."""
    return ram_bytes - CPU_RESERVE - processes * CPU_CONTEXT


def this_host_limit(processes: int = 1) -> int:
    """:func:`host_limit` of this machine's RAM (or its container's limit)."""
    return host_limit(host_ram_bytes(), processes)


def host_shortfall(shape, s, device, limit: int, processes: int = 1) -> str | None:
    """Why the run ``s`` cannot keep its host side on a host of ``limit`` (:func:`host_limit`): the analytic
    estimate judged by the planner's rule (:meth:`fitburst.memory.budget.Budget.judge` and ``host_fits``: a sharded
    run's host bytes per node, its host side: offloaded activations, a host-resident table) at ``s``'s sequence
    length; None when it fits.
    ``processes``: the training processes on this node (each offloads its own activations)."""
    from .budget import Budget
    from .estimator import estimate

    budget = Budget(device, gpus_per_node=processes, host_limit=limit)
    e = budget.judge(estimate(shape, s, device, calibrate=False))
    if budget.host_fits(e):
        return None
    return (f"{e.host_bytes / GiB:,.2f} GiB of host RAM at {s.seq_len} tokens x micro-batch {s.micro_batch_size} "
            f"does not fit this host's {limit / GiB:,.2f} GiB (its RAM less {CPU_RESERVE / GiB:.0f} GiB for the "
            f"system and {CPU_CONTEXT / MiB:.0f} MiB per process)")


def traced_host_bytes(events: Iterable, start: int = 0, tag: str = "host") -> int:
    """The most host memory the traced step's offloaded tensors take at once (the events its offloading stand-in
    tags ``host``), from the measured step's first event ``start`` on; the warm-up step's are all back by then.
    ``tag="host_weight"``: the input embedding table the loop moved to host RAM (from the load on)."""
    host: set[int] = set()
    cur = peak = 0
    for i, e in enumerate(events):
        if e.kind == "alloc" and e.tag == tag:
            host.add(e.sid)
            cur += e.size
        elif e.kind == "free" and e.sid in host:
            host.discard(e.sid)
            cur -= e.size
        if i >= start:
            peak = max(peak, cur)
    return peak


def offload_words(host_side: int, limit: int | None) -> str:
    """The host side of a run in words (offloaded activations, pinned, and a host-resident embedding table): its
    bytes against the limit where one is known."""
    what = f"host side: {host_side / GiB:,.2f} GiB (offloaded activations in pinned host RAM, a host-resident table)"
    if limit is None:
        return what
    verdict = "fits" if host_side <= limit else "does NOT fit"
    return (f"{what}; {verdict} the host's {limit / GiB:,.2f} GiB (its RAM less {CPU_RESERVE / GiB:.0f} GiB for the "
            f"system and {CPU_CONTEXT / MiB:.0f} MiB per process)")


def offload_problem(spec, ram_bytes: int) -> str | None:
    """Why what ``spec`` keeps in host RAM (offloaded activations, a host-resident embedding table) cannot fit a
    host of ``ram_bytes`` as configured (longest sample ``data.max_seq_len``, its micro-batch, the GPU
    ``preflight.device`` names), with the fix; None when they fit
    or where it cannot tell without a probe or the network (preflight.device auto / cuda / cuda:0,1, a model
    whose config.json is neither local nor bundled, an architecture the analytic estimate does not model)."""
    from fitburst.hardware import named_device
    from fitburst.settings import settings_from_spec

    from .estimator import estimate
    from .shapes import ModelConfigError, bundled_config, load_shape

    if not (spec.training.activation_offloading or spec.training.embeddings_on_host):
        return None
    try:
        device = named_device(spec.preflight.device)
    except ValueError:
        return None
    if device is None or device.kind != "cuda":  # off CUDA both are refused on their own (the rule table)
        return None
    name = spec.model.name
    local = Path(name).expanduser().exists() or bundled_config(name, spec.model.revision) is not None
    if not local:
        return None
    try:
        shape = load_shape(name, spec.model.revision)
    except (ModelConfigError, ValueError, OSError):
        return None
    s = settings_from_spec(spec, device)
    est = estimate(shape, s, device, calibrate=False)
    need, limit = est.host_side_bytes, host_limit(ram_bytes)
    if need <= limit:
        return None
    if not s.activation_offloading:
        return (f"training.embeddings_on_host keeps the {need / GiB:,.1f} GiB input embedding table in host RAM, and "
                f"this host has {ram_bytes / GiB:,.1f} GiB ({limit / GiB:,.1f} GiB after {CPU_RESERVE / GiB:.0f} GiB "
                f"for the system and the training process): set training.embeddings_on_host: false")
    what = "layer inputs (the checkpoints)" if s.gradient_checkpointing else "saved activations"
    table = (f" (and {est.host_table_bytes / GiB:,.1f} GiB of input embeddings, training.embeddings_on_host)"
             if est.host_table_bytes else "")
    return (f"activation offloading keeps {est.offloaded_host_bytes / GiB:,.1f} GiB of {what} in pinned host RAM"
            f"{table} at "
            f"data.max_seq_len {s.seq_len} x micro-batch {s.micro_batch_size} on {device.name}, and this host has "
            f"{ram_bytes / GiB:,.1f} GiB ({limit / GiB:,.1f} GiB after {CPU_RESERVE / GiB:.0f} GiB for the system and "
            f"the training process): set training.activation_offloading: false (the planner offloads only where the "
            f"host holds it), a shorter data.max_seq_len or a smaller training.micro_batch_size, or train on a host "
            f"with more RAM")
