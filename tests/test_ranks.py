"""The supervisors of a multi-node run (fitburst.ranks.Ranks) meeting at node 0's store, with each node's torchrun
replaced by a small script (the ranks themselves train in tests/test_distributed.py, through the SkyPilot run
block): what one node's ranks do reaches the other node's supervisor, in both directions."""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import pytest

from fitburst.ranks import Ranks, RanksFailed
from fitburst.spec import load_pipeline

# one node's "torchrun", as the spec's name says: "fail-<node>": that node's rank writes its failure record and
# exits 1 while the other's waits for a minute (as a peer of a failed rank waits in a collective); "sleep-<s>": all
# end well
RANKS = """
import json, pathlib, sys, time
run, node, plan = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if plan == f"fail-{node}":
    (run / f"rank-{node}.failed.json").write_text(json.dumps(
        {"rank": node, "step": 2, "error": "DefaultCPUAllocator: can't allocate memory", "oom_kind": "cpu",
         "peak_bytes": 123}))
    sys.exit(1)
if plan == "interrupt" and node == 0:  # rank 0 logs a step; the supervisor is interrupted while relaying it
    (run / "metrics.jsonl").write_text('{"step": 1, "train_loss": 1.0}\\n')
time.sleep(float(plan.removeprefix("sleep-")) if plan.startswith("sleep-") else 60)
(run / f"finished-{plan}-{node}").write_text("")
"""


class ScriptRanks(Ranks):
    """Ranks whose torchrun is :data:`RANKS`, told what to do by the attempt's spec (its name)."""

    def command(self, spec_path, prepared_dir, run_dir, device):
        plan = next(line.split(": ")[1] for line in spec_path.read_text().splitlines() if line.startswith("name:"))
        return [sys.executable, "-c", RANKS, str(run_dir), str(self.node_rank), plan]


def ended_early(run_dir: Path, plan: str, node: int) -> bool:
    """Whether node ``node``'s rank of attempt ``plan`` was ended by its supervisor: no process of it is running
    and it never reached the end of its minute-long wait."""
    argv = [str(run_dir), str(node), plan]
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode().split("\0")
            state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the process ended while we looked
            continue
        if args[-4:-1] == argv and state != "Z":
            return False
    return not (run_dir / f"finished-{plan}-{node}").exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(tmp_path: Path) -> tuple[ScriptRanks, ScriptRanks, list[int], threading.Thread]:
    """Node 0's supervisor (serving the store) and node 1's, following it in a thread: ``status`` gets its exit
    status."""
    port = free_port()
    head = ScriptRanks(1, 2, 0, "127.0.0.1", port)
    head.store  # noqa: B018 - node 0 serves the store before the other node connects
    follower = ScriptRanks(1, 2, 1, "127.0.0.1", port)
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(follower.follow(tmp_path, tmp_path / "node1")), daemon=True)
    thread.start()
    return head, follower, status, thread


@pytest.fixture
def spec(pipelines_file):
    return load_pipeline(pipelines_file, "demo", {"preflight.device": "cpu"})


def test_a_failure_on_either_node_ends_both_and_reaches_node_0_then_the_next_attempt_runs_on_both(tmp_path, spec):
    head, follower, status, thread = two_nodes(tmp_path)

    # node 1's rank runs out of memory while node 0's would sleep for a minute: node 0's is ended, not waited for
    with pytest.raises(RanksFailed, match="rank 1 at step 2") as e:
        head.run(spec.model_copy(update={"name": "fail-1"}), tmp_path, tmp_path / "node0", poll_s=0.05)
    assert e.value.oom_kind == "cpu" and e.value.peak_bytes == 123  # the step-down reads node 1's record
    assert ended_early(tmp_path / "node0", "fail-1", 0)
    assert "node 1" not in str(e.value)

    # node 0's rank fails while node 1's sleeps: node 1 ends its ranks and says so
    with pytest.raises(RanksFailed, match="rank 0 at step 2"):
        head.run(spec.model_copy(update={"name": "fail-0"}), tmp_path, tmp_path / "node0", poll_s=0.05)

    head.run(spec.model_copy(update={"name": "sleep-0.2"}), tmp_path, tmp_path / "node0", poll_s=0.05)
    head.finish()
    thread.join(timeout=60)
    assert status == [0] and follower.attempt == 3
    assert json.loads(head.store.get("attempt/2/node/1")) == {"records": None}  # node 1 ran the third attempt too
    assert (tmp_path / "node1" / "ranks-spec-node1.yaml").read_text().startswith("name: sleep-0.2")
    assert ended_early(tmp_path / "node1", "fail-0", 1)  # node 1 ended its rank before following the third attempt


def test_node_0_ending_on_an_error_makes_the_other_nodes_exit_failed(tmp_path, spec):
    head, follower, status, thread = two_nodes(tmp_path)
    head.finish(error="demo does not fit A6000")
    thread.join(timeout=60)
    assert status == [1]


def test_the_plan_inside_a_rank_torchrun_started_is_refused_with_the_command_to_run(tmp_path, demo_spec, demo_prepared,
                                                                                    monkeypatch, capsys):
    """Planning is the supervisor's: N ranks planning alone could each pick other settings."""
    from fitburst.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(demo_spec.to_yaml())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    rc = main(["train", "--spec", str(spec), "--prepared", str(demo_prepared.dir), "--run-dir", str(tmp_path / "run"),
               "--plan"])
    err = capsys.readouterr().err
    assert rc != 0 and "fitburst train --nproc-per-node N" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_node_0_interrupted_mid_attempt_ends_every_node_and_the_others_hear_of_it(tmp_path, spec, monkeypatch):
    """Ctrl-C (or a cancelled flow) reaches node 0's supervisor while the ranks train: its ranks end, the other
    node's end too, and the end of the run reaches the other node under the next attempt's key."""
    from fitburst import ranks

    monkeypatch.setattr(ranks, "REPORT_TIMEOUT_S", 5)  # how long node 0 waits for a node that never answers
    head, follower, status, thread = two_nodes(tmp_path)

    def interrupted(row, step):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        head.run(spec.model_copy(update={"name": "interrupt"}), tmp_path, tmp_path / "node0", poll_s=0.05,
                 on_metrics=interrupted)
    head.finish(error="interrupted")  # as fitburst train does on its way out
    thread.join(timeout=60)
    assert status == [1]
    assert ended_early(tmp_path / "node0", "interrupt", 0) and ended_early(tmp_path / "node1", "interrupt", 1)


def test_a_node_rank_outside_the_nodes_is_refused_before_anything_loads(tmp_path, demo_spec, demo_prepared, capsys):
    from fitburst.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(demo_spec.to_yaml())
    rc = main(["train", "--spec", str(spec), "--prepared", str(demo_prepared.dir), "--run-dir", str(tmp_path / "run"),
               "--nnodes", "2", "--node-rank", "2"])
    err = capsys.readouterr().err
    assert rc != 0 and "--node-rank 2 is not a node of --nnodes 2" in err and "0 .. 1" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
