#!/usr/bin/env bash
# Issue 37 over SSH: the dense proxy's soak with three kills, driven through `stepdeploy rollout run` over SSH to the
# GPU box made a node by bench/gpu_node.sh (its own sshd on 127.0.0.1, host key checked), so that detection is the
# SSH executor's; each restart part by part (bench/restart_times.py). Results in $OUT: the rollout's log, report,
# restarts and ledger.
#
#   OUT=$OUT [SOAK=200s KILLS="50s 105s 160s" TIMEOUT=420] bash bench/gpu_sshkills.sh DEBS WHEELS
set -uo pipefail
debs=${1:?the unpacked-sshd packages directory} wheels=${2:?the wheels directory}
out=${OUT:?set OUT}
umask 077
state=/tmp/node run=/tmp/sshkills
[ -e "$state/env.sh" ] || bash bench/gpu_node.sh "$debs" "$wheels" "$state" || exit 1
# shellcheck source=/dev/null
source "$state/env.sh"
rm -rf "$run" /var/lib/stepdeploy/runs/sshkills-*
kills=()
for at in ${KILLS:-50s 105s 160s}; do kills+=(--inject "kill:rank=last@$at"); done
rc=0
timeout "${TIMEOUT:-420}" python3 -m stepdeploy rollout run -i "$state/inventory.ini" --run-dir "$run" \
    -m proxy-0.7b-dense --stages warmup,soak --warmup-iterations 6 --soak-duration "${SOAK:-200s}" \
    --checkpoint-interval 30 "${kills[@]}" > "$out/sshkills.log" 2>&1 || rc=$?
echo "rollout exit $rc"; tail -n 2 "$out/sshkills.log"
python3 -m stepdeploy report "$run" > "$out/sshkills-report.txt" 2>&1
python3 bench/restart_times.py "$run" | tee "$out/sshkills-restarts.txt"
echo "processes with STEPDEPLOY_RUN_ID after the rollout: $(grep -l STEPDEPLOY_RUN_ID /proc/[0-9]*/environ 2>/dev/null | wc -l)"
cp "$run/ledger.sqlite" "$out/sshkills-ledger.sqlite"
find "$run" -path '*soak*' -name phases.jsonl -exec cp --backup=numbered {} "$out/sshkills-phases.jsonl" \;
