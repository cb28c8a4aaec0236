"""The vision-language family: a tiny Qwen2-VL built locally, image + conversation records with exact assistant
labels and image tokens that follow the resolution setting, LoRA on the language model with the tower frozen, and
the vl-demo pipeline through the whole DAG."""

from __future__ import annotations

import json
import shutil

import pytest

from fitburst.data import IGNORE_INDEX, DataError, load_split, prepare_pipeline
from fitburst.spec import load_pipeline


@pytest.fixture(scope="module")
def vl_spec(pipelines_file):
    return load_pipeline(pipelines_file, "vl-demo")


def _with_data(spec, **data):
    return spec.model_copy(update={"data": spec.data.model_copy(update=data)})


def test_tiny_vl_loads_through_from_pretrained(vl_spec):
    """Model, tokenizer (Qwen2-VL's special tokens, a chat template) and image processor all come back from the
    saved folder; the tokenizer's ids survive the reload."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from fitburst.demo_models import VL_SPECIAL_TOKENS
    from fitburst.families.vision_language import load_image_processor
    from fitburst.models import resolve_model_ref

    ref = resolve_model_ref(vl_spec.model.name)
    model = AutoModelForImageTextToText.from_pretrained(ref)
    tok = AutoTokenizer.from_pretrained(ref)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert all(tok.convert_tokens_to_ids(t) != tok.unk_token_id for t in VL_SPECIAL_TOKENS)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], tokenize=False)
    assert load_image_processor(ref).merge_size == model.config.vision_config.spatial_merge_size


def test_shipped_images_are_the_generator_output(tmp_path):
    """The shipped set is what the seeded generator writes (records byte for byte, images pixel for pixel)."""
    from PIL import Image, ImageChops

    from fitburst.demo_models import VL_DATA, write_shapes_demo

    out = write_shapes_demo(tmp_path)
    assert out.read_text() == VL_DATA.read_text()
    for line in out.read_text().splitlines()[:6]:
        name = json.loads(line)["messages"][0]["content"][0]["image"]
        a, b = Image.open(tmp_path / name), Image.open(VL_DATA.parent / name)
        assert ImageChops.difference(a.convert("RGB"), b.convert("RGB")).getbbox() is None


def test_labels_are_the_reply_and_image_tokens_follow_the_resolution(vl_spec):
    """Only the assistant's reply (and its end of turn) is a target; each image is (pixels / 28**2) / 4 image tokens
    in the sequence, so lowering data.image_max_pixels shortens every sample by exactly that."""
    from fitburst.models import load_tokenizer

    tok = load_tokenizer(vl_spec.model.name)
    full = prepare_pipeline(vl_spec)
    low = prepare_pipeline(_with_data(vl_spec, image_max_pixels=56 * 56))
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    row = load_split(full, "train")[0]
    assert tok.decode([t for t in row["labels"] if t != IGNORE_INDEX]).startswith(("A red", "A green", "A blue",
                                                                                   "A yellow"))
    assert row["input_ids"].count(image_id) == 16 == sum(row["mm_token_type_ids"])
    assert row["image_grid_thw"] == [[1, 8, 8]] and len(row["pixel_values"]) == 64
    assert (full.stats["image_tokens_max"], low.stats["image_tokens_max"]) == (16, 4)
    assert full.stats["total_tokens"] - low.stats["total_tokens"] == 12 * full.stats["images"]
    first = next(i for i, t in enumerate(row["labels"]) if t != IGNORE_INDEX)
    assert image_id in row["input_ids"][:first] and image_id not in row["input_ids"][first:]


def test_image_record_problems_are_located_before_any_compute(vl_spec, tmp_path):
    """A missing image and an unreadable one are each refused with file, line and field."""
    src = vl_spec.data_path()
    shutil.copytree(src.parent, tmp_path / "vl")
    lines = (tmp_path / "vl" / "shapes.jsonl").read_text().splitlines()
    rec = json.loads(lines[2])
    rec["messages"][0]["content"][0]["image"] = "images/nope.png"
    lines[2] = json.dumps(rec)
    (tmp_path / "vl" / "shapes.jsonl").write_text("\n".join(lines) + "\n")
    spec = _with_data(vl_spec, path=str(tmp_path / "vl" / "shapes.jsonl"))
    with pytest.raises(DataError, match=r"shapes\.jsonl:3: messages\[0\]\.content\[0\]\.image: no image file at "):
        prepare_pipeline(spec)
    rec = json.loads(lines[4])
    (tmp_path / "vl" / rec["messages"][0]["content"][0]["image"]).write_bytes(b"not a png")
    lines[2] = json.dumps(json.loads((src.parent / "shapes.jsonl").read_text().splitlines()[2]))
    (tmp_path / "vl" / "shapes.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"shapes\.jsonl:5: messages\[0\]\.content\[0\]\.image: cannot read .* as an "
                                        r"image \(UnidentifiedImageError"):
        prepare_pipeline(spec)


@pytest.mark.parametrize(("method", "vision", "trains"), [
    ("lora", "frozen", {"language_model"}), ("lora", "projector", {"language_model", "merger"}),
    ("full", "frozen", {"language_model"}), ("full", "tower", {"language_model", "merger", "visual"}),
])
def test_what_trains(vl_spec, method, vision, trains):
    """LoRA wraps the language model's linears (and the merger only when asked); full fine-tuning leaves the tower
    frozen unless asked. The loop's own step runs on a batch with images and moves only what trains."""
    import torch

    from fitburst.data import collate
    from fitburst.train import build_model, optimizer_step

    spec = vl_spec.model_copy(update={"method": vl_spec.method.model_copy(update={"type": method, "vision": vision})})
    model, tok = build_model(spec, "cpu", "fp32")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    parts = {next(k for k in ("merger", "visual", "language_model") if k in n) for n in names}  # head tied
    assert parts == trains
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    rows = load_split(prepare_pipeline(spec), "train").to_list()[:4]
    loss = optimizer_step(model, opt, params, [collate(rows, tok.pad_token_id)], device="cpu", max_grad_norm=1.0)
    assert loss > 0
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and moved <= set(names)


