"""Metrics, heartbeat and status files written by every rank (standard library only; shipped as a file).

    out/metrics.jsonl          rank 0: one JSON object per iteration (the same keys for both engines)
    out/phases.jsonl           rank 0: where a start's time goes, one line per phase, appended by every start
                               of the run: {"phase", "time", "pid", ...}. start (the process began), initialized
                               (process group up), model, optimizer, resumed (+ iteration, load_s), first_step
                               (+ iteration, step_s),
                               save (+ iteration, began, blocking_s, background; megatron engine: setup_wait_s,
                               the wait for save_setup in it; time - began: what the step loop waited for),
                               save_setup (megatron engine: + part, began, seconds: a one-off set-up of the save,
                               done in the background),
                               save_committed (+ iteration, began: its save's, background_s: the write
                               after the step loop went on, commit_s; time: when `latest` named it)
    out/heartbeat/rank<R>      every rank: {"iteration", "time", "pid"}, rewritten every step (hang detection);
                               + "state": "saving" while a checkpoint save blocks the step loop (rewritten every
                               SAVE_BEAT_S then, for at most SAVE_BEAT_LIMIT_S: a save that hangs longer is a hang)
    out/status/rank<R>.json    every rank: {"state": "running", "pid", ...} at start, {"state": "exited",
                               "code", "reason"} at exit. A rank killed outright leaves "running" with a
                               dead pid: that is how the controller tells the rank that died from its victims.
                               launch_ranks.py adds what it saw once the worker is gone: "failed_first_at"
                               (the first of its node to fail) or "stopped_after_rank" (stopped after that rank
                               failed), "launcher_saw"; over a "running" record, "died" (or "exited"), "code".
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckpt import atomic_write_json

METRIC_KEYS = ("iteration", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "rank_step_time_s",
               "mem_allocated_gib", "mem_reserved_gib", "mem_peak_gib", "mfu", "time")
# written when given: the megatron engine's phase split; MoE models' expert load (moe_stats.py), router bias
# (expert-bias balancing), megatron's load-balancing loss per layer and MTP losses (one per MTP layer)
OPTIONAL_KEYS = ("forward_backward_s", "optimizer_s", "profiled", "moe_load", "moe_load_max", "moe_dropped",
                 "moe_load_ceiling", "router_bias", "router_bias_absmax", "router_bias_busiest", "mtp_loss",
                 "moe_aux_loss", "moe_aux_loss_mean")
SAVE_BEAT_S = 5.0
SAVE_BEAT_LIMIT_S = 420.0  # nvidia-resiliency-ext's Megatron example: checkpoint section timeout


class RankFiles:
    def __init__(self, out_dir: Path, rank: int) -> None:
        self.out_dir, self.rank = out_dir, rank
        self.heartbeat = out_dir / "heartbeat" / f"rank{rank}"
        self.status = out_dir / "status" / f"rank{rank}.json"
        self.metrics = out_dir / "metrics.jsonl"
        self.phases = out_dir / "phases.jsonl"

    def started(self, world: int, local_rank: int) -> None:
        atomic_write_json(self.status, {"state": "running", "pid": os.getpid(), "rank": self.rank, "world": world,
                                        "local_rank": local_rank, "host": socket.gethostname(),
                                        "node": os.environ.get("STEPDEPLOY_NODE_NAME"), "started": time.time()})

    def beat(self, iteration: int, state: str | None = None) -> None:
        # every step, on every rank: no fsync (the GPU idles while the host writes it)
        beat = {"iteration": iteration, "time": time.time(), "pid": os.getpid()} | ({"state": state} if state else {})
        atomic_write_json(self.heartbeat, beat, durable=False)

    @contextlib.contextmanager
    def saving(self, iteration: int, limit_s: float = SAVE_BEAT_LIMIT_S) -> Iterator[None]:
        """The heartbeat says "saving" while the block runs, rewritten every SAVE_BEAT_S up to `limit_s`."""
        stop = threading.Event()
        self.beat(iteration, "saving")

        def tick() -> None:
            deadline = time.monotonic() + limit_s
            while not stop.wait(SAVE_BEAT_S) and time.monotonic() < deadline:
                self.beat(iteration, "saving")

        ticker = threading.Thread(target=tick, name="saving-heartbeat", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            self.beat(iteration)

    def exited(self, code: int, reason: str) -> None:
        status = json.loads(self.status.read_text()) if self.status.exists() else {"rank": self.rank}
        status.update({"state": "exited", "code": code, "reason": reason[:2000], "ended": time.time()})
        atomic_write_json(self.status, status)

    def record(self, values: dict[str, Any]) -> None:
        """Append one metrics line (rank 0 only); missing keys are written as null, optional ones left out."""
        line = {key: values.get(key) for key in METRIC_KEYS} | {k: values[k] for k in OPTIONAL_KEYS if k in values}
        with open(self.metrics, "a") as handle:
            handle.write(json.dumps(line) + "\n")

    def phase(self, name: str, when: float | None = None, **data: Any) -> None:
        """Rank 0: one line of out/phases.jsonl (start-up, resume, first step, checkpoint saves: goodput)."""
        if self.rank != 0:
            return
        line = {"phase": name, "time": time.time() if when is None else when, "pid": os.getpid(), **data}
        with open(self.phases, "a") as handle:
            handle.write(json.dumps(line) + "\n")


def log(rank: int, message: str) -> None:
    print(f"[rank {rank}] {message}", flush=True)
