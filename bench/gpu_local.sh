#!/usr/bin/env bash
# One H200 box without sshd, driven through the local executor (issue 19), and the optimizer offload against the
# plan (issue 22). Node side as the python_env role would make it; the controller is this checkout on
# PYTHONPATH. Then: preflight of the box; the dense proxy's soak with a kill (`rollout run --executor local`),
# and nothing of it left after; render + `run launch` of the dense proxy with torch's foreach AdamW and with
# megatron-core's HybridDeviceOptimizer (offload), 20 iterations each, peak memory and step time to compare with
# `stepdeploy plan` (docs/benchmarks.md). Results in $OUT/local.tgz.
#
#   OUT=/tmp/out [STEPS="preflight rollout offload"] bash bench/gpu_local.sh .debs .whl   # $1 unused: no sshd
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

steps=" ${STEPS:-preflight rollout offload} "
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

[[ $steps == *" offload "* ]] && for v in foreach:mbs=4 offload:mbs=4,offload=on,precision_aware_optimizer=on; do
    n=${v%%:*} layout=${v#*:}
    run=/tmp/opt-$n
    python3 -m stepdeploy render -i "$inv" -m proxy-0.7b-dense --stage warmup --iterations 20 --save-interval 0 \
        --layout "$layout" --run-id "opt-$n" --out "$run" > "$keep/render-$n.log" 2>&1
    started=$SECONDS
    timeout 200 python3 -m stepdeploy run launch "$run" --executor local --follow > "$keep/launch-$n.log" 2>&1
    echo "exit $? after $((SECONDS - started)) s" >> "$keep/launch-$n.log"
    python3 -m stepdeploy run fetch "$run" --executor local > /dev/null 2>&1
    find "$run" -name metrics.jsonl -path '*fetched*' -exec cp {} "$keep/metrics-$n.jsonl" \;
    tail -n 1 "$keep/launch-$n.log"
    tail -n 1 "$keep/metrics-$n.jsonl" | cut -c1-400
done
tar -czf "$out/local.tgz" -C /tmp --exclude='checkpoints' --exclude='*.pt' local-out local-dense
