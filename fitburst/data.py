"""Data prep: read fine-tuning records from where they live, apply the chat template, mask prompts, split, cache.

Sources (:func:`iter_records`): local .jsonl/.json/.csv/.parquet/.arrow files and folders of them, folders written
by ``save_to_disk``, and hub datasets (id, subset, split, revision; streamed when asked) through ``datasets``;
``data.columns`` maps differently named columns to the record fields.

Accepted shapes (``format: auto`` detects them per record):
- ``messages``: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}``
- ``alpaca``: ``{"instruction": ..., "input": ..., "output": ...}``
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``
- ``input_target``: ``{"input": ..., "target": ...}`` (sequence-to-sequence records)

How records become samples is the model family's (:mod:`fitburst.families`): a causal LM's conversations are
tokenized with their replies as labels, an encoder-decoder's become (input, target) pairs, a vision-language model's
image + conversation records carry their pixels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fitburst.cache import cache_root
from fitburst.errors import DataError, UserError
from fitburst.families import CAUSAL, IGNORE_INDEX, Family
from fitburst.families import collate as family_collate
from fitburst.families.vision_language import RecordImages, load_image_processor
from fitburst.models import model_family, resolve_model_ref, tokenizer_for
from fitburst.raw_records import (
    DATA_SUFFIXES,
    is_saved,
    load_error,
    map_columns,
    raw_records,
    refuse_or_skip,
    source_name,
)
from fitburst.spec import DataSpec, resolve_env

log = logging.getLogger(__name__)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "model": "assistant"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")  # what chat templates take


@dataclass
class PreparedData:
    """Tokenized train/val splits on disk and what the preflight needs to know about them."""

    dir: str
    content_hash: str
    n_train: int
    n_val: int
    n_skipped: int
    n_no_target: int
    stats: dict = field(default_factory=dict)
    family: str = "causal"  # whose samples these are (Family.name); train and eval take the family from the model

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dir(cls, path: str | Path) -> PreparedData:
        d = json.loads((Path(path) / "prepared.json").read_text())
        d["dir"] = str(Path(path))
        if "seq2seq" in d:  # a cache that recorded only whether its samples were encoder-decoder ones
            d["family"] = "seq2seq" if d.pop("seq2seq") else "causal"
        return cls(**d)


# --- records -> messages -----------------------------------------------------------------------------

def detect_format(record: dict) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "input" in record and "target" in record:
        return "input_target"
    raise ValueError(f"cannot tell the format from keys {sorted(record)}: expected messages, conversations, "
                     "instruction/output, prompt/completion or input/target")


def _check_role(role: object, i: int, key: str = "messages") -> None:
    """A chat turn's role must be one chat templates know: a typo would otherwise surface as a missing reply."""
    if role in CHAT_ROLES:
        return
    import difflib

    close = difflib.get_close_matches(str(role), CHAT_ROLES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"{key}[{i}]: unknown role {role!r}{hint}; a role is one of {', '.join(CHAT_ROLES)}")


