#!/usr/bin/env bash
# The soak issue's check on one H200, through the product (`stepdeploy rollout run` over SSH to the box itself,
# bench/gpu_node.sh): an MoE target (the Step-3.5-Flash slice) rolled out on a dataset `stepdeploy data prepare` made
# from this checkout's docs -- the ladder's MoE proxy, the target judged by MFU against its plan, a soak judged on its
# loss trend, gradient norms and expert load -- then the dense proxy's soak with a rank killed after its first
# checkpoint (restart cost, goodput). Ledgers, fetched files (not checkpoints) and reports land in $OUT.
#
#   OUT=/tmp/out [ROLLOUTS=dense|moe|saves] bash bench/gpu_soak.sh .debs .whl      # the device machine's $OUT
set -uo pipefail
debs=$1 wheels=$2
out=${OUT:?set OUT}
node=/tmp/node
bash bench/gpu_node.sh "$debs" "$wheels" "$node" > "$out/node.log" 2>&1 || { tail -20 "$out/node.log"; exit 1; }
# shellcheck disable=SC1091
source "$node/env.sh"
inv=$node/inventory.ini

python3 -m stepdeploy data prepare README.md docs --out /tmp/corpus --json > "$out/data.json" 2> "$out/data.log"

rollout() {  # NAME SECONDS ARGS...: one rollout, its report, its ledger and fetched files
    local name=$1 seconds=$2; shift 2
    local started=$SECONDS
    timeout "$seconds" python3 -m stepdeploy rollout run -i "$inv" --run-dir "/tmp/$name" "$@" > "$out/$name.log" 2>&1
    echo "exit $? after $((SECONDS - started)) s" >> "$out/$name.log"
    python3 -m stepdeploy report "/tmp/$name" --html "/tmp/$name/report.html" > "$out/$name-report.txt" 2>&1
    python3 -m stepdeploy report "/tmp/$name" --json > "$out/$name-report.json" 2>/dev/null
    tar -czf "$out/$name.tgz" -C /tmp --exclude='checkpoints' --exclude='*.pt' "$name"
}

# ROLLOUTS picks (default moe dense; moe-soak: the slice's soak alone, its training gates on GPU); the run's files must stay few (the device returns 8 files)
for name in ${ROLLOUTS:-moe dense}; do
    case $name in
        moe) rollout moe 400 -m step-3.5-flash-slice-1gpu --stages warmup,scale,soak --warmup-iterations 6 \
                 --scale-iterations 10 --soak-duration 50s --checkpoint-interval 100000 --data /tmp/corpus ;;
        moe-soak) rollout moe-soak 430 -m step-3.5-flash-slice-1gpu --stages warmup,soak --warmup-iterations 6 \
                 --soak-duration 150s --checkpoint-interval 100000 --data /tmp/corpus ;;
        dense) rollout dense 200 -m proxy-0.7b-dense --stages warmup,soak --warmup-iterations 6 \
                   --soak-duration 100s --checkpoint-interval 30 --inject kill:rank=last@65s ;;
        # issue 21: the stall per asynchronous save (phases.jsonl: save.blocking_s, save_committed.background_s),
        # retention 2 and a kill between saves, in the few minutes one device call allows
        saves) rollout saves 480 -m proxy-0.7b-dense --stages warmup,soak --warmup-iterations 6 \
                   --soak-duration 240s --checkpoint-interval 40 --keep-checkpoints 2 --heartbeat-timeout 60s \
                   --inject kill:rank=last@150s ;;
    esac
    tail -n 3 "$out/$name.log"
done
