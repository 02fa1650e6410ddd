#!/usr/bin/env bash
# One H200 box without sshd, driven through the local executor (issue 19). Node side as the python_env role would
# make it; the controller is this checkout on PYTHONPATH (bench/gpu_box.sh). Then: preflight of the box; the dense
# proxy's soak with a kill (`rollout run --executor local`), and nothing of it left after; with densedata, the same
# soak on data prepared from this checkout's docs (`data prepare`, GPTDataset); with STEPS naming moe, the
# Step-3.5-Flash slice's rollout (warmup, scale, soak with checkpoints and a kill) on prepared data; with moeproxy,
# the MoE proxy's rollout (warmup, soak) on the synthetic stream; with firststep, the dense rollout with every
# start's first step profiled; with moewarm, the MoE proxy's routers under a warm-up from near zero; with moevariants,
# the MoE proxy under megatron-core options (MOE_VARIANTS). Results in
# $OUT/local.tgz. The optimizers against the plan (foreach, fused, offload): bench/gpu_optim.sh.
#
#   OUT=/tmp/out [STEPS="preflight rollout densekills denseprofile slicekill moekill mfu densedata moe moeproxy slicebpe slicecontrol firststep moewarm moevariants"] bash bench/gpu_local.sh .debs .whl   # $1 unused: no sshd
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

local_rollout() {  # NAME LIMIT ARGS...: `rollout run --executor local --run-dir /tmp/NAME ARGS` within LIMIT seconds;
                   # its log, exit, report and the processes it left in $keep/NAME*
    local name=$1 limit=$2 started=$SECONDS rc=0 left
    shift 2
    # a second call on a warm box: the last call's runs (the node refuses a run directory holding another rendering)
    rm -rf "/tmp/$name" /var/lib/stepdeploy/runs/"$name"-*
    timeout "$limit" python3 -m stepdeploy rollout run -i "$inv" --executor local --run-dir "/tmp/$name" "$@" \
        > "$keep/$name.log" 2>&1 || rc=$?
    echo "exit $rc after $((SECONDS - started)) s" >> "$keep/$name.log"
    tail -n 2 "$keep/$name.log"
    python3 -m stepdeploy report "/tmp/$name" > "$keep/$name-report.txt" 2>&1
    left=$(grep -l STEPDEPLOY_RUN_ID /proc/[0-9]*/environ 2>/dev/null | wc -l)
    echo "processes with STEPDEPLOY_RUN_ID after the rollout: $left" | tee -a "$keep/$name.log"
}

steps=" ${STEPS:-preflight rollout} "
if [[ $steps == *" preflight "* ]]; then
timeout 150 python3 -m stepdeploy preflight "$inv" --json > "$keep/preflight.json" 2> "$keep/preflight.log"
echo "preflight exit $?"
fi

prepare_corpus() {  # this checkout's docs as byte-level tokens in /tmp/corpus (megatron-core's indexed format)
    python3 -m stepdeploy data prepare README.md docs --out /tmp/corpus --json > "$keep/data.json" 2> "$keep/data.log"
}

dense_soak=(-m proxy-0.7b-dense --stages "warmup,soak" --warmup-iterations 6 --soak-duration 100s
            --checkpoint-interval 40 --inject kill:rank=last@65s)
if [[ $steps == *" rollout "* ]]; then
local_rollout local-dense 300 "${dense_soak[@]}"
fi

if [[ $steps == *" densekills "* ]]; then
# issue 37: three kills in one dense soak (a checkpoint every 30 iterations), each restart part by part
local_rollout local-densekills "${KILLS_TIMEOUT:-420}" -m proxy-0.7b-dense --stages "warmup,soak" \
    --warmup-iterations 6 --soak-duration "${KILLS_SOAK:-200s}" --checkpoint-interval 30 \
    --inject kill:rank=last@50s --inject kill:rank=last@105s --inject kill:rank=last@160s
python3 bench/restart_times.py /tmp/local-densekills | tee "$keep/local-densekills-restarts.txt"
find /tmp/local-densekills -path '*soak*' -name phases.jsonl -exec cp {} "$keep/local-densekills-phases.jsonl" \;
grep -rh "resumed from" /tmp/local-densekills --include='*.log' | sort | uniq | tee -a "$keep/local-densekills-restarts.txt"
fi

