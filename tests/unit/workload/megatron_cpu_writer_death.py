"""Run by test_megatron_writer_death.py in a process of its own: the megatron engine's Saver on CPU (gloo, world 1,
megatron-core's real DDP, DistributedOptimizer, dist-checkpointing and persistent writer process), a few steps
between asynchronous saves, as the engine's loop takes them; the writer is SIGKILLed while it copies the tensors of
the save of iteration --kill-at, the rank blocked in megatron-core's wait for that copy.

    megatron_cpu_writer_death.py WORKDIR [--steps 2] [--kill-at 4]

The writer holds that save's copy (its preload, wrapped here: it writes its pid to WORKDIR/writer-holding, then
sleeps) until a thread of the rank kills it. Prints a JSON line when it kills the writer ({"killed": pid, "at":
time, "children": the rank's other child processes then}); the watchdog should then end the process with the
writer's death in its log. Exit 0 with a last line {"finished": ...} when it did not."""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

# at module level: the writer is a process spawned from here, which re-imports this script (megatron_cpu makes its
# CUDA calls no-ops on the CPU)
from megatron_cpu import dense_model_and_optimizer, free_port, megatron_on_cpu, one_step, token_batches


def held_preload(preload: Any, marker: str) -> Any:
    """In the writer: say that it holds the save's host copy (its pid in `marker`), then hold it."""
    Path(marker + ".tmp").write_text(str(os.getpid()))
    os.replace(marker + ".tmp", marker)
    time.sleep(600)
    return preload()


def kill_the_writer(marker: Path) -> None:
    while not marker.exists():
        time.sleep(0.05)
    pid = int(marker.read_text())
    children = [p.pid for p in multiprocessing.active_children() if p.pid != pid]
    os.kill(pid, signal.SIGKILL)
    print(json.dumps({"killed": pid, "at": time.time(), "children": children}), flush=True)


def main(args: argparse.Namespace) -> None:
    os.environ["STEPDEPLOY_CKPT_WRITER"] = "persistent"
    megatron_on_cpu(0, 1, free_port())
    import engine_megatron as em
    import megatron_ckpt
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from metrics import RankFiles

    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "out").mkdir(parents=True)
    marker = workdir / "writer-holding"
    hold = {"on": False}
    save_function_and_args = FileSystemWriterAsync.get_save_function_and_args

    def held(self: Any) -> Any:
        save_fn, preload_fn, save_args = save_function_and_args(self)
        if hold["on"] and preload_fn is not None:  # the save to kill the writer in: its copy waits
            preload_fn = functools.partial(held_preload, preload_fn, str(marker))
        return save_fn, preload_fn, save_args

    FileSystemWriterAsync.get_save_function_and_args = held

    cfg = workload_config(load_model("tiny-dense"), Layout(mbs=2), RenderOptions(run_id="t", seq_length=32,
                          global_batch_size=2), engine="megatron", world=1, peak_tflops=790.0)
    ps.initialize_model_parallel(1, 1)
    model, optimizer = dense_model_and_optimizer(cfg, em.transformer_config_kwargs(cfg) | {"use_cpu_initialization":
                                                                                           True}, 1)
    pool = token_batches(cfg["model"]["vocab_size"], 8)
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)
    saver = megatron_ckpt.Saver(workdir / "checkpoints", RankFiles(workdir / "out", 0), 2, 0)
    threading.Thread(target=kill_the_writer, args=(marker,), daemon=True).start()
    for iteration in range(1, args.kill_at + 1):  # the engine's loop: step, poll, save every `steps`
        one_step(model, optimizer, pool[iteration % len(pool)], positions)
        saver.poll()
        if iteration % args.steps == 0:
            hold["on"] = iteration == args.kill_at
            saver.save(model, optimizer, iteration)
    saver.finish(args.kill_at)
    print(json.dumps({"finished": args.kill_at}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--steps", type=int, default=2, help="steps before each save")
    parser.add_argument("--kill-at", type=int, default=4, help="the iteration whose save the writer dies in")
    main(parser.parse_args())