@pytest.fixture(scope="module")
def vl_run(prefect_server, pipelines_file):
    from flows.finetune import finetune

    return finetune(pipeline="vl-demo", pipelines_file=str(pipelines_file))


def test_tiny_vl_trains_through_the_dag(vl_run):
    """data prep -> preflight -> train -> eval -> MLflow on the tiny Qwen2-VL with images: validation loss falls,
    and the preflight estimate is recorded next to the measured peak."""
    from mlflow.tracking import MlflowClient

    run = MlflowClient().get_run(vl_run["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["pipeline"] == "vl-demo"
    m = run.data.metrics
    assert m["memory.estimated_peak_bytes"] > 0 and m["memory.measured_peak_bytes"] > 0
    assert m["eval.tuned_loss"] < m["eval.base_loss"] - 1.0


@pytest.mark.parametrize(("method", "vision"), [("lora", "frozen"), ("lora", "projector"), ("lora", "tower"),
                                                ("full", "frozen"), ("full", "projector")])
def test_estimate_counts_what_trains(vl_spec, method, vision):
    """The estimator's trainable parameters (LoRA on the vision side as method.vision asks; a full fine-tune's
    frozen tower left out) equal what build_model really trains; the base count equals the loaded model's."""
    from fitburst.data import images_per_record
    from fitburst.memory import estimate, resolve_device
    from fitburst.models import model_family, spec_shape
    from fitburst.settings import settings_from_spec
    from fitburst.train import build_model

    spec = vl_spec.model_copy(update={"method": vl_spec.method.model_copy(update={"type": method, "vision": vision})})
    model, _ = build_model(spec, "cpu", "fp32")
    s = settings_from_spec(spec, resolve_device("cpu"), 40,
                           images=images_per_record(spec), family=model_family(spec.model))
    assert (s.images, s.image_tokens, s.vision) == (1, 16, vision)
    e = estimate(spec_shape(spec), s, resolve_device("cpu"))
    assert e.params["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert e.params["total"] == sum(p.numel() for p in model.parameters())


def test_vision_terms_follow_images_and_what_trains(vl_spec):
    """Frozen, the tower adds a forward transient and keeps nothing; trained, it keeps activations that grow with
    the patches; more or larger images lengthen the language sequence and raise the peak."""
    from dataclasses import replace

    from fitburst.memory import RunSettings, estimate, load_shape, resolve_device
    from fitburst.memory.activations import vision_activations

    shape = load_shape("qwen2-vl-7b")
    dev = resolve_device("cuda:80GiB")
    s = RunSettings(method="lora", target_modules="all-linear", precision="bf16", micro_batch_size=1, seq_len=1400,
                    images=1,
                      image_tokens=1280)
    kept, fwd = vision_activations(shape, s, 2, "flash", 1)
    assert kept == 0 and fwd > 0
    tower, _ = vision_activations(shape, replace(s, vision="tower"), 2, "flash", 1)
    double, _ = vision_activations(shape, replace(s, vision="tower", images=2), 2, "flash", 1)
    assert tower > 0 and double == 2 * tower
    assert estimate(shape, replace(s, vision="tower"), dev).allocated_peak_bytes > estimate(
        shape, s, dev).allocated_peak_bytes
    assert "vision" in estimate(shape, s, dev).phases


def test_seed_qwen2_vl_7b_fp32_on_m2_max(pipelines_file):
    """The seed: Qwen2-VL-7B LoRA in fp32 with 1280-token images does not fit an M2 Max's 42.43 GiB MPS budget; the
    planner proposes a plan that does, with no bitsandbytes (none on MPS)."""
    from fitburst.data import images_per_record
    from fitburst.memory import Budget, estimate, resolve_device
    from fitburst.models import model_family, spec_shape
    from fitburst.preflight import preflight
    from fitburst.settings import settings_from_spec

    spec = load_pipeline(pipelines_file, "qwen2vl-7b-lora", {"preflight.exact": False})  # the trace: minutes at 7B
    dev = resolve_device(spec.preflight.device)
    s = settings_from_spec(spec, dev, spec.data.max_seq_len,
                           images=images_per_record(spec), family=model_family(spec.model))
    assert not Budget(dev, 0.03).judge(estimate(spec_shape(spec), s, dev)).fits
    report = preflight(spec, spec.data.max_seq_len)
    assert report.verdict.placement == "local" and report.plan.fits
    assert report.plan.settings.quant == "none" and report.changes
    assert report.plan.needed_bytes <= report.plan.limit_bytes


def test_planner_lowers_the_resolution_and_the_data_follows(vl_spec):
    """When only fewer image tokens make it fit, the plan quarters data.image_max_pixels; the images prepared at
    the planned resolution are 4 tokens each and every sample is exactly as much shorter as the plan assumed."""
    from dataclasses import replace

    from fitburst.data import images_per_record
    from fitburst.memory import Budget, estimate, plan_fit, resolve_device
    from fitburst.models import model_family, spec_shape
    from fitburst.settings import settings_from_spec, spec_with_settings

    full = prepare_pipeline(vl_spec)
    seq = full.stats["max"]
    shape = spec_shape(vl_spec)
    s = replace(settings_from_spec(vl_spec, resolve_device("cpu"), seq,
                                   images=images_per_record(vl_spec),
                                   family=model_family(vl_spec.model)), micro_batch_size=64, eval_batch=0)
    cpu = resolve_device("cpu:64GiB")
    need = Budget(cpu).needed  # the estimate's upper band edge, what a plan must keep within the limit
    low = need(estimate(shape, replace(s, image_tokens=4, seq_len=seq - 12), cpu))
    high = need(estimate(shape, s, cpu))
    assert low < high
    dev = replace(cpu, budget_bytes=int((low + high) / 2 / (1 - 0.03)))  # between the two, less the headroom
    allow = {k: False for k in ("gradient_checkpointing", "reduce_batch", "dropout", "optimizer_8bit", "precision")}
    plan = plan_fit(shape, s, dev, allow=allow)
    assert plan.fits and plan.settings.image_tokens == 4 and any("image resolution" in c for c in plan.changes)
    planned = spec_with_settings(vl_spec, plan.settings)
    assert planned.data.image_max_pixels == 56 * 56
    lowered = prepare_pipeline(planned)
    assert lowered.stats["image_tokens_max"] == 4 and lowered.stats["max"] == plan.settings.seq_len


def test_vision_settings_are_validated_with_their_line(tmp_path, pipelines_file):
    """A resolution below one image token and packing with images are each refused at their line in the file."""
    import yaml

    from fitburst.spec import SpecError

    doc = yaml.safe_load(pipelines_file.read_text())
    body = doc["pipelines"]["vl-demo"]
    body["data"] = dict(body["data"], path=str(pipelines_file.parent / body["data"]["path"]), image_max_pixels=100)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"pipelines": {"vl": body}}))
    with pytest.raises(SpecError, match=r"line \d+: field 'data.image_max_pixels' \(got 100\): Input should be "
                                        r"greater than or equal to 784"):
        load_pipeline(tmp_path / "p.yaml", "vl")
    body["data"]["image_max_pixels"] = 3136
    body["training"] = dict(body["training"], packing=True)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"pipelines": {"vl": body}}))
    with pytest.raises(SpecError, match=r"line \d+: field 'training.packing' \(got True\): packed batches carry no "
                                        "images"):
        load_pipeline(tmp_path / "p.yaml", "vl")