if [[ $steps == *" denseprofile "* ]]; then
# issue 37: where a dense restart's model build, read and first step go (cProfile of each start's build and read,
# and of its first step), and each start's phases
local_rollout local-denseprof 300 -m proxy-0.7b-dense --stages "warmup,soak" --warmup-iterations 6 \
    --soak-duration 80s --checkpoint-interval 30 --inject kill:rank=last@45s \
    --env STEPDEPLOY_PROFILE_START=1 --env STEPDEPLOY_PROFILE_FIRST=1 ${PROFILE_ENV:+--env "$PROFILE_ENV"}
python3 bench/restart_times.py /tmp/local-denseprof | tee "$keep/local-denseprof-restarts.txt"
find /tmp/local-denseprof -path '*soak*' \( -name 'start-rank*.json' -o -name 'first-step-rank*.json' \
    -o -name phases.jsonl \) -exec cp --backup=numbered {} "$keep/" \;
fi

if [[ $steps == *" slicekill "* || $steps == *" moekill "* ]]; then
# issue 37: a restart of the Step-3.5-Flash slice (slicekill; a 48 GB checkpoint, an H200) or of the MoE proxy
# (moekill; ~50 GB, fits an H100) on the synthetic stream: one save (at 50 or 30), the kill after its commit, no
# second save before the soak ends (two such checkpoints and the writer's page-locked copy do not fit 128 GiB).
# KILL_AT may name several times ("150s 205s 268s"): each restart resumes from that one save, so each kill must
# come at a later iteration than the one before (the soak stops after 2 restarts in a row without progress)
if [[ $steps == *" slicekill "* ]]; then kill_model=step-3.5-flash-slice-1gpu kill_every=50 kill_at=115s
else kill_model=proxy-0.7b-moe kill_every=30 kill_at=100s; fi
kill_every=${KILL_EVERY:-$kill_every}
kill_run=local-${kill_model%%-1gpu}
kills=()
for at in ${KILL_AT:-$kill_at}; do kills+=(--inject "kill:rank=0@$at"); done
# what the box does around each restart (a restarted large rank's torch import and process group took 3-4x a first
# start's, call BD): every 0.5 s the page cache, shared and locked memory, the pages read in and major faults since
# boot, and the GPU memory in use, to tell a page cache evicted under /dev/shm from the driver's teardown
sample_box() {
    while :; do
        printf '%s %s %s %s\n' "$(date +%s.%N)" \
            "$(awk '/^(MemFree|Cached|Shmem|Mlocked):/ {printf "%s=%s ", $1, $2}' /proc/meminfo)" \
            "$(awk '/^(pgpgin|pgmajfault) / {printf "%s=%s ", $1, $2}' /proc/vmstat)" \
            "gpu_mib=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1)"
        sleep 0.5
    done
}
sample_box > "$keep/$kill_run-samples.txt" 2>&1 &
sampler=$!
local_rollout "$kill_run" "${KILL_TIMEOUT:-330}" -m "$kill_model" --stages "warmup,soak" --warmup-iterations 6 \
    --soak-duration "${KILL_SOAK:-150s}" --checkpoint-interval "$kill_every" --keep-checkpoints 1 "${kills[@]}"
kill "$sampler"
python3 bench/restart_times.py "/tmp/$kill_run" | tee "$keep/$kill_run-restarts.txt"
find "/tmp/$kill_run" -path '*soak*' -name phases.jsonl -exec cp --backup=numbered {} "$keep/$kill_run-phases.jsonl" \;
fi

