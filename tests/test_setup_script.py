"""scripts/setup.sh chooses the torch build by rule, run against a stub venv whose pip records what it was asked
(no real install): the CPU build pinned (+cpu) where there is no NVIDIA GPU, from the configured sources first and
PyTorch's CPU index only when they lack it; the index's torch where a GPU is; a torch already there is kept. uv
(installed by pip) installs fitburst's packages, and pip does where uv fails; neither compiles; compileall compiles
the venv's packages once they are in."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

STUB_PYTHON = """#!/usr/bin/env bash
case "$*" in *"import torch"*) [ -n "${STUB_HAS_TORCH:-}" ] || exit 1; echo 2.13.0+cu128;; esac
case "$*" in *sysconfig*) echo /stub/site;; *compileall*) echo "python $*" >> "$STUB_LOG";; esac
exit 0
"""
COMPILE = "python -m compileall -q -j 0 /stub/site fitburst flows tasks tests"  # the venv's and fitburst's, once
STUB_PIP = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
case "$*" in *"+cpu"*) case "$*" in *extra-index-url*) ;; *) [ -n "${STUB_LOCAL_CPU:-}" ] || exit 1;; esac;; esac
exit 0
"""
STUB_UV = """#!/usr/bin/env bash
echo "uv $*" >> "$STUB_LOG"
exit ${STUB_UV_EXIT:-0}
"""
UV = "install -q --no-compile uv"
PIP_PACKAGES = "install -q --no-compile -e .[dev]"


def uv_packages(tmp_path: Path) -> str:
    return f"uv pip install -q --python {tmp_path / 'venv/bin/python'} -e .[dev]"


def setup_sh(tmp_path: Path, gpu: bool, **env: str) -> list[str]:
    venv, bin_ = tmp_path / "venv", tmp_path / "bin"
    for folder, name, text in ((venv / "bin", "python", STUB_PYTHON), (venv / "bin", "pip", STUB_PIP),
                               (venv / "bin", "uv", STUB_UV),
                               (bin_, "nvidia-smi", f"#!/usr/bin/env bash\nexit {0 if gpu else 9}\n")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    log = tmp_path / "pip.log"
    proc = subprocess.run(["bash", str(REPO / "scripts/setup.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FITBURST_VENV": str(venv), "STUB_LOG": str(log),
                               "PATH": f"{bin_}:/usr/bin:/bin", **env})
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines()


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="the CPU-build rule is Linux's")
def test_no_gpu_pins_the_cpu_build_from_configured_sources_first(tmp_path):
    calls = setup_sh(tmp_path, gpu=False, STUB_LOCAL_CPU="1")
    assert calls == ["install -q --no-compile torch==2.13.0+cpu", UV, uv_packages(tmp_path), COMPILE]


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="the CPU-build rule is Linux's")
def test_no_gpu_and_no_local_cpu_wheel_adds_the_pytorch_cpu_index(tmp_path):
    calls = setup_sh(tmp_path, gpu=False)
    assert calls == ["install -q --no-compile torch==2.13.0+cpu",
                     "install -q --no-compile torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu",
                     UV, uv_packages(tmp_path), COMPILE]


def test_a_gpu_gets_the_index_torch_and_an_installed_torch_is_kept(tmp_path):
    assert setup_sh(tmp_path, gpu=True)[0] == "install -q --no-compile torch==2.13.0"
    (tmp_path / "pip.log").unlink()
    assert setup_sh(tmp_path, gpu=False, STUB_HAS_TORCH="1") == [UV, uv_packages(tmp_path), COMPILE]


def test_pip_installs_the_packages_where_uv_fails(tmp_path):
    calls = setup_sh(tmp_path, gpu=False, STUB_HAS_TORCH="1", STUB_UV_EXIT="2")
    assert calls == [UV, uv_packages(tmp_path), PIP_PACKAGES, COMPILE]
