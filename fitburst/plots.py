"""Plots for run records, each saying one thing: the loss curve (train loss per step, eval points at the start
and end), the estimated memory breakdown, and estimated vs measured peaks of the same quantity."""

from __future__ import annotations

import json
from pathlib import Path

from fitburst.memory import Estimate
from fitburst.meter import MemoryPeak

GIB = 1024**3


def _pyplot():
    """matplotlib's pyplot on the Agg backend, imported at first plot (heavy: kept off the tracker's import path)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_curve(metrics_jsonl: Path, dest: Path, title: str = "", eval_points: dict | None = None) -> Path:
    """Train loss per optimizer step; ``eval_points`` (``{"base": loss, "tuned": loss}``) marks the validation loss
    of the base model at step 0 and of the tuned model at the last step."""
    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["train_loss"] for r in rows], marker=".", color="#4c72b0", label="train loss (window mean)")
    if eval_points:
        last = steps[-1] if steps else 0
        for label, x, y, color in (("validation, base", 0, eval_points.get("base"), "#c44e52"),
                                   ("validation, tuned", last, eval_points.get("tuned"), "#55a868")):
            if y is not None:
                ax.scatter([x], [y], s=60, marker="D", color=color, zorder=3, label=f"{label} {y:.3f}")
    ax.set(xlabel="optimizer step", ylabel="loss (cross-entropy per token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest


def memory_bar_chart(estimate: Estimate, dest: Path, title: str = "") -> Path:
    """The estimate alone: horizontal bars of its components, with its allocated peak, device total and budget."""
    comps = sorted(estimate.components.items(), key=lambda kv: kv[1])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(comps) + 1.8))
    ax.barh([k for k, _ in comps], [v / GIB for _, v in comps], color="#4c72b0")
    ax.set_xlabel("GiB (estimated)")
    for label, value, color in (("allocated peak", estimate.allocated_peak_bytes, "#8172b2"),
                                ("device total", estimate.device_total_bytes, "#dd8452"),
                                ("budget", estimate.budget_bytes, "#c44e52")):
        if value:
            ax.axvline(value / GIB, color=color, linestyle="--", label=f"{label} {value / GIB:.2f} GiB")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest


def comparable_pairs(estimate: Estimate, peak: MemoryPeak) -> list[tuple[str, int, int]]:
    """(quantity, estimated, measured) for each quantity measured on the run's device kind: only like with like.

    - the figure :meth:`fitburst.memory.Estimate.comparable_bytes` names for the kind (CUDA: tensor peak,
      ``max_memory_allocated``; CPU: what the run added to the process; MPS: the driver's allocation);
    - CUDA: allocator reserved vs ``max_memory_reserved``;
    - CPU: device total (runtime floor included) vs the process high-water mark (VmHWM).
    """
    kind = peak.kind or "cpu"
    pairs = []
    label = {"cuda": "tensor peak (allocated)", "cpu": "run's added memory", "mps": "driver-allocated peak"}
    if peak.allocated_bytes:
        pairs.append((label.get(kind, "allocated peak"), estimate.comparable_bytes(kind), peak.allocated_bytes))
    if kind == "cuda" and peak.reserved_bytes:
        pairs.append(("allocator reserved", estimate.reserved_peak_bytes, peak.reserved_bytes))
    if kind == "cpu" and peak.rss_peak_bytes:
        pairs.append(("process total (VmHWM)", estimate.device_total_bytes, peak.rss_peak_bytes))
    return pairs


def memory_comparison(estimate: Estimate, peak: MemoryPeak, dest: Path, title: str = "") -> Path:
    """Estimated vs measured, one panel (own scale) per quantity measured (see :func:`comparable_pairs`); the
    estimated bar of the first panel is split into the estimate's components, so each component's share is visible."""
    pairs = comparable_pairs(estimate, peak)
    plt = _pyplot()
    fig, axes = plt.subplots(max(len(pairs), 1), 1, figsize=(8, 1.5 * max(len(pairs), 1) + 1.2), squeeze=False)
    for i, (ax, (quantity, est, meas)) in enumerate(zip(axes[:, 0], pairs, strict=False)):
        if i == 0 and estimate.components:
            comps = sorted(estimate.components.items(), key=lambda kv: -kv[1])
            scale = min(est / max(sum(v for _, v in comps), 1), 1.0)
            cmap, left = plt.get_cmap("Blues_r"), 0.0
            for j, (name, v) in enumerate(comps):
                w = v * scale / GIB
                ax.barh(1, w, left=left, color=cmap(0.1 + 0.7 * j / max(len(comps), 1)), label=name)
                left += w
            if est / GIB > left:
                ax.barh(1, est / GIB - left, left=left, color="#bbbbbb", label="allocator / runtime")
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), title="estimated", title_fontsize=7)
        else:
            ax.barh(1, est / GIB, color="#dd8452")
        ax.barh(0, meas / GIB, color="#55a868")
        ax.set_yticks([1, 0], ["estimated", "measured"])
        ratio = f", measured/estimated {meas / est:.2f}" if est else ""
        ax.set_title(f"{quantity}: {est / GIB:.3f} vs {meas / GIB:.3f} GiB{ratio}", fontsize=9, loc="left")
        ax.set_xlim(0, max(est, meas) / GIB * 1.08)
        ax.set_xlabel("GiB", fontsize=8)
    fig.suptitle(title or "estimated vs measured, the same quantity in each panel", fontsize=10)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest
