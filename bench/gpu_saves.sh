#!/usr/bin/env bash
# Issue 21 on one H200, through the product: the stall per checkpoint save of the dense proxy, synchronous
# (STEPDEPLOY_CKPT_ASYNC=0) against asynchronous in the same call (`stepdeploy render` + `run launch --follow`,
# 45 iterations, a save every 15), then bench/gpu_soak.sh's `saves` rollout (asynchronous saves every 40
# iterations, 2 kept, a rank killed between saves). Each run's phases.jsonl and log land in $OUT/saves.tgz.
#
#   OUT=/tmp/out bash bench/gpu_saves.sh .debs .whl      # the device machine's $OUT
set -uo pipefail
debs=$1 wheels=$2
out=${OUT:?set OUT}
node=/tmp/node
bash bench/gpu_node.sh "$debs" "$wheels" "$node" > "$out/node.log" 2>&1 || { tail -20 "$out/node.log"; exit 1; }
# shellcheck disable=SC1091
source "$node/env.sh"
inv=$node/inventory.ini
keep=/tmp/saves-out
mkdir -p "$keep"
for mode in 0 1; do
    run=/tmp/saves-async$mode
    python3 -m stepdeploy render -i "$inv" -m proxy-0.7b-dense --stage soak --iterations 45 --save-interval 15 \
        --run-id "saves-async$mode" --env "STEPDEPLOY_CKPT_ASYNC=$mode" --out "$run" > "$keep/render$mode.log" 2>&1
    started=$SECONDS
    timeout 240 python3 -m stepdeploy run launch "$run" --follow > "$keep/launch$mode.log" 2>&1
    echo "exit $? after $((SECONDS - started)) s" >> "$keep/launch$mode.log"
    python3 -m stepdeploy run fetch "$run" > /dev/null 2>&1
    find "$run" -name phases.jsonl -exec cp {} "$keep/phases-async$mode.jsonl" \;
    tail -n 2 "$keep/launch$mode.log"
    grep -h '"save' "$keep/phases-async$mode.jsonl" | head -8
done
started=$SECONDS  # bench/gpu_soak.sh's `saves` rollout
timeout 480 python3 -m stepdeploy rollout run -i "$inv" --run-dir /tmp/saves -m proxy-0.7b-dense --stages warmup,soak \
    --warmup-iterations 6 --soak-duration 240s --checkpoint-interval 40 --keep-checkpoints 2 --heartbeat-timeout 60s \
    --inject kill:rank=last@150s > "$keep/saves.log" 2>&1
echo "exit $? after $((SECONDS - started)) s" >> "$keep/saves.log"
tail -n 3 "$keep/saves.log"
python3 -m stepdeploy report /tmp/saves > "$keep/saves-report.txt" 2>&1
python3 -m stepdeploy report /tmp/saves --json > "$keep/saves-report.json" 2>/dev/null
tar -czf "$out/saves.tgz" -C /tmp --exclude='checkpoints' --exclude='*.pt' saves-out saves
