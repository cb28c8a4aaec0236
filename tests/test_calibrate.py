"""`fitburst calibrate`: fit correction constants from a real MLflow store, and the estimator applies them."""

from __future__ import annotations

import argparse
import json

import pytest

from fitburst.memory import RunSettings, estimate, load_shape, resolve_device

# (tags, metrics): measured / estimated ratios known by construction
RUNS = [
    *[({"device": "cuda", "path": "cloud", "cloud.gpu": "A100-80GB"},
       {"memory.estimated_allocated_bytes": 1e9, "memory.measured_peak_bytes": r * 1e9}) for r in (1.08, 1.10, 1.12)],
    ({"device": "cuda (NVIDIA A100-80GB)", "path": "local"},
     {"memory.estimated_comparable_bytes": 2e9, "memory.estimated_allocated_bytes": 2e9,
      "memory.measured_peak_bytes": 2.2e9}),
    ({"device": "cuda", "path": "cloud", "cloud.gpu": "T4"},
     {"memory.estimated_allocated_bytes": 1e9, "memory.measured_peak_bytes": 1.3e9}),
    ({"device": "cpu", "path": "local"},
     {"memory.estimated_comparable_bytes": 100e6, "memory.measured_peak_bytes": 90e6}),
    ({"device": "cpu", "path": "local"},
     {"memory.estimated_reserved_bytes": 100e6, "memory.measured_peak_bytes": 92e6}),
    ({"device": "mps", "path": "local"},
     {"memory.estimated_reserved_bytes": 1e9, "memory.measured_peak_bytes": 1.2e9}),
    ({"device": "cuda", "path": "local"}, {"memory.estimated_allocated_bytes": 1e9}),  # no measurement: ignored
]


