"""Records as they lie: local .jsonl/.json/.csv/.parquet/.arrow files, folders of them, folders written by
``save_to_disk`` and hub datasets, read row by row with where each row is (a file's line, a row index), columns
renamed to the record fields (``data.columns``). :mod:`fitburst.data` turns them into conversations and samples."""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from fitburst.errors import DataError
from fitburst.spec import DataSpec

log = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
TABLE_BUILDERS = {".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}  # read through datasets' builders
DATA_SUFFIXES = JSON_SUFFIXES + tuple(TABLE_BUILDERS)
MAX_LINE_BYTES = 16 << 20  # a record this long is cut to data.max_seq_len tokens anyway; refuse it before tokenizing


class DataUnreachable(DataError):
    """A hub dataset that cannot be fetched from here (offline, or the hub refused): its records are unknown, not
    known bad."""


def refuse_or_skip(err: DataError, skip_invalid: bool) -> int:
    if not skip_invalid:
        raise DataError(f"{err} (fix it, or set data.skip_invalid: true to count and skip bad records)") from None
    log.warning("skipping %s", err)
    return 1


def map_columns(rec: object, columns: dict[str, str]) -> object:
    """The record with ``data.columns`` applied (record field <- the data's column)."""
    if not columns or not isinstance(rec, dict):
        return rec
    missing = [f"'{col}' (data.columns.{key})" for key, col in columns.items() if col not in rec]
    if missing:
        raise ValueError(f"no column {', '.join(missing)}; this record has {sorted(rec)}")
    out = {k: v for k, v in rec.items() if k not in columns.values()}
    out.update({key: rec[col] for key, col in columns.items()})
    return out


def source_name(source: Path | str, data: DataSpec) -> str:
    if data.dataset is None:
        return str(source)
    return f"{source} ({f'subset {data.subset}, ' if data.subset else ''}split {data.split})"


def raw_records(source: Path | str, data: DataSpec) -> Iterator[tuple[str, object]]:
    """(where, raw record or the exception reading it) for every record of ``source``."""
    if data.dataset is not None or isinstance(source, str):
        yield from _rows(_open_dataset(source, data), source_name(source, data))
        return
    if not source.exists():
        raise DataError(f"{source}: data not found (data.path is relative to pipelines.yaml)")
    if source.is_dir() and is_saved(source):
        yield from _rows(_open_dataset(source, data), str(source))
        return
    if source.is_file() and source.suffix.lower() not in DATA_SUFFIXES:
        raise DataError(f"{source}: data.path must name a .jsonl, .json, .csv, .parquet or .arrow file, a folder "
                        f"of them or a save_to_disk folder; convert the {source.suffix or 'extension-less'} file first")
    files = sorted(f for f in source.rglob("*") if f.is_file() and f.suffix.lower() in DATA_SUFFIXES) \
        if source.is_dir() else [source]
    if not files:
        raise DataError(f"{source}: the folder holds no {', '.join(DATA_SUFFIXES)} files")
    for f in files:
        if f.suffix.lower() in TABLE_BUILDERS:
            yield from _rows(_open_table(f, data.streaming), str(f))
        else:
            yield from _json_records(f)


def is_saved(folder: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return (folder / "state.json").exists() or (folder / "dataset_dict.json").exists()


def _rows(ds, where: str) -> Iterator[tuple[str, object]]:
    for i, rec in enumerate(ds):
        yield f"{where}: row {i}", rec


def _open_table(path: Path, streaming: bool):
    from datasets import Features, Value, load_dataset  # datasets: heavy, only to read data
    from datasets.exceptions import DatasetsError

    kw = {}
    if path.suffix.lower() == ".csv":  # every cell text: a reply "42" stays a string, not an inferred int
        with path.open(newline="", encoding="utf-8-sig", errors="replace") as f:
            kw["features"] = Features({col: Value("string") for col in next(csv.reader(f), [])})
    try:
        return load_dataset(TABLE_BUILDERS[path.suffix.lower()], data_files=str(path), split="train",
                            streaming=streaming, **kw)
    except (DatasetsError, ValueError, OSError) as e:
        cause = e.__cause__ or e
        raise DataError(f"{path}: cannot read it as {path.suffix[1:]}: {type(cause).__name__}: {cause}") from None


def _open_dataset(source: Path | str, data: DataSpec):
    """The split of a saved folder, hub-style folder or hub id (an IterableDataset with ``data.streaming``)."""
    from datasets import DatasetDict, load_dataset, load_from_disk  # datasets: heavy, only to read data
    from datasets.exceptions import DatasetsError

    try:
        if isinstance(source, Path) and is_saved(source):
            ds = load_from_disk(str(source))
            if isinstance(ds, DatasetDict):
                if data.split not in ds:
                    raise ValueError(f"no split {data.split!r} (splits: {', '.join(ds)}): set data.split")
                ds = ds[data.split]
            return ds.to_iterable_dataset() if data.streaming else ds
        ds = load_dataset(str(source), data.subset, split=data.split, revision=data.revision,
                          streaming=data.streaming)
    except (DatasetsError, ValueError, OSError, RuntimeError) as e:  # RuntimeError: the hub client after a failure
        raise load_error(source, data, e) from None
    if data.columns and ds.column_names is not None:
        missing = [f"'{col}' (data.columns.{key})" for key, col in data.columns.items() if col not in ds.column_names]
        if missing:
            raise DataError(f"{source_name(source, data)}: no column {', '.join(missing)}; its columns: "
                            f"{', '.join(ds.column_names)}")
    return ds


def load_error(source: Path | str, data: DataSpec, e: Exception) -> DataError:
    if isinstance(source, str) and isinstance(e, (OSError, RuntimeError)):
        hint = (" (is the hub reachable from here? offline, use a saved or hub-style local folder, or a dataset "
                "already in the datasets cache with HF_HUB_OFFLINE=1)")
        return DataUnreachable(f"{source_name(source, data)}: cannot load the dataset: {e}{hint}")
    return DataError(f"{source_name(source, data)}: cannot load the dataset: {e}")


def _json_records(path: Path) -> Iterator[tuple[str, object]]:
    """A .jsonl/.json file's records with their line (record index for .json); file-level problems raise."""
    with path.open("rb") as f:
        if not any(line.strip() for line in f):
            raise DataError(f"{path}: the file is empty: add records (one JSON object per line) or fix data.path")
    if path.suffix.lower() == ".json":
        raw = path.read_bytes()
        try:
            doc = json.loads(_decode(raw, path, 0))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(doc, list):
            raise DataError(f"{path}: a .json data file must hold a list of records (or write one record per line "
                            "as .jsonl)")
        for i, r in enumerate(doc):
            yield f"{path}: record {i + 1}", r
        return
    with path.open("rb") as f:  # line by line: a large file is never held whole
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield from _json_line(path, lineno, line.rstrip(b"\r\n"))


def _json_line(path: Path, lineno: int, line: bytes) -> Iterator[tuple[str, object]]:
    where = f"{path}:{lineno}"
    if len(line) > MAX_LINE_BYTES:
        yield where, DataError(
            f"the line is {len(line) / (1 << 20):.0f} MiB (limit {MAX_LINE_BYTES >> 20} MiB): a record "
            "that long is cut to data.max_seq_len tokens anyway; split it or drop it")
        return
    try:
        yield where, json.loads(_decode(line, path, lineno))
    except json.JSONDecodeError as e:
        yield where, DataError(f"not valid JSON: {e.msg} (column {e.colno})")
    except DataError as e:
        yield where, e


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


# --- cache keys and length statistics -----------------------------------------------------------------
