"""Evaluation: validation loss and perplexity of the base model and of the tuned adapter, plus sample generations.

The adapter is reloaded from disk the way a user would load it, and the base figures come from the same loaded
model with the adapter switched off, so the model is loaded once. The loss and the generations are the model's
family's (:class:`fitburst.families.Family`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fitburst.builders import loss_kernel
from fitburst.data import PreparedData, load_split
from fitburst.device import make_amp
from fitburst.families import family_for
from fitburst.models import load_pipeline_model, load_tokenizer
from fitburst.spec import PipelineSpec


@dataclass
class EvalResult:
    base_loss: float
    base_ppl: float
    tuned_loss: float
    tuned_ppl: float
    n_tokens: int
    samples: list[dict] = field(default_factory=list)
    init_loss: float | None = None  # method.init_from: the adapter the run started from, on the same split

    @property
    def delta_loss(self) -> float:
        return self.tuned_loss - self.base_loss

    def save(self, run_dir: str | Path) -> None:
        Path(run_dir, "eval.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, run_dir: str | Path) -> EvalResult:
        return cls(**json.loads(Path(run_dir, "eval.json").read_text()))


def evaluate(spec: PipelineSpec, prepared: PreparedData, adapter_dir: str | Path, *, device: str,
             precision: str) -> EvalResult:
    """Load the base model once, attach the saved adapter, and measure base vs tuned on the validation split, in
    batches of ``spec.eval.batch_size`` under the run's autocast, with the loss kernel training ran."""
    from peft import PeftModel  # peft: heavy, loaded only when evaluating

    rows = load_split(prepared, "val").to_list()
    if not rows:
        raise ValueError(f"pipeline '{spec.name}' has no validation split: set data.val_split > 0 or eval.enabled: "
                         "false")
    ev = spec.eval
    amp = make_amp(precision, device, pure_bf16=spec.training.pure_bf16)
    tok = load_tokenizer(str(adapter_dir))

    base = load_pipeline_model(spec, device, precision)
    family = family_for(base.config)
    kernel = loss_kernel(spec, device, precision)  # the loss training ran (training.loss: fused, its kernel)

    def measure(model) -> tuple[float, int, list[dict]]:
        loss, n = family.eval_loss(model, rows, tok.pad_token_id, ev.batch_size, device, ev.max_batches, amp=amp,
                                   kernel=kernel)
        with amp.autocast():
            samples = family.generate_samples(model, tok, rows, ev.samples, ev.max_new_tokens, device)
        return loss, n, samples

    init_loss = None
    if spec.method.type == "full":  # the "adapter" folder holds the whole tuned model
        base_loss, n, base_samples = measure(base)
        del base
        tuned_loss, _, tuned_samples = measure(load_pipeline_model(spec, device, precision, path=str(adapter_dir)))
    else:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
        with model.disable_adapter():
            base_loss, n, base_samples = measure(model)
        tuned_loss, _, tuned_samples = measure(model)
        init = spec.init_folder()
        if init is not None:  # the adapter it started from (the champion), on the same rows, the same way
            model.load_adapter(str(init), adapter_name="init")
            model.set_adapter("init")
            init_loss, _ = family.eval_loss(model, rows, tok.pad_token_id, ev.batch_size, device, ev.max_batches,
                                            amp=amp, kernel=kernel)
    samples = [{**t, "base_completion": b["completion"]} for t, b in zip(tuned_samples, base_samples, strict=True)]
    return EvalResult(base_loss=base_loss, base_ppl=math.exp(min(base_loss, 50)), tuned_loss=tuned_loss,
                      tuned_ppl=math.exp(min(tuned_loss, 50)), n_tokens=n, samples=samples,
                      init_loss=init_loss)
