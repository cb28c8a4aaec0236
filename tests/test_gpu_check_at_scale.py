"""benchmarks/gpu_check.py --at-scale --dry-run: every configuration of the at-scale check, on the CPU with tiny
stand-ins of its models, through the same parent (priority order, deadline, CSV after each, at most 8 files back),
children (model build, fitburst's loop with the readings, Hugging Face's Trainer) and replay as a GPU run. The
children run in this process (a fresh interpreter per child would take minutes here)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from fitburst import hardware

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def check():
    import _at_scale
    import gpu_check

    return gpu_check, _at_scale


def in_process(gpu_check):
    """``_at_scale.child`` running gpu_check's child in this process: (exit status, last words)."""

    def child(args: list[str], timeout: float) -> tuple[int, str]:
        try:
            return gpu_check.main(args), ""
        except Exception as e:  # noqa: BLE001 - the parent records a child's failure, as with a process
            return 1, repr(e)[:300]

    return child


@pytest.fixture(scope="module")
def dry_run(check, tmp_path_factory):
    gpu_check, at_scale = check
    out, models = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(at_scale, "child", in_process(gpu_check))
        # the fused loss as a CPU with no C++ compiler runs it (fitburst's chunked loss): inductor's compile of
        # CCE's CPU path takes minutes here, and the check's code path is the same
        mp.setattr(hardware, "cpu_compiler", lambda: False)
        rc = gpu_check.main(["--dry-run", "--steps", "2", "--budget", "3600", "--out", str(out),
                             "--models", str(models)])
    with (out / "at_scale.csv").open() as f:
        rows = list(csv.DictReader(f))
    return rc, out, rows, json.loads((out / "at_scale.json").read_text())


