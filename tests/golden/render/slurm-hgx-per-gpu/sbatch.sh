#!/usr/bin/env bash
# Rendered by stepdeploy 0.0.0-golden from templates/sbatch.sh.j2 -- do not edit; render again.
# Run "golden-slurm-hgx", stage "warmup": 2 node(s) as one Slurm job, 8 task(s) per node.
# The controller submits it with `sbatch --parsable` on the Slurm controller host. As the batch script
# it starts the tasks with srun; as a task (`sbatch.sh task`, on every node) it runs that node's part,
# one training rank per GPU (rank = node rank x tasks per node + local id; no torchrun).
#SBATCH --job-name=sd-warmup-golden-slurm-hgx
#SBATCH --nodes=2
#SBATCH --nodelist=hgx-0,hgx-1
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --partition=gpu
#SBATCH --exclusive
#SBATCH --chdir=/var/lib/stepdeploy/runs/golden-slurm-hgx
#SBATCH --output=/var/lib/stepdeploy/runs/golden-slurm-hgx/logs/slurm-%j.out
#SBATCH --error=/var/lib/stepdeploy/runs/golden-slurm-hgx/logs/slurm-%j.err
#SBATCH --export=ALL,STEPDEPLOY_RUN_ID=golden-slurm-hgx
set -uo pipefail

run_dir=/var/lib/stepdeploy/runs/golden-slurm-hgx
cd -- "$run_dir" || exit 2
mkdir -p -- "$run_dir/out" "$run_dir/logs"

if [ "${1:-}" != task ]; then
  # One failed task ends the job (a dead rank must not leave its peers waiting for the collective timeout).
  exec srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=8 --export=ALL \
    bash "$run_dir/sbatch.sh" task
fi

# A task: this node's part of the run, chosen by the node's Slurm name (the job is pinned to --nodelist).
case "${SLURMD_NODENAME:-}" in
  hgx-0) node_dir=nodes/0-hgx-0; node_rank=0 ;;
  hgx-1) node_dir=nodes/1-hgx-1; node_rank=1 ;;
  *) printf 'stepdeploy: node %s has no part in run %s\n' "${SLURMD_NODENAME:-?}" golden-slurm-hgx >&2; exit 2 ;;
esac
log="$run_dir/logs/${node_dir##*/}.log"

# shellcheck source=/dev/null
. "$run_dir/$node_dir/env.sh"
RANK=$((node_rank * 8 + SLURM_LOCALID))
export RANK
export LOCAL_RANK="$SLURM_LOCALID"
export WORLD_SIZE=16
export LOCAL_WORLD_SIZE=8
export MASTER_ADDR=192.0.2.31
export MASTER_PORT=29500
exec /opt/stepdeploy/venv/bin/python "$run_dir/workload/train.py" --config "$run_dir/workload.json" --out-dir "$run_dir/out" \
  >> "$log" 2>&1 < /dev/null
