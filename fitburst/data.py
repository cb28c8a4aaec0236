"""Data prep: read JSONL/JSON fine-tuning records, apply the chat template, mask prompts, split, cache.

Accepted shapes (``format: auto`` detects them per file from the first record):
- ``messages``: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}``
- ``alpaca``: ``{"instruction": ..., "input": ..., "output": ...}``
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fitburst.errors import UserError
from fitburst.spec import DataSpec

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "model": "assistant"}
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


class DataError(UserError, ValueError):
    """A record or file that cannot be used; the message names file and line."""


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dir(cls, path: str | Path) -> PreparedData:
        d = json.loads((Path(path) / "prepared.json").read_text())
        d["dir"] = str(Path(path))
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
    raise ValueError(f"cannot tell the format from keys {sorted(record)}: expected messages, conversations, "
                     "instruction/output or prompt/completion")


def to_messages(record: dict, fmt: str) -> list[dict]:
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
    else:
        raise ValueError(f"unknown format {fmt!r}")
    if out[-1]["role"] != "assistant" or not out[-1]["content"]:
        raise ValueError("the last turn must be a non-empty assistant reply (nothing to learn otherwise)")
    return out


DATA_SUFFIXES = (".jsonl", ".ndjson", ".json")
MAX_LINE_BYTES = 16 << 20  # a record this long is cut to data.max_seq_len tokens anyway; refuse it before tokenizing


def read_records(path: Path, fmt: str = "auto", skip_invalid: bool = False) -> tuple[list[list[dict]], int]:
    """Read a .jsonl or .json file into message lists; a bad record raises DataError with its line number
    unless ``skip_invalid`` (then it is counted and logged)."""
    if not path.exists():
        raise DataError(f"{path}: data file not found (data.path is relative to pipelines.yaml)")
    if path.suffix.lower() not in DATA_SUFFIXES:
        raise DataError(f"{path}: data.path must name a .jsonl or .json file (one JSON record per line, or a JSON "
                        f"list of records); convert the {path.suffix or 'extension-less'} file first")
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"{path}: the file is empty: add records (one JSON object per line) or fix data.path")
    items: list[tuple[int, object]] = []
    if path.suffix.lower() == ".json":
        try:
            doc = json.loads(_decode(raw, path, 0))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(doc, list):
            raise DataError(f"{path}: a .json data file must hold a list of records (or write one record per line "
                            "as .jsonl)")
        items = [(i + 1, r) for i, r in enumerate(doc)]  # record index, not line
    else:
        for lineno, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue
            if len(line) > MAX_LINE_BYTES:
                items.append((lineno, DataError(
                    f"the line is {len(line) / (1 << 20):.0f} MiB (limit {MAX_LINE_BYTES >> 20} MiB): a record "
                    "that long is cut to data.max_seq_len tokens anyway; split it or drop it")))
                continue
            try:
                items.append((lineno, json.loads(_decode(line, path, lineno))))
            except json.JSONDecodeError as e:
                items.append((lineno, DataError(f"not valid JSON: {e.msg} (column {e.colno})")))
            except DataError as e:
                items.append((lineno, e))
    out, skipped = [], 0
    for lineno, rec in items:
        try:
            if isinstance(rec, Exception):
                raise rec
            f = detect_format(rec) if fmt == "auto" and isinstance(rec, dict) else fmt
            out.append(to_messages(rec, f))
        except ValueError as e:
            msg = f"{path}: record {lineno}: {e}" if path.suffix == ".json" else f"{path}:{lineno}: {e}"
            if not skip_invalid:
                hint = " (fix it, or set data.skip_invalid: true to count and skip bad records)"
                raise DataError(msg + hint) from None
            log.warning("skipping %s", msg)
            skipped += 1
    if not out:
        raise DataError(f"{path}: no usable records")
    return out, skipped


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    """UTF-8 text (a leading BOM dropped); a DataError naming the line and the bad byte otherwise."""
    try:
        return raw.decode("utf-8-sig" if lineno <= 1 else "utf-8")
    except UnicodeDecodeError as e:
        where = lineno or raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        msg = (f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {col}): re-save the file as UTF-8, e.g. "
               "`iconv -f latin1 -t utf-8`")
        if lineno:
            raise DataError(msg) from None
        raise DataError(f"{path}:{where}: {msg}") from None


# --- tokenization -----------------------------------------------------------------------------------

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_template_kwargs(tokenizer, template: str) -> dict:
    """``apply_chat_template`` arguments for ``data.template`` auto/chatml: the tokenizer's own template, or ChatML."""
    if template == "chatml" or not getattr(tokenizer, "chat_template", None):
        from fitburst.models import CHATML_TEMPLATE

        return {"chat_template": CHATML_TEMPLATE}
    return {}


