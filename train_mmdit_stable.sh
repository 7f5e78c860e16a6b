#!/usr/bin/env bash
# Launcher: ./train_mmdit_stable.sh [--config FILE] [key=value ...]
# Arguments pass through to train_mmdit_stable.py as config overrides.
#   ENABLE_PROFILING=true  turn on the scheduled profiler (PROFILE_STEPS=N: active steps to record)
set -euo pipefail
cd "$(dirname "$0")"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
extra=()
if [[ "${ENABLE_PROFILING:-false}" == "true" ]]; then
  extra+=(training.enable_profiling=true)
  [[ -n "${PROFILE_STEPS:-}" ]] && extra+=("training.profile_steps=${PROFILE_STEPS}")
fi
exec "$PYTHON" train_mmdit_stable.py "$@" "${extra[@]}"
