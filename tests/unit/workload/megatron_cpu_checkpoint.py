"""Run by test_megatron_checkpoint.py in a process of its own: the megatron engine's save() and resume() on
CPU with megatron-core's real DDP, DistributedOptimizer and dist-checkpointing (gloo, world size 1).

megatron-core hard-codes CUDA in places (device='cuda' tensors, torch.cuda.*Tensor type checks), so this
process first points those at the CPU -- which is why it must not share a process with other tests. Trains
two steps, saves asynchronously (the engine's Saver), takes two more while the write is in flight, commits;
builds a second model and optimizer from another seed, resumes, takes the same
two steps, and prints one JSON line comparing weights, fp32 master weights, Adam state and step count with what
was saved, and the resumed run's two steps with the uninterrupted run's; then trains the same four steps with the
engine's ParamGather (the param all-gather dispatched after each step) and compares them with megatron's own.
gloo carries megatron's collectives one by one, not coalesced (megatron_cpu.uncoalesced_collectives).
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from megatron_cpu import free_port, megatron_on_cpu, one_step, token_batches


def main(model_name: str, workdir: Path) -> None:
    megatron_on_cpu(0, 1, free_port())
    import engine_megatron as em
    import host_copy
    import megatron_ckpt
    import megatron_resume
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from metrics import RankFiles

    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    cfg = workload_config(load_model(model_name), Layout(mbs=2), RenderOptions(run_id="t", seq_length=32,
                          global_batch_size=2), engine="megatron", world=1, peak_tflops=790.0)
    ps.initialize_model_parallel(1, 1)
    kwargs = em.transformer_config_kwargs(cfg) | {"use_cpu_initialization": True}
    if "num_moe_experts" in kwargs:  # the alltoall dispatcher allocates a CUDA stream
        kwargs["moe_token_dispatcher_type"] = "allgather"

    skipped: list[tuple[int, bool]] = []

    def build(seed: int, resuming_from: Path | None = None) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        config = TransformerConfig(**kwargs)
        if resuming_from is not None:  # as the engine: no random initialization when a checkpoint will be loaded
            skipped.append((megatron_resume.skip_initialization(config, resuming_from, 0),
                            not config.perform_initialization))
        model = Float16Module(config, em.build_model(cfg, config))
        # the engine's DDP config (overlapped param gather), with buckets small enough that the model has several
        ddp = DistributedDataParallelConfig(**(em.ddp_config_kwargs(cfg) | {"bucket_size": 20_000}))
        model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                                                           use_distributed_optimizer=True), [model])
        return model, optimizer

    def main_params(optimizer: Any) -> list[torch.Tensor]:
        """The distributed optimizer's fp32 master copies of the bf16 weights (what the next update starts from)."""
        return [p.detach().clone() for inner in megatron_ckpt.inner_optimizers(optimizer)
                for group in inner.shard_fp32_from_float16_groups for p in group]

    def adam_states(optimizer: Any) -> list[dict[str, torch.Tensor]]:
        return [{k: v.detach().clone().float() for k, v in state.items()}
                for inner in megatron_ckpt.inner_optimizers(optimizer) for state in inner.optimizer.state.values()]

    model, optimizer = build(1)
    pool = token_batches(cfg["model"]["vocab_size"], 16)
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)

    def train_step(model: Any, optimizer: Any, step: int, gather: Any = None) -> float:
        return one_step(model, optimizer, pool[step], positions, gather.dispatch if gather is not None else None)

    first_losses = [train_step(model, optimizer, step) for step in range(2)]
    ckpt_dir = workdir / "checkpoints"
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    files = RankFiles(workdir / "out", 0)
    host = workdir / "host"  # the host copy of each committed checkpoint (host_copy.py), as the engine keeps it
    host.mkdir(exist_ok=True)
    saver = megatron_ckpt.Saver(ckpt_dir, files, 2, 0, host=host_copy.Copier(host, 0))
    saver.save(model, optimizer, 2)  # asynchronous: a forked process writes while training goes on
    in_flight = saver.pending is not None and not (ckpt_dir / "iter_0000002").exists()
    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved_states = adam_states(optimizer)
    saved_main = main_params(optimizer)
    # the uninterrupted run's next two steps (taken while checkpoint 2 is written): the resumed run must take
    # exactly the same ones
    continued_losses = [train_step(model, optimizer, 2), train_step(model, optimizer, 3)]
    saver.poll(blocking=True)
    continued_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    phases = [json.loads(line) for line in (workdir / "out" / "phases.jsonl").read_text().splitlines()]
    checkpoint_files = sorted(p.name for p in (ckpt_dir / "iter_0000002").iterdir())

    model2, optimizer2 = build(7, ckpt_dir)
    differs_before = sum(not torch.equal(p, saved_params[n]) for n, p in model2.named_parameters())
    load_parts: dict[str, float] = {}
    resumed = megatron_resume.resume(model2, optimizer2, ckpt_dir, 0, load_parts, skipped[0][0])
    states = adam_states(optimizer2)
    main = main_params(optimizer2)
    params_differing = sum(not torch.equal(p, saved_params[n]) for n, p in model2.named_parameters())
    resumed_losses = [train_step(model2, optimizer2, 2), train_step(model2, optimizer2, 3)]

    # the engine's ParamGather (every bucket's all-gather dispatched after the step, in forward order) against
    # megatron's own (dispatched bucket by bucket from the forward's pre-hooks), from the same seed
    model3, optimizer3 = build(1)
    gather = em.ParamGather(model3)
    dispatches: list[int] = []
    for group in gather.groups:
        group.start_param_sync = counted(group.start_param_sync, dispatches)
    embedding = model3.module.module.embedding.word_embeddings.weight
    eager_losses, dispatched_per_step = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            eager_losses.append(train_step(model3, optimizer3, step, gather))
            dispatched_per_step.append(len(dispatches))
            dispatches.clear()
    # a second save, retention 1: checkpoint 2 goes once 4 is committed, and only then
    saver.keep = 1
    saver.save(model, optimizer, 4)
    both_before_commit = sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith("."))
    saver.poll(blocking=True)  # checkpoint 4 committed
    saver.poll()  # the next step's poll starts its host copy
    saver.host.join()
    host_copies = sorted(p.name for p in host.iterdir())
    at_4 = {n: p.detach().clone() for n, p in model.named_parameters()}
    # a restart on the same node: checkpoint 4 read from its host copy, the same weights as from storage
    model4, optimizer4 = build(11)
    host_parts: dict[str, float] = {}
    host_resumed = megatron_resume.resume(model4, optimizer4, ckpt_dir, 0, host_parts, 4, host)
    host_params_differing = sum(not torch.equal(p, at_4[n]) for n, p in model4.named_parameters())
    saver.finish(4)  # the end of training: the host copy goes
    print(json.dumps({
        "in_flight_after_save": in_flight, "phases": phases, "checkpoint_files": checkpoint_files,
        "load_parts": load_parts, "initialization_skipped": skipped, "before_second_commit": both_before_commit,
        "after_second_commit": sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith(".room-")),
        "eager_gather_groups": len(gather.groups),
        "eager_first_group_has_embedding": any(q is embedding for b in gather.groups[0].buckets for q in b.params_list),
        "eager_dispatched_per_step": dispatched_per_step,
        # megatron warns from a pre-hook that finds the next bucket dispatched: its order check, not ours
        "eager_redispatch_warnings": sum("already been dispatched" in str(w.message) for w in caught),
        "eager_losses": eager_losses, "lazy_losses": first_losses + continued_losses,
        "eager_params_differing": sum(not torch.equal(p, continued_params[n]) for n, p in model3.named_parameters()),
        "resumed": resumed, "params": len(saved_params), "params_differing_before": differs_before,
        "params_differing": params_differing,
        "adam_states": [len(saved_states), len(states)],
        "adam_tensors_differing": sum(not torch.equal(a[k], b[k]) for a, b in zip(saved_states, states, strict=True)
                                      for k in a if k != "step"),
        "main_params": [len(saved_main), len(main)],
        "main_params_differing": sum(not torch.equal(a, b) for a, b in zip(saved_main, main, strict=True)),
        "main_params_max_diff": max((float((a - b).abs().max()) for a, b in zip(saved_main, main, strict=True)
                                     if a.numel()), default=0.0),
        "losses_continued": continued_losses, "losses_resumed": resumed_losses,
        "params_differing_after_2_steps": sum(not torch.equal(p, continued_params[n])
                                              for n, p in model2.named_parameters()),
        "steps_saved": sorted({float(s["step"]) for s in saved_states}),
        "steps_resumed": sorted({float(s["step"]) for s in states}),
        "latest": (ckpt_dir / "latest").read_text().strip(),
        "host_copies": host_copies, "host_left_after_the_end": host.exists(), "host_resumed": host_resumed,
        "host_parts": host_parts, "host_params_differing": host_params_differing}))


def counted(fn: Any, calls: list[int]) -> Any:
    def wrap(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fn(*args, **kwargs)
    return wrap


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