def to_messages(record: object, fmt: str) -> list[dict]:
    """Normalise one record to a chat ``messages`` list ending with an assistant turn."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if fmt == "messages":
        msgs = record.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] needs 'role' and 'content'")
            _check_role(m["role"], i)
            out.append({"role": m["role"], "content": str(m["content"])})
    elif fmt == "sharegpt":
        conv = record.get("conversations")
        if not isinstance(conv, list) or not conv:
            raise ValueError("'conversations' must be a non-empty list")
        out = []
        for i, m in enumerate(conv):
            role = SHAREGPT_ROLES.get(m.get("from", "") if isinstance(m, dict) else "")
            if role is None or "value" not in m:
                raise ValueError(f"conversations[{i}] needs 'from' (human/gpt/system) and 'value'")
            out.append({"role": role, "content": str(m["value"])})
    elif fmt == "alpaca":
        if not record.get("instruction") or "output" not in record:
            raise ValueError("alpaca records need a non-empty 'instruction' and an 'output'")
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        out = [{"role": "user", "content": prompt}, {"role": "assistant", "content": str(record["output"])}]
    elif fmt == "prompt_completion":
        if not isinstance(record.get("prompt"), str) or not isinstance(record.get("completion"), str):
            raise ValueError("'prompt' and 'completion' must be strings")
        out = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    elif fmt == "input_target":
        if not isinstance(record.get("input"), str) or not isinstance(record.get("target"), str):
            raise ValueError("'input' and 'target' must be strings")
        out = [{"role": "user", "content": record["input"]}, {"role": "assistant", "content": record["target"]}]
    else:
        raise ValueError(f"unknown format {fmt!r}")
    if out[-1]["role"] != "assistant" or not out[-1]["content"]:
        raise ValueError("the last turn must be a non-empty assistant reply (nothing to learn otherwise)")
    return out


def iter_records(source: Path | str, data: DataSpec) -> Iterator[tuple[str, list[dict] | DataError]]:
    """Each record of ``source`` as (where it is, its messages or the DataError saying what is wrong with it).

    ``source`` is a local file or folder (JSON lines keep their line numbers; csv/parquet/arrow files, folders of
    them and folders written by ``save_to_disk`` give row indices) or a hub dataset id / hub-style folder when
    ``data.dataset`` is set (``load_dataset`` with subset, split and revision; rows read lazily with
    ``data.streaming``). ``data.columns`` renames the data's columns to the record fields first."""
    for where, rec in raw_records(source, data):
        try:
            if isinstance(rec, Exception):
                raise rec
            rec = map_columns(rec, data.columns)
            fmt = detect_format(rec) if data.format == "auto" and isinstance(rec, dict) else data.format
            yield where, to_messages(rec, fmt)
        except ValueError as e:
            yield where, DataError(f"{where}: {e}")


def read_records(source: Path | str, fmt: str = "auto", skip_invalid: bool = False,
                 data: DataSpec | None = None) -> tuple[list[list[dict]], int]:
    """All records of ``source`` (see :func:`iter_records`; ``data`` gives columns and the hub fields) as message
    lists; a bad record raises DataError with its source and line or row unless ``skip_invalid`` (then it is
    counted and logged)."""
    spec = (data or DataSpec(path=str(source))).model_copy(update={"format": fmt, "skip_invalid": skip_invalid})
    out, skipped = [], 0
    for _, item in iter_records(source, spec):
        if isinstance(item, DataError):
            skipped += refuse_or_skip(item, skip_invalid)
        else:
            out.append(item)
    if not out:
        raise DataError(f"{source_name(source, spec)}: no usable records")
    return out, skipped


def count_records(source: Path | str, data: DataSpec) -> tuple[int, int]:
    """(usable records, skipped) in one pass that holds no record: checks a streamed set before any compute."""
    n = skipped = 0
    for _, item in iter_records(source, data):
        if isinstance(item, DataError):
            skipped += refuse_or_skip(item, data.skip_invalid)
        else:
            n += 1
    if not n:
        raise DataError(f"{source_name(source, data)}: no usable records")
    return n, skipped


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def source_fingerprint(source: Path | str, data: DataSpec) -> str:
    """What identifies the records' content: a file's bytes, a folder's files (a saved dataset's fingerprints),
    or a hub dataset's id, subset, split, revision and builder hash (data files at the revision)."""
    h = hashlib.sha256()
    if isinstance(source, str) or (data.dataset is not None and not is_saved(source)):  # as raw_records reads it
        from datasets import load_dataset_builder  # datasets: heavy, only for a hub dataset
        from datasets.exceptions import DatasetsError

        try:
            builder = load_dataset_builder(str(source), data.subset, revision=data.revision)
        except (DatasetsError, ValueError, OSError, RuntimeError) as e:
            raise load_error(source, data, e) from None
        h.update(json.dumps([str(source), data.subset, data.split, data.revision, builder.hash]).encode())
        return h.hexdigest()
    files = [source] if source.is_file() else sorted(
        f for f in source.rglob("*") if f.is_file() and (f.suffix.lower() in DATA_SUFFIXES or f.name == "state.json"))
    for f in files:
        h.update(str(f.relative_to(source)).encode() if f != source else b"")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def content_hash(source: Path | str, data: DataSpec, tokenizer, family: Family = CAUSAL) -> str:
    """The data cache key: the records' content, the data settings, the family's samples and the tokenizer."""
    return data_key(source, data, family, tokenizer_fingerprint(tokenizer))


