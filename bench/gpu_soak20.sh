#!/usr/bin/env bash
# Issues 21 and 37's goodput goal on one H200: a 20-minute soak of the dense proxy (or SOAK_MODEL), a checkpoint about
# every minute (SOAK_CKPT=90 iterations at ~0.645 s), one kill -9 at 10 minutes (SOAK_KILL), driven through the local
# executor (`stepdeploy rollout run --executor local`). One device call lasts at most 10 minutes, so the rollout runs in a session of its own
# (setsid: the device machine keeps such a process between calls while it stays warm) and later calls wait for it:
#
#   OUT=$OUT bash bench/gpu_soak20.sh start .whl     # first call: set the box up, start the rollout, return
#   OUT=$OUT bash bench/gpu_soak20.sh wait .whl      # next calls, back to back: wait up to 9 min (WAIT_S); when the rollout
#                                                    # ended, its report and files in $OUT/soak20.tgz
# The device gives a machine back after about 30 s idle (status: idle_release_s), and the rollout goes with it: each
# `wait` must follow the last call at once. A `wait` on a fresh machine fails at once (exit 3) instead of waiting.
set -uo pipefail
mode=${1:?start or wait}
wheels=${2:?the wheels directory}
out=${OUT:?set OUT}
umask 077
# shellcheck source=bench/gpu_box.sh
source bench/gpu_box.sh
keep=/tmp/soak20-out
run=/tmp/soak20
case $mode in
    start)
        gpu_box_setup "$wheels"
        mkdir -p "$keep"
        gpu_box_inventory /tmp/box.ini
        # SOAK_MODEL=step-3.5-flash-slice-1gpu SOAK_CKPT=600 SOAK_KILL=12m: the slice (issue 37), one save of its 48 GB
        # (a second does not fit the box's /dev/shm beside it) at ~11 min, the kill after its commit
        setsid nohup bash -c 'python3 -m stepdeploy rollout run -i /tmp/box.ini --executor local --run-dir "$1" \
            -m "$3" --stages warmup,soak --warmup-iterations 6 --soak-duration 20m \
            --checkpoint-interval "$4" --keep-checkpoints 1 --inject "kill:rank=last@$5" > "$2/soak20.log" 2>&1
            echo "exit $?" > "$2/done"' \
            _ "$run" "$keep" "${SOAK_MODEL:-proxy-0.7b-dense}" "${SOAK_CKPT:-90}" "${SOAK_KILL:-10m}" \
            < /dev/null > /dev/null 2>&1 &
        # each process's GPU memory every 30 s (the rank and its persistent checkpoint writer: the writer's CUDA
        # context is not in the planner's memory model yet)
        setsid nohup bash -c 'while [ ! -e "$1/done" ]; do date +%s; nvidia-smi --query-compute-apps=pid,process_name,used_memory \
            --format=csv,noheader; sleep 30; done' _ "$keep" > "$keep/gpu-mem.txt" 2>&1 < /dev/null &
        sleep 5
        echo "started: $(head -c 300 "$keep/soak20.log")" ;;
    wait)
        if [ ! -e "$keep/soak20.log" ]; then
            # a fresh machine: the one that ran `start` was given back (idle past the device's release time between
            # calls) and the rollout with it; waiting would only spend device time
            echo "error: no soak was started on this machine ($keep/soak20.log missing): start it again" >&2
            exit 3
        fi
        export PYTHONPATH=/tmp/site:$PWD
        for _ in $(seq 1 $(( ${WAIT_S:-540} / 5 ))); do [ -e "$keep/done" ] && break; sleep 5; done
        tail -n 3 "$keep/soak20.log"
        if [ -e "$keep/done" ]; then
            cat "$keep/done"
            python3 -m stepdeploy report "$run" > "$keep/soak20-report.txt" 2>&1
            python3 -m stepdeploy report "$run" --json > "$keep/soak20-report.json" 2>/dev/null
            left=$(grep -l STEPDEPLOY_RUN_ID /proc/[0-9]*/environ 2>/dev/null | wc -l)
            echo "processes with STEPDEPLOY_RUN_ID after the rollout: $left" | tee -a "$keep/soak20.log"
            grep -i "goodput" "$keep/soak20-report.txt" | head -3
            sort -u -t, -k2,3 "$keep/gpu-mem.txt" | grep -v '^[0-9]*$' | tail -n 6
            tar -czf "$out/soak20.tgz" -C /tmp --exclude='checkpoints' --exclude='*.pt' soak20-out soak20
        else
            echo "still running"
        fi ;;
    *) echo "error: start or wait, not $mode" >&2; exit 2 ;;
esac
