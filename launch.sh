#!/usr/bin/env bash
# Launcher of this project's entry points: ./launch.sh SCRIPT.py [arguments]
# (./train_mmdit_stable.sh is ./launch.sh train_mmdit_stable.py; NPROC_PER_NODE=8 ./launch.sh precompute_latents.py
# ... encodes on 8 processes.) It uses .venv beside it when there is one, and runs in the directory you call it
# from, so relative paths (--config, data.path, --out) mean what they mean there. ./launch.sh --help prints this;
# ./launch.sh SCRIPT.py --help, the script's options (on one process).
#
# One process when there is at most one GPU and no distributed variable is set; otherwise torchrun:
#   NPROC_PER_NODE  processes on this node (default: the GPUs in CUDA_VISIBLE_DEVICES, else all; at least 1)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   static multi-node rendezvous (default 1, 0, -, 29500)
#   RDZV_ENDPOINT (host:port), RDZV_ID            elastic c10d rendezvous instead of MASTER_ADDR
#   MAX_RESTARTS=N  torchrun restarts all workers up to N times after one fails (resuming from the last checkpoint);
#                   with MASTER_ADDR this uses c10d rendezvous there (torchrun's static one cannot restart workers)
# SIGTERM / SIGINT (Ctrl-C) make training checkpoint at the next step and exit 128 + the signal (143, 130), as a
# shell reports a command a signal ended: 0 means the run reached training.max_steps, so `... && export` and
# `until ./train_mmdit_stable.sh ...; do :; done` do what they say. Under torchrun the launcher passes them (and
# SIGHUP, as SIGTERM) to the workers and then exits as one process would. A worker's error that it has reported
# (the user's input, exit 2; a failure it explained, exit 1; an interruption, exit 130) ends the launch with that
# status and no torchrun traceback.
# A launcher killed by a signal it cannot pass on (kill -9, the OOM killer) takes torchrun and every worker with it
# (runtime/parent_death.py); a second launch into a run or output directory in use is refused with exit 2
# (runtime/directory_lock.py).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
usage() { sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; }  # the comment above
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") usage >&2; exit 2 ;;
esac
script="$1"
shift
[[ -f "$script" || ! -f "$here/$script" ]] || script="$here/$script"  # this checkout's entry point, from anywhere
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then PYTHON="$here/.venv/bin/python"; else PYTHON=python3; fi
fi
# The GPUs this job may use: CUDA_VISIBLE_DEVICES when set; else those nvidia-smi lists; else, where the
# NVIDIA driver's device nodes exist but nvidia-smi does not (some containers), those torch counts.
if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
  gpus=$(awk -F, '{print NF}' <<< "$CUDA_VISIBLE_DEVICES")
elif command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
elif compgen -G "/dev/nvidia[0-9]*" >/dev/null; then
  gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
else
  gpus=0
fi
nproc=${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
nnodes=${NNODES:-1}

# Usual settings, only where the user has not chosen: less fragmentation on CUDA, NCCL errors that fail
# the job instead of hanging it, and a fresh rendezvous store for each torchrun restart (workers of a restart
# sharing the store of the attempt before read its stale addresses and fail to connect: pytorch issue 135712).
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# CPU threads (torch's GNU OpenMP) wait for work by spinning 300k times before they sleep: on an idle machine that
# is fastest, but where another job keeps the cores busy the spinning threads take turns with it and training ran
# at 0.47 of its best. A short spin loses least across both (benchmarks/threads.py: 0.77 idle, 0.82 busy, where
# OMP_NUM_THREADS=1 gives 0.70 and 1.00; whole idle runs showed no loss); a GPU run's few CPU ops do not notice.
export GOMP_SPINCOUNT=${GOMP_SPINCOUNT:-1000}

help_asked() { local a; for a in "$@"; do case "$a" in -h|--help) return 0 ;; esac; done; return 1; }
if [[ "$nproc" == 1 && "$nnodes" == 1 && -z "${MASTER_ADDR:-}${RDZV_ENDPOINT:-}${MAX_RESTARTS:-}" ]] ||
   help_asked "$@"; then  # a script's --help once, not once per process
  exec "$PYTHON" "$script" "$@"  # the launcher becomes the worker: ending it ends the run
