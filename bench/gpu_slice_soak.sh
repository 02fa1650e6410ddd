#!/usr/bin/env bash
# Issue 35's evidence on one H200: the one-GPU Step-3.5-Flash slice's rollout (warm-up, then a soak of SLICE_SOAK,
# default 600s, with one kill) on a BPE of 16,384 tokens, with the catalog's balancing, through `rollout run
# --executor local` (bench/gpu_local.sh's slicebpe step). It outlasts one device call (600 s), so `start` runs it
# detached (setsid: it lives on between two calls of a warm machine) and follows it until LIMIT seconds; `wait`, in
# the next call, follows it to its end and packs what it left into $OUT/local.tgz.
#
#   start: OUT=/tmp/out bash bench/gpu_slice_soak.sh start .whl [LIMIT]
#   then at once, in the next call:  OUT=$OUT bash bench/gpu_slice_soak.sh wait [LIMIT]
set -uo pipefail
mode=$1
bg=/tmp/slice-soak  # the detached run's own OUT, log and end marker
follow() {  # LIMIT: until the detached run ends or LIMIT seconds pass; its last lines
    while [ ! -e "$bg/ended" ] && [ "$SECONDS" -lt "$1" ]; do sleep 10; done
    tail -n 3 "$bg/run.log"
    tail -n 2 /tmp/local-out/local-slicebpe.log 2>/dev/null
}
case $mode in
start)
    rm -rf "$bg" && mkdir -p "$bg/out"
    # shellcheck disable=SC2016  # $1 and $2 are the inner shell's
    SLICE_SOAK=${SLICE_SOAK:-600s} SLICE_CKPT=${SLICE_CKPT:-80} SLICE_KILL=${SLICE_KILL-kill:rank=0@330s} \
        SLICE_TIMEOUT=${SLICE_TIMEOUT:-1400} STEPS=slicebpe OUT=$bg/out \
        setsid nohup bash -c 'bash bench/gpu_local.sh .debs "$1"; touch "$2/ended"' _ "$2" "$bg" \
        > "$bg/run.log" 2>&1 < /dev/null &
    follow "${3:-570}" ;;
wait)
    follow "${2:-570}"
    [ -e "$bg/ended" ] || { echo "the detached run has not ended" >&2; exit 1; }
    cp "$bg/out/local.tgz" "$bg/run.log" "${OUT:?set OUT}/" ;;
*) echo "usage: gpu_slice_soak.sh start WHEELS [LIMIT] | wait [LIMIT]" >&2; exit 2 ;;
esac
