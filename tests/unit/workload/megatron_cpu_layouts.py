"""Run by test_megatron_layouts.py in a process of its own: the megatron engine's model and optimizer as the
planner's layouts shape them (workload/model_chunks.py), trained a few steps on 2 CPU ranks (gloo) with
megatron-core's own schedules (get_forward_backward_func):
- vpp: tiny-dense, PP 2 x VPP 2 (the interleaved schedule over two chunks per rank), fused AdamW;
- vpp-group: the same with 3 micro-batches a step, run by megatron in one group of 3 (the planner's
  vpp_group_size; megatron's default group, PP, refuses a last group shorter than PP);
- uneven: a 5-layer tiny-dense, PP 2 split 2/3 (num_layers_in_first/last_pipeline_stage), foreach AdamW;
- on-device and offload: tiny-dense, DP 2, from the same initial weights, torch's AdamW on the device and the
  optimizer on the host (megatron's HybridDeviceOptimizer, its host copies told apart by host_copies_apart).
Each rank reports which global layers each of its chunks holds, its parameters and the losses; rank 0 prints one
JSON line with every rank's report.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
STEPS, SEQ, MBS = 4, 32, 2


class _Stream:
    """What HybridDeviceOptimizer asks of a CUDA stream and its events, on the CPU: everything is in order."""

    def wait_stream(self, _other: Any) -> None:
        return None

    def record_event(self) -> _Stream:
        return self

    def synchronize(self) -> None:
        return None

    def wait(self, _stream: Any = None) -> None:
        return None


def cpu_streams() -> None:
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *_a, **_k: contextlib.nullcontext()
    torch.Tensor.pin_memory = lambda self, *a, **k: self


def host_copies_apart() -> None:
    """On the CPU every tensor is a host tensor, and HybridDeviceOptimizer offloads only parameters that are on
    the GPU (param.is_cuda). Have tensors answer is_cuda as on a GPU node: True, except the copies made by .cpu()
    (the offloaded master weights and their state). Once per process."""
    if getattr(torch.Tensor, "_host_copies_apart", False):
        return
    torch.Tensor._host_copies_apart = True  # type: ignore[attr-defined]
    to_cpu = torch.Tensor.cpu

    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copy = to_cpu(self, *args, **kwargs).clone()
        copy._on_host = True  # type: ignore[attr-defined]
        return copy

    def keep(method: Any) -> Any:
        def call(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = method(self, *args, **kwargs)
            if getattr(self, "_on_host", False) and torch.is_tensor(out):
                out._on_host = True
            return out
        return call

    torch.Tensor.cpu = cpu  # type: ignore[method-assign]
    empty = torch.empty
    torch.empty = lambda *a, pin_memory=False, **k: empty(*a, **k)  # no pinned allocator without CUDA
    for name in ("detach", "clone", "float"):  # a host copy's copies stay on the host
        setattr(torch.Tensor, name, keep(getattr(torch.Tensor, name)))
    torch.Tensor.is_cuda = property(lambda self: not getattr(self, "_on_host", False))  # type: ignore[assignment]
    # torch.distributed's broadcast asks a "CUDA" tensor's device for its compute capability (a checkpoint's
    # object broadcasts): answer as a GPU before sm_90 would
    torch.cuda.get_device_capability = lambda *_a, **_k: (8, 0)


class Layout:
    """A model and optimizer on this rank as the engine builds them for a layout, and its training step (the
    same micro-batches every step: the loss must fall)."""

    def __init__(self, model: str, layout_text: str, gbs: int, layers: int | None = None, seed: int = 1) -> None:
        import engine_megatron as em
        import model_chunks as mc
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.transformer_config import TransformerConfig
        from megatron_cpu import token_batches

        from stepdeploy.catalog import ModelSpec, load_model
        from stepdeploy.plan.layout import parse_layout
        from stepdeploy.render.options import RenderOptions
        from stepdeploy.render.workload import check_engine, workload_config

        spec = load_model(model)
        if layers is not None:
            spec = ModelSpec.model_validate({**spec.model_dump(), "num_layers": layers, "name": f"{model}-{layers}"})
        self.layout = parse_layout(layout_text)
        check_engine("megatron", self.layout, spec, 1)  # what render would refuse
        self.cfg = workload_config(spec, self.layout, RenderOptions(run_id="t", seq_length=SEQ, global_batch_size=gbs,
                                                                    iterations=STEPS), engine="megatron", world=2,
                                   peak_tflops=790.0)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(**em.parallel_sizes(self.cfg))
        torch.manual_seed(seed)
        self.config = TransformerConfig(**(em.transformer_config_kwargs(self.cfg) | {
            "use_cpu_initialization": True, "pipeline_dtype": torch.bfloat16}))
        self.chunks = mc.wrap_chunks(mc.build_chunks(self.cfg, self.config, em.build_model), self.config,
                                     em.ddp_config_kwargs(self.cfg))
        mc.attach_grad_sync(self.config, self.chunks, self.cfg["parallel"]["overlap_grad_reduce"])
        if self.layout.optimizer_cpu_offload:
            host_copies_apart()
        self.optimizer = mc.build_optimizer(self.cfg, self.chunks)
        self.model = mc.as_one_model(self.chunks)
        self.micro_batches = gbs // (MBS * ps.get_data_parallel_world_size())
        self.pool = token_batches(spec.vocab_size, self.micro_batches, ps.get_data_parallel_rank(), rows=MBS, seq=SEQ)
        self.forward_step = mc.lm_forward_step(torch.arange(SEQ).unsqueeze(0).expand(MBS, -1))
        self.schedule = get_forward_backward_func()

    def step(self) -> float | None:
        """One training step; the loss on the last pipeline stage, None elsewhere."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        feeds = [iter([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in self.pool]) for _ in self.chunks]
        out = self.schedule(forward_step_func=self.forward_step,
                            data_iterator=feeds if len(self.chunks) > 1 else feeds[0], model=self.chunks,
                            num_microbatches=self.micro_batches, seq_length=SEQ, micro_batch_size=MBS,
                            decoder_seq_length=SEQ, forward_only=False)
        self.optimizer.step()
        return round(float(sum(x["lm loss"] for x in out) / len(out)), 5) if out else None


