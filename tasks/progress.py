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

    def __init__(self, pipeline: str, total_steps: int, tokens_per_step: float,
                 forward: Callable[[dict, int], None] | None = None):
        self.total, self.tokens_per_step, self.forward = total_steps, tokens_per_step, forward
        self.key = f"training-{artifact_key(pipeline)}"
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.last: tuple[float, int] | None = None  # (time, step) of the previous update: rates over the window
        artifact_id = create_progress_artifact(
            progress=0.0, key=self.key, description=f"training {pipeline}: starting (or resuming)")
        assert isinstance(artifact_id, UUID)  # called from sync code: prefect ran the sync version
        self.artifact_id = artifact_id
        self.log = get_run_logger()

    def __call__(self, row: dict, step: int) -> None:
        if self.forward is not None:
            self.forward(row, step)
        now = time.perf_counter()
        # a resumed run starts at its checkpoint's step: the first rate is taken from the second update on
        rate = (step - self.last[1]) / (now - self.last[0]) if self.last and now > self.last[0] else float("nan")
        self.last = (now, step)
        left = (self.total - step) / rate if rate > 0 else float("nan")
        loss = row.get("train_loss", float("nan"))
        known = rate == rate
        line = (f"step {step}/{self.total} · loss {loss:.4f} · "
                f"{f'{rate:.2f}' if known else '?'} steps/s · "
                f"~{f'{rate * self.tokens_per_step:,.0f}' if known else '?'} tokens/s · "
                f"ETA {eta(left) if left == left else ('0s' if step >= self.total else '?')}")
        self.rows.append({"step": step, "train_loss": round(loss, 5), "steps_per_s": round(rate, 3) if known else None,
                          "tokens_per_s": round(rate * self.tokens_per_step) if known else None,
                          "eta_s": round(left, 1) if left == left else None, "elapsed_s": round(now - self.t0, 1)})
        update_progress_artifact(self.artifact_id, progress=100.0 * step / max(self.total, 1), description=line)
        self.log.info("%s", line)

    def finish(self) -> None:
        """The logged rows as a table artifact (the progress artifact already reads 100 %)."""
        if self.rows:
            create_table_artifact(self.rows, key=f"{self.key}-log", description="training progress, per log step")
