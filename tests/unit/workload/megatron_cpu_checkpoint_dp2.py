"""Run by test_megatron_checkpoint.py in processes of their own: the megatron engine's asynchronous save on two
CPU ranks (gloo, DP 2, distributed optimizer: each rank writes its own optimizer shard). Trains a step, saves
checkpoint 1 in the background while both ranks take another step, commits; saves checkpoint 2 and aborts it
while it is being written (what a stop does); then a model and optimizer from another seed resume on both ranks
and must hold checkpoint 1's weights and each rank's own fp32 master shard. Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import megatron_cpu  # noqa: E402,F401 (a process spawned from here -- a rank's checkpoint writer -- needs its set-up)


def rank_main(rank: int, port: int, workdir: str) -> None:
    sys.path.insert(0, str(HERE))
    from megatron_cpu import dense_model_and_optimizer, megatron_on_cpu, one_step, token_batches

    megatron_on_cpu(rank, 2, port)
    import engine_megatron as em
    import megatron_ckpt
    import megatron_resume
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from metrics import RankFiles

    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    cfg = workload_config(load_model("tiny-dense"), Layout(mbs=2), RenderOptions(run_id="t", seq_length=32,
                          global_batch_size=4), engine="megatron", world=2, peak_tflops=790.0)
    ps.initialize_model_parallel(1, 1)
    kwargs = em.transformer_config_kwargs(cfg) | {"use_cpu_initialization": True}

    def build(seed: int) -> tuple[Any, Any]:
        return dense_model_and_optimizer(cfg, kwargs, seed)

    def main_shard(optimizer: Any) -> list[torch.Tensor]:
        return [p.detach().clone() for inner in megatron_ckpt.inner_optimizers(optimizer)
                for group in inner.shard_fp32_from_float16_groups for p in group]

    pool = token_batches(cfg["model"]["vocab_size"], 4, dp_rank=rank)
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)
    ckpt_dir = Path(workdir) / "checkpoints"
    files = RankFiles(Path(workdir) / "out", rank)
    model, optimizer = build(1)
    one_step(model, optimizer, pool[0], positions)
    saver = megatron_ckpt.Saver(ckpt_dir, files, 2, rank)
    saver.save(model, optimizer, 1)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved_main = main_shard(optimizer)
    one_step(model, optimizer, pool[1], positions)  # while checkpoint 1 is written
    saver.poll(blocking=True)
    dist.barrier()  # rank 0 commits after the poll; the others need not wait for it, this listing does
    # the Savers' room reserves (ckpt_room.Reserve) are not part of the store
    committed_1 = sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith(".room-"))
    one_step(model, optimizer, pool[2], positions)
    saver.save(model, optimizer, 2)
    saver.abort()  # a stop while checkpoint 2 is written: nothing may commit it
    dist.barrier()
    after_abort = sorted(p.name for p in ckpt_dir.iterdir())
    latest_after_abort = (ckpt_dir / "latest").read_text().strip()

    model2, optimizer2 = build(7)
    differing_before = sum(not torch.equal(p, saved[n]) for n, p in model2.named_parameters())
    resumed = megatron_resume.resume(model2, optimizer2, ckpt_dir, rank)
    result = {
        "rank": rank, "resumed": resumed, "committed_1": committed_1, "after_abort": after_abort,
        "latest_after_abort": latest_after_abort, "differing_before": differing_before,
        "params_differing": sum(not torch.equal(p, saved[n]) for n, p in model2.named_parameters()),
        "main_shards": len(saved_main),
        "main_differing": sum(not torch.equal(a, b) for a, b in zip(saved_main, main_shard(optimizer2), strict=True)),
        "after_resume": sorted(p.name for p in ckpt_dir.iterdir())}
    everyone: list[Any] = [None, None]
    dist.all_gather_object(everyone, result)
    if rank == 0:
        print(json.dumps(everyone))
    dist.destroy_process_group()


def main(workdir: str) -> None:
    from megatron_cpu import free_port

    sys.path.insert(0, str(HERE))
    mp.spawn(rank_main, args=(free_port(), workdir), nprocs=2, join=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main(sys.argv[1])
