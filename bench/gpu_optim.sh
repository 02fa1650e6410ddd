#!/usr/bin/env bash
# Issue 22 items 2-3 on one H200, through the product: the dense proxy with torch's foreach AdamW, its fused AdamW,
# and megatron-core's HybridDeviceOptimizer (optimizer CPU offload), each `stepdeploy render --stage warmup
# --iterations 20 --layout ...` + `run launch --executor local --follow` on the box (bench/gpu_box.sh: no sshd),
# against `stepdeploy plan --layout ... --json`: one row per layout (median step and optimizer phase of iterations
# 6-20, the run's torch peak; measured / plan) in $OUT/optim.txt, the same in $OUT/optim.json, the runs' metrics,
# logs and plans in $OUT/optim.tgz (bench/optim_table.py makes the table). About 3 minutes.
#
#   OUT=/tmp/out bash bench/gpu_optim.sh .debs .whl        # on the device; $1 unused (no sshd)
#   bash bench/gpu_optim.sh --summarize DIR                  # CPU: the plans and the table from DIR's runs
#
# The exit status is bench/optim_table.py's: 0 when every run exited 0 and every row has its figures.
set -euo pipefail
model=proxy-0.7b-dense
first=6 iterations=20
# NAME=LAYOUT entries; LAYOUTS="foreach8=mbs=8 fused8=mbs=8,optimizer=fused" measures others (the same for --summarize)
read -ra layouts <<< "${LAYOUTS:-foreach=mbs=4 fused=mbs=4,optimizer=fused offload=mbs=4,offload=on,precision_aware_optimizer=on}"
python=${PYTHON:-python3}

plans_and_table() {  # DIR: `stepdeploy plan --json` of every layout into DIR, then the table of DIR's runs
    local dir=$1 entry name
    for entry in "${layouts[@]}"; do
        name=${entry%%=*}
        "$python" -m stepdeploy plan -m "$model" --nodes 1 --gpus-per-node 1 --gpu H200 --layout "${entry#*=}" \
            --json > "$dir/plan-$name.json" 2> "$dir/plan-$name.log" || echo "plan $name: exit $?" >&2
    done
    "$python" bench/optim_table.py "$dir" "${layouts[@]}" --first "$first" --last "$iterations" \
        --json "$dir/optim.json"
}

if [ "${1:-}" = --summarize ]; then
    [ -d "${2:-}" ] || { echo "error: --summarize needs a directory of runs (metrics-NAME.jsonl)" >&2; exit 2; }
    plans_and_table "$2"
    exit
fi

if [ "$#" -ne 2 ] || [ -z "${OUT:-}" ]; then
    echo "error: usage: OUT=DIR bash bench/gpu_optim.sh DEBS WHEELS, or bash bench/gpu_optim.sh --summarize DIR" >&2
    exit 2
fi
wheels=$2 out=$OUT
umask 077
# shellcheck source=bench/gpu_box.sh
source bench/gpu_box.sh
gpu_box_setup "$wheels"
keep=/tmp/optim-out
rm -rf "$keep" && mkdir -p "$keep"
inv=/tmp/box.ini
gpu_box_inventory "$inv"
stamp=$(date -u +%H%M%S)  # run ids of their own: a second call on a warm box must not meet the first's run directory

for entry in "${layouts[@]}"; do
    name=${entry%%=*} run=/tmp/optim-${entry%%=*}
    rm -rf "$run"
    rc=0
    "$python" -m stepdeploy render -i "$inv" -m "$model" --stage warmup --iterations "$iterations" \
        --save-interval 0 --layout "${entry#*=}" --run-id "optim-$name-$stamp" --out "$run" > "$keep/render-$name.log" 2>&1 \
        || rc=$?
    started=$SECONDS
    if [ "$rc" -eq 0 ]; then
        timeout 150 "$python" -m stepdeploy run launch "$run" --executor local --follow > "$keep/launch-$name.log" \
            2>&1 || rc=$?
        "$python" -m stepdeploy run fetch "$run" --executor local > /dev/null 2>&1 || true
        find "$run" -name metrics.jsonl -path '*fetched*' -exec cp {} "$keep/metrics-$name.jsonl" \; || true
    fi
    echo "exit $rc after $((SECONDS - started)) s" >> "$keep/launch-$name.log"
    tail -n 1 "$keep/launch-$name.log"
done

rc=0
plans_and_table "$keep" | tee "$out/optim.txt" || rc=$?
cp "$keep/optim.json" "$out/optim.json" || true
tar -czf "$out/optim.tgz" -C /tmp optim-out
exit "$rc"