def data_key(source: Path | str, data: DataSpec, family: Family, tokenizer_id: str) -> str:
    """A key of what decides the prepared data: the records' content, the data settings, the family's samples and
    ``tokenizer_id`` (what identifies the tokenizer: its fingerprint, or its files on disk)."""
    h = hashlib.sha256(source_fingerprint(source, data).encode())
    h.update(data.model_dump_json(exclude={"path", "dataset"}).encode())
    h.update(family.hash_salt)
    h.update(tokenizer_id.encode())
    return h.hexdigest()[:16]


def length_stats(lengths: list[int], full_lengths: list[int], max_seq_len: int) -> dict:
    import numpy as np  # numpy: kept off data's import path with the rest

    a = np.array(lengths)
    return {
        "p50": int(np.percentile(a, 50)), "p95": int(np.percentile(a, 95)), "max": int(a.max()),
        "mean": float(a.mean()), "total_tokens": int(a.sum()),
        "n_truncated": int(sum(f > max_seq_len for f in full_lengths)), "max_seq_len": max_seq_len,
    }


def prepare(data: DataSpec, data_path: Path | str, tokenizer, cache_dir: Path,
            records: tuple[list[list[dict]], int] | None = None, family: Family = CAUSAL) -> PreparedData:
    """Tokenize and split the records at ``data_path`` (a local path, or a hub id with ``data.dataset``); reuse the
    cached result when content, settings and tokenizer match. ``records``: :func:`read_records` of the source
    when the caller has read it already. ``family``: whose samples the records become (its ``tokenize``); the
    length statistics are of the longer of a sample's input and labels (an encoder-decoder pair's two sides).

    With ``data.streaming`` the records are read, tokenized and written to the cache in one pass that holds no
    more than a writer batch; the validation split is then drawn per record from a seeded hash of its position
    (about ``val_split`` of the records) rather than by shuffling the whole set."""
    from datasets import Dataset, Features, List, Value  # datasets: heavy, only to read data
    from datasets.exceptions import DatasetsError

    key = content_hash(data_path, data, tokenizer, family)
    out = cache_dir / key
    if (out / "prepared.json").exists():
        log.info("data cache hit %s", out)
        return PreparedData.from_dir(out)

    if records is not None:
        pairs: Iterator = ((f"{data_path}: record {k}", m) for k, m in enumerate(records[0], 1))
        skipped = records[1]
    elif data.streaming:
        pairs, skipped = _good_records(data_path, data), 0
    else:
        got, skipped = read_records(data_path, data.format, data.skip_invalid, data)
        pairs = ((f"{data_path}: record {k}", m) for k, m in enumerate(got, 1))
    seen = {"no_target": 0, "skipped": skipped}
    lengths: list[int] = []
    full: list[int] = []

    def rows():
        for i, (where, messages) in enumerate(pairs):
            try:
                r = family.tokenize(messages, tokenizer, data)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
            if all(label == IGNORE_INDEX for label in r["labels"]):
                seen["no_target"] += 1
                continue
            lengths.append(max(len(r["input_ids"]), len(r["labels"])))
            full.append(r["full_length"])
            yield {"input_ids": r["input_ids"], "labels": r["labels"], "val": _in_val(i, data)}

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}."))
    features = Features({"input_ids": List(Value("int64")), "labels": List(Value("int64")), "val": Value("bool")})
    ds = None
    try:
        if data.streaming:
            ds = Dataset.from_generator(rows, features=features, cache_dir=str(tmp / "gen"), fingerprint=key)
        elif got := list(rows()):
            ds = Dataset.from_list(got, features=features)
    except DatasetsError as e:  # the generator's own DataError (a record the template cannot render), or no rows
        if isinstance(e.__cause__, DataError):
            raise e.__cause__ from None
        if lengths:
            raise
    except DataError:  # a record the template or the pairing cannot use (a ValueError, but not datasets' "no data")
        raise
    except ValueError:  # datasets' "no data" when the generator yielded nothing
        if lengths:
            raise
    if seen["no_target"]:
        log.warning("%d record(s) have no target tokens left after truncation to %d and are left out",
                    seen["no_target"], data.max_seq_len)
    if ds is None or not len(ds):
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"{source_name(data_path, data)}: every record lost its reply to truncation: raise "
                        "data.max_seq_len")
    if data.streaming:
        train = ds.filter(lambda v: not v, input_columns="val").remove_columns("val")
        val = ds.filter(lambda v: v, input_columns="val").remove_columns("val")
    else:
        ds = ds.remove_columns("val")
        if data.val_split > 0 and len(ds) >= 2:
            n_val = max(1, round(len(ds) * data.val_split))
            split = ds.train_test_split(test_size=n_val, seed=data.seed, shuffle=True)
            train, val = split["train"], split["test"]
        else:
            train, val = ds, ds.select([])
    stats = length_stats(lengths, full, data.max_seq_len)
    stats["train_tokens"] = int(sum(len(x) for x in train["input_ids"])) if not data.streaming else int(
        sum(sum(len(x) for x in b["input_ids"]) for b in train.iter(batch_size=1024)))

    train.save_to_disk(str(tmp / "train"))
    val.save_to_disk(str(tmp / "val"))
    prepared = PreparedData(dir=str(out), content_hash=key, n_train=len(train), n_val=len(val),
                            n_skipped=seen["skipped"], n_no_target=seen["no_target"], stats=stats, family=family.name)
    (tmp / "prepared.json").write_text(prepared.to_json())
    del ds, train, val
    shutil.rmtree(tmp / "gen", ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # a concurrent prepare of the same content finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData.from_dir(out)


def _good_records(source: Path | str, data: DataSpec) -> Iterator[tuple[str, list[dict]]]:
    """The usable records, lazily (bad ones refused or, with skip_invalid, skipped)."""
    for where, item in iter_records(source, data):
        if isinstance(item, DataError):
            refuse_or_skip(item, data.skip_invalid)
        else:
            yield where, item


def check_pipeline_data(spec) -> tuple[int, int]:
    """(usable records, skipped) of a pipeline's data, read and checked as data prep reads them (a vision-language
    model's images opened), with no tokenizer: what ``fitburst validate`` runs. A bad record raises DataError
    naming its file and line (or is counted, with ``data.skip_invalid``)."""
    source, data = spec.data_source(), spec.data
    try:
        kind = model_family(spec.model).records
    except (OSError, UserError):  # the model's config is not reachable here: its records are still read as text
        kind = "text"
    if kind == "images":
        records, skipped = read_image_records(source, data)
        return len(records), skipped
    return count_records(source, data)


def _in_val(i: int, data: DataSpec) -> bool:
    """Streaming's validation draw: a seeded hash of the record's position, below ``val_split``."""
    if not data.streaming or data.val_split <= 0:
        return False
    digest = hashlib.sha256(f"{data.seed}:{i}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < data.val_split


def prepare_pipeline(spec, tokenizer=None) -> PreparedData:
    """:func:`prepare` for a pipeline: its data source and settings, its model's tokenizer, the shared cache.
    Bad data is refused before the tokenizer loads (a streamed set is checked in a pass that holds no record).
    The model's family says how its records are read (:data:`PREPARERS`) and become samples."""
    family = model_family(spec.model)
    return PREPARERS[family.records](spec, tokenizer, family)


def prepare_text(spec, tokenizer=None, family: Family = CAUSAL) -> PreparedData:
    """:func:`prepare` for a pipeline whose records are text conversations."""
    source, data = spec.data_source(), spec.data
    if data.streaming:
        count_records(source, data)
        records = None
    else:
        records = read_records(source, data.format, data.skip_invalid, data)
    tok = tokenizer if tokenizer is not None else tokenizer_for(spec.model)
    return prepare(data, source, tok, cache_root() / "data", records=records, family=family)


# --- image + conversation records (vision-language models, fitburst.families.vision_language) -----------------

def image_messages(record: object, base: Path) -> tuple[list[dict], list[Path]]:
    """An image + conversation record as chat messages whose image parts are bare placeholders, and its image
    files in order. The record: ``{"messages": [{"role": ..., "content": "text" or [{"type": "image", "image":
    "path relative to the data file"}, {"type": "text", "text": ...}]}, ...]}`` (the parts Qwen2-VL's chat template
    renders). Every image must exist and open; a problem raises ValueError naming the field."""
    from PIL import Image, UnidentifiedImageError  # PIL: only for image data

    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise ValueError("an image + conversation record needs a non-empty 'messages' list")
    messages, images = [], []
    for i, m in enumerate(record["messages"]):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] needs 'role' and 'content'")
        _check_role(m["role"], i)
        content = m["content"]
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be text or a list of image/text parts")
        parts = []
        for j, part in enumerate(content):
            field = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image" and isinstance(part.get("image"), str) and part["image"]:
                path = Path(part["image"]).expanduser()
                path = path if path.is_absolute() else base / path
                if not path.is_file():
                    raise ValueError(f"{field}.image: no image file at {path} (image paths are relative to the "
                                     "data file)")
                try:
                    with Image.open(path) as im:
                        im.load()
                except (UnidentifiedImageError, OSError, SyntaxError) as e:
                    raise ValueError(f"{field}.image: cannot read {path} as an image ({type(e).__name__}: {e})") \
                        from None
                parts.append({"type": "image"})
                images.append(path)
            else:
                raise ValueError(f"{field} must be {{'type': 'text', 'text': ...}} or {{'type': 'image', 'image': "
                                 "'path'}}")
        messages.append({"role": m["role"], "content": parts})
    last = messages[-1]
    if last["role"] != "assistant" or not (last["content"] if isinstance(last["content"], str) else any(
            p.get("text") for p in last["content"])):
        raise ValueError("the last turn must be a non-empty assistant reply (nothing to learn otherwise)")
    return messages, images


def read_image_records(source: Path | str, data: DataSpec) -> tuple[list[tuple[list[dict], list[Path]]], int]:
    """Every image + conversation record of a local ``source`` (see :func:`image_messages`), each image checked;
    a bad record raises DataError with its source, line or row and field unless ``data.skip_invalid``."""
    if not isinstance(source, Path):
        raise DataError(f"{source}: image + conversation records are read from a local file or folder (data.path); "
                        "image paths in them are relative to it")
    if data.streaming:
        raise DataError(f"{source}: data.streaming is for text records; image records are read whole")
    base = source if source.is_dir() else source.parent
    out, skipped = [], 0
    for where, rec in raw_records(source, data):
        try:
            if isinstance(rec, Exception):
                raise rec
            out.append(image_messages(map_columns(rec, data.columns), base))
        except ValueError as e:
            skipped += refuse_or_skip(e if isinstance(e, DataError) else DataError(f"{where}: {e}"),
                                       data.skip_invalid)
    if not out:
        raise DataError(f"{source}: no usable records")
    return out, skipped


def images_per_record(spec) -> int:
    """The most image parts one record of the pipeline's data holds (a pass over the records that opens no image;
    1 for data that is not a local file or folder; 0 for a pipeline without images, data.image_max_pixels unset).
    What the preflight plans the vision tower for (:func:`fitburst.settings.settings_from_spec`'s ``images``)."""
    if spec.data.image_max_pixels is None:
        return 0
    source = spec.data_source()
    if not isinstance(source, Path) or not source.exists():
        return 1
    most = 0
    for _, raw in raw_records(source, spec.data):
        try:
            rec = map_columns(raw, spec.data.columns)  # data.columns names the messages field as prep reads it
        except ValueError:  # a record prep would reject: it holds no images the run plans for
            continue
        msgs = rec.get("messages") if isinstance(rec, dict) else None
        if isinstance(msgs, list):
            most = max(most, sum(1 for m in msgs if isinstance(m, dict) and isinstance(m.get("content"), list)
                                 for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"))
    return most


def prepare_images(spec, tokenizer=None, family: Family | None = None) -> PreparedData:
    """:func:`prepare` for a vision-language pipeline: records and every image checked before the tokenizer and
    the image processor load, then tokenized with their pixels (cached by the content of the data file, its
    images, the settings, the tokenizer and the image processor). ``family``: the pipeline model's."""
    from datasets import Dataset, Features, List, Value  # datasets, PIL: heavy, only for image data
    from PIL import Image

    source, data = spec.data_source(), spec.data
    records, skipped = read_image_records(source, data)
    family = family or model_family(spec.model)
    tok = tokenizer if tokenizer is not None else tokenizer_for(spec.model)
    m = spec.model
    processor = load_image_processor(resolve_model_ref(m.name), m.revision, resolve_env(m.hf_token))
    h = hashlib.sha256(content_hash(source, data, tok).encode())
    h.update(processor.to_json_string().encode())
    for path in sorted({p for _, paths in records for p in paths}):
        h.update(str(path).encode() + path.read_bytes())
    key = h.hexdigest()[:16]
    cache_dir = cache_root() / "data"
    out = cache_dir / key
    if (out / "prepared.json").exists():
        return PreparedData.from_dir(out)

    rows, lengths, full, n_no_target, per_image = [], [], [], 0, []
    for k, (messages, paths) in enumerate(records, 1):
        images = []
        for p in paths:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        try:
            r = family.tokenize(messages, tok, data, RecordImages(images, processor))
        except (DataError, ValueError) as e:
            raise DataError(f"{source}: record {k}: {e}") from None
        if all(label == IGNORE_INDEX for label in r["labels"]):
            n_no_target += 1
            continue
        lengths.append(len(r["input_ids"]))
        full.append(r["full_length"])
        per_image += r.pop("image_tokens")
        r.pop("full_length")
        rows.append(r)
    if not rows:
        raise DataError(f"{source}: every record lost its reply to truncation: raise data.max_seq_len")
    features = Features({"input_ids": List(Value("int64")), "labels": List(Value("int64")),
                         "mm_token_type_ids": List(Value("int8")), "pixel_values": List(List(Value("float32"))),
                         "image_grid_thw": List(List(Value("int64")))})
    ds = Dataset.from_list(rows, features=features)
    if data.val_split > 0 and len(ds) >= 2:
        split = ds.train_test_split(test_size=max(1, round(len(ds) * data.val_split)), seed=data.seed, shuffle=True)
        train, val = split["train"], split["test"]
    else:
        train, val = ds, ds.select([])
    stats = length_stats(lengths, full, data.max_seq_len)
    stats["train_tokens"] = int(sum(len(x) for x in train["input_ids"]))
    stats.update(images=len(per_image), image_tokens_max=max(per_image, default=0),
                 image_tokens_mean=sum(per_image) / len(per_image) if per_image else 0.0,
                 image_max_pixels=data.image_max_pixels or processor.size.longest_edge)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}."))
    train.save_to_disk(str(tmp / "train"))
    val.save_to_disk(str(tmp / "val"))
    prepared = PreparedData(dir=str(out), content_hash=key, n_train=len(train), n_val=len(val), n_skipped=skipped,
                            n_no_target=n_no_target, stats=stats, family=family.name)
    (tmp / "prepared.json").write_text(prepared.to_json())
    try:
        tmp.rename(out)
    except OSError:  # a concurrent prepare of the same content finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData.from_dir(out)


PREPARERS = {"text": prepare_text, "images": prepare_images}  # by Family.records: how a family's records are read


def load_split(prepared: PreparedData, split: str):
    from datasets import load_from_disk  # datasets: heavy, only to read data

    return load_from_disk(str(Path(prepared.dir) / split))


def collate(batch: list[dict], pad_id: int, packed: bool = False) -> dict:
    """A batch of prepared samples as the model's tensors (:func:`fitburst.families.collate`: the samples' family's
    collate, for callers with samples and no model)."""
    return family_collate(batch, pad_id, packed)


def batch_tokens(batch: dict) -> int:
    """Real (non-padding) tokens in a collated batch."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()
