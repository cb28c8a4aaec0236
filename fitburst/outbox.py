"""The MLflow outbox: metrics survive an MLflow outage. The tracker (:class:`fitburst.tracking.Tracker`) writes a run
folder's metrics here first; a background thread sends them, and what an attempt left unsent is replayed by the
next (:func:`replay_outboxes`)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from fitburst.environ import redact

log = logging.getLogger(__name__)

OUTBOX_FILE = "mlflow_outbox.jsonl"
OUTBOX_FLUSH_S = float(os.environ.get("FITBURST_MLFLOW_FLUSH_S", "120"))


class Outbox:
    """An append-only JSONL file of records for MLflow (metrics, a pending close) plus the byte offset sent so far.

    :meth:`put` only appends to the file (the training loop never waits for the network); a daemon thread sends
    new lines in batches and advances ``<file>.sent`` after each success, retrying with back-off while the server
    is unreachable. A record keeps its original timestamp, so a resend after a lost reply is harmless. Lines left
    unsent when the process ends are sent by the next :class:`Outbox` on the same file (a resumed run)."""

    def __init__(self, path: Path, uri: str, interval: float = 0.5, max_backoff: float = 5.0, background: bool = True):
        from mlflow.tracking import MlflowClient  # heavy: loaded only to log

        self.path, self.sent_path = Path(path), Path(str(path) + ".sent")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self.client = MlflowClient(tracking_uri=uri)
        self.interval, self.max_backoff = interval, max_backoff
        self.failures = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"mlflow-outbox-{path.parent.name}", daemon=True)
        if background:
            self._thread.start()

    def put(self, run_id: str, metrics: list) -> None:
        self._append([{"run_id": run_id, "key": m.key, "value": m.value, "timestamp": m.timestamp,
                       "step": m.step} for m in metrics])

    def put_end(self, run_id: str, status: str) -> None:
        self._append([{"run_id": run_id, "end": status}])

    def _append(self, rows: list[dict]) -> None:
        with self._lock, self.path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        self._wake.set()

    def sent_offset(self) -> int:
        try:
            return int(self.sent_path.read_text() or 0)
        except (OSError, ValueError):
            return 0

    def pending(self) -> int:
        """Bytes not yet acknowledged by the server."""
        return self.path.stat().st_size - self.sent_offset()

    def send_once(self) -> bool:
        """Send everything unsent (in order, a run's metrics in batches of 1000). True when nothing is left."""
        from mlflow.entities import Metric  # heavy: loaded only to log

        offset = self.sent_offset()
        with self._lock, self.path.open("rb") as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        if end == 0:
            return True
        rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        i = 0
        while i < len(rows):
            row = rows[i]
            if "end" in row:
                self.client.set_terminated(row["run_id"], row["end"])
                i += 1
                continue
            j = i
            while j < len(rows) and j - i < 1000 and "end" not in rows[j] and rows[j]["run_id"] == row["run_id"]:
                j += 1
            self.client.log_batch(row["run_id"], metrics=[
                Metric(r["key"], r["value"], r["timestamp"], r["step"]) for r in rows[i:j]])
            i = j
        self.sent_path.write_text(str(offset + end))
        return True

    def _loop(self) -> None:
        backoff = self.interval
        while not self._stop.is_set():
            self._wake.wait(backoff)
            self._wake.clear()
            try:
                if self.pending() > 0:
                    self.send_once()
                self.failures, backoff = 0, self.interval
            except Exception as e:  # noqa: BLE001 - unreachable server, 5xx: keep the lines, try again later
                self.failures += 1
                backoff = min(self.max_backoff, self.interval * 2 ** self.failures)
                if self.failures in (1, 10) or self.failures % 100 == 0:
                    log.warning("MLflow unreachable (%s); %d bytes of records wait in %s", redact(str(e))[:200],
                                self.pending(), self.path)

    def flush(self, timeout: float = OUTBOX_FLUSH_S) -> bool:
        """Wait up to ``timeout`` seconds for everything to reach the server; True when it did."""
        deadline = time.monotonic() + timeout
        while self.pending() > 0 and time.monotonic() < deadline and self._thread.is_alive():
            self._wake.set()
            time.sleep(0.05)
        return self.pending() <= 0

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def replay_outboxes(root: str | Path, uri: str) -> int:
    """Send what earlier attempts left in the outboxes of the run folders under ``root`` (best effort; a folder
    whose server is still unreachable keeps its lines). Returns how many outboxes are now empty."""
    done = 0
    for path in Path(root).glob(f"*/{OUTBOX_FILE}"):
        box = Outbox(path, uri, background=False)  # one synchronous attempt
        try:
            if box.pending() > 0:
                box.send_once()
            done += 1
        except Exception as e:  # noqa: BLE001
            log.warning("MLflow records in %s still unsent (%s)", path, redact(str(e))[:200])
    return done