def render(messages: list[dict], tokenizer, template: str) -> tuple[str, list[tuple[int, int]], bool]:
    """Render a conversation to text; return it, the character spans of assistant replies, and whether the
    text already carries the model's special tokens.

    With a chat template, each reply runs from the end of the rendered prompt before it to the end of the rendered
    conversation up to it, where both renderings really are prefixes of the whole text. Templates that render
    history differently (Qwen3 gives only the turns after the last user turn a ``<think>`` block) fail that check;
    the replies are then located by their content in the whole text (plus the end-of-turn token right after)."""
    if template in ("auto", "chatml"):
        kw = chat_template_kwargs(tokenizer, template)
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
        spans = _prefix_spans(messages, tokenizer, kw, text)
        if spans is None:
            spans = _content_spans(messages, text, tokenizer.eos_token)
        return text, spans, True
    eos = tokenizer.eos_token or ""
    text, spans = "", []
    for m in messages:
        if m["role"] == "assistant":
            spans.append((len(text), len(text) + len(m["content"]) + len(eos)))
            text += m["content"] + eos + "\n"
        elif template == "alpaca":
            text += ALPACA_PROMPT.format(instruction=m["content"])
        else:
            text += m["content"] + "\n"
    return text, spans, False


def _prefix_spans(messages: list[dict], tokenizer, kw: dict, text: str) -> list[tuple[int, int]] | None:
    """Reply spans from rendered prefixes, or None where a rendered prefix is not a prefix of ``text``."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **kw)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, **kw)
        if not (text.startswith(prompt) and text.startswith(upto)):
            return None
        spans.append((len(prompt), len(upto)))
    return spans


def _content_spans(messages: list[dict], text: str, eos: str | None) -> list[tuple[int, int]]:
    """Reply spans found by content: turns are searched from the last backwards (so a reply that also occurs in a
    header or an earlier turn is found where it really is); a reply takes the end-of-turn token right after it."""
    spans, limit = [], len(text)
    for i in range(len(messages) - 1, -1, -1):
        content = messages[i]["content"].strip()  # templates often trim
        if not content:
            continue
        at = text.rfind(content, 0, limit)
        if at < 0:
            raise DataError(f"messages[{i}] ({messages[i]['role']}): the chat template does not render this turn's "
                            "content verbatim, so its reply tokens cannot be located; set data.template: chatml, or "
                            "give the tokenizer a template with {% generation %} blocks")
        if messages[i]["role"] == "assistant":
            end = at + len(content)
            if eos and text.startswith(eos, end):
                end += len(eos)
            spans.append((at, end))
        limit = at
    return spans[::-1]


def tokenize(messages: list[dict], tokenizer, template: str, max_seq_len: int, train_on_prompt: bool) -> dict:
    """Token ids and labels (prompt tokens set to -100 unless ``train_on_prompt``), truncated to max_seq_len.

    A chat template with ``{% generation %}`` blocks gives its own assistant-token mask
    (``return_assistant_tokens_mask``); otherwise :func:`render` finds the reply spans."""
    kw = chat_template_kwargs(tokenizer, template) if template in ("auto", "chatml") else None
    if kw is not None and GENERATION_TAG.search(kw.get("chat_template") or tokenizer.chat_template):
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kw)
        ids, keep = list(enc["input_ids"]), [bool(k) for k in enc["assistant_masks"]]
    else:
        text, spans, has_special = render(messages, tokenizer, template)
        enc = tokenizer(text, add_special_tokens=not has_special, return_offsets_mapping=True)
        ids = enc["input_ids"]
        keep = [any(a <= s < b for a, b in spans) or (s == e and any(a < e <= b for a, b in spans))
                for s, e in enc["offset_mapping"]]
    labels = [tok if (train_on_prompt or inside) else IGNORE_INDEX for tok, inside in zip(ids, keep, strict=True)]
    return {"input_ids": ids[:max_seq_len], "labels": labels[:max_seq_len], "full_length": len(ids)}


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def content_hash(path: Path, data: DataSpec, tokenizer) -> str:
    h = hashlib.sha256(path.read_bytes())
    h.update(data.model_dump_json(exclude={"path"}).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()[:16]


def length_stats(lengths: list[int], full_lengths: list[int], max_seq_len: int) -> dict:
    import numpy as np

    a = np.array(lengths)
    return {
        "p50": int(np.percentile(a, 50)), "p95": int(np.percentile(a, 95)), "max": int(a.max()),
        "mean": float(a.mean()), "total_tokens": int(a.sum()),
        "n_truncated": int(sum(f > max_seq_len for f in full_lengths)), "max_seq_len": max_seq_len,
    }


def prepare(data: DataSpec, data_path: Path, tokenizer, cache_dir: Path,
            records: tuple[list[list[dict]], int] | None = None) -> PreparedData:
    """Tokenize and split ``data_path``; reuse the cached result when file, settings and tokenizer match.
    ``records``: :func:`read_records` of the file when the caller has read it already."""
    from datasets import Dataset

    key = content_hash(data_path, data, tokenizer)
    out = cache_dir / key
    if (out / "prepared.json").exists():
        log.info("data cache hit %s", out)
        return PreparedData.from_dir(out)

    conversations, skipped = records or read_records(data_path, data.format, data.skip_invalid)
    rows = []
    for k, messages in enumerate(conversations, 1):
        try:
            rows.append(tokenize(messages, tokenizer, data.template, data.max_seq_len, data.train_on_prompt))
        except DataError as e:
            raise DataError(f"{data_path}: record {k}: {e}") from None
    no_target = sum(all(label == IGNORE_INDEX for label in r["labels"]) for r in rows)
    if no_target:
        log.warning("%d record(s) have no target tokens left after truncation to %d and are left out",
                    no_target, data.max_seq_len)
    rows = [r for r in rows if any(label != IGNORE_INDEX for label in r["labels"])]
    if not rows:
        raise DataError(f"{data_path}: every record lost its reply to truncation: raise data.max_seq_len")
    ds = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    if data.val_split > 0 and len(ds) >= 2:
        n_val = max(1, round(len(ds) * data.val_split))
        split = ds.train_test_split(test_size=n_val, seed=data.seed, shuffle=True)
        train, val = split["train"], split["test"]
    else:
        train, val = ds, ds.select([])
    stats = length_stats([len(r["input_ids"]) for r in rows], [r["full_length"] for r in rows], data.max_seq_len)
    stats["train_tokens"] = int(sum(len(x) for x in train["input_ids"]))

    import tempfile

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}."))
    train.save_to_disk(str(tmp / "train"))
    val.save_to_disk(str(tmp / "val"))
    prepared = PreparedData(dir=str(out), content_hash=key, n_train=len(train), n_val=len(val),
                            n_skipped=skipped, n_no_target=no_target, stats=stats)
    (tmp / "prepared.json").write_text(prepared.to_json())
    try:
        tmp.rename(out)
    except OSError:  # a concurrent prepare of the same content finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedData.from_dir(out)


def prepare_pipeline(spec, tokenizer=None) -> PreparedData:
    """:func:`prepare` for a pipeline: its data file and settings, its model's tokenizer, the shared cache."""
    from fitburst.models import cache_root, tokenizer_for

    records = read_records(spec.data_path(), spec.data.format, spec.data.skip_invalid)  # bad data: before any load
    tok = tokenizer if tokenizer is not None else tokenizer_for(spec.model)
    return prepare(spec.data, spec.data_path(), tok, cache_root() / "data", records=records)


def load_split(prepared: PreparedData, split: str):
    from datasets import load_from_disk

    return load_from_disk(str(Path(prepared.dir) / split))


def collate(batch: list[dict], pad_id: int) -> dict:
    """Pad a batch to its longest sample (right padding); labels padded with -100."""
    import torch

    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, b in enumerate(batch):
        k = len(b["input_ids"])
        ids[i, :k] = torch.tensor(b["input_ids"])
        labels[i, :k] = torch.tensor(b["labels"])
        mask[i, :k] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
