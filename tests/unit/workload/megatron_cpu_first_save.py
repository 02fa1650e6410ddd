"""Run by test_megatron_first_save.py and bench/ckpt_first_save.py in a process of its own: the megatron engine's
Saver on CPU (gloo, world 1, megatron-core's real DDP, DistributedOptimizer and dist-checkpointing), a few steps
between asynchronous saves, as the engine's loop takes them.

    megatron_cpu_first_save.py WORKDIR [--model tiny-dense] [--saves 3] [--steps 4] [--no-setup] [--writer fork]

--no-setup: the Saver without its set-up (SaveSetup), as before issue 21's fix. Prints one JSON line: each save's
`save` phase line, the `save_setup` lines, the thread that started each multiprocessing Manager of this process
(megatron's write-results queue is one), the bytes of each tensor megatron's first save copied to host memory
(its preload) and what megatron_ckpt.host_copy_sizes predicted for them, and the committed iterations."""

from __future__ import annotations

import argparse
import json
import multiprocessing.process
import os
import shutil
import threading
from multiprocessing import managers
from pathlib import Path
from typing import Any

import torch
from megatron_cpu import dense_model_and_optimizer, free_port, megatron_on_cpu, one_step, token_batches


def main(args: argparse.Namespace) -> None:
    if args.writer:
        os.environ["STEPDEPLOY_CKPT_WRITER"] = args.writer
    manager_threads: list[str] = []
    start = managers.BaseManager.start

    def recorded_start(self: Any, *a: Any, **k: Any) -> Any:
        manager_threads.append(threading.current_thread().name)
        return start(self, *a, **k)

    managers.BaseManager.start = recorded_start
    writers: list[int] = []  # the persistent writer processes started (megatron-core's async_loop as their target)
    process_start = multiprocessing.process.BaseProcess.start

    def recorded_process_start(self: Any) -> None:
        if getattr(getattr(self, "_target", None), "__name__", None) == "async_loop":
            writers.append(1)
        process_start(self)

    multiprocessing.process.BaseProcess.start = recorded_process_start
    megatron_on_cpu(0, 1, free_port())
    import engine_megatron as em
    import megatron_ckpt
    import megatron_writer
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from metrics import RankFiles

    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    copied: list[list[int]] = []  # per save: the bytes of each tensor its preload copied to host memory
    preload = FileSystemWriterAsync.preload_tensors

    def recorded_preload(write_buckets: Any, *a: Any, **k: Any) -> Any:
        copied.append([t.numel() * t.element_size() for _f, _k, (_b, tensors) in write_buckets for _i, t in tensors])
        return preload(write_buckets, *a, **k)

    if megatron_writer.writer_kind() == "fork":  # the persistent writer gets the preload pickled: a local one is not
        FileSystemWriterAsync.preload_tensors = staticmethod(recorded_preload)

    cfg = workload_config(load_model(args.model), Layout(mbs=2), RenderOptions(run_id="t", seq_length=32,
                          global_batch_size=2), engine="megatron", world=1, peak_tflops=790.0)
    ps.initialize_model_parallel(1, 1)
    kwargs = em.transformer_config_kwargs(cfg) | {"use_cpu_initialization": True}
    if "num_moe_experts" in kwargs:  # the alltoall dispatcher allocates a CUDA stream
        kwargs["moe_token_dispatcher_type"] = "allgather"
    model, optimizer = dense_model_and_optimizer(cfg, kwargs, 1)
    pool = token_batches(cfg["model"]["vocab_size"], 8)
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)

    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "out").mkdir(parents=True)
    files = RankFiles(workdir / "out", 0)
    ckpt_dir = workdir / "checkpoints"
    saver = megatron_ckpt.Saver(ckpt_dir, files, 2, 0, prepare=not args.no_setup)
    predicted: list[int] = []
    last = args.saves * args.steps
    for iteration in range(1, last + 1):  # the engine's loop: step, poll, save every `steps`
        one_step(model, optimizer, pool[iteration % len(pool)], positions)
        if iteration == 1:
            predicted = megatron_ckpt.host_copy_sizes(model, optimizer, device_type="cpu")
        saver.poll()
        if iteration % args.steps == 0:
            saver.save(model, optimizer, iteration)
    saver.finish(last)
    phases = [json.loads(line) for line in (workdir / "out" / "phases.jsonl").read_text().splitlines()]
    print(json.dumps({"saves": [p for p in phases if p["phase"] == "save"],
                      "setup": [p for p in phases if p["phase"] == "save_setup"],
                      "manager_threads": manager_threads, "writer_processes": len(writers),
                      "first_save_copied": copied[0] if copied else [], "predicted": predicted,
                      "committed": sorted(p.name for p in ckpt_dir.iterdir())}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps before each save")
    parser.add_argument("--no-setup", action="store_true", help="the Saver without its set-up (before the fix)")
    parser.add_argument("--writer", choices=("persistent", "fork"), help="STEPDEPLOY_CKPT_WRITER (default: its own)")
    main(parser.parse_args())
