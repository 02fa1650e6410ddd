"""Run by test_step35_equivalence.py in processes of their own: the Step-3.5-Flash layers with expert parallelism 2
on two CPU ranks (gloo), as step-3.5-flash-slice-ep2 runs on two GPUs. A tiny variant (megatron_cpu_step35.py's,
4 experts: 2 per rank) is built on both ranks; both train on the same tokens, so each rank's per-token loss must
equal the independent reference's with all four experts (gathered from the ranks); one step through megatron's
DDP and finalize_model_grads must leave the same router bias on both ranks (the expert loads are all-reduced).
Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
SEQ, BATCH = 32, 2


def rank_main(rank: int, port: int, out: str) -> None:
    sys.path.insert(0, str(HERE))
    from megatron_cpu import megatron_on_cpu

    megatron_on_cpu(rank, 2, port)
    import engine_megatron as em
    import step35_reference as ref
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_cpu_step35 import layer_weights, relative, tiny_step_model

    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    spec = tiny_step_model()
    cfg = workload_config(spec, Layout(ep=2, mbs=BATCH), RenderOptions(run_id="t", seq_length=SEQ,
                          global_batch_size=2 * BATCH), engine="megatron", world=2, peak_tflops=790.0)
    cfg["parallel"]["experts"] = "grouped_mm_eager"
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    kwargs = em.transformer_config_kwargs(cfg) | {
        "bf16": False, "params_dtype": torch.float32, "pipeline_dtype": torch.float32,
        "use_cpu_initialization": True, "moe_token_dispatcher_type": "allgather",
        "moe_shared_expert_overlap": False}
    torch.manual_seed(3)  # the same dense weights on both ranks; each builds its own two experts
    config = TransformerConfig(**kwargs)
    gpt = em.build_model(cfg, config)
    with torch.no_grad():  # the experts differ between the ranks: each draws its own
        for name, param in gpt.named_parameters():
            if "experts.weight" in name:
                param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(100 + rank))
    model = cfg["model"]
    torch.manual_seed(11)
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ + 1))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)

    def whole() -> dict:
        """The reference's weights: every expert, gathered from both ranks."""
        def full(param: torch.Tensor) -> torch.Tensor:
            if param.dim() == 3:  # stacked experts [local, in, out]
                parts = [torch.empty_like(param) for _ in range(2)]
                dist.all_gather(parts, param.detach().contiguous())
                return torch.cat(parts)
            return param.detach()
        layers = gpt.decoder.layers
        return {"embedding": gpt.embedding.word_embeddings.weight.detach(), "output": gpt.output_layer.weight.detach(),
                "final_norm": gpt.decoder.final_layernorm.weight.detach(),
                "layers": [layer_weights(layers[i], model["layers"][i], spec, full) for i in range(spec.num_layers)]}

    with torch.no_grad():
        losses = gpt(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
        expected = ref.model_losses(tokens, whole(), model, ref.Switches())
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=gpt)
    router = gpt.decoder.layers[1].mlp.router
    ddp.zero_grad_buffer()
    gpt(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean().backward()
    finalize_model_grads([ddp])
    biases = [torch.empty_like(router.expert_bias) for _ in range(2)]
    dist.all_gather(biases, router.expert_bias.detach())
    local_experts = [m.weight1.shape[0] for m in gpt.modules() if hasattr(m, "weight1")]
    result = {"rank": rank, "loss_vs_reference": relative(losses, expected), "local_experts": local_experts,
              "bias_rank0": biases[0].tolist(), "bias_rank1": biases[1].tolist(),
              "bias_moved": float((biases[0] - torch.tensor([0.0] * 4)).abs().max())}
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()


def main(out: str) -> None:
    from megatron_cpu import free_port

    mp.spawn(rank_main, args=(free_port(), out), nprocs=2, join=True)
    print(Path(out).read_text())


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main(sys.argv[1])
