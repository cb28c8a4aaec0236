"""Validate's check of a local model folder: a readable config.json of a model type transformers knows (its
configuration table, read only for a local folder: spec loading imports no transformers otherwise)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fitburst.spec import ModelSpec


def model_folder_problems(model: ModelSpec) -> list[str]:
    """A local model folder must hold a readable config.json of a model type transformers knows."""
    p = Path(model.name).expanduser()
    if not (p.is_dir() or model.name.startswith((".", "/", "~")) or model.name.count("/") > 1):
        return []  # a hub id (org/name) or the built-in demo
    if not p.is_dir():
        return [f"no model folder at {p.resolve()} (a local model is a folder saved with save_pretrained; "
                "a hub model is written org/name)"]
    cfg_path = p / "config.json"
    if not cfg_path.exists():
        return [f"{p} has no config.json: point model.name at the folder save_pretrained wrote"]
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return [f"{cfg_path} is not valid JSON ({e}): re-save the model with save_pretrained"]
    model_type = cfg.get("model_type") if isinstance(cfg, dict) else None
    if not isinstance(model_type, str) or not model_type:
        return [f"{cfg_path} has no 'model_type': re-save the model with save_pretrained"]
    if not (model.trust_remote_code and "auto_map" in cfg):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if model_type not in CONFIG_MAPPING_NAMES:
            close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=1)
            hint = f"did you mean '{close[0]}'?" if close else "upgrade transformers, or set trust_remote_code"
            return [f"{cfg_path}: model_type {model_type!r} is unknown to transformers ({hint})"]
    return []
