"""The soak's fault matrix on a 2-node simulated cluster: 4 fault kinds x {first, last} rank/node, plus one
soak without faults. For each: the classification, detection time, restart time, iterations lost, whether
the soak completed, stray processes afterwards and whether the ledger tells a consistent story.

    python bench/fault_matrix.py [--only kill,hang] [--json] [--poll-interval SECONDS]

Each case is a soak of the torch engine (tiny-dense, gloo, checkpoint every 3 iterations) driven by the
rollout controller with one `--inject` fault. Detection time: the injection's ledger event to the
controller's `detected` event. Restart time: detection to the first metrics line written after the restart.
Iterations lost: the iteration the failed attempt reached minus the checkpoint the restart resumed from.
With --json, a kill's case also carries `kill_parts`: bench/restart_times.py's parts of the kill to the end of the
first new step (detection, stop, restart, launch, imports + process group, model build, checkpoint load, set-up,
first step), read from the case's ledger.
Goals (issue 8): crash <= 10 s, hang <= heartbeat timeout + 10 s, link-down <= process-group timeout + 10 s,
iterations lost <= one checkpoint interval, zero stray processes, no false alarm without faults.

--poll-interval sets RolloutConfig.poll_interval_s (default: the SSH executor's own, NodeExecutor.poll_interval_s):
a crash is detected at the first poll after it, so the interval bounds a crash's detection. Every poll of a case
is timed (bench/poll_cost.py: wall time, the controller's CPU) and printed under the table with the probe's own
CPU on each node (issue 37: detection over SSH within 1 s).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from poll_cost import probe_cpu, summary, timed_polls  # bench/ is this script's directory: on sys.path
from restart_times import restarts as restart_parts

from stepdeploy.inventory import load_cluster
from stepdeploy.ledger import Ledger
from stepdeploy.remote.ssh import Endpoint, connection
from stepdeploy.rollout.config import RolloutConfig, StageFailed
from stepdeploy.sim import faults as sim_faults
from stepdeploy.sim.cluster import SimConfig, down, up

PG_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, CKPT_INTERVAL, AT = 20, 15.0, 3, "40s"  # 40 s: past the first checkpoints
CASES: list[tuple[str, str, float, float]] = [  # (name, spec, soak seconds, goal seconds)
    ("kill first", f"kill:rank=first@{AT}", 95, 10),
    ("kill last", f"kill:rank=last@{AT}", 95, 10),
    ("hang first", f"hang:rank=first@{AT}", 115, HEARTBEAT_TIMEOUT_S + 10),
    ("hang last", f"hang:rank=last@{AT}", 115, HEARTBEAT_TIMEOUT_S + 10),
    ("link-down first", f"link-down:node=first@{AT},for=25s", 145, PG_TIMEOUT_S + 10),
    ("link-down last", f"link-down:node=last@{AT},for=25s", 145, PG_TIMEOUT_S + 10),
    ("node-loss first", f"node-loss:node=first@{AT},for=20s", 145, 0),
    ("node-loss last", f"node-loss:node=last@{AT},for=20s", 145, 0),
    ("no fault", "", 60, 0),
]


def run_case(cfg: SimConfig, work: Path, name: str, spec: str, seconds: float,
             poll_interval_s: float | None = None) -> dict[str, Any]:
    from stepdeploy.rollout.runner import Rollout

    run_id = re.sub(r"[^a-z0-9]+", "-", name)
    run_dir = work / run_id
    run_dir.mkdir(parents=True)
    config = RolloutConfig(inventory=str(cfg.inventory), model="tiny-dense", stages=("soak",),
                           soak_duration_s=seconds, checkpoint_interval=CKPT_INTERVAL, pg_timeout_s=PG_TIMEOUT_S,
                           seq_length=64, global_batch_size=4, inject=(spec,) if spec else (),
                           monitor_interval_s=2.0, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, node_wait_s=120.0,
                           poll_interval_s=poll_interval_s)
    ledger = Ledger(run_dir / "ledger.sqlite")
    ledger.create_run(run_id, config.to_json(), list(config.stages))
    error = ""
    with timed_polls() as polls:
        try:
            cluster = load_cluster(config.inventory)  # the sim cluster's link-down and node-loss act from the host
            Rollout(run_dir, ledger, run_id, config, cluster=cluster, faults=sim_faults.for_cluster(cluster)).run()
        except StageFailed as exc:
            error = exc.message
    parts = restart_parts(run_dir) if spec.startswith("kill") else []  # the kill to the first new step, by part
    return {**measure(cfg, ledger, run_id, run_dir, error), "poll": summary(polls["poll"]),
            "run_command": summary(polls["run_command"]), "kill_parts": parts}


def measure(cfg: SimConfig, ledger: Ledger, run_id: str, run_dir: Path, error: str) -> dict[str, Any]:
    events = ledger.events(run_id)
    fired = [e for e in events if e["kind"] == "inject" and "spec" in e["data"]]
    detected = [e for e in events if e["kind"] == "detected"]
    reclassified = [e for e in events if e["kind"] == "classified" and e["data"].get("kind")]
    restarts = [e for e in events if e["kind"] == "restart"]
    attempts = ledger.attempts(run_id, "soak")
    failed = [a for a in attempts if a["status"] == "failed"]
    final = (reclassified or detected)[-1]["data"] if detected else {}
    kind = final.get("kind")
    culprit = " ".join(x for x in (final.get("node") or "", "" if final.get("rank") is None
                                   else f"rank {final['rank']}") if x) or None
    t_inject = fired[0]["data"]["time"] if fired else None
    t_detect = detected[0]["data"]["time"] if detected else None
    rows = _metrics(run_dir)
    restart_s = None
    if restarts and t_detect is not None:
        after = [m["time"] for m in rows if m.get("time") and m["time"] > restarts[0]["data"]["time"]]
        restart_s = round(min(after) - t_detect, 1) if after else None
    resumed = _resumed(run_dir)
    failed_at = failed[0]["detail"].get("failed_at_iteration") if failed else None
    start = resumed[-1] if resumed else 0  # no "resumed from checkpoint" line: the restart began afresh
    lost = failed_at - start if failed_at is not None and failed else None
    alarms = [e for e in events if e["kind"] == "monitor" and e["data"].get("severity") == "fail"]
    detect_s = round(t_detect - t_inject, 1) if t_detect and t_inject else None
    return {"run": run_id, "kind": kind, "culprit": culprit, "detect_s": detect_s,
            "restart_s": restart_s, "failed_at": failed_at, "resumed_from": start if failed else None,
            "iterations_lost": lost, "completed": not error and ledger.stages(run_id)[0].status == "passed",
            "restarts": len(failed), "strays": _strays(cfg, run_id), "fail_findings": len(alarms),
            "ledger_ok": _consistent(events, attempts, bool(fired)), "error": error}


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    for path in sorted((run_dir / "attempts/soak-target/fetched").glob("**/out/metrics.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        if rows:
            return rows
    return []


def _resumed(run_dir: Path) -> list[int]:
    text = "\n".join(p.read_text(errors="replace")
                     for p in sorted((run_dir / "attempts/soak-target/fetched").glob("**/logs/*.log")))
    return [int(m) for m in re.findall(r"resumed from checkpoint (\d+)", text)]


def _endpoint(cfg: SimConfig, i: int) -> Endpoint:
    return Endpoint(host=cfg.address(i), key_file=cfg.client_key, known_hosts=cfg.known_hosts)


def _strays(cfg: SimConfig, run_id: str) -> int:
    count = 0
    for i in (1, 2):
        with connection(_endpoint(cfg, i)) as conn:
            res = conn.run(f"pgrep -af -- {run_id}-soak | grep -v pgrep || true", hide=True)
        count += len([line for line in res.stdout.splitlines() if line.strip()])
    return count


def _consistent(events: list[dict[str, Any]], attempts: list[dict[str, Any]], injected: bool) -> bool:
    """Every failed attempt has its detection, a clean stop, a diagnosis and a restart; only the last passed;
    an injection fired exactly once; no attempt left running."""
    failed = [a for a in attempts if a["status"] == "failed"]
    count = {k: sum(1 for e in events if e["kind"] == k) for k in ("detected", "diagnosis", "restart")}
    stops = [e for e in events if e["kind"] == "stop"]
    fired = [e for e in events if e["kind"] == "inject" and "spec" in e["data"]]
    return (bool(attempts) and attempts[-1]["status"] == "passed" and all(a["status"] != "running" for a in attempts)
            and count["detected"] == count["diagnosis"] == count["restart"] == len(failed)
            and all(not e["data"]["left"] for e in stops) and len(stops) >= len(failed)
            and len(fired) == (1 if injected else 0) and (len(failed) >= 1) == injected)


def table(results: list[tuple[str, float, dict[str, Any]]]) -> str:
    lines = ["| fault | classified | culprit | detection s (goal) | restart s | iterations lost (<= 3) | completed | "
             "restarts | stray processes | monitor fail findings | ledger consistent |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, goal, r in results:
        goal_text = f" (<= {goal:.0f})" if goal else ""
        lost = ("—" if r["iterations_lost"] is None
                else f"{r['iterations_lost']} ({r['failed_at']} -> {r['resumed_from']})")
        detect = "—" if r["detect_s"] is None else r["detect_s"]
        lines.append(f"| {name} | {r['kind'] or '—'} | {r['culprit'] or '—'} | {detect}{goal_text}"
                     f" | {r['restart_s'] if r['restart_s'] is not None else '—'} | {lost} | "
                     f"{'yes' if r['completed'] else 'NO: ' + r['error']} | {r['restarts']} | {r['strays']} | "
                     f"{r['fail_findings']} | {'yes' if r['ledger_ok'] else 'NO'} |")
    return "\n".join(lines)


def poll_lines(results: list[tuple[str, float, dict[str, Any]]], interval: float | None,
               probes: dict[str, float]) -> str:
    """One line per case: its polls' wall time and controller CPU; then the probe's CPU on each node."""
    lines = [f"poll interval: {'the executor default' if interval is None else f'{interval:g} s'}"]
    for name, _goal, r in results:
        lines.append(f"{name}: detection {r['detect_s']} s")
        for call in ("poll", "run_command"):
            p = r[call]
            lines.append(f"  {call}: {p['calls']} calls, wall median {p.get('wall_median_ms')} ms, p90 "
                         f"{p.get('wall_p90_ms')} ms, max {p.get('wall_max_ms')} ms; controller CPU median "
                         f"{p.get('cpu_median_ms')} ms a call")
    lines.append("probe CPU a poll (user+sys, 20 probes in a row): "
                 + ", ".join(f"{node} {ms} ms" for node, ms in probes.items()))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated fault kinds to run (kill,hang,link-down,...)")
    parser.add_argument("--json", action="store_true", help="also print one JSON line per case")
    parser.add_argument("--poll-interval", type=float, default=None, metavar="SECONDS",
                        help="RolloutConfig.poll_interval_s for every case (default: the SSH executor's own)")
    args = parser.parse_args()
    only = [k for k in args.only.split(",") if k]
    cases = [c for c in CASES if not only or c[0].split()[0] in only or (c[0] == "no fault" and "none" in only)]
    results = []
    probes: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="sdfbench-") as tmp:
        cfg = SimConfig(name="sdfbench", subnet="10.88.0.0/24", http_port=8089, state_dir=Path(tmp) / "sim")
        up(cfg, 2)
        try:
            for name, spec, seconds, goal in cases:
                t0 = time.monotonic()
                result = run_case(cfg, Path(tmp) / "runs", name, spec, seconds, args.poll_interval)
                result["wall_s"] = round(time.monotonic() - t0, 1)
                results.append((name, goal, result))
                if args.json:
                    print(json.dumps({"case": name, **result}), flush=True)
            probes = {f"node{i}": probe_cpu(_endpoint(cfg, i)) for i in (1, 2)}
        finally:
            report = down(cfg)
            if report.leftovers:
                print(f"sim down left: {report.leftovers}")
    print(table(results))
    print(poll_lines(results, args.poll_interval, probes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