fi

launch=(--nnodes "$nnodes" --nproc-per-node "$nproc" --max-restarts "${MAX_RESTARTS:-0}")
if [[ -z "${RDZV_ENDPOINT:-}" && -n "${MASTER_ADDR:-}" && "${MAX_RESTARTS:-0}" != 0 ]]; then
  RDZV_ENDPOINT="$MASTER_ADDR:${MASTER_PORT:-29500}"  # restarted workers would hang in the static rendezvous
fi
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
  launch+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-mmdit}")
elif [[ "$nnodes" == 1 && -z "${MASTER_ADDR:-}" ]]; then
  launch+=(--standalone)
else
  [[ "$nnodes" == 1 ]] || : "${NODE_RANK:?NODE_RANK (0..NNODES-1) is required with NNODES>1}"
  launch+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:?MASTER_ADDR is required with NNODES>1}"
           --master-port "${MASTER_PORT:-29500}")
fi

# Why workers exit, which torchrun cannot tell: it answers a signal by raising an error (exit 1) and killing the
# workers 30 s later, and prints a long traceback for any worker that exits non-zero. So torchrun runs in a session
# of its own, where a terminal's Ctrl-C (sent to the foreground process group) does not reach it; the launcher
# passes signals to the workers directly, and each worker leaves "REASON STATUS" in MMDIT_STATUS_DIR and exits 0,
# which torchrun neither reports nor restarts (runtime/preemption.py:mark_exit): "preempted" (it checkpointed
# because it was asked to, and every rank agreed on the signal: once every local worker did, the launcher exits
# with their status, 128 + the signal, whether or not it was signalled itself), "input-error" (rank 0 printed the
# one line that says what is wrong: exit 2), "failed" (rank 0 said why: exit 1) or "interrupted" (exit 130).
export MMDIT_STATUS_DIR
MMDIT_STATUS_DIR="$(mktemp -d)"
torchrun_pid=""
forward() {  # SIGINT stays SIGINT (a second Ctrl-C interrupts, as for one process); SIGTERM and SIGHUP: SIGTERM
  [[ -z "$torchrun_pid" ]] || pkill "-$1" -P "$torchrun_pid" 2>/dev/null || true
}
trap 'forward INT' INT  # before the start: a signal then can never leave torchrun running on its own
trap 'forward TERM' TERM HUP
echo "torchrun ${launch[*]}" >&2
# torchrun, and each worker it starts, through runtime/parent_death.py: torchrun in a session of its own, and each
# ends with its parent, however that ends (the launcher: a kill -9, the OOM killer). It execs: $! is torchrun's pid.
ends_with_parent=("$PYTHON" "$here/runtime/parent_death.py")
"${ends_with_parent[@]}" torchrun $$ "$PYTHON" -m torch.distributed.run "${launch[@]}" --no-python \
  "${ends_with_parent[@]}" worker "$PYTHON" -u "$script" "$@" &
torchrun_pid=$!
status=0
while true; do  # `wait` returns early when a trapped signal arrives; wait again until torchrun has ended
  wait "$torchrun_pid" && status=0 || status=$?
  kill -0 "$torchrun_pid" 2>/dev/null || break
done
said() { (grep -lE "^$1( |$)" "$MMDIT_STATUS_DIR"/* 2>/dev/null || true) | wc -l; }
input_errors=$(said input-error) failed=$(said failed) interrupted=$(said interrupted) preempted=$(said preempted)
preempted_status=$(awk '$1 == "preempted" { print $2; exit }' "$MMDIT_STATUS_DIR"/* 2>/dev/null || true)
rm -rf "$MMDIT_STATUS_DIR"
if (( input_errors > 0 )); then exit 2; fi
if (( failed > 0 )); then exit 1; fi
if (( interrupted > 0 )); then exit 130; fi
if (( preempted == nproc )); then
  echo "pre-empted: all $nproc local worker(s) checkpointed; exit $preempted_status (the same command resumes)" >&2
  exit "$preempted_status"
fi
exit "$status"
