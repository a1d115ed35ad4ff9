#!/usr/bin/env bash
# Launch `fmoe train RECIPE` with torchrun on this machine or under SLURM.
#   recipes/launch.sh recipes/tiny.toml [--set train.steps=10 ...]
# Under SLURM (srun recipes/launch.sh ..., one task per node) the node count, node rank and the
# rendezvous host come from SLURM_*; elsewhere one node with every visible GPU (or NPROC, default 1).
set -euo pipefail
recipe=${1:?usage: launch.sh RECIPE [fmoe train options]}
shift
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  nnodes=${SLURM_NNODES:-1}
  node_rank=${SLURM_NODEID:-0}
  master=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)
  nproc=${SLURM_GPUS_ON_NODE:-${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}}
  port=${MASTER_PORT:-29500}
else
  nnodes=1
  node_rank=0
  master=127.0.0.1
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  nproc=${NPROC:-$(( gpus > 0 ? gpus : 1 ))}
  port=${MASTER_PORT:-29500}
fi
[[ "${nproc}" -ge 1 ]] || nproc=1
exec torchrun --nnodes "${nnodes}" --node-rank "${node_rank}" --nproc-per-node "${nproc}" \
  --master-addr "${master}" --master-port "${port}" -m fmoe train "${recipe}" "$@"
