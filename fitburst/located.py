"""Located errors: where each key of a YAML file is (its line), and pydantic's errors said in the file's words
(the field, the value, a close name for a misspelt key). :mod:`fitburst.spec` builds its SpecError from them."""

from __future__ import annotations

import copy
import difflib
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import ErrorDetails


def compose_lines(text: str) -> dict[tuple, int]:
    """Map every key path of a YAML document to its 1-based line number."""
    lines: dict[tuple, int] = {}

    def walk(node: yaml.Node, path: tuple) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value
                lines[path + (key,)] = k.start_mark.line + 1
                walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, path + (i,))

    root = yaml.compose(text)
    if root is not None:
        walk(root, ())
    return lines


def deep_merge(base: dict, over: dict) -> dict:
    """``over`` merged into a copy of ``base``, mappings key by key."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the field at ``loc`` (a path inside ``root``)."""
    model: Any = root
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def explain(root: type[BaseModel], err: ErrorDetails, where: str, source: str) -> str:
    """One pydantic error of a ``root`` model as a line of a SpecError: ``where`` (the line), the field, ``source``
    (" (from overrides)"), the value and what is wrong."""
    loc = tuple(p for p in err["loc"] if p not in ("function-after",))
    field = ".".join(str(p) for p in loc) or "(pipeline)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        owner = _model_at(root, loc)
        known = list(owner.model_fields) if owner else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known fields: {', '.join(known)}"
        return f"{where}unknown field '{field}'{source} ({hint})"
    if err["type"] == "missing":
        return f"{where}field '{field}' is required"
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    return f"{where}field '{field}'{source}{shown}: {msg}"
