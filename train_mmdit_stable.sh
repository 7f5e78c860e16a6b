#!/usr/bin/env bash
# Launcher: ./train_mmdit_stable.sh [--config FILE] [key=value ...]
# Arguments pass through to train_mmdit_stable.py as config overrides, on one process or under torchrun as
# launch.sh decides (./launch.sh --help lists NPROC_PER_NODE, NNODES, MASTER_ADDR, MAX_RESTARTS, ...; SIGTERM and
# Ctrl-C checkpoint and exit 143 and 130: 0 only once the run reached training.max_steps). ENABLE_PROFILING=true
# turns on the scheduled profiler (PROFILE_STEPS=N: active steps).
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"  # the comment above, then train_mmdit_stable.py's options
  echo
fi
extra=()
if [[ "${ENABLE_PROFILING:-false}" == "true" ]]; then
  echo "profiling is on: the profiled steps run slower and traces land in <run dir>/tensorboard" >&2
  extra+=(profiler.enabled=true)
  [[ -n "${PROFILE_STEPS:-}" ]] && extra+=("profiler.active_steps=${PROFILE_STEPS}")
fi
here="$(cd "$(dirname "$0")" && pwd)"
exec "$here/launch.sh" "$here/train_mmdit_stable.py" "$@" ${extra[@]+"${extra[@]}"}
