"""The data facts a preflight plans with: the longest sample, the training examples and the mean length.

``fitburst preflight`` keeps them on disk under what decides them: the records' content, the data settings, the
model family's samples and the tokenizer's files as they lie on disk (a model folder, or huggingface_hub's cache,
read without a network call). An unchanged pipeline's preflight then neither imports transformers nor loads its
tokenizer, which is most of a warm preflight's time. A tokenizer that could not be had (not cached, hub
unreachable) is remembered for :func:`miss_ttl` seconds, so a warm preflight does not wait on the hub's retries.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from fitburst.cache import cache_root, keep, read_kept
from fitburst.data import PreparedData, count_records, data_key, prepare_pipeline
from fitburst.models import LOCAL_MODELS, model_family, resolve_model_ref
from fitburst.spec import PipelineSpec

log = logging.getLogger(__name__)

# what AutoTokenizer (and a vision-language model's image processor) read from a model folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "merges.txt", "preprocessor_config.json")


@dataclass(frozen=True)
class DataFacts:
    """``longest`` and ``mean`` in tokens; ``tokenized`` False: no tokenizer could be had, so both are
    ``data.max_seq_len`` (the worst case) and ``n_train`` is counted from the records."""

    longest: int
    n_train: int | None
    mean: float | None
    tokenized: bool = True


def data_facts(spec: PipelineSpec, prepared: PreparedData | None = None) -> DataFacts:
    """The facts of ``prepared``; without it, the worst case: ``data.max_seq_len`` and the records' count."""
    if prepared is not None:
        return DataFacts(prepared.stats["max"], prepared.n_train, prepared.stats["mean"])
    n = count_records(spec.data_source(), spec.data)[0]
    seq = spec.data.max_seq_len
    return DataFacts(seq, round(n * (1 - spec.data.val_split)), seq, tokenized=False)


def miss_ttl() -> float:
    """Seconds a tokenizer that could not be had is not asked for again (``FITBURST_HUB_MISS_TTL``, default an
    hour, as SkyPilot's catalog answers are kept)."""
    return float(os.environ.get("FITBURST_HUB_MISS_TTL", 3600))


def tokenizer_files(spec: PipelineSpec) -> list[tuple[str, str]] | None:
    """(file, what identifies its content) for each tokenizer file of the pipeline's model found on disk, or None
    where none is: a hub model whose files huggingface_hub has not cached. A hub file's path names the commit it
    was fetched at, so a new revision changes it; a model folder's files are hashed."""
    m = spec.model
    if m.name in LOCAL_MODELS or Path(m.name).expanduser().is_dir():
        folder = Path(resolve_model_ref(m.name)).expanduser()
        found = [(f, hashlib.sha256((folder / f).read_bytes()).hexdigest()) for f in TOKENIZER_FILES
                 if (folder / f).is_file()]
        return found or None
    from huggingface_hub import try_to_load_from_cache  # reads the cache folder only

    cached = [(f, p) for f in TOKENIZER_FILES
              if isinstance(p := try_to_load_from_cache(m.name, f, revision=m.revision), str)]
    return cached or None


def _facts_path(spec: PipelineSpec, tokenizer: list[tuple[str, str]]) -> Path:
    key = data_key(spec.data_source(), spec.data, model_family(spec.model), repr(tokenizer))
    return cache_root() / "facts" / f"{key}.json"


def _miss_path(spec: PipelineSpec) -> Path:
    name = hashlib.sha256(f"{spec.model.name}@{spec.model.revision}".encode()).hexdigest()[:16]
    return cache_root() / "facts" / f"no-tokenizer-{name}.json"


def known_miss(spec: PipelineSpec) -> str | None:
    """Why the pipeline's tokenizer could not be loaded within the last :func:`miss_ttl` seconds, or None."""
    miss = read_kept(_miss_path(spec), miss_ttl())
    return str(miss.get("error")) if miss is not None else None


def remember_miss(spec: PipelineSpec, error: Exception) -> None:
    """Keep that the pipeline's tokenizer could not be loaded (``error``), for :func:`known_miss`."""
    if miss_ttl() > 0:
        keep(_miss_path(spec), {"error": type(error).__name__})


def pipeline_facts(spec: PipelineSpec) -> DataFacts:
    """The pipeline's data facts: kept ones when nothing that decides them changed, else its data prepared (bad
    data refused as data prep refuses it) and the facts kept; the worst case when the tokenizer cannot be had."""
    files = tokenizer_files(spec)
    path = _facts_path(spec, files) if files is not None else None
    if path is not None and (kept := read_kept(path)) is not None:
        return DataFacts(**kept)
    if files is None and (why := known_miss(spec)) is not None:
        log.warning("the tokenizer of %s could not be loaded in the last %.0f min (%s); planning for "
                    "data.max_seq_len=%d", spec.model.name, miss_ttl() / 60, why, spec.data.max_seq_len)
        return data_facts(spec)
    try:
        facts = data_facts(spec, prepare_pipeline(spec))
    except OSError as e:  # e.g. a hub tokenizer that cannot be fetched here
        log.warning("could not tokenize the data (%s); planning for data.max_seq_len=%d", type(e).__name__,
                    spec.data.max_seq_len)
        remember_miss(spec, e)
        return data_facts(spec)
    files = tokenizer_files(spec)  # a hub tokenizer is on disk now that it has loaded
    if files is not None:
        keep(_facts_path(spec, files), asdict(facts))
    return facts
