#!/usr/bin/env bash
# One H200 box without sshd, driven through the local executor (issue 19). Node side as the python_env role would
# make it; the controller is this checkout on PYTHONPATH (bench/gpu_box.sh). Then: preflight of the box; the dense
# proxy's soak with a kill (`rollout run --executor local`), and nothing of it left after. Results in
# $OUT/local.tgz. The optimizers against the plan (foreach, fused, offload): bench/gpu_optim.sh.
#
#   OUT=/tmp/out [STEPS="preflight rollout"] bash bench/gpu_local.sh .debs .whl   # $1 unused: no sshd
set -uo pipefail
wheels=$2
out=${OUT:?set OUT}
umask 077
# shellcheck source=bench/gpu_box.sh
source bench/gpu_box.sh
gpu_box_setup "$wheels"
keep=/tmp/local-out
mkdir -p "$keep"
inv=/tmp/box.ini
gpu_box_inventory "$inv"

steps=" ${STEPS:-preflight rollout} "
if [[ $steps == *" preflight "* ]]; then
timeout 150 python3 -m stepdeploy preflight "$inv" --json > "$keep/preflight.json" 2> "$keep/preflight.log"
echo "preflight exit $?"
fi

if [[ $steps == *" rollout "* ]]; then
started=$SECONDS
timeout 300 python3 -m stepdeploy rollout run -i "$inv" --executor local --run-dir /tmp/local-dense \
    -m proxy-0.7b-dense --stages warmup,soak --warmup-iterations 6 --soak-duration 100s --checkpoint-interval 40 \
    --inject kill:rank=last@65s > "$keep/local-dense.log" 2>&1
echo "exit $? after $((SECONDS - started)) s" >> "$keep/local-dense.log"
tail -n 2 "$keep/local-dense.log"
python3 -m stepdeploy report /tmp/local-dense > "$keep/local-dense-report.txt" 2>&1
left=$(grep -l STEPDEPLOY_RUN_ID /proc/[0-9]*/environ 2>/dev/null | wc -l)
echo "processes with STEPDEPLOY_RUN_ID after the rollout: $left" | tee -a "$keep/local-dense.log"
fi

tar -czf "$out/local.tgz" -C /tmp --exclude='checkpoints' --exclude='*.pt' local-out local-dense
