#!/usr/bin/env bash
# The Python packages benchmarks/train_step.py needs on a lent GPU machine that its image lacks, as wheels for
# that machine's Python (CPython 3.12, x86-64 Linux, which has torch 2.11, transformers, safetensors, einops,
# huggingface-hub, numpy, pillow, pyyaml, requests, regex, filelock, peft): downloaded here into .whl/, which
# .gitignore ignores, to be carried with the repository (benchmarks/RESULTS.md: the GPU recipe). All three are
# built wheels (nothing compiles there); the install that benchmarks/gpu_train_step.sh runs there is tried here
# last, timed, so that a wrong set fails on this machine and not in a GPU window.
#   omegaconf 2.4.0    the configs (it vendors its ANTLR runtime: no antlr4 wheel)
#   diffusers 0.42.1   the anchor rows (its other requirements are on the image)
#   torchao 0.18.0     the float8 rows (its own check asks for torch >= 2.11; float8 training is Python)
# Not carried: flash-attn (FA2, FA3: no wheel, built from source for hours) and flash-attn-4, whose CuTe DSL
# compiler (nvidia-cutlass-dsl-libs-cu13, 92 MB) is over the 64 MiB a call may carry: those rows are
# "not runnable" there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
rm -rf .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl omegaconf==2.4.0 diffusers==0.42.1 torchao==0.18.0
ls -l .whl
du -sh .whl
site=$(mktemp -d)
time "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
rm -rf "$site"
