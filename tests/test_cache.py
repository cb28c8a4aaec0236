"""fitburst.cache.build_once: one build per cache, however many processes ask for it at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import sys, time
from pathlib import Path
from fitburst.cache import build_once

def build(tmp):
    with open(sys.argv[2], "a") as log:
        log.write("built\\n")
    time.sleep(1.0)  # long enough for the other caller to arrive while this one builds
    (tmp / "config.json").write_text("{}")

print(build_once(Path(sys.argv[1]), build))
"""


def test_two_processes_asking_for_one_model_at_once_build_it_once(tmp_path, root):
    dest, log = tmp_path / "models" / "tiny", tmp_path / "builds.log"
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(dest), str(log)], stdout=subprocess.PIPE, text=True,
                              env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [str(dest)] * 2 and (dest / "config.json").exists()
    assert log.read_text().splitlines() == ["built"]  # the second caller waited and took the first one's folder
    assert [p.name for p in dest.parent.iterdir() if p.name.startswith(".build-")] == []


def test_a_build_that_fails_leaves_no_folder_and_the_next_caller_builds(tmp_path):
    from fitburst.cache import build_once

    dest = tmp_path / "tiny"

    def broken(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError, match="out of disk"):
        build_once(dest, broken)
    assert not dest.exists()
    assert build_once(dest, lambda tmp: (tmp / "config.json").write_text("{}")) == dest
    assert (dest / "config.json").exists()
