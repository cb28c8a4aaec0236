#!/usr/bin/env bash
# The Python packages `benchmarks/gpu_check.py --at-scale` needs on the device machine that its image lacks, as
# wheels for its Python 3.12 (x86-64) in .whl/ at the repository's root (git-ignored), which the `run` call carries.
# bitsandbytes is trimmed to the CPU library and the CUDA 13.0 one the image's torch (2.11+cu130) loads: the whole
# wheel (43 MB) would leave no room under the 64 MiB the working tree may take. Versions: the ones fitburst's own
# environment resolves (shared stack notes).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1 \
  bitsandbytes==0.50.2
bnb=$(ls .whl/bitsandbytes-*.whl)
zip -q -d "$bnb" $(unzip -Z1 "$bnb" | grep -E 'libbitsandbytes_.*\.so$' | grep -vE '_(cpu|cuda130)\.so$')
du -sh .whl
