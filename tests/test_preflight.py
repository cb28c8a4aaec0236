"""The preflight's placement: one planner per device, one verdict, the error band, the time of the local device,
an eval that fits, and the exact-estimate hook. Real pipelines from pipelines.yaml, the analytic estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fitburst.cloud import gpus
from fitburst.data_facts import data_facts
from fitburst.hours import Hours, estimate_hours, throughput
from fitburst.memory import RunSettings, estimate, load_shape, plan_fit, resolve_device
from fitburst.memory.calibration import band_for
from fitburst.preflight import decide, preflight
from fitburst.spec import load_pipeline

REPO = Path(__file__).resolve().parents[1]
PIPELINES = REPO / "pipelines.yaml"
GiB = 1 << 30


@pytest.fixture(autouse=True)
def snapshot_prices(monkeypatch):
    """Price cloud GPUs from the snapshot (no SkyPilot catalog download offline)."""
    real = gpus.offers
    monkeypatch.setattr("fitburst.cloud.rank.offers",
                        lambda g, p, spot=False, count=1: real(g, p, spot, use_catalog=False, count=count))


@pytest.fixture(scope="module")
def records_20k(tmp_path_factory) -> Path:
    """20,000 alpaca records (the demo's, repeated): a run of ~9 M tokens at 512."""
    lines = (REPO / "fitburst/demo/instructions.jsonl").read_text().splitlines()
    path = tmp_path_factory.mktemp("data") / "20k.jsonl"
    path.write_text("\n".join(lines[i % len(lines)] for i in range(20_000)) + "\n")
    return path


def _preflight(name: str, device: str, **over):
    over = {"preflight.exact": False, **over}  # the analytic planner; tracing 1.5-7B models takes minutes here
    spec = load_pipeline(PIPELINES, name, over)
    facts = data_facts(spec)
    return spec, preflight(spec, facts.longest, device, n_train=facts.n_train, mean_len=facts.mean)


# --- the local device is timed as what it is (issue 9.4) ------------------------------------------------

@pytest.mark.parametrize("device", ["A6000", "RTX4090", "H100"])
def test_small_qlora_on_20k_records_stays_on_a_local_gpu(device, records_20k):
    spec, r = _preflight("qwen1.5b-qlora", device, **{"data.path": str(records_20k)})
    assert r.tokens == 18_000 * 512  # 10 % validation split, dry-run length
    assert r.verdict.placement == "local", r.verdict.reason
    assert r.local_hours < spec.burst.max_local_hours
    assert r.local_time.source.startswith(f"table: {device} ")
    assert r.candidates == []  # the cloud was never considered


def test_preflight_cli_times_a_named_card_from_the_record_count(records_20k):
    out = subprocess.run([sys.executable, "-m", "fitburst.cli", "preflight", "qwen1.5b-qlora", "--device", "A6000",
                          "--set", f"data.path={records_20k}", "--set", "preflight.exact=false", "--json"],
                         capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    d = json.loads(out.stdout[out.stdout.index("{"):])
    assert out.returncode == 0 and d["verdict"] == "local", d["reason"]
    for key in ("pipeline", "reason", "device", "estimate", "changes", "settings", "seq_len", "spec_yaml", "tokens",
                "local_hours", "candidates"):  # the keys consumers read
        assert key in d
    assert d["tokens"] == 18_000 * 512 and 0 < d["local_hours"] < 12
    assert d["local_hours_source"].startswith("table: A6000")
    assert d["estimate"]["band"]["high"] == band_for("analytic", "cuda").high
    assert d["estimate_method"] == "analytic" and "preflight.exact is false" in d["trace"]


def test_torch_names_of_local_cards_find_their_table_entry():
    a6000 = resolve_device("A6000")
    local = replace(a6000, name="cuda (NVIDIA RTX A6000)")
    assert throughput(local).tflops == throughput(a6000).tflops
    assert throughput(replace(a6000, name="cuda (NVIDIA H100 80GB HBM3)")).tflops > throughput(a6000).tflops
    unknown = throughput(replace(a6000, name="cuda (NVIDIA GeForce GTX 1080 Ti)"))
    assert "not in the table" in unknown.source and unknown.tflops == throughput(resolve_device("T4")).tflops
    m2max, m1 = throughput(resolve_device("M2-Max-64GB")), throughput(resolve_device("M1-16GB"))
    assert m2max.tflops > m1.tflops and m2max.source.startswith("table: M2-MAX")
    shape, s = load_shape("Qwen2.5-1.5B"), RunSettings(method="qlora", gradient_checkpointing=True)
    measured = estimate_hours(shape, s, throughput(a6000, measured_tokens_per_s=1000.0), 3_600_000)
    assert measured.hours == pytest.approx(1.0) and measured.source.startswith("probe: ")
    cloud = estimate_hours(shape, s, throughput(a6000), 3_600_000, cloud=True)
    assert cloud.hours == pytest.approx(estimate_hours(shape, s, throughput(a6000), 3_600_000).hours + 0.25)


# --- an eval that fits (issue 9.5) ------------------------------------------------------------------------

def test_7b_lora_at_2048_on_an_a6000_is_local_and_the_eval_is_planned():
    spec, r = _preflight("qwen7b-lora", "A6000", **{"data.max_seq_len": 2048})
    assert r.verdict.placement == "local", r.verdict.reason
    assert r.plan.settings.eval_batch == spec.eval.batch_size  # the chunked loss keeps batch 8 below training
    assert r.estimate.phases["eval"] < r.estimate.phases[r.estimate.peak_phase]
    # a larger eval batch: the eval step becomes what does not fit, and the planner lowers it
    spec, big = _preflight("qwen7b-lora", "A6000", **{"data.max_seq_len": 2048, "eval.batch_size": 64})
    assert big.verdict.placement == "local", big.verdict.reason
    assert any(c.startswith("eval batch 64 -> ") for c in big.changes)
    assert big.planned.eval.batch_size == big.plan.settings.eval_batch < 64
    unplanned = estimate(load_shape(spec.model.name), replace(big.plan.settings, eval_batch=64),
                         resolve_device("A6000"))
    assert unplanned.peak_phase == "eval"


# --- one verdict; burst candidates from the pipeline's GPUs only (issue 8.4) ------------------------------

def test_burst_candidates_are_the_pipelines_gpus_only():
    spec, r = _preflight("qwen7b-lora", "T4", **{"data.max_seq_len": 2048, "preflight.allow.quantize": False,
                                                "burst.providers": ["runpod", "lambda", "azure"]})
    assert r.verdict.placement == "burst" and not r.plan.fits
    assert {c.gpu for c in r.candidates} == {"A6000", "T4"}  # burst.gpus: [A6000, T4]; never an A100
    assert "A6000 on runpod" in r.verdict.reason
    assert not any("A100" in c for c in r.changes)
    t4 = next(c for c in r.candidates if c.gpu == "T4")
    assert not t4.usable and t4.estimate.device == "T4"  # typed all the way: an Estimate, not a dict
    assert json.loads(json.dumps(r.to_dict()))["candidates"][0]["estimate"]["device"] == "A6000"


def test_no_usable_cloud_gpu_fails_with_the_reasons():
    spec, r = _preflight("qwen7b-lora", "T4", **{"data.max_seq_len": 2048, "preflight.allow.quantize": False,
                                                "burst.gpus": ["T4"], "burst.providers": ["azure"],
                                                "burst.max_gpus_per_node": 1})
    assert r.verdict.placement == "fail"
    assert "T4 on azure: does not fit in T4" in r.verdict.reason


@pytest.mark.parametrize("policy, fits, hours, cap, expected", [
    ("auto", False, None, None, "burst"),
    ("auto", True, 2.0, None, "local"),
    ("auto", True, 30.0, 8.0, "burst"),  # fits, but too slow locally
    ("auto", True, 30.0, 40.0, "local"),
    ("never", False, None, None, "fail"),
    ("never", True, 30.0, 8.0, "local"),  # slow, but bursting is off
    ("always", True, 0.1, None, "burst"),
])
def test_placement_rule(policy, fits, hours, cap, expected):
    spec = load_pipeline(PIPELINES, "qwen1.5b-qlora", {"burst.policy": policy, "burst.max_local_hours": cap,
                                                       "burst.providers": ["azure", "lambda"]})
    shape = load_shape(spec.model.name)
    device = resolve_device("T4" if fits else "cuda:2GiB")
    plan = plan_fit(shape, RunSettings(method="qlora", micro_batch_size=8, seq_len=512), device)
    assert plan.fits is fits
    asked = []

    def rank():
        from fitburst.cloud import offers, rank_candidates

        asked.append(True)
        return rank_candidates(spec, shape, plan.settings, tokens=1_000_000,
                               offer_list=offers(spec.burst.gpus, spec.burst.providers, use_catalog=False))

    verdict, cands = decide(spec, plan, Hours(hours, "test") if hours else None, rank)
    assert verdict.placement == expected and verdict.reason
    assert bool(asked) == (expected == "burst")  # the cloud is priced only when bursting is on the table


# --- the error band and the headroom (issue 8.5) ----------------------------------------------------------

def test_the_verdict_plans_for_the_bands_upper_edge():
    shape = load_shape("Qwen2.5-1.5B")
    s = RunSettings(method="lora", micro_batch_size=4, seq_len=1024, dropout=0.0)
    e = estimate(shape, s, resolve_device("cuda:100GiB"))
    high = band_for("analytic", "cuda").high
    # a card on which the estimate itself fits with room, but its upper edge does not
    size = int(e.reserved_peak_bytes * (1 + high / 2) / 0.97) + 300 * (1 << 20)
    dev = resolve_device(f"cuda:{size / GiB:.3f}GiB")
    assert e.reserved_peak_bytes < dev.budget_bytes * 0.97
    tight = plan_fit(shape, s, dev)
    assert tight.changes and tight.settings != s and tight.needed_bytes <= tight.limit_bytes
    roomy = plan_fit(shape, s, resolve_device(f"cuda:{size * (1 + high) / GiB:.3f}GiB"))
    assert roomy.fits and roomy.changes == []


# --- the exact estimate verifies the plan (merge point of the traced estimate) -----------------------------

def traced_like(shape, factor: float, calls: list):
    """Stands in for the traced estimate: the analytic figure x ``factor``, judged by the traced band."""
    def exact(x, d):
        calls.append(x)
        e = estimate(shape, x, d)
        return replace(e, reserved_peak_bytes=int(e.reserved_peak_bytes * factor), method="traced")
    return exact


def test_an_exact_estimate_verifies_the_plan_and_a_disagreeing_one_sends_it_a_rung_further():
    shape = load_shape("Qwen/Qwen2.5-7B-Instruct")
    s = RunSettings(method="lora", rank=64, target_modules="all-linear", micro_batch_size=4, grad_accum=4, seq_len=3072)
    first: list = []  # the plan the search traces first (the cheapest worth tracing)
    plan_fit(shape, s, resolve_device("A6000"), exact=traced_like(shape, 1.0, first))
    need = estimate(shape, first[0], resolve_device("A6000")).reserved_peak_bytes
    # a card where that plan fits by the traced band's upper edge, whatever the band's width
    card = band_for("traced", "cuda").upper(need) / 0.97 * 1.01 + resolve_device("cuda:1GiB").outside_allocator
    dev = resolve_device(f"cuda:{card / GiB:.3f}GiB")

    plain = plan_fit(shape, s, dev)  # analytic alone: planned for its (wider) band's upper edge
    assert plain.changes  # it takes rungs the verified plan below does without
    agreed_calls: list = []
    agreed = plan_fit(shape, s, dev, exact=traced_like(shape, 1.0, agreed_calls))
    # the exact estimate agrees: the search only had to pick plans worth tracing, so a cheaper plan is verified
    assert agreed.fits and len(agreed_calls) == 1 and agreed.estimate.method == "traced"
    assert not agreed.settings.gradient_checkpointing and agreed.settings.effective_batch == s.effective_batch
    assert agreed.settings != plain.settings
    assert agreed.estimate.band == band_for("traced", "cuda")
    calls: list = []
    checked = plan_fit(shape, s, dev, exact=traced_like(shape, 1.35, calls))
    assert calls[0] == agreed.settings  # the cheapest plan was checked first, rejected, then the next rung
    assert checked.fits and checked.settings != agreed.settings and len(calls) >= 2
    assert checked.needed_bytes <= checked.limit_bytes


def test_a_plan_the_analytic_estimate_over_estimates_is_traced_and_taken():
    """The analytic figure can be above the trace on CUDA (by up to the analytic-vs-traced band's low edge): the
    search must still trace the plan as configured (not skip to checkpointing, or to a burst), and take it when
    the trace fits."""
    shape = load_shape("Qwen/Qwen2.5-7B-Instruct")
    s = RunSettings(method="lora", rank=16, micro_batch_size=2, seq_len=2048)
    need = estimate(shape, s, resolve_device("A100-80GB")).reserved_peak_bytes
    lower = 1 + 0.95 * band_for("analytic-vs-traced", "cuda").low  # a trace that much under the analytic figure
    assert lower < 0.97
    ctx = resolve_device("cuda:1GiB").outside_allocator
    card = band_for("traced", "cuda").upper(int(need * lower)) / 0.97 / 0.995 + ctx
    dev = resolve_device(f"cuda:{card / GiB:.3f}GiB")
    limit = int(dev.budget_bytes * 0.97)
    assert need > limit  # the analytic estimate alone: does not fit, even before its band
    assert band_for("traced", "cuda").upper(int(need * lower)) <= limit  # the lower trace: fits
    plain = plan_fit(shape, s, dev)
    assert plain.changes  # analytic alone: a rung down
    calls: list = []
    p = plan_fit(shape, s, dev, exact=traced_like(shape, lower, calls))
    assert p.fits and p.changes == [] and p.settings == s and calls == [s]
    assert p.estimate.method == "traced" and p.needed_bytes <= p.limit_bytes
    # a trace as high as the analytic figure: the plan as configured is tried once, rejected, and the search
    # goes on to a plan the trace accepts, with at most a few traces
    calls = []
    p = plan_fit(shape, s, dev, exact=traced_like(shape, 1.0, calls))
    assert calls[0] == s and p.fits and p.settings != s and 2 <= len(calls) <= 4


def test_when_the_exact_checks_run_out_the_most_frugal_plan_left_is_checked_last():
    """An exact estimate that rejects the first plans it sees (each just over the card, so the search learns
    little from them): after the 4 checks a device gets, the planner checks the plan that needs least, and takes
    it when it fits, saying cheaper ones were not all checked, instead of giving up on the device."""
    shape = load_shape("Qwen/Qwen2.5-7B-Instruct")
    s = RunSettings(method="lora", rank=16, micro_batch_size=4, seq_len=1024, dropout=0.05)
    dev = resolve_device("A6000")
    over = int(int(dev.budget_bytes * 0.97) / (1 + band_for("traced", "cuda").high)) + (64 << 20)
    calls: list = []

    def exact(x, d):
        calls.append(x)
        e = replace(estimate(shape, x, d), method="traced")
        return replace(e, reserved_peak_bytes=max(over, e.reserved_peak_bytes)) if len(calls) <= 4 else e

    p = plan_fit(shape, s, dev, exact=exact)
    assert len(calls) == 5 and p.fits and p.settings == calls[-1] and p.estimate.method == "traced"
    needs = [estimate(shape, x, dev).reserved_peak_bytes for x in calls]
    assert needs[-1] == min(needs)  # the most frugal plan, not the next cheapest
    assert "rejected 4 cheaper plan(s)" in p.changes[-1] and p.needed_bytes <= p.limit_bytes


# --- the traced estimate wired in: it checks the chosen plan, the report shows both figures -----------------

def test_the_preflight_traces_the_chosen_plan_and_reports_both_figures(demo_spec, demo_prepared):
    r = preflight(demo_spec, demo_prepared.stats["max"], "cpu:8GiB", n_train=demo_prepared.n_train)
    assert r.verdict.placement == "local"
    assert r.estimate.method == "traced" and r.estimate.band == band_for("traced", "cpu")
    assert r.analytic.method == "analytic" and r.analytic.band == band_for("analytic", "cpu")
    assert r.analytic.settings == r.estimate.settings  # the same plan, two estimates
    d = json.loads(json.dumps(r.to_dict()))
    assert d["estimate_method"] == "traced" and d["estimate"]["notes"][0].startswith("traced: ")
    assert d["analytic_estimate"]["reserved_peak_bytes"] != d["estimate"]["reserved_peak_bytes"]
    assert d["analytic_needed_bytes"] > d["analytic_estimate"]["reserved_peak_bytes"]
    assert d["needed_bytes"] == band_for("traced", "cpu").upper(d["estimate"]["reserved_peak_bytes"])
    md = r.to_markdown()
    assert "traced estimate" in md and "analytic" in md


def test_where_the_trace_cannot_run_the_analytic_band_decides_and_the_report_says_so(demo_spec, demo_prepared):
    seq = demo_prepared.stats["max"]
    int8 = demo_spec.model_copy(update={"method": demo_spec.method.model_copy(update={"type": "qlora",
                                                                                       "quant": "int8"})})
    r = preflight(int8, seq, "cpu:8GiB")
    assert r.estimate.method == "analytic" and r.estimate.band == band_for("analytic", "cpu")
    assert r.analytic is None and "int8" in r.unchecked
    assert "not traced" in r.to_dict()["trace"] and "int8" in r.to_markdown()
    off = demo_spec.model_copy(update={"preflight": demo_spec.preflight.model_copy(update={"exact": False})})
    r = preflight(off, seq, "cpu:8GiB")
    assert r.estimate.method == "analytic" and r.unchecked == "preflight.exact is false"


@pytest.mark.parametrize("policy, cap", [("auto", 1e-6), ("always", None)])
def test_a_run_that_bursts_whatever_the_local_trace_says_traces_the_cloud_plan_only(demo_spec, demo_prepared,
                                                                                   monkeypatch, policy, cap):
    from fitburst.memory import trace

    traced: list[str] = []
    real = trace.traced_estimate
    monkeypatch.setattr(trace, "traced_estimate", lambda spec, s, d, **kw: traced.append(d.name) or real(spec, s, d,
                                                                                                         **kw))
    burst = demo_spec.burst.model_copy(update={"policy": policy, "max_local_hours": cap, "gpus": ["A6000"]})
    spec = demo_spec.model_copy(update={"burst": burst})
    r = preflight(spec, demo_prepared.stats["max"], "cpu:8GiB", n_train=demo_prepared.n_train)
    assert r.verdict.placement == "burst", r.verdict.reason
    assert traced and set(traced) == {"A6000"}  # the plan that runs, not the local one
    assert r.estimate.method == "analytic" and "bursts whatever it says" in r.unchecked
    assert r.candidates[0].estimate.method == "traced"
    # the same pipeline placed locally traces the local plan
    traced.clear()
    local = demo_spec.model_copy(update={"burst": burst.model_copy(update={"policy": "never"})})
    r = preflight(local, demo_prepared.stats["max"], "cpu:8GiB", n_train=demo_prepared.n_train)
    assert r.verdict.placement == "local" and traced == ["cpu:8GiB"]
