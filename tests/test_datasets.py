"""Data from where it lives, through ``datasets``: csv/parquet/arrow files and folders, save_to_disk folders, hub-style
dataset folders (subset, split), streaming, ``data.columns``; every problem located by source and row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from datasets import Dataset, DatasetDict

from fitburst.data import DataError, load_split, prepare, prepare_pipeline, read_records
from fitburst.spec import DataSpec, SpecError, load_pipeline

ROWS = [{"question": f"Add {a} and {a + 1}.", "answer": f"{2 * a + 1}"} for a in range(40)]
COLUMNS = {"prompt": "question", "completion": "answer"}


def demo_rows() -> list[dict]:
    root = Path(__file__).resolve().parents[1]
    return [json.loads(line) for line in (root / "fitburst/demo/instructions.jsonl").read_text().splitlines()]


def hub_folder(tmp_path: Path) -> Path:
    """A hub-style dataset repo: two subsets (README configs), each with train and test parquet files."""
    repo = tmp_path / "org-set"
    for subset, rows in (("plain", ROWS), ("shout", [{**r, "answer": r["answer"] + "!"} for r in ROWS])):
        (repo / subset).mkdir(parents=True)
        Dataset.from_list(rows[:30]).to_parquet(repo / subset / "train.parquet")
        Dataset.from_list(rows[30:]).to_parquet(repo / subset / "test.parquet")
    configs = [{"config_name": s, "data_files": [{"split": "train", "path": f"{s}/train.parquet"},
                                                  {"split": "test", "path": f"{s}/test.parquet"}]}
               for s in ("plain", "shout")]
    (repo / "README.md").write_text("---\n" + yaml.safe_dump({"configs": configs}) + "---\n# a test set\n")
    return repo


def write_pipeline(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "pipelines.yaml"
    p.write_text(yaml.safe_dump({"pipelines": {"case": {
        "model": {"name": "fitburst/tiny-demo"}, "data": {"max_seq_len": 64, **data}, "training": {"max_steps": 2}}}}))
    return p


@pytest.mark.parametrize("suffix", ["csv", "parquet", "arrow"])
def test_table_files_read_with_column_mapping(tmp_path, suffix):
    ds = Dataset.from_list(ROWS)
    path = tmp_path / f"d.{suffix}"
    if suffix == "csv":
        ds.to_csv(path, index=False)
    elif suffix == "parquet":
        ds.to_parquet(path)
    else:
        _write_arrow(ds, path)
    msgs, skipped = read_records(path, data=DataSpec(path=str(path), columns=COLUMNS))
    assert skipped == 0 and len(msgs) == len(ROWS)
    assert msgs[3] == [{"role": "user", "content": "Add 3 and 4."}, {"role": "assistant", "content": "7"}]
    with pytest.raises(DataError, match=rf"d\.{suffix}: row 0: cannot tell the format from keys \['answer', 'qu"):
        read_records(path)


def _write_arrow(ds: Dataset, path: Path) -> None:
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, ds.data.schema) as writer:
        writer.write_table(ds.data.table)


def test_bad_row_in_a_parquet_file_is_located(tmp_path):
    rows = [{"prompt": "a", "completion": "b"}] * 3 + [{"prompt": "c", "completion": None}]
    path = tmp_path / "d.parquet"
    Dataset.from_list(rows).to_parquet(path)
    with pytest.raises(DataError, match=r"d\.parquet: row 3: 'prompt' and 'completion' must be strings.*skip_invalid"):
        read_records(path)
    assert read_records(path, skip_invalid=True)[1] == 1


def test_folder_of_files_keeps_each_files_lines(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in demo_rows()[:5]) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(demo_rows()[5]) + "\n{\"instruction\": \"x\"}\n")
    with pytest.raises(DataError, match=r"b\.jsonl:2: cannot tell the format"):
        read_records(tmp_path)
    (tmp_path / "b.jsonl").write_text(json.dumps(demo_rows()[5]) + "\n")
    assert len(read_records(tmp_path)[0]) == 6


def test_saved_dataset_folder_and_split(tmp_path):
    DatasetDict({"train": Dataset.from_list(ROWS[:10]), "extra": Dataset.from_list(ROWS[10:13])}).save_to_disk(
        tmp_path / "saved")
    data = DataSpec(dataset="saved", split="extra", columns=COLUMNS)
    msgs, _ = read_records(tmp_path / "saved", data=data)
    assert [m[1]["content"] for m in msgs] == ["21", "23", "25"]
    with pytest.raises(DataError, match=r"no split 'dev' \(splits: train, extra\)"):
        read_records(tmp_path / "saved", data=data.model_copy(update={"split": "dev"}))


def test_hub_style_folder_subset_and_split_feed_a_pipeline(tmp_path, demo_tokenizer):
    repo = hub_folder(tmp_path)
    spec = load_pipeline(write_pipeline(tmp_path, {"dataset": repo.name, "subset": "shout", "split": "train",
                                                   "columns": COLUMNS, "val_split": 0.2}), "case")
    assert spec.data_source() == repo
    prepared = prepare_pipeline(spec, demo_tokenizer)
    assert (prepared.n_train, prepared.n_val) == (24, 6)
    text = demo_tokenizer.decode(load_split(prepared, "train")[0]["input_ids"])
    assert "!" in text  # the shout subset, not plain
    plain = prepare_pipeline(spec.model_copy(update={"data": spec.data.model_copy(update={"subset": "plain"})}),
                             demo_tokenizer)
    assert plain.content_hash != prepared.content_hash
    bad = spec.data.model_copy(update={"split": "validation"})
    with pytest.raises(DataError, match=r"org-set \(subset shout, split validation\): cannot load the dataset"):
        read_records(repo, data=bad)
    cols = spec.data.model_copy(update={"columns": {"prompt": "q", "completion": "answer"}})
    with pytest.raises(DataError, match=r"no column 'q' \(data.columns.prompt\); its columns: question, answer"):
        read_records(repo, data=cols)


def test_streaming_matches_in_memory_prepare(tmp_path, demo_tokenizer):
    path = tmp_path / "d.parquet"
    Dataset.from_list(demo_rows()).to_parquet(path)
    data = DataSpec(path=str(path), max_seq_len=64, val_split=0.25)
    whole = prepare(data, path, demo_tokenizer, tmp_path / "cache")
    streamed = prepare(data.model_copy(update={"streaming": True}), path, demo_tokenizer, tmp_path / "cache")
    assert streamed.content_hash != whole.content_hash
    assert streamed.n_train + streamed.n_val == whole.n_train + whole.n_val == len(demo_rows())
    assert 0.15 < streamed.n_val / len(demo_rows()) < 0.35  # the seeded per-record draw
    rows = {tuple(r["input_ids"]) for s in ("train", "val") for r in load_split(streamed, s)}
    assert rows == {tuple(r["input_ids"]) for s in ("train", "val") for r in load_split(whole, s)}
    assert streamed.stats["total_tokens"] == whole.stats["total_tokens"]


def test_streaming_refuses_a_bad_row_with_its_location(tmp_path, demo_tokenizer):
    rows = demo_rows()[:20]
    rows[17] = {"instruction": "", "output": "x"}
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = load_pipeline(write_pipeline(tmp_path, {"path": "d.jsonl", "streaming": True, "format": "alpaca"}),
                         "case")
    with pytest.raises(DataError, match=r"d\.jsonl:18: alpaca records need a non-empty 'instruction'"):
        prepare_pipeline(spec, demo_tokenizer)


@pytest.mark.parametrize(("data", "expect"), [
    ({"path": "d.jsonl", "dataset": "org/set"}, "line 3: field 'data': set exactly one of data.path"),
    ({"path": "d.jsonl", "columns": {"instrucion": "q"}}, "line 4: field 'data.columns': 'instrucion' is not a "
                                                          "record field (did you mean 'instruction'?)"),
    ({"path": "d.jsonl", "subset": "x"}, "subset and revision belong to a hub dataset"),
    ({"dataset": "./nothere"}, "field 'data.dataset' (got './nothere'): folder not found"),
])
def test_validator_locates_new_data_fields(tmp_path, data, expect):
    (tmp_path / "d.jsonl").write_text(json.dumps(demo_rows()[0]) + "\n")
    with pytest.raises(SpecError) as e:
        load_pipeline(write_pipeline(tmp_path, data), "case")
    assert expect in str(e.value)


@pytest.mark.parametrize("streaming", [False, True])
def test_every_reply_truncated_away_is_one_located_message(tmp_path, demo_tokenizer, streaming):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "word " * 80, "completion": "yes"}) for _ in range(5)) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl: every record lost its reply to truncation"):
        prepare(DataSpec(path=str(path), max_seq_len=16, streaming=streaming), path, demo_tokenizer, tmp_path / "c")
