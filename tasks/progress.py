"""Training progress in Prefect: a progress artifact (percent done, with step, loss, tokens/s and ETA in its
description) updated from train()'s ``on_metrics`` callback, one clean log line per update, and a table of the
logged rows at the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from tasks import artifact_key


def eta(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class TrainingProgress:
    """Callable as ``on_metrics(row, step)``; forwards each row to ``forward`` (the MLflow logger) first.

    Tokens/s is the step rate times the tokens of an average optimizer step (micro batch x accumulation x mean
    sequence length of the prepared data); the loop does not report per-step token counts."""

    def __init__(self, pipeline: str, total_steps: int, start_step: int, tokens_per_step: float,
                 forward: Callable[[dict, int], None] | None = None):
        self.total, self.start, self.tokens_per_step, self.forward = total_steps, start_step, tokens_per_step, forward
        self.key = f"training-{artifact_key(pipeline)}"
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.artifact_id: UUID = create_progress_artifact(
            progress=100.0 * start_step / max(total_steps, 1), key=self.key,
            description=f"training {pipeline}: step {start_step}/{total_steps}, starting")
        self.log = get_run_logger()

    def __call__(self, row: dict, step: int) -> None:
        if self.forward is not None:
            self.forward(row, step)
        elapsed = time.perf_counter() - self.t0
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        left = (self.total - step) / rate if rate > 0 else float("nan")
        loss = row.get("train_loss", float("nan"))
        line = (f"step {step}/{self.total} · loss {loss:.4f} · {rate:.2f} steps/s · "
                f"~{rate * self.tokens_per_step:,.0f} tokens/s · ETA {eta(left) if left == left else '?'}")
        self.rows.append({"step": step, "train_loss": round(loss, 5), "steps_per_s": round(rate, 3),
                          "tokens_per_s": round(rate * self.tokens_per_step), "eta_s": round(left, 1) if left == left
                          else None, "elapsed_s": round(elapsed, 1)})
        update_progress_artifact(self.artifact_id, progress=100.0 * step / max(self.total, 1), description=line)
        self.log.info("%s", line)

    def finish(self) -> None:
        """The logged rows as a table artifact (the progress artifact already reads 100 %)."""
        if self.rows:
            create_table_artifact(self.rows, key=f"{self.key}-log", description="training progress, per log step")
