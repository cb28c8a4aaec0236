"""Mixed precision and gradient accumulation on the CPU, with the real training step (autocast and GradScaler run
on the CPU as on a GPU): autocast LoRA tracks fp32, full fine-tuning at a small lr moves fp32 master weights, an
inf gradient makes the scaler skip one step, and accumulation is token-weighted."""

from __future__ import annotations

import json

import pytest
from conftest import fake_cuda_card

from fitburst.builders import build_model, make_optimizer
from fitburst.data import load_split
from fitburst.device import make_amp
from fitburst.recipe import train
from fitburst.train import optimizer_step

# How far (relative) the logged loss of an autocast run may be from the fp32 run's, per logged window of 10 steps
# (30 steps, lr 3e-3, demo model; the loss falls from ~6.0 to ~2.7): 5 % in every window, 1 % in the last. Measured
# on this CPU: bf16 0.09 / 0.43 / 0.10 %; fp16 2.7 / 3.8 / 0.36 % (the scaler skips its first step while its scale
# calibrates, so fp16 runs one step behind while the loss falls fastest).
TRACK_TOL, TRACK_TOL_LAST = 0.05, 0.01


def with_training(spec, **training):
    return spec.model_copy(update={"training": spec.training.model_copy(update=training)})


def with_method(spec, **method):
    return spec.model_copy(update={"method": spec.method.model_copy(update=method)})


def curve(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fp32_curve(demo_spec, demo_prepared, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fp32")
    train(with_training(demo_spec, max_steps=30, log_every=10, precision="fp32"), demo_prepared, run_dir,
          progress=False)
    return [row["train_loss"] for row in curve(run_dir)]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_lora_falls_and_tracks_fp32(precision, fp32_curve, demo_spec, demo_prepared, tmp_path):
    import torch

    spec = with_training(demo_spec, max_steps=30, log_every=10, precision=precision)
    model, _ = build_model(spec, "cpu", precision)
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {getattr(torch, {"bf16": "bfloat16"}.get(precision, "float16"))}
    del model
    r = train(spec, demo_prepared, tmp_path, progress=False)
    rows = curve(tmp_path)
    losses = [row["train_loss"] for row in rows]
    assert r.precision == precision and losses[-1] < losses[0] - 1.0
    gaps = [abs(a - b) / b for a, b in zip(losses, fp32_curve, strict=True)]
    print(f"{precision}: relative gaps to fp32 per window {[round(g, 4) for g in gaps]}, skipped {r.skipped_steps}")
    assert max(gaps) < TRACK_TOL and gaps[-1] < TRACK_TOL_LAST, (losses, fp32_curve, r.skipped_steps)
    if precision == "fp16":  # the scaler is in the loop and its record is logged
        assert rows[-1]["skipped_steps"] == r.skipped_steps and rows[-1]["loss_scale"] > 0
    else:
        assert "skipped_steps" not in rows[-1]


def _changed_fraction(spec, demo_prepared, precision: str, steps: int = 3) -> float:
    """Fraction of the weights a few AdamW steps at the spec's lr changed (as the loop builds and steps them)."""
    import torch

    from fitburst.data import collate

    torch.manual_seed(0)
    tr = spec.training
    model, tok = build_model(spec, "cpu", precision)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = make_optimizer("adamw", params, tr.learning_rate, 0.0)
    amp = make_amp(precision, "cpu", pure_bf16=tr.pure_bf16)
    rows = load_split(demo_prepared, "train").to_list()
    for i in range(steps):
        optimizer_step(model, opt, params, [collate(rows[8 * i:8 * i + 8], tok.pad_token_id)], device="cpu",
                       max_grad_norm=1.0, amp=amp)
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before, strict=True))
    return changed / sum(b.numel() for b in before)


