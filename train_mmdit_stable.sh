#!/usr/bin/env bash
# Launcher: ./train_mmdit_stable.sh [--config FILE] [key=value ...]
# Arguments pass through to train_mmdit_stable.py as config overrides.
#
# One process when there is at most one GPU and no distributed variable is set; otherwise torchrun:
#   NPROC_PER_NODE  processes on this node (default: the GPUs in CUDA_VISIBLE_DEVICES, else all; at least 1)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   static multi-node rendezvous (default 1, 0, -, 29500)
#   RDZV_ENDPOINT (host:port), RDZV_ID            elastic c10d rendezvous instead of MASTER_ADDR
#   ENABLE_PROFILING=true  turn on the scheduled profiler (PROFILE_STEPS=N: active steps to record)
set -euo pipefail
cd "$(dirname "$0")"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
extra=()
if [[ "${ENABLE_PROFILING:-false}" == "true" ]]; then
  echo "profiling is on: the profiled steps run slower and traces land in <run dir>/tensorboard" >&2
  extra+=(training.enable_profiling=true)
  [[ -n "${PROFILE_STEPS:-}" ]] && extra+=("training.profile_steps=${PROFILE_STEPS}")
fi

gpus=0  # the GPUs this job may use: CUDA_VISIBLE_DEVICES when set, else all that nvidia-smi lists
if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
  IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"; gpus=${#visible[@]}
elif command -v nvidia-smi >/dev/null 2>&1; then gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
nproc=${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
nnodes=${NNODES:-1}

# Usual settings, only where the user has not chosen: less fragmentation on CUDA, NCCL errors that fail
# the job instead of hanging it.
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

if [[ "$nproc" == 1 && "$nnodes" == 1 && -z "${MASTER_ADDR:-}${RDZV_ENDPOINT:-}" ]]; then
  exec "$PYTHON" train_mmdit_stable.py "$@" "${extra[@]}"
fi

launch=(--nnodes "$nnodes" --nproc-per-node "$nproc")
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
  launch+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-mmdit}")
elif [[ "$nnodes" == 1 && -z "${MASTER_ADDR:-}" ]]; then
  launch+=(--standalone)
else
  [[ "$nnodes" == 1 ]] || : "${NODE_RANK:?NODE_RANK (0..NNODES-1) is required with NNODES>1}"
  launch+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:?MASTER_ADDR is required with NNODES>1}"
           --master-port "${MASTER_PORT:-29500}")
fi
echo "torchrun ${launch[*]}" >&2
exec "$PYTHON" -m torch.distributed.run "${launch[@]}" train_mmdit_stable.py "$@" "${extra[@]}"