if [[ $steps == *" mfu "* ]]; then
# issue 40: each model's MFU through the product (the scale stage's rungs, MFU_ITERS iterations each, the target
# rung the model itself) and two of its steps profiled by category (STEPDEPLOY_PROFILE: out/profile-rank0.json,
# workload/traces.py). MFU_MODELS: which (the slice needs an H200); MFU_LAYOUT: --layout for every run but a
# layout variant;
# MFU_VARIANTS: runs of each model, TAG=WHAT, whitespace-separated: WHAT empty (the engine as it is), an --env
# assignment, or layout:K=V,... (the whole --layout: a given layout starts from the defaults, mbs=1 and foreach
# AdamW among them, not from the planner's choice, so name every key the planner chose), e.g. for the dense proxy
#   MFU_MODELS=proxy-0.7b-dense MFU_VARIANTS='base= rerun= foreach=layout:mbs=8,optimizer=foreach'
#   (rerun: the noise for bench/loss_compare.py; the planner picks MBS 8 and the fused AdamW)
#   MFU_MODELS=step-3.5-flash-slice-1gpu MFU_VARIANTS='base= swiglu=STEPDEPLOY_MCORE_OVERRIDES={"bias_activation_fusion":true}'
#   (megatron's fused SwiGLU, and layers.py's compiled clamped one: gated MLPs only; the proxies' GELU MLP without
#   bias makes TransformerConfig refuse it)
#   MFU_MODELS=proxy-0.7b-dense MFU_VARIANTS='base= unfused=layout:mbs=8,optimizer=fused,rope-fusion=off'
#   (megatron's unfused RoPE, the engine before rope.py's compiled one became the default, calls BE-BH; as a layout,
#   so that the rendered plan knows it too)
# each run is local-mfu-MODEL-TAG; compare the losses with bench/loss_compare.py
for model in ${MFU_MODELS:-proxy-0.7b-dense proxy-0.7b-moe step-3.5-flash-slice-1gpu}; do
    for variant in ${MFU_VARIANTS:-base=}; do
        name=local-mfu-${model%%-1gpu}-${variant%%=*} what=${variant#*=}
        extra=()
        case $what in
            layout:*) extra+=(--layout "${what#layout:}") ;;  # instead of MFU_LAYOUT
            *) [ -n "${MFU_LAYOUT:-}" ] && extra+=(--layout "$MFU_LAYOUT")
               [ -n "$what" ] && extra+=(--env "$what") ;;
        esac
        local_rollout "$name" "${MFU_TIMEOUT:-300}" -m "$model" --stages warmup,scale --warmup-iterations 6 \
            --scale-iterations "${MFU_ITERS:-30}" --env "STEPDEPLOY_PROFILE=${MFU_PROFILE:-25:26}" "${extra[@]}"
        find "/tmp/$name" -path '*scale*fetched*' \( -name 'profile-rank0.json' -o -name metrics.jsonl \) \
            | while read -r f; do cp --backup=numbered "$f" "$keep/$name-$(basename "$f")"; done
        grep -i "mfu" "$keep/$name-report.txt" | head -4
    done
done
fi

if [[ $steps == *" densedata "* ]]; then
# the same soak on prepared data (issue 20: `data prepare`, read by megatron-core's GPTDataset)
prepare_corpus
local_rollout local-densedata 300 "${dense_soak[@]}" --data /tmp/corpus
fi

if [[ $steps == *" moe "* ]]; then
# the Step-3.5-Flash slice (an MoE target: the MoE proxy in its ladder) on prepared data, a checkpoint at iteration
# 30 of the soak (the MoE save's stall, issue 21) and a kill after it. A checkpoint is ~48 GB: the box's /dev/shm
# (half its 128 GiB) holds one, so one is kept and the soak ends before the restarted run's next save
prepare_corpus
rm -rf /tmp/local-moe /var/lib/stepdeploy/runs/local-moe-*  # before df: the room without the last call's runs
df -h /dev/shm | tee "$keep/shm.txt"
local_rollout local-moe "${MOE_TIMEOUT:-450}" -m step-3.5-flash-slice-1gpu --stages warmup,scale,soak \
    --warmup-iterations 6 --scale-iterations 10 --soak-duration "${MOE_SOAK:-150s}" --checkpoint-interval 30 \
    --keep-checkpoints 1 --inject kill:rank=last@90s --data /tmp/corpus
fi

if [[ $steps == *" moeproxy "* ]]; then
# the MoE proxy's own rollout (issue 20: it passes on one GPU) on the default data, the seeded synthetic stream:
# warm-up, then a soak whose gates judge the expert load after the warm-up; no checkpoint (~50 GB each). 300 s: the
# routers collapse in the first steps and come back as the loss leaves the unigram plateau (steps 40-80); a 60 s soak
# ends inside that and fails expert_load (docs/benchmarks-log.md, calls AJ and AL-AN)
local_rollout local-moeproxy "${MOEPROXY_TIMEOUT:-540}" -m proxy-0.7b-moe --stages warmup,soak \
    --warmup-iterations 6 --soak-duration "${MOEPROXY_SOAK:-300s}" --checkpoint-interval 100000
