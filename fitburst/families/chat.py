"""Chat templates: a conversation rendered to text with the character spans of its replies, for the families whose
samples are conversations (causal, vision-language)."""

from __future__ import annotations

import re

from fitburst.errors import DataError
from fitburst.spec import CHATML_TEMPLATE

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_template_kwargs(tokenizer, template: str) -> dict:
    """``apply_chat_template`` arguments for ``data.template`` auto/chatml: the tokenizer's own template, or ChatML."""
    if template == "chatml" or not getattr(tokenizer, "chat_template", None):
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

