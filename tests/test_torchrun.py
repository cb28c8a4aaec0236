"""fitburst.torchrun: torch's torchrun arguments and agent, with the ranks forked from a launcher that imported what
they import. The ranks themselves train in tests/test_distributed.py (forked, spawned, and under a user's own
torchrun); here, what the launcher hands torch's agent, with the agent itself stubbed."""

from __future__ import annotations

import pytest

import fitburst.torchrun as launcher

TRAIN = ["train", "--spec", "s.yaml", "--prepared", "p", "--run-dir", "r", "--quiet"]


@pytest.fixture
def launched(monkeypatch):
    """What main() hands torch's elastic_launch: (config, entrypoint, args), with the imports stubbed (they would
    mark packages absent in this test's process: fitburst.unused_imports)."""
    import torch.distributed.launcher.api as api

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's config sets it where unset: not in this process after
    seen: dict = {}

    def elastic_launch(config, entrypoint):
        seen.update(config=config, entrypoint=entrypoint)
        return lambda *args: seen.update(args=args)

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    monkeypatch.setattr(launcher, "_import_what_a_rank_imports", lambda argv: seen.update(imported=argv))
    return seen


def test_a_standalone_launch_forks_fitburst_train_ranks_after_importing_them(launched, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)  # as on this CPU build; a CUDA host's test
    # process may have asked its driver already (the spawn branch: the test below)
    assert launcher.main(["--standalone", "--nproc-per-node=3", "-m", "fitburst.cli", *TRAIN]) == 0
    config = launched["config"]
    assert config.nproc_per_node == 3 and config.min_nodes == config.max_nodes == 1
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "localhost:0"  # torchrun --standalone's
    assert config.start_method == "fork"
    assert launched["entrypoint"] is launcher.rank and launched["args"] == (TRAIN,)
    assert launched["imported"] == TRAIN  # before the ranks exist


def test_several_nodes_keep_torchruns_static_rendezvous(launched):
    launcher.main(["--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29601",
                   "--nproc-per-node=2", "-m", "fitburst.cli", *TRAIN])
    config = launched["config"]
    assert (config.min_nodes, config.max_nodes, config.rdzv_backend) == (2, 2, "static")
    assert config.rdzv_endpoint == "10.0.0.1:29601" and config.rdzv_configs["rank"] == 1


@pytest.mark.parametrize("bad_fork", [True, False])
def test_the_ranks_are_spawned_where_a_forked_child_would_be_refused_cuda(launched, monkeypatch, bad_fork):
    """A CUDA build whose driver this process asked (torch marks its forked children "in bad fork"): a child
    forked to ask reports it, and the ranks are spawned."""
    import torch

    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 0, raising=False)  # torchrun's own question
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: bad_fork)  # what the probe child reads
    launcher.main(["--standalone", "--nproc-per-node=2", "-m", "fitburst.cli", *TRAIN])
    assert launched["config"].start_method == ("spawn" if bad_fork else "fork")


def test_another_program_is_refused_with_what_to_use(launched, capsys):
    assert launcher.main(["--standalone", "--nproc-per-node=2", "-m", "my.trainer", "--lr", "1"]) == 2
    assert "starts `-m fitburst.cli` ranks only; for another program use torchrun" in capsys.readouterr().err
    assert "config" not in launched  # nothing launched


def test_torchruns_question_whether_cuda_is_there_goes_through_nvml(launched, monkeypatch):
    """LaunchConfig asks torch.cuda.is_available(); asked of the driver, CUDA would be refused to forked ranks."""
    import os

    import torch

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    asked: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(os.environ.get(
        "PYTORCH_NVML_BASED_CUDA_CHECK")) or False)
    launcher.main(["--standalone", "--nproc-per-node=2", "-m", "fitburst.cli", *TRAIN])
    assert asked and set(asked) == {"1"}
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ  # the ranks get the environment as it was


@pytest.fixture
def fresh_rank_state():
    """This process's thread count, signal handlers and streams, put back after a test runs rank() here."""
    import signal
    import sys

    import torch

    threads, sigs = torch.get_num_threads(), (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT)
    handlers = {s: signal.getsignal(s) for s in sigs}
    streams = [(st, st.line_buffering, st.write_through) for st in (sys.stdout, sys.stderr)]
    yield
    torch.set_num_threads(threads)
    for s, h in handlers.items():
        signal.signal(s, h)
    for st, line, through in streams:
        st.reconfigure(line_buffering=line, write_through=through)


def test_a_rank_starts_as_a_new_python_would(monkeypatch, fresh_rank_state):
    """A forked rank inherits its launcher's thread pool (OMP_NUM_THREADS set too late for it) and the elastic
    agent's signal handlers: rank() sets both as a new process has them, and writes its output as it prints."""
    import signal
    import sys

    import torch

    import fitburst.cli

    seen: dict = {}

    def main(argv):
        seen.update(threads=torch.get_num_threads(), term=signal.getsignal(signal.SIGTERM),
                    int=signal.getsignal(signal.SIGINT), line=sys.stdout.line_buffering)
        return 0

    torch.set_num_threads(2)
    signal.signal(signal.SIGTERM, lambda *a: None)  # as the agent's _terminate_process_handler
    signal.signal(signal.SIGINT, lambda *a: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(fitburst.cli, "main", main)
    launcher.rank(TRAIN)
    assert seen == {"threads": 1, "term": signal.SIG_DFL, "int": signal.default_int_handler, "line": True}


def test_a_rank_whose_command_fails_exits_with_its_status(monkeypatch, fresh_rank_state):
    import fitburst.cli

    monkeypatch.setattr(fitburst.cli, "main", lambda argv: 2 if argv == ["bad"] else 0)
    launcher.rank(["good"])
    with pytest.raises(SystemExit) as e:
        launcher.rank(["bad"])
    assert e.value.code == 2


def test_a_spec_the_ranks_could_not_read_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    import torch.distributed.launcher.api as api

    monkeypatch.setattr(api, "elastic_launch", lambda *a, **k: pytest.fail("a rank was started"))
    (spec := tmp_path / "spec.yaml").write_text("name: demo\nmodel: 3\n")  # not a resolved pipeline
    (tmp_path / "prepared.json").write_text("{}")  # argparse checks that much of --prepared
    train = ["train", "--spec", str(spec), "--prepared", str(tmp_path), "--run-dir", "r"]
    assert launcher.main(["--standalone", "--nproc-per-node=2", "-m", "fitburst.cli", *train]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(spec) in err and "Traceback" not in err