def test_bf16_full_finetune_at_small_lr_moves_the_weights(demo_spec, demo_prepared, caplog):
    import torch

    full = with_training(with_method(demo_spec, type="full"), learning_rate=2e-5, precision="bf16")
    model, _ = build_model(full, "cpu", "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # fp32 master weights, compute in autocast
    del model
    mixed = _changed_fraction(full, demo_prepared, "bf16")
    pure_spec = with_training(full, pure_bf16=True)
    pure = _changed_fraction(pure_spec, demo_prepared, "bf16")
    assert mixed > 0.95, mixed
    assert pure < 0.5 * mixed, (pure, mixed)  # why pure bf16 is opt-in: most updates fall below bf16 resolution
    with caplog.at_level("WARNING"):
        from fitburst.device import warn_pure_bf16

        warn_pure_bf16(True, 2e-5)
    assert "below bf16 resolution" in caplog.text


def test_inf_gradient_makes_the_scaler_skip_one_step(demo_spec, demo_prepared):
    import torch

    from fitburst.data import collate

    spec = with_training(demo_spec, precision="fp16")
    torch.manual_seed(0)
    model, tok = build_model(spec, "cpu", "fp16")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("adamw", params, 1e-3, 0.0)
    amp = make_amp("fp16", "cpu")
    batch = collate(load_split(demo_prepared, "train").to_list()[:8], tok.pad_token_id)
    poison = {"on": False}
    params[0].register_hook(lambda g: g * float("inf") if poison["on"] else g)

    def step() -> tuple[float, bool]:
        before = [p.detach().clone() for p in params]
        loss = optimizer_step(model, opt, params, [batch], device="cpu", max_grad_norm=1.0, amp=amp)
        return loss, any(bool((p.detach() != b).any()) for p, b in zip(params, before, strict=True))

    loss, moved = step()
    assert moved and not amp.last_step_skipped
    scale = amp.scaler.get_scale()
    poison["on"] = True
    _, moved = step()
    assert amp.last_step_skipped and amp.skipped_steps == 1 and not moved
    assert amp.scaler.get_scale() == scale / 2
    poison["on"] = False
    losses = [step() for _ in range(3)]
    assert amp.skipped_steps == 1 and all(m for _, m in losses)
    assert all(torch.isfinite(torch.tensor(v)) for v, _ in losses) and losses[-1][0] < loss


def test_accumulation_is_token_weighted(demo_spec, demo_prepared):
    """grad_accum=2 x micro_batch=4 gives the gradient of one micro-batch of 8, on variable-length masked data."""
    import torch

    from fitburst.data import IGNORE_INDEX, collate

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]

    def n_labels(r):
        return sum(x != IGNORE_INDEX for x in r["labels"])

    demo = load_split(demo_prepared, "train").to_list()
    # multi-turn rows of 1 to 4 demo conversations: lengths and reply-token counts vary a lot between samples
    rows = []
    for i, k in enumerate([1, 1, 2, 1, 4, 3, 2, 4]):
        parts = demo[8 * i:8 * i + k]
        rows.append({key: sum((p[key] for p in parts), []) for key in ("input_ids", "labels")})
    assert len({n_labels(r) for r in rows}) > 4 and len({len(r["input_ids"]) for r in rows}) > 4
    torch.manual_seed(0)
    model, tok = build_model(demo_spec, "cpu", "fp32")
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for micro in ([rows], [rows[:4], rows[4:]]):
        opt = Capture(params, lr=0.0)
        loss = optimizer_step(model, opt, params, [collate(m, tok.pad_token_id) for m in micro], device="cpu",
                              max_grad_norm=None)
        results.append((loss, opt.grads))
    (loss1, g1), (loss2, g2) = results
    assert loss1 == pytest.approx(loss2, abs=1e-5)
    assert max(float((a - b).abs().max()) for a, b in zip(g1, g2, strict=True)) < 1e-5
    assert max(float(a.abs().max()) for a in g1) > 1e-3  # the comparison is not of zeros
    # the unweighted rule (mean of micro-batch means) would have differed
    with torch.no_grad():
        means = [model(**collate(m, tok.pad_token_id)).loss.item() for m in (rows[:4], rows[4:])]
    assert abs(sum(means) / 2 - loss1) > 1e-3


def test_checkpoint_keeps_rng_and_scaler_state(tmp_path, demo_spec, demo_prepared):
    import torch
    from transformers import get_scheduler

    from fitburst.checkpoints import load_checkpoint, rng_states, save_checkpoint
    from fitburst.data import collate

    spec = with_training(demo_spec, precision="fp16")
    model, tok = build_model(spec, "cpu", "fp16")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("adamw", params, 1e-3, 0.0)
    sched = get_scheduler("constant", opt)
    amp = make_amp("fp16", "cpu")
    batch = collate(load_split(demo_prepared, "train").to_list()[:4], tok.pad_token_id)
    optimizer_step(model, opt, params, [batch], device="cpu", max_grad_norm=1.0, amp=amp)
    amp.scaler.update(new_scale=1024.0)
    amp.skipped_steps = 3
    assert set(rng_states()) == {"cpu"} | {k for k, ok in (("cuda", torch.cuda.is_available()),
                                                            ("mps", torch.backends.mps.is_available())) if ok}
    torch.manual_seed(7)
    ckpt = save_checkpoint(tmp_path, 5, model, opt, sched, amp=amp)
    expected = torch.rand(4)
    fresh = make_amp("fp16", "cpu")
    assert load_checkpoint(ckpt, model, opt, sched, "cpu", amp=fresh) == 5
    assert torch.equal(torch.rand(4), expected)
    assert fresh.scaler.get_scale() == 1024.0 and fresh.skipped_steps == 3


def test_pure_bf16_is_an_explicit_opt_in_for_bf16(pipelines_file):
    from fitburst.spec import SpecError, load_pipeline

    with pytest.raises(SpecError, match="pure_bf16 keeps bf16 weights: set precision: bf16"):
        load_pipeline(pipelines_file, "demo", {"training.pure_bf16": True, "training.precision": "fp16"})
    spec = load_pipeline(pipelines_file, "demo", {"training.pure_bf16": True, "training.precision": "bf16"})
    assert make_amp("bf16", "cpu", pure_bf16=spec.training.pure_bf16).dtype is None  # no autocast: weights are bf16


def test_a_gpu_that_only_emulates_bf16_trains_in_fp16(monkeypatch):
    """torch.cuda.is_bf16_supported() says yes on a T4 (sm 7.5: it can make bf16 tensors, emulated): auto must
    still pick fp16 there, as the preflight planned, and an explicit bf16 must be refused."""
    import torch

    from fitburst.device import DeviceError, resolve_precision

    T4Props = fake_cuda_card(monkeypatch, "Tesla T4", 7, 5)
    assert torch.cuda.is_bf16_supported()  # what torch answers by default on such a card
    assert resolve_precision("auto", "cuda") == "fp16"
    with pytest.raises(DeviceError, match="no bf16"):
        resolve_precision("bf16", "cuda")
    T4Props.major, T4Props.minor = 8, 0  # an A100
    assert resolve_precision("auto", "cuda") == "bf16"