grep -i "expert_load\|moe_load" "$keep/local-moeproxy-report.txt" | head -5
fi

if [[ $steps == *" firststep "* ]]; then
# what a start's first step costs, and why (issue 20): the dense proxy's rollout with a kill, every start's first
# step under cProfile (--env STEPDEPLOY_PROFILE_FIRST=1): the warm-up's (a cold compile cache), the soak's first
# start and its restart (warm); first-step-rank0-<iteration>.json of each. FIRST_ENV: more KEY=VALUE for every rank
# (space-separated), e.g. FIRST_ENV=TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK=0: inductor's occupancy-driven halving of a
# reduction's block, which adds a second config to benchmark at every start (docs/benchmarks-log.md, call AK)
first_env=()
for pair in ${FIRST_ENV:-}; do first_env+=(--env "$pair"); done
local_rollout local-first "${FIRST_TIMEOUT:-200}" -m proxy-0.7b-dense --stages warmup,soak --warmup-iterations 6 \
    --soak-duration 70s --checkpoint-interval 20 --inject kill:rank=last@45s --env STEPDEPLOY_PROFILE_FIRST=1 \
    "${first_env[@]}"
find /tmp/local-first -name 'first-step-rank*.json' -path '*fetched*' -exec cp --backup=numbered {} "$keep/" \;
printf '%s\n' "$keep"/first-step*
fi

prepare_bpe() {  # a BPE of 16,384 tokens trained on this checkout's docs and the Python standard library's own
                 # sources (code and English, ~2.7M tokens, nothing downloaded) in /tmp/bpe/corpus
    local stdlib sources
    stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    mapfile -t sources < <(find "$stdlib" -name '*.py' -size +0 -not -path '*site-packages*' -not -path '*/test*' \
                           | sort)
    rm -rf /tmp/bpe
    python3 -m stepdeploy data prepare README.md docs "${sources[@]}" --train-tokenizer 16384 \
        --out /tmp/bpe/corpus --json > "$keep/bpe.json" 2> "$keep/bpe.log"
    echo "data prepare exit $?: $(tail -n 1 "$keep/bpe.log")"
}

if [[ $steps == *" slicebpe "* ]]; then
# issue 35: the Step-3.5-Flash slice on BPE-tokenized text, not bytes, with the catalog's balancing (the published
# auxiliary loss, Megatron-Bridge's step35: 1e-3, beside the expert bias) and one kill; then the control, the expert
# bias frozen (--layout router_bias_update=off, the planner's layout otherwise), which must still fail expert_load.
# A soak longer than one device call (600 s) runs detached: bench/gpu_slice_soak.sh.
prepare_bpe
# SLICE_STAGES=soak, SLICE_CKPT=100000, SLICE_KILL="": the longest soak one call holds (no warm-up, saves or kill)
slice_soak=(-m step-3.5-flash-slice-1gpu --stages "${SLICE_STAGES:-warmup,soak}" --warmup-iterations 6
            --soak-duration "${SLICE_SOAK:-300s}" --checkpoint-interval "${SLICE_CKPT:-60}" --keep-checkpoints 1
            --data /tmp/bpe/corpus)
kill_at=()
[ -n "${SLICE_KILL-kill:rank=0@150s}" ] && kill_at=(--inject "${SLICE_KILL-kill:rank=0@150s}")
local_rollout local-slicebpe "${SLICE_TIMEOUT:-560}" "${slice_soak[@]}" "${kill_at[@]}"
[[ $steps == *" slicecontrol "* ]] && local_rollout local-slicecontrol "${SLICE_TIMEOUT:-560}" "${slice_soak[@]}" \
    --layout mbs=4,optimizer=fused,router_bias_update=off
find /tmp/local-slice* -name metrics.jsonl -path '*soak*fetched*' | while read -r m; do
    cp "$m" "$keep/$(echo "$m" | cut -d/ -f3)-soak-metrics.jsonl"; done
fi