@pytest.fixture()
def store(tmp_path, monkeypatch):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("FITBURST_CACHE", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("calib")
    for tags, metrics in RUNS:
        run = client.create_run(exp, tags=tags)
        client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
        client.set_terminated(run.info.run_id)
    return uri


def _args(uri, **kw):
    return argparse.Namespace(tracking_uri=uri, experiment="calib", min_runs=3, dry_run=False, json=False, **kw)


def test_fit_writes_per_family_and_per_gpu_constants(store, tmp_path, capsys):
    from fitburst.calibrate import main

    assert main(_args(store)) == 0
    out = capsys.readouterr().out
    assert "8 runs with estimated and measured peaks" in out  # the run without a measurement is skipped
    data = json.loads((tmp_path / "cache" / "calibration.json").read_text())
    fam, gpus = data["families"], data["gpus"]
    assert fam["cuda"]["n"] == 5 and fam["cuda"]["factor"] == pytest.approx(1.10)
    assert fam["cuda"]["paths"] == ["cloud", "local"]
    assert fam["cpu"]["factor"] == pytest.approx(0.91) and fam["mps"]["factor"] == pytest.approx(1.2)
    assert set(gpus) == {"A100-80GB"} and gpus["A100-80GB"]["n"] == 4  # T4 has 1 run (< --min-runs)
    assert gpus["A100-80GB"]["factor"] == pytest.approx(1.10)
    for g in [*fam.values(), *gpus.values()]:
        assert g["after"]["median"] <= g["before"]["median"]
    assert fam["cuda"]["before"]["median"] == pytest.approx(1 - 1 / 1.1)  # |estimate / measured - 1|
    assert fam["cuda"]["after"]["median"] < 0.02


def test_estimate_applies_the_constants_and_nothing_changes_without_a_file(store, tmp_path, monkeypatch):
    from fitburst.calibrate import main

    shape, s = load_shape("qwen2.5-0.5b"), RunSettings(seq_len=256)
    a100, cpu, l4 = resolve_device("A100-80GB"), resolve_device("cpu:64GiB"), resolve_device("L4")
    raw = {d.name: estimate(shape, s, d, calibrate=False) for d in (a100, cpu, l4)}
    for d in (a100, cpu, l4):  # no file yet: identical
        e = estimate(shape, s, d)
        assert e.calibration_factor == 1.0 and e.allocated_peak_bytes == raw[d.name].allocated_peak_bytes
    assert main(_args(store)) == 0
    e = estimate(shape, s, a100)  # per-GPU constant
    assert e.calibration_factor == pytest.approx(1.10)
    assert e.allocated_peak_bytes == int(raw[a100.name].allocated_peak_bytes * 1.10)
    assert e.device_total_bytes == e.reserved_peak_bytes + a100.outside_allocator
    assert any("calibrated" in n for n in e.notes)
    assert estimate(shape, s, l4).calibration_factor == pytest.approx(1.10)  # cuda family constant
    e = estimate(shape, s, cpu)
    assert e.reserved_peak_bytes == int(raw[cpu.name].reserved_peak_bytes * 0.91)
    monkeypatch.setenv("FITBURST_CACHE", str(tmp_path / "empty"))
    assert estimate(shape, s, a100).allocated_peak_bytes == raw[a100.name].allocated_peak_bytes


def test_cli_dry_run_writes_nothing(store, tmp_path):
    from fitburst.cli import main

    assert main(["calibrate", "--tracking-uri", store, "--experiment", "calib", "--dry-run"]) == 0
    assert not (tmp_path / "cache" / "calibration.json").exists()
    assert main(["calibrate", "--tracking-uri", store, "--experiment", "nope", "--dry-run"]) == 1


def test_repeated_calibration_converges_instead_of_undoing_itself(tmp_path, monkeypatch):
    """Runs whose true peak is 1.15 x the analytic estimate (reserved 1.25 x): calibrate, then log new runs with
    the calibrated estimates (as the preflight does, factor recorded), calibrate again: the factor stays."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from fitburst.calibrate import collect, fit, main
    from fitburst.tracking import memory_runs

    monkeypatch.setenv("FITBURST_CACHE", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("calib")
    shape, a100 = load_shape("qwen2.5-0.5b"), resolve_device("A100-80GB")

    def log_runs(n: int) -> None:
        for i in range(n):
            raw = estimate(shape, RunSettings(seq_len=256 * (i + 1)), a100, calibrate=False)
            e = estimate(shape, RunSettings(seq_len=256 * (i + 1)), a100)  # with whatever file exists now
            run = client.create_run(exp, tags={"device": "cuda", "path": "cloud", "cloud.gpu": "A100-80GB"})
            metrics = {"memory.estimated_comparable_bytes": e.allocated_peak_bytes,
                       "memory.estimated_reserved_bytes": e.reserved_peak_bytes,
                       "memory.calibration_factor": e.calibration_factor,
                       "memory.calibration_reserved_factor": e.reserved_calibration_factor,
                       "memory.measured_peak_bytes": 1.15 * raw.allocated_peak_bytes,
                       "memory.measured_reserved_bytes": 1.25 * raw.reserved_peak_bytes}
            client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
            client.set_terminated(run.info.run_id)

    factors = []
    for _ in range(3):
        log_runs(3)
        assert main(_args(uri)) == 0
        g = json.loads((tmp_path / "cache" / "calibration.json").read_text())["gpus"]["A100-80GB"]
        factors.append((g["factor"], g["reserved_factor"]))
    assert factors == [pytest.approx((1.15, 1.25), abs=1e-3)] * 3  # converged at the first fit, and stays
    e = estimate(shape, RunSettings(seq_len=256), a100)
    raw = estimate(shape, RunSettings(seq_len=256), a100, calibrate=False)
    assert e.reserved_peak_bytes == pytest.approx(1.25 * raw.reserved_peak_bytes, rel=1e-3)
    assert e.allocated_peak_bytes == pytest.approx(1.15 * raw.allocated_peak_bytes, rel=1e-3)
    # runs made with the fitted file: measured / logged estimate is ~1.0 (what the old rule fitted, undoing the
    # correction); with the applied factor divided out they still give 1.15
    later = [r for r in client.search_runs([exp], "metrics.`memory.calibration_factor` > 1.01")]
    assert len(later) == 6
    logged = [r.data.metrics["memory.measured_peak_bytes"] / r.data.metrics["memory.estimated_comparable_bytes"]
              for r in later]
    assert max(abs(x - 1) for x in logged) < 1e-3
    assert fit(collect(memory_runs(uri, "calib")))["gpus"]["A100-80GB"]["factor"] == pytest.approx(1.15, abs=1e-3)


def test_an_out_of_memory_record_raises_the_factor_to_its_floor(store, tmp_path):
    """A step-down record (fitburst.supervisor) says the run needed at least its measured peak: the fitted factor of its
    family and GPU is never below measured / estimated, while other families keep the runs' median."""
    from fitburst.calibrate import main

    history = tmp_path / "cache" / "oom_history.jsonl"
    history.parent.mkdir(parents=True)
    oom = {"pipeline": "p", "device": "cuda", "device_name": "cuda (NVIDIA A100-80GB)", "oom_kind": "cuda",
           "measured_peak_bytes": 1.25e9, "estimated_bytes": 1e9}
    old = {**oom, "estimated_bytes": None}  # written before estimates were recorded: no floor
    history.write_text(json.dumps(oom) + "\n" + json.dumps(old) + "\n" + '{"pipeline": "cut sh')
    assert main(_args(store)) == 0
    data = json.loads((tmp_path / "cache" / "calibration.json").read_text())
    cuda, a100 = data["families"]["cuda"], data["gpus"]["A100-80GB"]
    assert cuda["factor"] == pytest.approx(1.25) and cuda["oom_n"] == 1  # the runs alone give 1.10
    assert a100["factor"] == pytest.approx(1.25) and a100["oom_floor"] == pytest.approx(1.25)
    assert data["families"]["cpu"]["factor"] == pytest.approx(0.91) and "oom_n" not in data["families"]["cpu"]


def _store_with(tmp_path, runs: list[tuple[dict, dict]]) -> str:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("calib")
    for tags, metrics in runs:
        run = client.create_run(exp, tags=tags)
        client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
        client.set_terminated(run.info.run_id)
    return uri


def test_cpu_demo_runs_are_heap_dominated_and_fit_nothing(tmp_path, monkeypatch, capsys):
    """Five demo runs as the flow and a fresh `fitburst train` measure them: 11 MiB of tensors in a 43 MiB
    estimate, RSS growth 30-33 MiB after the preflight warmed torch, 75 MiB in a fresh process. The figure is the
    runtime heap, not the model: no factor is fitted (it was 0.753, worsening the worst error)."""
    from fitburst.cli import main

    monkeypatch.setenv("FITBURST_CACHE", str(tmp_path / "cache"))
    mib = 1 << 20
    runs = [({"device": "cpu (local)", "path": "local"},
             {"memory.estimated_allocated_bytes": 10.77 * mib, "memory.estimated_comparable_bytes": 42.77 * mib,
              "memory.measured_peak_bytes": m * mib}) for m in (31.0, 32.5, 29.9, 31.6, 75.0)]
    uri = _store_with(tmp_path, runs)
    assert main(["calibrate", "--tracking-uri", uri, "--experiment", "calib"]) == 1
    out = capsys.readouterr().out
    assert "5 CPU/MPS runs left out: their peak is mostly the runtime heap" in out
    assert not (tmp_path / "cache" / "calibration.json").exists()


def test_calibrate_never_writes_a_factor_that_worsens_its_errors(tmp_path, monkeypatch, capsys):
    from fitburst.cli import main

    monkeypatch.setenv("FITBURST_CACHE", str(tmp_path / "cache"))
    ratios = {"cuda": (0.70, 0.72, 0.75, 0.76, 3.9), "mps": (1.10, 1.12, 1.15)}
    runs = [({"device": kind, "path": "local"},
             {"memory.estimated_allocated_bytes": 1e9, "memory.estimated_comparable_bytes": 1e9,
              "memory.measured_peak_bytes": r * 1e9}) for kind, rs in ratios.items() for r in rs]
    uri = _store_with(tmp_path, runs)
    assert main(["calibrate", "--tracking-uri", uri, "--experiment", "calib"]) == 0
    fam = json.loads((tmp_path / "cache" / "calibration.json").read_text())["families"]
    for g in fam.values():
        assert g["after"]["median"] <= g["before"]["median"] and g["after"]["worst"] <= g["before"]["worst"], g
    assert fam["cuda"]["factor"] == 1.0 and fam["cuda"]["chosen"].startswith("kept 1.0")
    assert fam["mps"]["factor"] == pytest.approx(1.12, abs=1e-3) and fam["mps"]["chosen"] == "median"
