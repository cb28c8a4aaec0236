"""Starting the ranks of a sharded run: torchrun on this machine, or on several nodes with one supervisor per node.

One attempt is one torchrun per node starting ``fitburst train`` once per GPU (:mod:`fitburst.recipe` inside the
ranks, :mod:`fitburst.distributed` for their process group): torch's torchrun as :mod:`fitburst.torchrun` runs it,
forking each rank from a process that has imported what the ranks import. The process that calls :meth:`Ranks.run` stays
above the ranks: it holds the MLflow run, relays rank 0's loss curve and, when a rank runs out of memory, steps
every rank down together (:func:`fitburst.supervisor.train_stepping_down` calls :meth:`Ranks.run` once per rung).

Several nodes: node 0's supervisor plans, steps down and evaluates; the others follow (:meth:`Ranks.follow`). They
meet at a ``TCPStore`` that node 0's supervisor serves on the run's port: node 0 posts each attempt's spec, every
node posts how its ranks ended, and a node whose ranks stopped makes the others end theirs at once (a rank waiting
in a collective on a peer that is gone would otherwise wait for the backend's timeout). torchrun's rendezvous is
static (``--node-rank``, ``--master-addr``, a fresh port per attempt), so a node keeps its global ranks, and the
checkpoint shards on its disk, from one attempt to the next.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from fitburst import environ
from fitburst.errors import UserError

RANK_FAILED = "rank-{rank}.failed.json"  # written by a rank that stopped on an error (fitburst.recipe)
RANKS_LOG = "ranks.log"  # torchrun's and the ranks' output, in the run folder
RANKS_SPEC = "ranks-spec.yaml"  # the spec the ranks of the current attempt train, in the run folder
# how long a supervisor waits for another node: node 0 plans before the first attempt and evaluates after the last
NODE_TIMEOUT = timedelta(hours=12)
REPORT_TIMEOUT_S = 300  # after its own ranks ended, how long node 0 waits for the other nodes to say how theirs did


class RanksFailed(UserError, RuntimeError):
    """A rank of a sharded run stopped (torchrun then ended the others). ``records``: what each failed rank wrote
    (:data:`RANK_FAILED`), from every node; ``oom_kind`` and ``peak_bytes``: a rank's out-of-memory error, when that
    was the cause (the step-down, :mod:`fitburst.supervisor`, then acts for all ranks together)."""

    def __init__(self, message: str, records: list[dict]):
        super().__init__(message)
        self.records = records
        oom = next((r for r in records if r.get("oom_kind")), None)
        self.oom_kind: str | None = oom["oom_kind"] if oom else None
        self.peak_bytes: int | None = oom.get("peak_bytes") if oom else None


def local_ranks(spec) -> int:
    """The processes a local run of ``spec`` starts: one per visible CUDA GPU with ``training.distributed: fsdp``
    on CUDA, else one (auto stays on one device until a plan asks for more)."""
    if spec.training.distributed != "fsdp" or spec.preflight.device.lower() not in ("auto", "cuda"):
        return 1
    import torch  # heavy: loaded only when training

    return max(1, torch.cuda.device_count())


def _refusal(log: Path, start: int) -> str | None:
    """The first ``error: ...`` line a rank printed after ``start`` (fitburst's one-line refusals, made before
    training starts)."""
    with log.open("rb") as f:
        f.seek(start)
        lines = f.read().decode(errors="replace").splitlines()
    return next((line.split("error: ", 1)[1] for line in lines if "error: " in line), None)


class Ranks:
    """The processes of one sharded run: ``per_node`` on each of ``nodes`` machines, this machine being node
    ``node_rank``; several nodes meet at ``master_addr``:``port`` (node 0's address)."""

    def __init__(self, per_node: int = 1, nodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
                 port: int = 29400):
        self.per_node, self.nodes, self.node_rank = per_node, nodes, node_rank
        self.master_addr, self.port = master_addr, port
        self.attempt = 0
        self._store: Any = None

    @property
    def size(self) -> int:
        return self.per_node * self.nodes

    def __repr__(self) -> str:
        return f"Ranks({self.per_node} per node x {self.nodes} nodes, this node {self.node_rank})"

    # --- node 0 (or the one node) --------------------------------------------------------------------------

    def run(self, spec, prepared_dir: str | Path, run_dir: str | Path, *, device: str | None = None,
            on_metrics: Callable[[dict, int], None] | None = None, poll_s: float = 0.5) -> None:
        """One attempt: train ``spec`` on every rank of every node (the ranks run ``fitburst train``). Rank 0's loss
        curve (``metrics.jsonl``) is passed on to ``on_metrics`` while it trains; the ranks' output goes to
        ``ranks.log`` in the run folder. Raises :class:`RanksFailed` when a rank on any node stops; an interrupt
        here ends this node's ranks, and the other nodes end theirs."""
        run_dir = Path(run_dir)
        text = spec.to_yaml()
        if self.nodes > 1:
            self._post(f"attempt/{self.attempt}", {"spec": text})
        try:
            records, start = self._attempt(text, prepared_dir, run_dir, device, on_metrics, poll_s)
            failed = records is not None
            if self.nodes > 1:
                others = self._reports(self.attempt)
                failed = failed or any(r is not None for r in others)
                records = [*(records or []), *(r for node in others for r in (node or []))]
        finally:  # the next message to the other nodes (an attempt, or the end) goes under the next key
            self.attempt += 1
        if failed:
            records = records or []
            what = "; ".join(f"rank {r['rank']} at step {r['step']}: {r['error']}" for r in records) or _refusal(
                run_dir / RANKS_LOG, start) or "torchrun exited with an error and no rank said why (killed?)"
            where = f"{self.size} processes" if self.nodes == 1 else f"{self.nodes} nodes x {self.per_node} processes"
            raise RanksFailed(f"{spec.name}: training on {where} stopped ({what}); the log is "
                              f"{run_dir / RANKS_LOG}, and a rerun resumes from the last checkpoint", records)

    def finish(self, error: str | None = None) -> None:
        """Node 0: no attempt follows; the other nodes' supervisors exit (non-zero with ``error``)."""
        if self.nodes > 1 and self.node_rank == 0:
            self._post(f"attempt/{self.attempt}", {"done": True, "error": error})
            try:  # the store ends with this process: the others read the message first
                self.store.wait([f"over/{n}" for n in range(1, self.nodes)], timedelta(seconds=REPORT_TIMEOUT_S))
            except RuntimeError:
                pass  # a node that is gone reads nothing

    # --- the other nodes ----------------------------------------------------------------------------------

    def follow(self, prepared_dir: str | Path, run_dir: str | Path, *, device: str | None = None) -> int:
        """Node 1..N-1: start this node's ranks for each attempt node 0 posts, say how they ended, until node 0
        says the run is over. Returns the exit status: 0 when it ended well."""
        run_dir = Path(run_dir)
        while True:
            msg = json.loads(self.store.get(f"attempt/{self.attempt}"))
            if msg.get("done"):
                self.store.set(f"over/{self.node_rank}", "")
                if msg["error"]:
                    print(f"error: node 0: {msg['error']}", file=sys.stderr)
                return 1 if msg["error"] else 0
            self._attempt(msg["spec"], prepared_dir, run_dir, device, None, 0.5)
            self.attempt += 1

    # --- one attempt on this node ---------------------------------------------------------------------------

    def command(self, spec_path: Path, prepared_dir: str | Path, run_dir: Path, device: str | None) -> list[str]:
        """This node's torchrun for the current attempt: ``--standalone`` on one node; on several a static
        rendezvous at node 0, on a port of its own per attempt (the last attempt's may not be free yet)."""
        where = (["--standalone"] if self.nodes == 1 else
                 [f"--nnodes={self.nodes}", f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                  f"--master-port={self.port + 1 + self.attempt}"])
        return [sys.executable, "-m", "fitburst.torchrun", *where, f"--nproc-per-node={self.per_node}",
                "-m", "fitburst.cli", "train", "--spec", str(spec_path), "--prepared", str(prepared_dir),
                "--run-dir", str(run_dir), "--quiet", *(["--device", device] if device else [])]

    def _attempt(self, spec_text: str, prepared_dir: str | Path, run_dir: Path, device: str | None,
                 on_metrics: Callable[[dict, int], None] | None, poll_s: float) -> tuple[list[dict] | None, int]:
        """Run this node's torchrun to its end; returns its failed ranks' records (None: they all ended well) and
        where this attempt's output starts in ``ranks.log``. Several nodes: posts them for the others, and ends its
        ranks early when another node posts a failure."""
        run_dir.mkdir(parents=True, exist_ok=True)
        mine = [run_dir / RANK_FAILED.format(rank=r) for r in self._global_ranks()]
        for stale in mine:
            stale.unlink(missing_ok=True)
        spec_path = run_dir / self._on_this_node(RANKS_SPEC)
        spec_path.write_text(spec_text)
        relay = _MetricsRelay(run_dir / "metrics.jsonl", on_metrics)
        # the ranks log nothing to MLflow themselves: the supervisor does (and holds the run)
        env = {k: v for k, v in environ.snapshot().items() if k != "FITBURST_MLFLOW_RUN_ID"}
        with (run_dir / self._on_this_node(RANKS_LOG)).open("a") as out:
            start = out.tell()
            proc = subprocess.Popen(self.command(spec_path, prepared_dir, run_dir, device), env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                while proc.poll() is None:
                    relay()
                    if self.nodes > 1 and self._another_failed():
                        _end(proc, signal.SIGTERM)
                    time.sleep(poll_s)
                relay()
            except BaseException:  # Ctrl-C, cancellation, an error in on_metrics: no rank outlives this process
                _end(proc, signal.SIGTERM)
                if self.nodes > 1:
                    self._post(self._report_key(self.attempt, self.node_rank), {"records": []})
                raise
        records = None
        if proc.returncode != 0:
            records = [json.loads(p.read_text()) for p in mine if p.exists()]
        if self.nodes > 1:
            self._post(self._report_key(self.attempt, self.node_rank), {"records": records})
        return records, start

    def _global_ranks(self) -> range:
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    def _on_this_node(self, name: str) -> str:
        """A file of this node's supervisor in the run folder: node 0's keeps its name, another node's is named
        after it (with burst.bucket every node writes into the same folder)."""
        if self.node_rank == 0:
            return name
        stem, dot, ext = name.partition(".")
        return f"{stem}-node{self.node_rank}{dot}{ext}"

    # --- the supervisors' store -------------------------------------------------------------------------------

    @property
    def store(self):
        """Node 0's ``TCPStore`` (served by node 0's supervisor; the others are its clients)."""
        if self._store is None:
            from torch.distributed import TCPStore  # heavy: loaded only when training

            self._store = TCPStore(self.master_addr, self.port, is_master=self.node_rank == 0,
                                   timeout=NODE_TIMEOUT, wait_for_workers=False)
        return self._store

    def _post(self, key: str, value: dict) -> None:
        self.store.set(key, json.dumps(value))

    @staticmethod
    def _report_key(attempt: int, node: int) -> str:
        return f"attempt/{attempt}/node/{node}"

    def _another_failed(self) -> bool:
        for node in range(self.nodes):
            key = self._report_key(self.attempt, node)
            if node != self.node_rank and self.store.check([key]):
                if json.loads(self.store.get(key))["records"] is not None:
                    return True
        return False

    def _reports(self, attempt: int) -> list[list[dict] | None]:
        """The other nodes' failed-rank records for ``attempt`` (None: a node whose ranks all ended well)."""
        keys = [self._report_key(attempt, n) for n in range(1, self.nodes)]
        try:
            self.store.wait(keys, timedelta(seconds=REPORT_TIMEOUT_S))
        except RuntimeError:  # a node that never reported (its machine is gone): its ranks count as failed
            return [json.loads(self.store.get(k))["records"] if self.store.check([k]) else
                    [{"rank": f"node {n}", "step": "?", "error": "its node did not report"}]
                    for n, k in enumerate(keys, start=1)]
        return [json.loads(self.store.get(k))["records"] for k in keys]


class _MetricsRelay:
    """Rank 0's loss curve, as it appends it to ``metrics.jsonl``, passed on row by row."""

    def __init__(self, path: Path, on_metrics: Callable[[dict, int], None] | None):
        self.path, self.on_metrics = path, on_metrics
        self.offset = path.stat().st_size if path.exists() else 0

    def __call__(self) -> None:
        if self.on_metrics is None or not self.path.exists():
            return
        with self.path.open() as f:
            f.seek(self.offset)
            for line in iter(f.readline, ""):
                if not line.endswith("\n"):
                    break  # rank 0 is still writing it
                self.offset += len(line)
                row = json.loads(line)
                self.on_metrics({k: v for k, v in row.items() if k != "step"}, row["step"])


def _end(proc: subprocess.Popen, sig: int) -> None:
    """End torchrun and its ranks (its own process group): ``sig``, then SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
