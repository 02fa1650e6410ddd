"""What the CPU megatron-core scripts (megatron_cpu_checkpoint.py, megatron_cpu_param_gather.py) share: making
megatron-core run on the CPU over gloo, and the training step the engine's loop takes. Each script runs in a
process of its own, because megatron_on_cpu repoints torch's CUDA calls for the whole process."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch

WORKLOAD = Path(__file__).resolve().parents[3] / "stepdeploy" / "workload"


def _spawned_from_a_cpu_script() -> None:
    """A process multiprocessing spawned from one of these scripts re-imports the script, and this module: one on
    the CPU is megatron-core's persistent checkpoint writer (or a Manager), whose CUDA calls (set_device to the
    rank's GPU, synchronize after its host copies) have nothing to do here."""
    import multiprocessing

    # a spawned child imports its parent's main module while it is "inheriting" (multiprocessing/spawn.py)
    if getattr(multiprocessing.current_process(), "_inheriting", False) and not torch.cuda.is_available():
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda _device: None
        torch.cuda.synchronize = lambda *_args, **_kwargs: None


_spawned_from_a_cpu_script()


def megatron_on_cpu(rank: int, world: int, port: int) -> None:
    """Make stepdeploy/workload importable, point megatron-core's CUDA calls at the CPU, join a gloo group of
    `world` ranks on 127.0.0.1:port, and have gloo carry megatron's collectives one by one."""
    sys.path.insert(0, str(WORKLOAD))
    cuda_on_cpu()
    import rope
    import torch.distributed as dist

    rope.install()  # megatron's fused RoPE path, as the engine's build() sets it up (rope.prepare) for its config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    uncoalesced_collectives()


def cuda_on_cpu() -> None:
    def cpu(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrap(*args: Any, **kwargs: Any) -> Any:
            device = kwargs.get("device")
            if device is not None and ("cuda" in str(device) or type(device) is int):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)
        return wrap

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like", "ones_like"):
        setattr(torch, name, cpu(getattr(torch, name)))
    tensor_to, tensor_type = torch.Tensor.to, torch.Tensor.type

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple("cpu" if (isinstance(a, str) and "cuda" in a) or isinstance(a, torch.device) or type(a) is int
                     else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        return tensor_to(self, *args, **kwargs)

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        return tensor_type(self).replace("torch.", "torch.cuda.", 1)  # megatron checks for CUDA tensor types

    torch.Tensor.to, torch.Tensor.type = to, type_
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.is_available = lambda: False
    torch.cuda.current_stream = lambda *a, **k: None


def uncoalesced_collectives() -> None:
    """Have megatron-core issue the collectives it coalesces per bucket group (param all-gather, grad
    reduce-scatter) as plain async ops, one per bucket, behind a handle that waits for them all. torch's gloo
    coalesced all-gather corrupts the heap when two are in flight at once, even on one rank (torch 2.13 CPU; the
    repro is bench/gloo_coalesced_allgather.py, docs/benchmarks.md), and ParamGather puts every bucket's gather
    in flight together, as it does with NCCL on GPUs, where coalescing only groups the kernel launches. This
    changes how gloo carries each op, not when megatron or the engine dispatches it or waits for it."""
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from torch.distributed.distributed_c10d import _CoalescingManager

    handles: list[Any] = []  # the handle of each open `with _coalescing_manager(...)` block

    def issued(collective: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            work = collective(*args, **kwargs)
            if work is not None and handles:
                handles[-1].append(work)
            return work
        return call

    @contextlib.contextmanager
    def one_by_one(group: Any = None, device: Any = None, async_ops: bool = False) -> Any:
        handle = _CoalescingManager()
        handles.append(handle)
        try:
            yield handle
        finally:
            handles.pop()
        if async_ops and not handle.works:
            raise RuntimeError("megatron issued an async collective this shim does not capture")

    pgb._coalescing_manager = one_by_one
    pgb.dist_all_gather_func = issued(pgb.dist_all_gather_func)
    pgb.dist_reduce_scatter_func = issued(pgb.dist_reduce_scatter_func)


def token_batches(vocab: int, count: int, dp_rank: int = 0, rows: int = 2, seq: int = 32) -> list[torch.Tensor]:
    """`count` micro-batches of [rows, seq + 1] synthetic tokens as the engines draw them (synthetic.py)."""
    from synthetic import markov_table, markov_tokens

    table = markov_table(vocab, 1)
    return [markov_tokens(table, 1, 1, micro, dp_rank, rows, seq + 1) for micro in range(count)]


def dense_model_and_optimizer(cfg: dict[str, Any], kwargs: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """The engine's GPTModel in megatron's Float16Module and DDP (the engine's DDP config, no overlapped param
    gather) and the distributed Adam, from `seed` (after megatron_on_cpu and initialize_model_parallel)."""
    import engine_megatron as em
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(**kwargs)
    model = Float16Module(config, em.build_model(cfg, config))
    ddp = DistributedDataParallelConfig(**(em.ddp_config_kwargs(cfg) | {"overlap_param_gather": False}))
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                                                       use_distributed_optimizer=True), [model])
    return model, optimizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_step(model: Any, optimizer: Any, tokens: torch.Tensor, positions: torch.Tensor,
             after_step: Any = None) -> float:
    """One training step of a megatron DDP model and its distributed optimizer, as the engine's loop takes it."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    model.finish_grad_sync()
    optimizer.step()
    if after_step is not None:
        after_step()
    return float(loss)
