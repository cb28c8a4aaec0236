"""Run folders: a rerun resumes the newest unfinished folder of the same config; nothing else is shared."""

from __future__ import annotations

import json
import os

from fitburst.rundir import open_run_dir, release


def test_resume_only_unfinished_unlocked_same_config(tmp_path, demo_spec, monkeypatch):
    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path))
    first, resumed = open_run_dir(demo_spec)
    assert not resumed and first.parent == tmp_path / "demo"
    # no checkpoint yet: a second run gets its own folder (and the first is locked by us anyway)
    second, resumed = open_run_dir(demo_spec)
    assert second != first and not resumed
    (first / "checkpoints" / "step-50").mkdir(parents=True)
    # locked by a live process (us): not taken
    third, resumed = open_run_dir(demo_spec)
    assert third not in (first, second) and not resumed
    release(first)
    again, resumed = open_run_dir(demo_spec)
    assert (again, resumed) == (first, True)
    release(first)
    # a lock file left by a dead owner holds nothing: the folder is taken
    (first / ".lock").write_text("999999")
    assert open_run_dir(demo_spec) == (first, True)
    release(first)
    # a live owner in another process keeps it
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys, time
fd = os.open({str(first / ".lock")!r}, os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(30)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        other_dir, resumed = open_run_dir(demo_spec)
        assert other_dir != first and not resumed
        release(other_dir)
    finally:
        holder.kill()
        holder.wait()
    # finished: never resumed
    (first / "train_result.json").write_text(json.dumps({"steps": 150, "total_steps": 150}))
    fresh, resumed = open_run_dir(demo_spec)
    assert fresh != first and not resumed
    # another config never picks it up
    (first / "train_result.json").unlink()
    release(first)
    other = demo_spec.model_copy(update={"training": demo_spec.training.model_copy(update={"max_steps": 7})})
    d, resumed = open_run_dir(other)
    assert d != first and not resumed
    assert str(os.getpid()) == (d / ".lock").read_text()


def test_changed_data_never_resumes_a_checkpoint_of_the_old_data(tmp_path, demo_spec, monkeypatch):
    monkeypatch.setenv("FITBURST_RUNS_DIR", str(tmp_path))
    old, resumed = open_run_dir(demo_spec, data_hash="aaaa")
    (old / "checkpoints" / "step-10").mkdir(parents=True)
    release(old)
    new, resumed = open_run_dir(demo_spec, data_hash="bbbb")  # same config, the data file changed
    assert new != old and not resumed
    assert json.loads((new / "run.json").read_text())["data_hash"] == "bbbb"
    release(new)
    assert open_run_dir(demo_spec, data_hash="aaaa") == (old, True)
    release(old)