moe_run() {  # NAME ITERS WARMUP [render options...]: the MoE proxy rendered for ITERS iterations whose lr ramps from
             # peak/W over W = WARMUP iterations (render + run launch, no checkpoint); its metrics (moe_load per
             # layer, megatron's aux loss, grad norm) in $keep/NAME-metrics.jsonl and a line per step on stdout
    local name=$1 iters=$2 warmup=$3 run=/tmp/local-$1 started=$SECONDS rc=0
    shift 3
    rm -rf "$run"
    python3 -m stepdeploy render -i "$inv" -m "${MOE_MODEL:-proxy-0.7b-moe}" --stage warmup --iterations "$iters" \
        --warmup-iterations "$warmup" --save-interval 0 --run-id "$name-$(date -u +%H%M%S)" "$@" \
        --out "$run" > "$keep/$name-render.log" 2>&1 || echo "render failed: $(tail -n 3 "$keep/$name-render.log")"
    timeout "${MOE_RUN_TIMEOUT:-170}" python3 -m stepdeploy run launch "$run" --executor local --follow \
        > "$keep/$name.log" 2>&1 || rc=$?
    echo "$name: exit $rc after $((SECONDS - started)) s" | tee -a "$keep/$name.log"
    # timeout ends the client, not the run: stop it, or the next run finds its rendezvous port taken (call AL)
    [ "$rc" -eq 124 ] && python3 -m stepdeploy run stop "$run" --executor local --grace 5 >> "$keep/$name.log" 2>&1
    python3 -m stepdeploy run fetch "$run" --executor local > /dev/null 2>&1
    find "$run" -name metrics.jsonl -path '*fetched*' -exec cp {} "$keep/$name-metrics.jsonl" \;
    python3 - "$keep/$name-metrics.jsonl" <<'PY' || true
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if "moe_load_max" in line]
for r in rows:
    if r["iteration"] <= 5 or r["iteration"] % 5 == 0:
        aux = r.get("moe_aux_loss_mean")
        print(r["iteration"], f'lr {r["lr"]:.3g} loss {r["loss"]:.3f} gn {r["grad_norm"]:.3g}',
              "aux", "-" if aux is None else f"{aux:.3f}", "max", r["moe_load_max"],
              " ".join(f"{v:.2f}" for v in r["moe_load"].values()))
PY
}

if [[ $steps == *" moewarm "* ]]; then
# the MoE proxy's routers against the learning-rate warm-up (issue 20: one step at the peak collapses them)
moe_run moewarm "${MOEWARM_ITERS:-75}" "${MOEWARM_WARMUP:-50}"
fi

if [[ $steps == *" moevariants "* ]]; then
# the MoE proxy's unigram plateau and routers (issue 20) under megatron-core options set through the product
# (render --env STEPDEPLOY_MCORE_OVERRIDES): MOE_VARIANTS is "NAME=JSON NAME=JSON ..." (JSON without spaces; "{}":
# the catalog's configuration), each run MOE_VARIANT_ITERS iterations with a warm-up of MOE_VARIANT_WARMUP.
# MOE_RENDER_ARGS: more render options for every variant, e.g. "--layout grouped_gemm=false" (megatron-core's
# SequentialMLP instead of the engine's grouped experts: rules the engine's own expert kernels in or out)
# MOE_MODEL: another MoE model (e.g. step-3.5-flash-slice-1gpu); MOE_BPE=1: on prepare_bpe's data (--data /tmp/bpe/corpus)
read -ra render_args <<< "${MOE_RENDER_ARGS:-}"
if [ "${MOE_BPE:-0}" = 1 ]; then prepare_bpe; render_args+=(--data /tmp/bpe/corpus); fi
for variant in ${MOE_VARIANTS:-catalog={\}}; do
    moe_run "moe-${variant%%=*}" "${MOE_VARIANT_ITERS:-40}" "${MOE_VARIANT_WARMUP:-2}" \
        --env "STEPDEPLOY_MCORE_OVERRIDES=${variant#*=}" "${render_args[@]}"
done
fi

runs=()
for run in local-dense local-densedata local-moe local-moeproxy local-slicebpe local-slicecontrol local-first local-moewarm; do [ -d "/tmp/$run" ] && runs+=("$run"); done
for dir in /tmp/local-moe-*; do [ -d "$dir" ] && runs+=("${dir#/tmp/}"); done
tar -czf "$out/local.tgz" -C /tmp --exclude='checkpoints' --exclude='*.pt' local-out "${runs[@]}"
