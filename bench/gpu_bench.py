"""GPU benchmarks of the megatron engine, launched exactly as stepdeploy launches it: render here, run the
rendered per-node launch scripts on the H200 machine, summarise here.

    python bench/gpu_bench.py render perf memory resume --out runs/gpu      # here: stepdeploy render per config
    python3 bench/gpu_bench.py device runs/gpu --out $OUT/results.tar       # there: stdlib only
    python bench/gpu_bench.py summarize /work/.device/N/results.tar         # here: tables, JSON lines

Every configuration is one `stepdeploy render` of a catalog model onto a one-node H200 inventory
(bench/inventories/h200x{1,2}.ini), with --no-nvls (NCCL_NVLS_ENABLE=0 and the other multicast switches).
On the device each configuration's results are appended to one tar file as soon as it ends, so a run cut
off by the call's time limit still returns what finished. Kinds:
- run: launch, wait, keep metrics.jsonl, memtrace.json (STEPDEPLOY_MEMTRACE=1), the log's tail;
- resume: launch, SIGKILL every process of the run once checkpoint `kill_after` is committed, launch again
  (it must resume from that checkpoint), and compare its losses with an uninterrupted reference run;
- monitor: a run with the monitor's probe command (stepdeploy.monitor.probe) run every 5 s beside it;
- script: a bench script (e.g. bench/gpu_experts.py) with --out.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the GPU machine has the repository, not an installed stepdeploy
from stepdeploy.workload.ckpt import latest_iteration  # noqa: E402  (standard library only)

REMOTE = "/tmp/sdruns"
DENSE, MOE = "proxy-0.7b-dense", "proxy-0.7b-moe"
S35 = "step-3.5-flash-slice-1gpu"


def cfg(model: str, gpus: int, layout: str | None, *, iterations: int = 20, gbs: int | None = None,
        kind: str = "run", **extra: object) -> dict:
    return {"model": model, "gpus": gpus, "layout": layout, "iterations": iterations, "gbs": gbs, "kind": kind,
            **extra}


PROFILE = ['STEPDEPLOY_PROFILE=21:22']  # torch.profiler over the last two iterations (left out of the means)
CONFIGS: dict[str, dict] = {
    # perf: the planner's own choice (no --layout), then fixed references
    "dense-1": cfg(DENSE, 1, None, iterations=22, env=PROFILE), "moe-1": cfg(MOE, 1, None, iterations=22, env=PROFILE),
    "dense-2": cfg(DENSE, 2, None, iterations=22, env=PROFILE), "moe-2": cfg(MOE, 2, None, iterations=22, env=PROFILE),
    "moe-2-nopg": cfg(MOE, 2, "mbs=8,overlap-param-gather=0", iterations=22, env=PROFILE),
    "moe-2-pg": cfg(MOE, 2, "mbs=8,overlap-param-gather=1", iterations=22, env=PROFILE),
    "dense-2-pg": cfg(DENSE, 2, "mbs=8,overlap-param-gather=1", iterations=22, env=PROFILE),
    # NCCL on fewer SMs, so that the overlapped reduce-scatter / all-gather slow the GEMMs beside them less
    "moe-2-ch8": cfg(MOE, 2, None, iterations=22, env=[*PROFILE, "NCCL_MAX_NCHANNELS=8"]),
    "moe-2-nopg-ch8": cfg(MOE, 2, "mbs=8,overlap-param-gather=0", iterations=22,
                          env=[*PROFILE, "NCCL_MAX_NCHANNELS=8"]),
    "dense-1-m4": cfg(DENSE, 1, "mbs=4"), "moe-1-m4": cfg(MOE, 1, "mbs=4"),
    "dense-2-tp2": cfg(DENSE, 2, "tp=2,mbs=4"),
    # memory: short runs (2 micro-batches per step), every recompute mode, TP/EP/DP, distributed optimizer on/off
    "mem-d1": cfg(DENSE, 1, "mbs=4", iterations=4, gbs=8),
    "mem-d1-sel": cfg(DENSE, 1, "mbs=4,recompute=selective", iterations=4, gbs=8),
    "mem-d1-full": cfg(DENSE, 1, "mbs=4,recompute=full", iterations=4, gbs=8),
    "mem-d1-nodo": cfg(DENSE, 1, "mbs=4,dist-opt=0", iterations=4, gbs=8),
    "mem-d2-dp": cfg(DENSE, 2, "mbs=4", iterations=4, gbs=16),
    "mem-d2-dp-nodo": cfg(DENSE, 2, "mbs=4,dist-opt=0", iterations=4, gbs=16),
    "mem-d2-tp": cfg(DENSE, 2, "tp=2,mbs=4", iterations=4, gbs=8),
    "mem-m1": cfg(MOE, 1, "mbs=4", iterations=4, gbs=8),
    "mem-m1-full": cfg(MOE, 1, "mbs=4,recompute=full", iterations=4, gbs=8),
    "mem-m1-sel": cfg(MOE, 1, "mbs=2,recompute=selective", iterations=4, gbs=4),
    "mem-m2-ep": cfg(MOE, 2, "ep=2,mbs=4", iterations=4, gbs=16),
    "mem-m2-ep-nodo": cfg(MOE, 2, "ep=2,mbs=4,dist-opt=0", iterations=4, gbs=16),
    "mem-m2-dp": cfg(MOE, 2, "ep=1,mbs=4", iterations=4, gbs=16),
    # resume: killed after checkpoint 4, relaunched; the reference runs the same uninterrupted
    "resume-d1": cfg(DENSE, 1, "mbs=4", iterations=10, gbs=8, kind="resume", save_interval=4, kill_after=4,
                     reference="resume-d1-ref"),
    "resume-d1-ref": cfg(DENSE, 1, "mbs=4", iterations=10, gbs=8, save_interval=4),
    "resume-m2": cfg(MOE, 2, "ep=2,mbs=4", iterations=10, gbs=16, kind="resume", save_interval=4, kill_after=4,
                     reference="resume-m2-ref"),
    "resume-m2-ref": cfg(MOE, 2, "ep=2,mbs=4", iterations=10, gbs=16, save_interval=4),
    # dense DP2 with the distributed optimizer's overlapped param gather: a save must gather every weight first
    "resume-d2": cfg(DENSE, 2, "mbs=4,overlap-param-gather=1", iterations=10, gbs=16, kind="resume", save_interval=4,
                     kill_after=4, reference="resume-d2-ref"),
    "resume-d2-ref": cfg(DENSE, 2, "mbs=4,overlap-param-gather=1", iterations=10, gbs=16, save_interval=4),
    # monitor: the soak monitors' probe beside a run
    "monitor-d2": cfg(DENSE, 2, "mbs=4", iterations=120, kind="monitor", save_interval=60),
    "monitor-d1": cfg(DENSE, 1, "mbs=4", iterations=60, kind="monitor", save_interval=30),
    "experts": {"kind": "script", "script": "bench/gpu_experts.py", "gpus": 1},
    "attention": {"kind": "script", "script": "bench/gpu_attention.py", "gpus": 1},
    # Step-3.5-Flash's one-GPU slice: the planner's own layout (profiled), then each micro-batch size
    "s35-1": cfg(S35, 1, None, iterations=22, env=PROFILE),
    "s35-1-m1": cfg(S35, 1, "mbs=1", iterations=12),
    "s35-1-m2": cfg(S35, 1, "mbs=2", iterations=12),
    "s35-1-m4": cfg(S35, 1, "mbs=4", iterations=12, gbs=16),
    # exploration: options measured before they become the engine's defaults
    "x-dense-1-m8": cfg(DENSE, 1, "mbs=8", iterations=12),
    "x-dense-1-m4-ce": cfg(DENSE, 1, "mbs=4", iterations=12,
                           env=['STEPDEPLOY_MCORE_OVERRIDES={"cross_entropy_loss_fusion": true}']),
    "x-dense-1-m4": cfg(DENSE, 1, "mbs=4", iterations=12),
    "x-dense-1-m8-ce": cfg(DENSE, 1, "mbs=8", iterations=12,
                           env=['STEPDEPLOY_MCORE_OVERRIDES={"cross_entropy_loss_fusion": true}']),
    # bf16 gradients on the wire with fp32 accumulation in the reduce-scatter (halves what the MoE proxy's DP2
    # sends; gradients then accumulate over micro-batches in bf16, and the planner, which assumes an fp32 gradient
    # buffer, over-predicts memory by that buffer's other half). Measured 2026-11-30 (1.926x), not adopted
    "x-moe-2-rsbf16": cfg(MOE, 2, None, iterations=22, env=[*PROFILE, "STEPDEPLOY_DDP_OVERRIDES=" + json.dumps(
        {"grad_reduce_in_fp32": False, "reduce_scatter_with_fp32_accumulation": True,
         "average_in_collective": False})]),  # megatron's fp32-accumulating reduce-scatter sums only
    # megatron's default pre-scales the whole (unsharded) fp32 gradient buffer by 1/DP before the reduce-scatter,
    # a pass over 8 B/param on the compute stream; average_in_collective lets NCCL average instead
    "x-moe-2-avg": cfg(MOE, 2, None, iterations=22, env=[*PROFILE, "STEPDEPLOY_DDP_OVERRIDES=" + json.dumps(
        {"average_in_collective": True})]),
    "x-moe-2-avg-pg": cfg(MOE, 2, "mbs=8,overlap-param-gather=1", iterations=22, env=[
        *PROFILE, "STEPDEPLOY_DDP_OVERRIDES=" + json.dumps({"average_in_collective": True})]),
    "x-dense-2-avg": cfg(DENSE, 2, None, iterations=22, env=[*PROFILE, "STEPDEPLOY_DDP_OVERRIDES=" + json.dumps(
        {"average_in_collective": True})]),
}
SETS = {
    "perf": ["moe-1", "moe-2", "moe-2-nopg", "dense-1", "dense-2", "dense-1-m4", "moe-1-m4", "dense-2-tp2"],
    "memory": [n for n in CONFIGS if n.startswith("mem-")],
    "resume": ["resume-d1-ref", "resume-d1", "resume-d2-ref", "resume-d2", "resume-m2-ref", "resume-m2"],
    "explore": ["x-dense-1-m4", "x-dense-1-m8", "x-dense-1-m4-ce"],
    "step35": ["attention", "s35-1", "s35-1-m1", "s35-1-m2"],
}


# --- here: render --------------------------------------------------------------------------------------------
def render(names: list[str], out: Path, env: list[str]) -> None:
    stepdeploy = Path(sys.executable).parent / "stepdeploy"
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    plan = json.loads(plan_path.read_text()) if plan_path.exists() else {}
    for name in names:
        c = CONFIGS[name]
        entry = {"name": name, **c}
        if c["kind"] != "script":
            dest = out / name
            shutil.rmtree(dest, ignore_errors=True)
            cmd = [str(stepdeploy), "render", "-i", str(HERE / "inventories" / f"h200x{c['gpus']}.ini"),
                   "-m", c["model"], "--out", str(dest), "--run-id", f"gpu-{name}", "--no-nvls",
                   "--remote-dir", REMOTE, "--python", "python3", "--iterations", str(c["iterations"]),
                   "--save-interval", str(c.get("save_interval", c["iterations"] + 1))]
            cmd += ["--layout", c["layout"]] if c["layout"] else []
            cmd += ["--gbs", str(c["gbs"])] if c["gbs"] else []
            for item in [*env, *c.get("env", [])]:
                cmd += ["--env", item]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            manifest = json.loads((dest / "manifest.json").read_text())
            entry |= {"command": shlex.join(["stepdeploy", *cmd[1:]]).replace(str(HERE.parent) + "/", ""),
                      "rendered_layout": manifest["layout"], "predicted": manifest["inputs"]["layout"],
                      "workload": json.loads((dest / "workload.json").read_text())["parallel"]}
            if c["kind"] == "monitor":
                from stepdeploy.monitor import probe

                entry["probe"] = probe.remote_command(probe.ProbeSpec(run_dir=f"{REMOTE}/gpu-{name}",
                                                                      checkpoint_dir=REMOTE))
        plan[name] = entry
        print(f"rendered {name}: {entry.get('rendered_layout', '')} {entry.get('predicted', '')}")
    plan_path.write_text(json.dumps(plan, indent=1) + "\n")


# --- there: run ---------------------------------------------------------------------------------------------
def _launch(run: str, name: str, log: Path, timeout: int) -> subprocess.Popen:
    env = dict(os.environ, STEPDEPLOY_RUN_ID=f"gpu-{name}", STEPDEPLOY_MEMTRACE="1", PYTHONUNBUFFERED="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    node = next(Path(run, "nodes").iterdir())
    return subprocess.Popen(["timeout", str(timeout), "bash", str(node / "launch.sh")], env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _collect(run: Path, log: Path) -> dict:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("Traceback (most recent call last)")]
    out: dict = {"log_tail": lines[-25:], "tracebacks": [lines[i:i + 45] for i in starts[:3]]}
    metrics = run / "out" / "metrics.jsonl"
    out["metrics"] = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    trace = run / "out" / "memtrace.json"
    out["memtrace"] = json.loads(trace.read_text()) if trace.exists() else {}
    out["profiles"] = {p.stem: json.loads(p.read_text()) for p in sorted((run / "out").glob("profile-rank*.json"))}
    latest = latest_iteration(run / "out" / "checkpoints")
    out["latest_checkpoint"] = None if latest is None else str(latest)
    return out


def _kill_run(run: Path) -> None:
    subprocess.run(["pkill", "-9", "-f", str(run)], check=False)
    time.sleep(2)


def run_one(plan_dir: Path, entry: dict, work: Path) -> dict:
    name, kind = entry["name"], entry["kind"]
    started = time.time()
    if kind == "script":
        target = work / f"{name}.json"
        proc = subprocess.run([sys.executable, entry["script"], "--out", str(target)], capture_output=True,
                              text=True, timeout=300, check=False)
        result = json.loads(target.read_text()) if target.exists() else {}
        return {"rc": proc.returncode, "stdout": proc.stdout[-6000:], "stderr": proc.stderr[-3000:],
                "result": result, "wall_s": round(time.time() - started, 1)}
    run = Path(REMOTE) / f"gpu-{name}"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(plan_dir / name, run)
    log = work / f"{name}.log"
    result: dict = {}
    proc = _launch(str(run), name, log, 400)
    if kind == "resume":
        while proc.poll() is None and (latest_iteration(run / "out" / "checkpoints") or 0) < entry["kill_after"]:
            time.sleep(0.5)
        _kill_run(run)
        proc.wait()
        result["killed_at"] = _collect(run, log)
        proc = _launch(str(run), name, log, 400)
    samples: list[dict] = []
    while proc.poll() is None:
        if kind == "monitor":
            t = time.time()
            probe = subprocess.run(["bash", "-c", entry["probe"]], capture_output=True, text=True, timeout=60,
                                   check=False)
            samples.append({"time": t, "rc": probe.returncode, "output": probe.stdout, "stderr": probe.stderr[-500:]})
            time.sleep(max(0.0, 5.0 - (time.time() - t)))
        else:
            time.sleep(0.5)
    result |= {"rc": proc.returncode, "wall_s": round(time.time() - started, 1), **_collect(run, log)}
    if samples:
        result["probe_samples"] = samples
    shutil.rmtree(run / "out" / "checkpoints", ignore_errors=True)  # the MoE proxy's are ~47 GiB each
    return result


def device(plan_dir: Path, names: list[str], out: Path) -> None:
    plan = json.loads((plan_dir / "plan.json").read_text())
    work = Path("/tmp/gpu-bench")
    work.mkdir(exist_ok=True)
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "-L"], check=False)
    for name in names or list(plan):
        entry = plan[name]
        print(f"== {name} ({entry['kind']})", flush=True)
        try:
            result = run_one(plan_dir, entry, work)
        except Exception as exc:  # keep going: the next configuration may still run
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["name"] = name
        blob = json.dumps(result).encode()
        with tarfile.open(out, "a") as tar:
            info = tarfile.TarInfo(f"{name}.json")
            info.size, info.mtime = len(blob), int(time.time())
            tar.addfile(info, io.BytesIO(blob))
        print(_line(plan[name], result), flush=True)
        for line in result.get("log_tail", [])[-4:]:
            print("   ", line[:300])


# --- both: summarise ------------------------------------------------------------------------------------------
def _steady(metrics: list[dict]) -> list[dict]:
    """Iterations 6..N (2..N for short runs), leaving out the profiled ones."""
    timed = [m for m in metrics if not m.get("profiled")]
    return timed[5:] if len(timed) > 8 else timed[1:] or timed


def summary(entry: dict, result: dict) -> dict:
    metrics = result.get("metrics", [])
    steady = _steady(metrics)

    def mean(key: str) -> float | None:
        vals = [m[key] for m in steady if isinstance(m.get(key), int | float)]
        return sum(vals) / len(vals) if vals else None

    peak = max((m.get("mem_peak_gib") or 0 for m in metrics), default=None)
    return {"name": entry["name"], "model": entry.get("model"), "gpus": entry.get("gpus"),
            "layout": entry.get("layout"), "rendered_layout": entry.get("rendered_layout"),
            "workload": entry.get("workload"), "predicted": entry.get("predicted"), "rc": result.get("rc"),
            "iterations": len(metrics), "step_s": mean("step_time_s"), "tokens_per_s": mean("tokens_per_s"),
            "mfu": mean("mfu"), "forward_backward_s": mean("forward_backward_s"), "optimizer_s": mean("optimizer_s"),
            "peak_gib": peak, "memtrace": result.get("memtrace"), "profiles": result.get("profiles") or None,
            "loss_first": metrics[0]["loss"] if metrics else None,
            "loss_last": metrics[-1]["loss"] if metrics else None, "gbs": entry.get("gbs")}


def _line(entry: dict, result: dict) -> str:
    if entry["kind"] == "script":
        return f"   rc {result.get('rc')} {result.get('stdout', '')[-1500:]}"
    s = summary(entry, result)
    return (f"   rc {s['rc']} iters {s['iterations']} step {s['step_s']} (fb {s['forward_backward_s']} opt "
            f"{s['optimizer_s']}) tok/s {s['tokens_per_s']} mfu {s['mfu']} "
            f"peak {s['peak_gib']} GiB (pred {(s['predicted'] or {}).get('predicted_torch_allocated_gib')}) "
            f"loss {s['loss_first']} -> {s['loss_last']}")


def summarize(tar_path: Path, plan_dir: Path) -> None:
    plan = json.loads((plan_dir / "plan.json").read_text())
    with tarfile.open(tar_path) as tar:
        results = {Path(m.name).stem: json.load(tar.extractfile(m)) for m in tar.getmembers() if m.isfile()}
    for name, result in results.items():
        entry = plan.get(name, {"name": name, "kind": "?"})
        if entry["kind"] in ("run", "monitor"):
            print(json.dumps(summary(entry, result)))
            if entry["kind"] == "monitor":
                print("\n".join(monitor_table(result, entry)))
        elif entry["kind"] == "resume":
            print(json.dumps(resume_check(result, results.get(entry["reference"], {}), entry)))
        else:
            print(json.dumps({"name": name, **{k: result.get(k) for k in ("rc", "result")}}))


def monitor_table(result: dict, entry: dict) -> list[str]:
    """What the soak monitors read on the GPU node during the run: one markdown row per probe sample, parsed
    by stepdeploy.monitor.probe and judged (deltas) by stepdeploy.monitor.judge and .training."""
    from stepdeploy.monitor import judge, probe, training

    spec = probe.ProbeSpec(run_dir=f"{REMOTE}/gpu-{entry['name']}", checkpoint_dir=REMOTE)
    rows = ["| t s | GPU mem MiB | util % | temp C | power W | ECC uncorr vol/agg | remap pend/fail | XIDs | "
            "heartbeat it (age s) | MemAvailable GiB | ckpt disk free GiB | findings |", "|---" * 12 + "|"]
    samples, prev = result.get("probe_samples", []), None
    for raw in samples:
        cur = probe.parse(raw["output"], "gpu", spec, raw["time"])
        found = (judge.judge_node(prev, cur) + training.judge_training(prev, cur)) if prev else []
        gpu, beat = (cur.gpus or [None])[0], (cur.heartbeats or [None])[0]
        free = getattr(cur.disk, "free_bytes", None) or getattr(cur.disk, "available_bytes", None) or 0
        cells = [f"{raw['time'] - samples[0]['time']:.0f}"]
        cells += ([f"{gpu.memory_used_mib:.0f}", f"{gpu.utilization_pct:.0f}", f"{gpu.temperature_c:.0f}",
                   f"{gpu.power_w:.0f}", f"{gpu.ecc_uncorrected_volatile}/{gpu.ecc_uncorrected_aggregate}",
                   f"{gpu.remap_pending}/{gpu.remap_failure}"] if gpu else ["-"] * 6)
        cells += [str(len(cur.xids)), f"{beat.iteration} ({cur.time - beat.time:.1f})" if beat else "-",
                  f"{cur.meminfo_kib.get('MemAvailable', 0) / 2**20:.1f}", f"{free / 2**30:.0f}",
                  "; ".join(f"{f.severity} {f.kind} {f.subject}: {f.message}" for f in found) or "-"]
        rows.append("| " + " | ".join(cells) + " |")
        prev = cur
    return rows


def resume_check(result: dict, reference: dict, entry: dict) -> dict:
    """Did the relaunch resume from the checkpoint, and do its losses follow the uninterrupted run's?"""
    killed = result.get("killed_at", {})
    after = result.get("metrics", [])
    ref = {m["iteration"]: m["loss"] for m in reference.get("metrics", [])}
    resumed = [line for line in result.get("log_tail", []) if "resumed from checkpoint" in line]
    iterations = [m["iteration"] for m in after]
    pairs = [(m["iteration"], m["loss"], ref.get(m["iteration"])) for m in after
             if m["iteration"] > entry["kill_after"] and ref.get(m["iteration"]) is not None]
    worst = max((abs(a - b) for _i, a, b in pairs), default=None)
    return {"name": entry["name"], "rc": result.get("rc"), "killed_after_checkpoint": killed.get("latest_checkpoint"),
            "iterations_logged": iterations, "resumed_lines": resumed[-2:], "vs_reference": pairs,
            "max_loss_diff": worst, "final_checkpoint": result.get("latest_checkpoint")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("render")
    r.add_argument("names", nargs="+", help="configurations or sets: " + ", ".join([*SETS, *CONFIGS]))
    r.add_argument("--out", type=Path, default=Path("runs/gpu"))
    r.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for every rank")
    d = sub.add_parser("device")
    d.add_argument("plan_dir", type=Path)
    d.add_argument("names", nargs="*")
    d.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summarize")
    s.add_argument("tar", type=Path)
    s.add_argument("--plan", type=Path, default=Path("runs/gpu"))
    args = parser.parse_args()
    if args.verb == "render":
        names = [n for item in args.names for n in SETS.get(item, [item])]
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            parser.error(f"unknown configuration(s): {', '.join(unknown)}")
        render(names, args.out, args.env)
    elif args.verb == "device":
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        device(args.plan_dir, args.names, args.out)
    else:
        summarize(args.tar, args.plan)


if __name__ == "__main__":
    main()