def scenario(name: str, model: str, layout_text: str, gbs: int, layers: int | None = None) -> dict[str, Any]:
    import model_chunks as mc
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    built = Layout(model, layout_text, gbs, layers)
    losses = [built.step() for _ in range(STEPS)]
    chunks, optimizer, cfg, config = built.chunks, built.optimizer, built.cfg, built.config
    inner = [type(o).__name__ for o in mc.torch_optimizers(optimizer)]
    hybrid = [o for o in mc.torch_optimizers(optimizer) if type(o).__name__ == "HybridDeviceOptimizer"]
    offloaded = {"host_optimizers": sum(len(o.cpu_optimizers) for o in hybrid),
                 "device_optimizers": sum(o.gpu_optimizer is not None for o in hybrid),
                 "host_params": sum(getattr(p, "_on_host", False) for o in hybrid for c in o.cpu_optimizers
                                    for g in c.param_groups for p in g["params"]),
                 "params": sum(1 for o in hybrid for g in o.param_groups for p in g["params"])}
    fused = [bool(g.get("fused")) for o in mc.torch_optimizers(optimizer) for g in o.param_groups]
    report = {
        "rank": dist.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "chunk_layers": [[layer.layer_number for layer in c.module.module.decoder.layers] for c in chunks],
        "params": sum(p.numel() for c in chunks for p in c.parameters()),
        "losses": losses, "optimizers": inner, "fused_groups": fused, "offloaded": offloaded,
        "stage_layers": [cfg["parallel"]["first_stage_layers"], cfg["parallel"]["last_stage_layers"]],
        "vpp_group": config.microbatch_group_size_per_vp_stage, "micro_batches": built.micro_batches}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    ps.destroy_model_parallel()
    return {"name": name, "ranks": gathered}


def rank_main(rank: int, port: int, out: str, runs: str = "layouts") -> None:
    """`runs`: "layouts" (this script's scenarios) or "resume" (megatron_cpu_layout_resume.py's cases)."""
    sys.path.insert(0, str(HERE))
    from megatron_cpu import megatron_on_cpu

    megatron_on_cpu(rank, 2, port)
    cpu_streams()
    import torch.distributed as dist

    if runs == "resume":
        from megatron_cpu_layout_resume import resume_cases

        results = resume_cases(Path(out).parent)
    else:
        results = [scenario("vpp", "tiny-dense", "pp=2,vpp=2,mbs=2,optimizer=fused", gbs=4),
                   scenario("vpp-group", "tiny-dense", "pp=2,vpp=2,mbs=2", gbs=6),
                   scenario("uneven", "tiny-dense", "pp=2,mbs=2", gbs=4, layers=5),
                   scenario("on-device", "tiny-dense", "mbs=2", gbs=4),
                   scenario("offload", "tiny-dense", "mbs=2,offload=on,precision_aware_optimizer=on", gbs=4)]
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(out: str, runs: str) -> None:
    """2 gloo ranks on this machine; prints the JSON rank 0 wrote to `out`."""
    sys.path.insert(0, str(HERE))
    from megatron_cpu import free_port

    torch.multiprocessing.spawn(rank_main, args=(free_port(), out, runs), nprocs=2, join=True)
    print(Path(out).read_text())


if __name__ == "__main__":
    main(sys.argv[1], "layouts")
