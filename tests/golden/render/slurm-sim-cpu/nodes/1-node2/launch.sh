#!/usr/bin/env bash
# Rendered by stepdeploy 0.0.0-golden from templates/launch.sh.j2 -- do not edit; render again.
# Node "node2" (node rank 1 of 2), run "golden-slurm-cpu".
# The controller starts this detached (setsid nohup), so this script leads its own session and
# process group; it records its PID, runs the launcher (stepdeploy's, or torchrun for a c10d rendezvous or
# torchrun's own restarts), and records the launcher's exit code atomically.
set -uo pipefail

run_dir=/var/lib/stepdeploy/runs/golden-slurm-cpu
node_dir="$run_dir"/nodes/1-node2
cd -- "$run_dir" || exit 2
mkdir -p -- "$run_dir/out" "$run_dir/logs"
rm -f -- "$node_dir/exit_code"
printf '%s\n' "$$" > "$node_dir/launch.pid"

# shellcheck source=/dev/null
. "$node_dir/env.sh"

# stepdeploy's launcher (workload/launch_ranks.py): torchrun's static rendezvous without torchrun's torch import.
# It writes the first failed rank's end (and which ranks it stopped after it) into their status files.
launcher=(
  /opt/stepdeploy/venv/bin/python -I "$run_dir/workload/launch_ranks.py"
  --nnodes=2
  --nproc-per-node=1
  --node-rank=1
  --master-addr=10.83.0.11
  --master-port=29500
  --status-dir="$run_dir/out/status"
  --
)
workload=(
  "$run_dir/workload/train.py"
  --config "$run_dir/workload.json"
  --out-dir "$run_dir/out"
)

set +e
"${launcher[@]}" "${workload[@]}" &
child=$!
# Forward a stop to the launcher, which stops its workers (they run in sessions of their own).
trap 'kill -TERM "$child" 2>/dev/null' TERM INT HUP
wait "$child"
rc=$?
while kill -0 "$child" 2>/dev/null; do
  wait "$child"
  rc=$?
done
printf '%s\n' "$rc" > "$node_dir/exit_code.tmp" && mv -f -- "$node_dir/exit_code.tmp" "$node_dir/exit_code"
exit "$rc"
