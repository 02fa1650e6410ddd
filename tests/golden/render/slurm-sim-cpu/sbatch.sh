#!/usr/bin/env bash
# Rendered by stepdeploy 0.0.0-golden from templates/sbatch.sh.j2 -- do not edit; render again.
# Run "golden-slurm-cpu", stage "soak": 2 node(s) as one Slurm job, 1 task(s) per node.
# The controller submits it with `sbatch --parsable` on the Slurm controller host. As the batch script
# it starts the tasks with srun; as a task (`sbatch.sh task`, on every node) it runs that node's part,
# the node's rendered launch.sh (the same script the SSH executor starts).
#SBATCH --job-name=sd-soak-golden-slurm-cpu
#SBATCH --nodes=2
#SBATCH --nodelist=node1,node2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --chdir=/var/lib/stepdeploy/runs/golden-slurm-cpu
#SBATCH --output=/var/lib/stepdeploy/runs/golden-slurm-cpu/logs/slurm-%j.out
#SBATCH --error=/var/lib/stepdeploy/runs/golden-slurm-cpu/logs/slurm-%j.err
#SBATCH --export=ALL,STEPDEPLOY_RUN_ID=golden-slurm-cpu
set -uo pipefail

run_dir=/var/lib/stepdeploy/runs/golden-slurm-cpu
cd -- "$run_dir" || exit 2
mkdir -p -- "$run_dir/out" "$run_dir/logs"

if [ "${1:-}" != task ]; then
  # One failed task ends the job (a dead rank must not leave its peers waiting for the collective timeout).
  exec srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=1 --export=ALL \
    bash "$run_dir/sbatch.sh" task
fi

# A task: this node's part of the run, chosen by the node's Slurm name (the job is pinned to --nodelist).
case "${SLURMD_NODENAME:-}" in
  node1) node_dir=nodes/0-node1 ;;
  node2) node_dir=nodes/1-node2 ;;
  *) printf 'stepdeploy: node %s has no part in run %s\n' "${SLURMD_NODENAME:-?}" golden-slurm-cpu >&2; exit 2 ;;
esac
log="$run_dir/logs/${node_dir##*/}.log"
exec bash "$run_dir/$node_dir/launch.sh" >> "$log" 2>&1 < /dev/null
