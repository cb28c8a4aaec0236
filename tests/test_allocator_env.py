"""Allocator settings applied on import (unless the user set them), the mode the estimate reads, and one copy of
the model in memory after loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitburst.allocator_env import CUDA_CONF, MPS_RATIO, MPS_RATIO_SETTING, TORCH_CONF, allocator_mode, configure

SHOW = (f"import os, fitburst, fitburst.allocator_env as a; print(os.environ.get({CUDA_CONF!r}), "
        f"os.environ.get({MPS_RATIO!r}), a.allocator_mode())")


def imported(env_updates: dict) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in (CUDA_CONF, TORCH_CONF, MPS_RATIO, MPS_RATIO_SETTING)}
    env.update(env_updates)
    env["PYTHONPATH"] = f"{Path(__file__).parents[1]}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_import_sets_the_defaults_and_keeps_what_the_user_set():
    assert imported({}) == ["expandable_segments:True", "1.0", "expandable_segments"]
    assert imported({CUDA_CONF: "backend:native", MPS_RATIO: "1.4"}) == ["backend:native", "1.4", "default"]
    assert imported({MPS_RATIO_SETTING: "1.2"})[1] == "1.2"  # fitburst's own knob
    # torch's newer name counts as the user's choice too
    assert imported({TORCH_CONF: "max_split_size_mb:128"})[::2] == ["None", "default"]


@pytest.mark.parametrize("env, mode", [
    ({}, "default"),
    ({CUDA_CONF: "expandable_segments:True"}, "expandable_segments"),
    ({CUDA_CONF: "max_split_size_mb:64, expandable_segments:true"}, "expandable_segments"),
    ({CUDA_CONF: "expandable_segments:False"}, "default"),
    ({CUDA_CONF: "expandable_segments:True", TORCH_CONF: "backend:native"}, "default"),  # torch's name wins
])
def test_allocator_mode(env, mode):
    assert allocator_mode(env) == mode
    configured = dict(env)
    configure(configured)
    assert configured.get(CUDA_CONF) == env.get(CUDA_CONF, None if TORCH_CONF in env else "expandable_segments:True")


def load_peak(*args: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{Path(__file__).parents[1]}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("load_peak_child.py")), *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_holds_one_copy_of_the_model():
    """bf16 from an fp32 checkpoint: the peak while loading is one bf16 copy (no fp32 copy kept, none made twice);
    the same measure sees a second copy when there is one."""
    one = load_peak("bf16")
    assert 0.9 < one["peak_bytes"] / one["one_copy_bytes"] < 1.15, one
    two = load_peak("bf16", "--second-copy")
    assert two["peak_bytes"] / two["one_copy_bytes"] > 1.8, two
