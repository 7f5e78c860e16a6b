#!/usr/bin/env bash
# One command of the GPU recipe (benchmarks/RESULTS.md): on a lent GPU machine, install the wheels carried in .whl/
# (benchmarks/gpu_wheels.sh made them on a CPU machine) and continue the train-step table, all of it within SECONDS
# of wall time; the table and the logs go to $OUT. Options after SECONDS go to train_step.py.
#   bash benchmarks/gpu_train_step.sh SECONDS [OPTION ...]
set -uo pipefail
cd "$(dirname "$0")/.."
budget=${1:?usage: bash benchmarks/gpu_train_step.sh SECONDS [OPTION ...]}
shift
PYTHON=${PYTHON:-python3}
TABLE=${TABLE:-benchmarks/train_step_h100_80gb_hbm3.json}
OUT=${OUT:?the folder whose files come back}
ls .whl/*.whl >/dev/null || { echo "no .whl/: run benchmarks/gpu_wheels.sh here and carry .whl"; exit 1; }
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit
export PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor PYTHONUNBUFFERED=1
# train_step.py starts no row that its estimate ends after --stop-after; 25 s later `timeout` stops a row that
# runs long anyway (SIGTERM, SIGKILL 10 s on): the table on disk stays whole, that row marked for the next command
left=$((budget - SECONDS))
timeout -k 10 $((left - 20)) "$PYTHON" benchmarks/train_step.py --resume "$TABLE" --stop-after $((left - 45)) \
    "$@" 2>"$OUT/stderr.txt" | tee "$OUT/stdout.txt"
status=${PIPESTATUS[0]}
cp "$TABLE" "$OUT/"
du -sh .cache/inductor 2>/dev/null
echo "$SECONDS s in all"
exit "$status"
