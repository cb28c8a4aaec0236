"""Configs from the hub: config.json only, at the asked revision, cached; offline and unsupported models get one
clear message. The hub is a local HTTP server speaking the hub's resolve protocol (HF_ENDPOINT)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fitburst.memory.shapes import ModelConfigError, ModelShape

REPO = Path(__file__).resolve().parents[1]
QWEN3 = {**json.loads((REPO / "fitburst/configs/qwen2.5-0.5b.json").read_text()), "model_type": "qwen3",
         "head_dim": 64}


@pytest.fixture()
def hub():
    """A local hub: serves acme/tiny-qwen3 config.json at main (24 layers) and v2 (12 layers); records requests."""
    files = {("acme/tiny-qwen3", "main"): QWEN3, ("acme/tiny-qwen3", "v2"): {**QWEN3, "num_hidden_layers": 12}}
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802
            self._send(False)

        def do_GET(self):  # noqa: N802
            self._send(True)

        def _send(self, body: bool) -> None:
            seen.append(self.path)
            parts = self.path.split("/")  # /acme/tiny-qwen3/resolve/<revision>/<file>
            cfg = files.get(("/".join(parts[1:3]), parts[4])) if len(parts) > 5 else None
            if cfg is None or parts[5] != "config.json":
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.end_headers()
                return
            data = json.dumps(cfg).encode()
            self.send_response(200)
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", hashlib.sha1(parts[4].encode()).hexdigest())
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}", seen
    srv.shutdown()


def _run(code_or_args: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # conftest sets it for the whole suite
    e.update(HF_HUB_CACHE=str(tmp_path / "hf"), PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, *code_or_args], env=e, capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def test_hub_config_is_fetched_at_its_revision_and_cached(hub, tmp_path):
    url, seen = hub
    code = ("from fitburst.memory import load_shape; a = load_shape('acme/tiny-qwen3'); "
            "b = load_shape('acme/tiny-qwen3', 'v2'); print(a.layers, b.layers, a.qk_norm)")
    r = _run(["-c", code], tmp_path, HF_ENDPOINT=url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["24", "12", "True"]
    assert {p.split("/")[-1] for p in seen} == {"config.json"}  # never weights
    assert any("/resolve/v2/" in p for p in seen)
    # from the cache alone, offline
    r = _run(["-c", code], tmp_path, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="1")
    assert r.returncode == 0 and r.stdout.split() == ["24", "12", "True"], r.stderr


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_estimate_of_an_unbundled_hub_model_offline_says_how_to_fix_it(env, tmp_path):
    r = _run(["-m", "fitburst.cli", "estimate", "--model", "Qwen/Qwen3-8B", "--device", "A6000"], tmp_path, **env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "cannot fetch config.json of 'Qwen/Qwen3-8B'" in r.stderr
    assert "local folder or config.json" in r.stderr and "hf download Qwen/Qwen3-8B config.json" in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr  # one message: none of huggingface_hub's retry warnings


def test_unsupported_and_mixture_of_experts_configs_are_refused():
    neox = {"model_type": "gpt_neox", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 8,
            "intermediate_size": 8192, "vocab_size": 50304}
    with pytest.raises(ModelConfigError, match="model_type 'gpt_neox' is not one the analytic estimate models"):
        ModelShape.from_config(neox, name="EleutherAI/pythia-1b")
    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8,
               "num_experts_per_tok": 2}
    # Mixtral / Qwen-MoE are counted (tests/test_families.py); other MoE types are refused, never estimated dense
    with pytest.raises(ModelConfigError, match="mixture-of-experts model \\(8 experts\\)"):
        ModelShape.from_config({**mixtral, "model_type": "olmoe"}, name="allenai/OLMoE-1B-7B")
    # a MoE config under a dense model_type is still refused
    with pytest.raises(ModelConfigError, match="mixture-of-experts"):
        ModelShape.from_config({**mixtral, "model_type": "llama"}, name="x")
