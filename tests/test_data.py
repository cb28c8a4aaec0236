"""Data prep: the four record shapes, prompt masking, located errors, deterministic split, content-hash cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitburst.data import IGNORE_INDEX, DataError, prepare, read_records, to_messages
from fitburst.families.causal import tokenize
from fitburst.spec import DataSpec

RECORDS = {
    "messages": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                              {"role": "assistant", "content": "Hello friend"}]},
    "alpaca": {"instruction": "Say hello", "input": "to a friend", "output": "Hello friend"},
    "sharegpt": {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello friend"}]},
    "prompt_completion": {"prompt": "Hi there", "completion": "Hello friend"},
}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", list(RECORDS))
def test_formats_detected_and_end_with_assistant(tmp_path, fmt):
    msgs, skipped = read_records(write_jsonl(tmp_path / "d.jsonl", [RECORDS[fmt]]))
    assert skipped == 0
    assert msgs[0][-1] == {"role": "assistant", "content": "Hello friend"}
    assert msgs[0][-2]["role"] == "user"


def test_json_list_file(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([RECORDS["alpaca"], RECORDS["sharegpt"]]))
    assert len(read_records(p)[0]) == 2


@pytest.mark.parametrize("template", ["auto", "chatml", "alpaca", "none"])
def test_only_the_reply_is_trained(demo_tokenizer, template):
    row = tokenize(to_messages(RECORDS["messages"], "messages"), demo_tokenizer, template, 512, False)
    target = demo_tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
    assert target.startswith("Hello friend")
    assert "Hi there" not in target and "Be brief" not in target
    assert row["labels"][0] == IGNORE_INDEX
    full = tokenize(to_messages(RECORDS["messages"], "messages"), demo_tokenizer, template, 512, True)
    assert full["labels"] == full["input_ids"]


def test_multi_turn_trains_every_assistant_turn(demo_tokenizer):
    conv = {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "first answer"},
                         {"role": "user", "content": "two"}, {"role": "assistant", "content": "second answer"}]}
    row = tokenize(to_messages(conv, "messages"), demo_tokenizer, "chatml", 512, False)
    target = demo_tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
    assert "first answer" in target and "second answer" in target and "two" not in target


def test_bad_record_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [RECORDS["alpaca"], "", '{"instruction": "x"', {"prompt": 3}])
    with pytest.raises(DataError, match=r"d.jsonl:3: not valid JSON.*skip_invalid"):
        read_records(p)
    with pytest.raises(DataError, match=r"e.jsonl:2: .*prompt"):
        read_records(write_jsonl(tmp_path / "e.jsonl", [RECORDS["alpaca"], {"prompt": 3, "completion": "x"}]))
    msgs, skipped = read_records(p, skip_invalid=True)
    assert (len(msgs), skipped) == (1, 2)


def test_missing_file_and_empty_reply(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="non-empty assistant reply"):
        read_records(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": ""}]))


def test_prepare_split_stats_and_cache(tmp_path, demo_tokenizer):
    rows = [{"instruction": f"Add {i} and {i}.", "output": f"{i} + {i} = {2 * i}."} for i in range(50)]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    spec = DataSpec(path=str(p), val_split=0.2, max_seq_len=20)
    a = prepare(spec, p, demo_tokenizer, tmp_path / "cache")
    assert (a.n_train, a.n_val) == (40, 10)
    assert a.stats["max"] <= 20 and a.stats["p50"] <= a.stats["p95"] <= a.stats["max"]
    b = prepare(spec, p, demo_tokenizer, tmp_path / "cache")
    assert b.dir == a.dir  # cache hit: same content, same settings
    c = prepare(spec.model_copy(update={"seed": 7}), p, demo_tokenizer, tmp_path / "cache")
    assert c.dir != a.dir
    from fitburst.data import load_split

    assert load_split(a, "val")["input_ids"] == load_split(b, "val")["input_ids"]
    assert load_split(a, "val")["input_ids"] != load_split(c, "val")["input_ids"]


def test_truncation_that_removes_the_reply_is_reported(tmp_path, demo_tokenizer):
    rows = [{"instruction": "word " * 40, "output": "ok"}, {"instruction": "short", "output": "fine"}]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    prepared = prepare(DataSpec(path=str(p), val_split=0.0, max_seq_len=16), p, demo_tokenizer, tmp_path / "c")
    assert prepared.n_no_target == 1 and prepared.n_train == 1
    assert prepared.stats["n_truncated"] == 1


# --- assistant-only masks on real chat templates (tokenizer folders in tests/fixtures/tokenizers) -------------------

TOKENIZERS = Path(__file__).parent / "fixtures" / "tokenizers"
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "Give me two colours."},
        {"role": "assistant", "content": "Red and blue."},
        {"role": "user", "content": "And one more?"},
        {"role": "assistant", "content": "Green."}]


def labelled_runs(row) -> list[list[int]]:
    runs, run = [], []
    for tok, label in zip(row["input_ids"], row["labels"], strict=True):
        if label != IGNORE_INDEX:
            assert label == tok
            run.append(tok)
        elif run:
            runs, run = runs + [run], []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("name, eot", [("qwen3-style", "<|im_end|>"), ("llama3-style", "<|eot_id|>"),
                                       ("llama3-style-generation", "<|eot_id|>")])
def test_masks_hold_exactly_the_assistant_tokens(name, eot):
    """Each labelled run is one reply and its end-of-turn token, nothing of the user's turns or the headers: by
    content search where history changes the rendering (qwen3), by verified prefixes (llama3), by the tokenizer's
    own {% generation %} mask (llama3-generation)."""
    from fitburst.models import load_tokenizer

    tok = load_tokenizer(str(TOKENIZERS / name))
    row = tokenize(CHAT, tok, "auto", 512, False)
    replies = [m["content"] + eot for m in CHAT if m["role"] == "assistant"]
    assert [tok.decode(run) for run in labelled_runs(row)] == replies
    assert tok.decode(row["input_ids"]).count("What is the capital") == 1


def test_history_dependent_template_is_detected(demo_tokenizer):
    """The Qwen3-style template renders an earlier reply without the <think> block it gets as the last turn, so
    the rendered prefixes are not prefixes of the whole text (the old spans ran into the next user turn)."""
    from fitburst.families.chat import _prefix_spans
    from fitburst.models import load_tokenizer

    qwen = load_tokenizer(str(TOKENIZERS / "qwen3-style"))
    text = qwen.apply_chat_template(CHAT, tokenize=False)
    assert "<think>" in text and _prefix_spans(CHAT, qwen, {}, text) is None
    assert _prefix_spans(CHAT, demo_tokenizer, {}, demo_tokenizer.apply_chat_template(CHAT, tokenize=False))


def test_template_that_rewrites_replies_fails_with_a_located_message(tmp_path):
    from fitburst.models import load_tokenizer

    tok = load_tokenizer(str(TOKENIZERS / "qwen3-style"))
    tok.chat_template = tok.chat_template.replace("m['content'] }}", "m['content'] | upper }}")
    p = write_jsonl(tmp_path / "d.jsonl", [RECORDS["messages"], {"messages": CHAT}])
    with pytest.raises(DataError, match=r"d.jsonl: record 2: messages\[6\] \(assistant\).*verbatim"):
        prepare(DataSpec(path=str(p), val_split=0.0), p, tok, tmp_path / "c")


def test_a_token_belongs_to_a_reply_by_where_its_characters_start_or_where_an_empty_one_ends():
    from fitburst.families.causal import in_replies

    spans = [(30, 40), (10, 20)]  # two replies, given out of order
    offsets = [(0, 5), (9, 11), (10, 12), (18, 22), (20, 21), (10, 10), (20, 20), (25, 25), (35, 35), (40, 40),
               (41, 41), (39, 45)]
    assert in_replies(offsets, spans) == [False, False, True, True, False, True, True, False, True, True,
                                          False, True]
    assert in_replies(offsets, []) == [False] * len(offsets)