def test_traced_estimate_of_a_step_with_images_is_the_measured_peak(vl_spec):
    """The trace runs the real step of the tiny Qwen2-VL on fake tensors, images included (the ids and image grids
    real, so the model places the images as it would): its peak equals the live tensor bytes measured through the
    project's own step on the same shapes."""
    from dataclasses import replace

    import torch

    from fitburst.data import collate, images_per_record
    from fitburst.memory import resolve_device
    from fitburst.memory.trace import traced_estimate
    from fitburst.models import model_family, resolve_model_ref
    from fitburst.probe import TensorTracker
    from fitburst.settings import settings_from_spec
    from fitburst.train import build_model, make_optimizer, optimizer_step

    spec = vl_spec.model_copy(update={"training": vl_spec.training.model_copy(update={"micro_batch_size": 4})})
    rows = [r for r in load_split(prepare_pipeline(spec), "train").to_list() if len(r["input_ids"]) == 40][:4]
    torch.manual_seed(0)
    model, tok = build_model(spec, "cpu", "fp32")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("adamw", params, 1e-3, 0.0)
    batch = collate(rows, tok.pad_token_id)
    tracker = TensorTracker()
    tracker.add(list(model.parameters()) + list(model.buffers()) + list(batch.values()))
    with tracker:
        for _ in range(2):
            optimizer_step(model, opt, params, [batch], device="cpu", max_grad_norm=1.0)
    dev = resolve_device("cpu:64GiB")
    s = replace(settings_from_spec(spec, dev, 40,
                                   images=images_per_record(spec),
                                   family=model_family(spec.model)),
        padded=False)  # four samples of 40 tokens: no padding
    ref = resolve_model_ref(spec.model.name)
    local = spec.model_copy(update={"model": spec.model.model_copy(update={"name": ref})})
    traced = traced_estimate(local, s, dev, seq_len=40)
    assert traced.method == "traced"
    assert traced.allocated_peak_bytes == pytest.approx(tracker.peak, rel=0.002)


def test_estimate_cli_takes_images_and_refuses_them_for_a_text_model(capsys):
    """`fitburst estimate` gives a VL model's images their tokens and tower (a trained tower costs more than a
    frozen one; more images or pixels cost more), and refuses --images for a text-only model with one message."""
    from fitburst.cli import main

    def reserved(*extra: str) -> float:
        assert main(["estimate", "--model", "qwen2-vl-7b", "--method", "lora", "--targets", "all-linear",
                     "--seq-len", "2048", "--device", "A100-80GB", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["reserved_peak_bytes"]

    text = reserved()
    frozen = reserved("--images", "1")
    tower = reserved("--images", "1", "--vision", "tower")
    more = reserved("--images", "2", "--vision", "tower")
    assert text < frozen < tower < more
    assert main(["estimate", "--model", "qwen2.5-7b", "--images", "1", "--device", "T4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --images: qwen2.5-7b has no vision tower (a vision-language model takes images)"]
