"""Plots for run records: the training loss curve and the memory breakdown (estimated vs measured)."""

from __future__ import annotations

import json
from pathlib import Path

GIB = 1024**3


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_curve(metrics_jsonl: Path, dest: Path, title: str = "") -> Path:
    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], marker=".")
    ax.set(xlabel="optimizer step", ylabel="train loss", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest


def memory_bar_chart(estimate: dict, dest: Path, measured: dict | None = None, title: str = "") -> Path:
    """Horizontal bars of the estimate's components, with the budget and (if given) the measured peak."""
    comps = sorted(estimate.get("components", {}).items(), key=lambda kv: kv[1])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(comps) + 1.8))
    ax.barh([k for k, _ in comps], [v / GIB for _, v in comps], color="#4c72b0")
    ax.set_xlabel("GiB")
    lines = [("estimated peak", estimate.get("device_total_bytes"), "#dd8452"),
             ("budget", estimate.get("budget_bytes"), "#c44e52")]
    if measured and measured.get("allocated_bytes"):
        lines.append(("measured peak", measured["allocated_bytes"], "#55a868"))
    for label, value, color in lines:
        if value:
            ax.axvline(value / GIB, color=color, linestyle="--", label=f"{label} {value / GIB:.2f} GiB")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest
