"""Merge and share a tuned adapter: a merged model folder (base + adapter in the base dtype), and a push of the
adapter with a model card generated from the run to the Hugging Face Hub (opt-in: ``tracking.push_to_hub``)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from fitburst.errors import UserError
from fitburst.models import load_model
from fitburst.tracking import redact, tracking_uri


class ShareError(UserError):
    """The adapter to merge or push cannot be found or used; the message says what to pass instead."""


def find_adapter(run: str, dest: Path | None = None) -> Path:
    """The adapter folder of ``run``: a run folder (``runs/<pipeline>/<id>``), an adapter folder, or an MLflow run
    id whose ``adapter`` artifact is downloaded (into ``dest``)."""
    p = Path(run)
    for cand in (p / "adapter", p):
        if (cand / "adapter_config.json").exists():
            return cand
    if p.exists():
        raise ShareError(f"{p}: no adapter_config.json here or in {p / 'adapter'}: pass a run folder of a LoRA/QLoRA "
                         "run (runs/<pipeline>/<id>) or an MLflow run id")
    import mlflow  # mlflow: heavy, only to fetch a run's artifact

    try:
        got = mlflow.artifacts.download_artifacts(run_id=run, artifact_path="adapter", tracking_uri=tracking_uri(),
                                                  dst_path=str(dest) if dest else None)
    except Exception as e:  # noqa: BLE001 - MLflow raises several types for a missing run or artifact
        raise ShareError(f"{run!r} is neither a run folder nor an MLflow run with an 'adapter' artifact in "
                         f"{tracking_uri()} ({type(e).__name__}): pass a run folder or a run id") from None
    return Path(got)


def merge(run: str, out: str | Path | None = None) -> Path:
    """Load the adapter's base model in its own dtype, fold the adapter in (peft ``merge_and_unload``) and save
    an ordinary model folder with the adapter's tokenizer. Returns the folder (default ``<run>/merged``)."""
    from peft import PeftConfig, PeftModel  # peft, transformers: heavy, only to merge
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        adapter = find_adapter(run, Path(tmp))
        base_ref = PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
        dest = Path(out) if out else (Path(run) / "merged" if Path(run).is_dir() else Path(f"merged-{run}"))
        base = load_model(base_ref, dtype="auto", device="cpu")  # a causal or an encoder-decoder LM
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
        merged.save_pretrained(dest)
        AutoTokenizer.from_pretrained(str(adapter)).save_pretrained(dest)
    return dest


def model_card(spec, *, base: str, run_id: str | None, metrics: dict, tags: dict) -> str:
    """A model card for the adapter from the run's record: base model, method, data, training settings, eval.
    Built from the spec's settings (${ENV} references stay references), scrubbed of secret values."""
    from huggingface_hub import ModelCard, ModelCardData  # huggingface_hub: only to write a card

    m, t = spec.method, spec.training
    data = ModelCardData(base_model=base, library_name="peft", pipeline_tag="text-generation",
                         tags=["fitburst", m.type, "lora"] if m.type != "lora" else ["fitburst", "lora"])

    def fmt(key: str) -> str:
        v = metrics.get(key)
        return f"{v:.4f}" if isinstance(v, int | float) else "n/a"

    targets = m.target_modules if isinstance(m.target_modules, str) else ", ".join(m.target_modules)
    body = "\n".join([
        f"# {spec.name}", "",
        f"A {m.type.upper()} adapter for `{base}`, fine-tuned with fitburst "
        f"({tags.get('path', 'local')} run on {tags.get('device', 'n/a')}).", "",
        "## Training", "",
        "| setting | value |", "|---|---|",
        f"| method | {m.type}, rank {m.rank}, alpha {m.alpha}, dropout {m.dropout}, targets {targets} |",
        f"| quantization | {m.quant} |",
        f"| data | `{Path(spec.data.path).name}` ({spec.data.format}, max {spec.data.max_seq_len} tokens) |",
        f"| steps | {t.max_steps if t.max_steps else f'{t.epochs} epoch(s)'}, micro batch {t.micro_batch_size} x "
        f"{t.grad_accum} accumulation |",
        f"| optimizer | {t.optimizer}, lr {t.learning_rate} ({t.lr_scheduler}) |",
        f"| precision | {tags.get('precision', t.precision)} |", "",
        "## Evaluation (validation split)", "",
        "| | loss | perplexity |", "|---|---|---|",
        f"| base | {fmt('eval.base_loss')} | {fmt('eval.base_ppl')} |",
        f"| tuned | {fmt('eval.tuned_loss')} | {fmt('eval.tuned_ppl')} |", "",
        "## Use", "", "```python",
        "from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer", "",
        'model = AutoPeftModelForCausalLM.from_pretrained("REPO")',
        'tokenizer = AutoTokenizer.from_pretrained("REPO")', "```",
        *(["", f"MLflow run: `{run_id}`"] if run_id else []),
    ])
    return redact(str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")))


def push_adapter(repo_id: str, adapter_dir: str | Path, card: str, token: str | None = None,
                 private: bool = True) -> str:
    """Create (or reuse) the Hub repo and upload the adapter folder with ``README.md`` = ``card``. Returns the
    commit URL. Only the adapter, tokenizer files and the card are uploaded."""
    from huggingface_hub import HfApi  # huggingface_hub: only to push

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "adapter"
        shutil.copytree(adapter_dir, stage, ignore=shutil.ignore_patterns("checkpoints", "*.pt", ".lock"))
        (stage / "README.md").write_text(card)
        api.create_repo(repo_id, private=private, exist_ok=True)
        peft_type = json.loads((stage / "adapter_config.json").read_text()).get("peft_type", "")
        info = api.upload_folder(repo_id=repo_id, folder_path=str(stage),
                                 commit_message=f"fitburst {peft_type} adapter")
    return str(getattr(info, "commit_url", info))
