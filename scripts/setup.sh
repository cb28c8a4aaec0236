#!/usr/bin/env bash
# Create ./.venv (or $FITBURST_VENV) and install fitburst with its dev tools. Idempotent.
#
# torch (version $FITBURST_TORCH, default 2.13.0) is installed first, only when the venv has none, so a CUDA torch
# you installed yourself is kept. Which build:
#   - an NVIDIA GPU (nvidia-smi lists one) or macOS: torch from your configured index (PyPI's Linux wheel is the
#     CUDA build, macOS's has MPS);
#   - Linux without one: the CPU build, pinned as torch==X+cpu so nothing else can satisfy it. pip first looks in
#     the sources it is configured with (a local wheel folder or mirror that has it); only if none does, it adds
#     PyTorch's CPU index (https://download.pytorch.org/whl/cpu). No network probe decides anything.
# The packages are compiled to bytecode once, here: with PYTHONDONTWRITEBYTECODE set, as on this project's
# machines, Python would otherwise compile torch, transformers and peft from source again in every process, every
# run and every test's subprocess. pip installs them without compiling (--no-compile); compileall then compiles the
# venv and fitburst's own folders (an editable install: imported from here) on every core, where pip compiles one
# file after another (benchmarks/results/suite_time.txt: a fresh venv in 65 s instead of 82 s on 2 cores).
# A few modules written for newer Pythons (torch's testing/_internal/py312_intrinsics.py) fail to compile under
# either, which is no error.
# Everything but torch is installed by uv (installed into the venv by pip first), which resolves and installs the
# same versions in well under half pip's time (benchmarks/results/suite_time.txt); where uv cannot be had or fails
# (an index only pip is configured for, say), pip installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FITBURST_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH=${FITBURST_TORCH:-2.13.0}
CPU_INDEX=${FITBURST_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
PIP=("$VENV/bin/pip" install -q --no-compile)
if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "keeping the installed torch ($("$VENV/bin/python" -c "import torch; print(torch.__version__)"))"
elif [ "$(uname -s)" = "Darwin" ] || { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  "${PIP[@]}" "torch==$TORCH"
else
  echo "no NVIDIA GPU found: installing the CPU build of torch $TORCH"
  "${PIP[@]}" "torch==$TORCH+cpu" 2>/dev/null \
    || "${PIP[@]}" "torch==$TORCH+cpu" --extra-index-url "$CPU_INDEX"
fi
if ! { "${PIP[@]}" uv && "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -e '.[dev]'; }; then
  echo "uv could not install fitburst's packages: installing them with pip"
  "${PIP[@]}" -e '.[dev]'
fi
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$VENV/bin/python" -m compileall -q -j 0 "$SITE" fitburst flows tasks tests >/dev/null || true
echo "fitburst installed in $VENV; put it on PATH with: source $VENV/bin/activate"
