#!/usr/bin/env bash
# Wheels for the packages that bench/device_suite.sh needs and the GPU machine's image lacks (it has torch,
# transformers, accelerate, pyarrow, pandas, sympy, ...): archer's config stack, math-verify, and TRL with
# datasets for bench/grpo_vs_trl.py. Fetched for Python 3.12 on x86-64 without dependencies (every missing
# one is named); antlr4-python3-runtime 4.9.3, which hydra-core needs, exists only as source and is built here.
#
#   bash bench/device_wheels.sh DIR        (DIR/whl gets the wheels; the suite installs DIR/whl/*.whl)
set -euo pipefail
dir=${1:?usage: bench/device_wheels.sh DIR}
mkdir -p "$dir/whl"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir/whl" hydra-core==1.3.8 omegaconf==2.3.1 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
python3 -m pip wheel -q --no-deps -w "$dir/whl" antlr4-python3-runtime==4.9.3
du -sh "$dir/whl"