def test_every_configuration_runs_on_tiny_stand_ins(check, dry_run):
    _, at_scale = check
    rc, out, rows, meta = dry_run
    status = {name: s["status"] for name, s in meta["configs"].items()}
    assert rc == 0, meta["configs"]
    assert list(status) == [c.name for c in at_scale.CASES]  # in priority order
    assert {n for n, s in status.items() if s != "ok"} == {c.name for c in at_scale.CASES if c.cuda_only}
    peaks = {r["config"]: r for r in rows if r["stage"] == "peak"}
    assert set(peaks) == {n for n, s in status.items() if s == "ok"}
    assert all(float(r["tokens_per_s"]) > 0 and r["sdpa_backend"] and r["adamw"] for r in peaks.values())
    assert peaks["gemma1b-lora-2x2048-fused"]["loss_kernel"] == "chunked"
    assert peaks["qwen7b-lora-2048"]["seq_len"] == str(2048 // at_scale.TINY)
    speed = {r["config"] for r in rows if r["loop"] == "hf_trainer" and float(r["tokens_per_s"]) > 0}
    assert speed == {c.name for c in at_scale.CASES if c.speed}
    assert meta["versions"]["libraries"]["torch"] and len(list(out.iterdir())) <= 8


def test_out_of_time_configurations_are_named_and_the_csv_still_written(check, tmp_path):
    gpu_check, at_scale = check
    rc = gpu_check.main(["--dry-run", "--budget", "0", "--out", str(tmp_path), "--models", str(tmp_path / "m")])
    meta = json.loads((tmp_path / "at_scale.json").read_text())
    assert rc == 0 and (tmp_path / "at_scale.csv").exists()
    assert {s["status"] for s in meta["configs"].values()} == {"not run: out of time"}


def test_the_replay_estimates_each_measured_configuration(check, dry_run, capsys):
    gpu_check, _ = check
    _, out, rows, _ = dry_run
    assert gpu_check.main(["--replay", str(out / "at_scale.csv")]) == 0
    printed = capsys.readouterr().out
    for name in {r["config"] for r in rows if r["stage"] == "peak"}:
        assert f"{name} " in printed and "traced" in printed


def test_the_capped_case_trains_the_plan_fitburst_makes_for_the_card_it_stands_for(check, tmp_path):
    """Issue 35's 24 GB row as a GPU step: the spec the child trains is the plan ``fitburst estimate`` makes for
    cuda:24GiB, at its planned length, with nothing of the plan lost on the way into the spec (the node would
    otherwise train another run than the one planned) and nothing the rule table refuses on that card."""
    from fitburst.hardware import resolve_device
    from fitburst.rules import device_of_kind, problems
    from fitburst.settings import settings_from_spec

    _, at_scale = check
    c = next(c for c in at_scale.CASES if c.cap_gib)
    device = resolve_device(f"cuda:{c.cap_gib}GiB")
    spec = at_scale.spec_of(c, c.model, at_scale.fixed_length_data(tmp_path / "d.jsonl"), 6, tiny=False)
    planned, plan = at_scale.capped_plan(c, spec)
    assert plan.fits and planned.data.max_seq_len >= 2048
    back = settings_from_spec(planned, device)
    assert back == plan.settings.__class__(**{**plan.settings.__dict__, "seq_len": planned.data.max_seq_len})
    assert problems(back, device) == [] and problems(back, device_of_kind("cuda")) == []  # planned, and at the load
    assert back.rank == 32 and back.method == "qlora" and back.micro_batch_size == 1  # Unsloth's row, as asked


@pytest.mark.parametrize("child", ["--build", "--case", "--trainer"])
def test_a_child_on_a_gpu_runs_its_at_scale_part_not_the_small_check(check, monkeypatch, tmp_path, child):
    """The parent starts its children with ``--build``/``--case``/``--trainer`` and no ``--at-scale`` (nor, on a
    GPU, ``--dry-run``): each must run its part of the at-scale check. On the first H200 run each child ran the
    small-model check instead, until the parent's deadline."""
    gpu_check, at_scale = check
    for name in ("PYTORCH_NVML_BASED_CUDA_CHECK", "FITBURST_TRACE_CACHE"):  # main() sets them for its process
        monkeypatch.delenv(name, raising=False)
    ran: list[tuple] = []
    monkeypatch.setattr(at_scale, "child_main", lambda kind, name, *a: ran.append((kind, name)) or 0)
    monkeypatch.setattr(gpu_check, "cuda_or_exit", lambda: 1)  # a GPU is there
    monkeypatch.setattr(gpu_check, "run_all", lambda *a: pytest.fail("the small check started"))
    assert gpu_check.main([child, "llama-3.2-1b", "--out", str(tmp_path), "--models", str(tmp_path)]) == 0
    assert ran == [(child.lstrip("-"), "llama-3.2-1b")]


@pytest.mark.parametrize("snapshots, recorded", [(set(), []), ({"peak"}, ["on", "off"]), (None, ["on", "off"])])
def test_the_allocator_history_is_recorded_only_for_a_snapshot(check, monkeypatch, tmp_path, snapshots, recorded):
    """A run that keeps no snapshot trains without the allocator's history (torch 2.11 raises a SystemError when a
    checkpoint's recompute runs inside a custom Function's backward while it records); one that keeps one records
    it, and switches it off after."""
    import torch

    gpu_check, _ = check
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **k: calls.append("off" if enabled is None else "on"))
    readings = gpu_check.Readings(tmp_path, snapshots=snapshots)
    monkeypatch.setattr(readings, "take", lambda stage: None)
    with readings.around_training():
        pass
    assert calls == recorded


@pytest.mark.parametrize("autocast", [False, True])
def test_the_sdpa_backend_is_asked_with_the_dtype_autocast_gives_the_kernel(check, monkeypatch, autocast):
    """SDPA is on autocast's lower-precision list: under bf16 autocast a call made with fp32 tensors (k-bit
    training's fp32 stream) reaches the kernel in bf16, and torch chooses its backend for bf16. The column asked
    torch with the fp32 tensors before (on CUDA FlashAttention takes no fp32: the H200 rows read "math")."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    _, at_scale = check
    asked: list[tuple] = []
    choose = torch._fused_sdp_choice

    def recorded_choice(q, k, v, mask, *a, **kw):
        asked.append((q.dtype, k.dtype, v.dtype, mask.dtype))
        return choose(q, k, v, mask, *a, **kw)

    monkeypatch.setattr(torch, "_fused_sdp_choice", recorded_choice)
    q = torch.randn(1, 2, 8, 4)
    mask = torch.zeros(8, 8)  # a float mask: cast like the tensors; a bool one would keep its dtype
    seen: list[str] = []
    with at_scale.sdpa_backends(seen), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    low = torch.bfloat16 if autocast else torch.float32
    assert out.dtype == low  # what the kernel received, as autocast cast it
    assert asked == [(low,) * 4]
    assert seen == [SDPBackend(choose(*(t.to(low) for t in (q, q, q, mask)), 0.0, False)).name.lower()]
