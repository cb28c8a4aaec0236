"""fitburst.cloud without SkyPilot: policy validation, GPU naming, per-GPU re-plan, ranking, budget caps."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from fitburst.cloud import (
    BudgetError,
    BurstError,
    Candidate,
    check_budget,
    dry_run_report,
    offers,
    rank_candidates,
)
from fitburst.hardware import canonical_gpu
from fitburst.hours import estimate_hours, throughput
from fitburst.memory import resolve_device
from fitburst.memory.shapes import load_shape
from fitburst.settings import RunSettings, settings_from_spec
from fitburst.spec import SpecError, load_all, load_pipeline

REPO = Path(__file__).resolve().parents[1]
PIPELINES = REPO / "pipelines.yaml"
SNAPSHOT = dict(use_catalog=False)  # priced from the snapshot; the catalog path is in test_cloud_sky


def _offers(spec):
    return offers(spec.burst.gpus, spec.burst.providers, spot=spec.burst.spot, **SNAPSHOT)


def seven_b(**over):
    # a LoRA the user wants kept in bf16 (no 4-bit base): fits a 48 GB card, not a 16 GB one
    spec = load_pipeline(PIPELINES, "qwen7b-lora", {"burst.providers": ["runpod", "lambda", "azure"],
                                                    "preflight.allow.quantize": False, **over})
    settings = RunSettings(**{**settings_from_spec(spec).__dict__, "micro_batch_size": 1,
                              "gradient_checkpointing": True})
    return spec, load_shape(spec.model.name), settings


def small_qlora(**over):
    spec = load_pipeline(PIPELINES, "qwen1.5b-qlora",
                         {"burst.providers": ["azure", "lambda"], "burst.gpus": ["T4", "A6000"], **over})
    return spec, load_shape(spec.model.name), settings_from_spec(spec)


def test_fitburst_cloud_does_not_import_sky_or_prefect():
    import subprocess

    code = "import sys, fitburst.cloud; assert 'sky' not in sys.modules and 'prefect' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --- policy validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("burst, expected", [
    ("{gpus: [V100]}", "unknown GPU 'V100'"),
    ("{gpus: [T4], providers: [runpod, lambda]}", "T4 is on aws, gcp, azure"),
    ("{spot: true, providers: [lambda]}", "Lambda has no spot instances"),
    ("{policy: sometimes}", "burst.policy"),
    ("{max_hourly_usd: -1}", "burst.max_hourly_usd"),
    ("{bucket: my-bucket}", "bucket must be a URL"),
    ("{providers: [coreweave]}", "burst.providers"),
    ("{gpus: []}", "at least one GPU"),
    ("{max_hourly_usd: 2, max_total_usd: 0.1}", "less than 15 minutes"),
    ("{autostop: 10}", "did you mean 'autostop_minutes'"),
])
def test_bad_burst_policy_fails_validation_with_a_located_message(tmp_path, burst, expected):
    f = tmp_path / "pipelines.yaml"
    f.write_text(textwrap.dedent(f"""\
        pipelines:
          p:
            model: {{name: fitburst/tiny-demo}}
            data: {{path: d.jsonl}}
            burst: {burst}
        """))
    with pytest.raises(SpecError) as e:
        load_all(f)
    assert expected in str(e.value)
    assert "line 5" in str(e.value)


def test_good_policy_normalises_gpu_names():
    spec = load_pipeline(PIPELINES, "qwen7b-lora", {"burst.gpus": ["RTXA6000", "a100-80gb", "A6000"]})
    assert spec.burst.gpus == ["A6000", "A100-80GB"]
    assert canonical_gpu("A100") == "A100-40GB"  # Lambda's and AWS's "A100" is the 40 GB card


# --- naming and offers ---------------------------------------------------------------------------------

def test_offers_use_each_providers_catalog_name():
    found = offers(["A6000", "T4"], ["runpod", "lambda"], **SNAPSHOT)
    got = {(o.gpu, o.provider): o.accelerator for o in found}
    assert got == {("A6000", "runpod"): "RTXA6000", ("A6000", "lambda"): "A6000"}  # no T4 on RunPod/Lambda
    spot = offers(["A6000"], ["runpod", "lambda"], spot=True, **SNAPSHOT)
    assert [o.provider for o in spot] == ["runpod"]  # Lambda sells no spot


# --- ranking -------------------------------------------------------------------------------------------

def test_7b_lora_fits_48gb_not_16gb_and_ranks_runpod_a6000_first():
    spec, shape, settings = seven_b()
    cands = rank_candidates(spec, shape, settings, tokens=3_000_000, offer_list=_offers(spec))
    by = {(c.gpu, c.provider): c for c in cands}
    assert by[("A6000", "runpod")].fits and by[("A6000", "lambda")].fits
    t4 = by[("T4", "azure")]
    assert not t4.fits and "does not fit in T4" in t4.reason
    assert "dtype bf16 -> fp16 (T4 has no bf16)" in t4.changes
    assert (cands[0].gpu, cands[0].provider, cands[0].accelerator) == ("A6000", "runpod", "RTXA6000")
    assert cands[0].est_total_usd == pytest.approx(cands[0].hourly_usd * cands[0].est_hours, rel=0.02)
    assert [c.usable for c in cands] == [True, True, False]
    d = cands[0].to_dict()
    assert d["usable"] and d["estimate"]["fits"] and d["settings"]["precision"] == "bf16"


def test_small_qlora_fits_a_t4_and_a_short_run_is_cheapest_there():
    spec, shape, settings = small_qlora()
    cands = rank_candidates(spec, shape, settings, tokens=200_000, offer_list=_offers(spec))
    assert all(c.fits for c in cands)
    assert (cands[0].gpu, cands[0].provider) == ("T4", "azure")
    assert cands[0].settings.precision == "fp16"


def test_a_long_run_prefers_the_faster_gpu_even_at_a_higher_hourly_price():
    spec, shape, settings = small_qlora()
    cands = rank_candidates(spec, shape, settings, tokens=200_000_000, offer_list=_offers(spec))
    t4 = next(c for c in cands if c.gpu == "T4")
    assert cands[0].gpu == "A6000" and cands[0].hourly_usd > t4.hourly_usd


def test_measured_hours_replace_the_flops_estimate():
    spec, shape, settings = small_qlora()
    measured = {"T4": 10.0, "A6000": 1.0}
    cands = rank_candidates(spec, shape, settings, est_hours_fn=lambda gpu, s: measured[gpu],
                            offer_list=_offers(spec))
    assert cands[0].gpu == "A6000" and cands[0].est_hours == 1.0


def test_time_estimates_order_devices():
    spec, shape, settings = small_qlora()
    h = {d: estimate_hours(shape, settings, throughput(resolve_device(d)), 10_000_000).hours
         for d in ("cpu:64GiB", "T4", "A6000", "H100")}
    assert h["cpu:64GiB"] > h["T4"] > h["A6000"] > h["H100"] > 0
    assert estimate_hours(shape, settings, throughput(resolve_device("T4")), None) is None


# --- budget caps and placement -------------------------------------------------------------------------

def test_budget_caps_refuse_before_any_cluster_exists(monkeypatch):
    spec, shape, settings = seven_b(**{"burst.max_hourly_usd": 0.3})
    cands = rank_candidates(spec, shape, settings, tokens=3_000_000, offer_list=_offers(spec))
    assert not any(c.usable for c in cands)
    assert "over max_hourly_usd $0.30" in cands[0].reason
    with pytest.raises(BudgetError, match="refused before launch"):
        check_budget(spec, cands)

    spec, shape, settings = seven_b(**{"burst.max_total_usd": 0.5})
    cands = rank_candidates(spec, shape, settings, tokens=30_000_000, offer_list=_offers(spec))
    with pytest.raises(BudgetError, match="over max_total_usd"):
        check_budget(spec, cands)

    # burst_train refuses at the same point: no SkyPilot call is ever made
    from fitburst.cloud import burst_train

    with pytest.raises(BudgetError):
        burst_train(spec, "unused", "unused", cands)


def test_no_fitting_gpu_is_a_clear_error():
    spec, shape, settings = seven_b(**{"burst.gpus": ["T4"], "burst.providers": ["azure"]})
    cands = rank_candidates(spec, shape, settings, tokens=1_000, offer_list=_offers(spec))
    with pytest.raises(BurstError, match="fits none of the burst GPUs.*T4 on azure"):
        check_budget(spec, cands)
    with pytest.raises(BurstError, match="no GPU candidates"):
        check_budget(spec, [])


def test_dry_run_report_shows_local_and_cloud_side_by_side():
    spec, shape, settings = seven_b()
    cands = rank_candidates(spec, shape, settings, tokens=3_000_000, offer_list=_offers(spec))
    text = dry_run_report(spec, cands, local={"device": "cpu", "fits": False, "hours": 310.0})
    assert "local cpu" in text and "310.00" in text
    assert "chosen: A6000 on runpod as RTXA6000, $0.49/h" in text
    assert "price from fitburst-snapshot" in text  # offline: the source of the price is said
    assert Candidate(gpu="T4", provider="aws", accelerator="T4", memory_gib=16, fits=True,
                     hourly_usd=0.5).label() == "T4 on aws (T4)"


def test_the_package_ships_sky_train_yaml_unchanged():
    """sky/train.yaml is the task users read and edit; the package reads its own copy (package data, so bursting
    works from a `pip install`). The two must be the same file."""
    from fitburst.cloud import TASK_YAML

    assert TASK_YAML.read_bytes() == (REPO / "sky" / "train.yaml").read_bytes(), (
        "sky/train.yaml and fitburst/cloud/train.yaml differ: edit sky/train.yaml, then copy it over the package's")
    assert TASK_YAML.read_text().startswith("# fitburst: the SkyPilot task") and "# Usage:" in TASK_YAML.read_text()


def test_a_catalog_answer_is_kept_for_the_ttl_and_an_unreadable_catalog_is_remembered(monkeypatch, tmp_path, caplog):
    from fitburst.cloud import gpus

    monkeypatch.setenv("FITBURST_CACHE", str(tmp_path))
    monkeypatch.setenv("FITBURST_OFFERS_TTL", "3600")
    asked: list[str] = []

    def catalog(gpu, provider, spot, count=1):
        asked.append(provider)
        if provider == "lambda":
            raise ConnectionError("offline")
        return [gpus.Offer(gpu, provider, "RTXA6000", 48.0, 0.33, "EU", "1x_A6000", "skypilot-catalog")]

    monkeypatch.setattr(gpus, "_catalog_offers", catalog)
    first = gpus.offers(["A6000"], ["runpod", "lambda"])
    second = gpus.offers(["A6000"], ["runpod", "lambda"])
    assert asked == ["runpod", "lambda"]  # the second call asked nobody
    assert first == second
    assert [(o.provider, o.hourly_usd, o.source) for o in second] == [
        ("runpod", 0.33, "skypilot-catalog"), ("lambda", gpus.SNAPSHOT[("A6000", "lambda")][0],
                                               f"fitburst-snapshot-{gpus.SNAPSHOT_DATE}")]
    assert "catalog for lambda unavailable (ConnectionError)" in caplog.text
    monkeypatch.setenv("FITBURST_OFFERS_TTL", "0")  # no keeping: asked again
    gpus.offers(["A6000"], ["runpod"])
    assert asked[-1] == "runpod" and len(asked) == 3


def test_the_family_of_a_bundled_or_local_model_is_read_without_importing_transformers(tmp_path):
    import subprocess

    (tmp_path / "config.json").write_text('{"model_type": "t5", "is_encoder_decoder": true}')
    code = textwrap.dedent(f"""
        import sys
        from types import SimpleNamespace as M
        from fitburst.models import model_family
        kw = dict(revision=None, hf_token=None, trust_remote_code=False)
        print(model_family(M(name="Qwen/Qwen2.5-7B-Instruct", **kw)).name,
              model_family(M(name={str(tmp_path)!r}, **kw)).name,
              model_family(M(name="Qwen/Qwen2-VL-7B-Instruct", **kw)).name, "transformers" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == ["causal", "seq2seq", "vision_language", "False"]
