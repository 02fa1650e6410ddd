"""The `megatron` engine (GPU): megatron-core's GPTModel built from the catalog model with the plan's
TP/PP/VPP/EP/ETP/DP, its pipeline split and its optimizer (foreach or fused AdamW, or offloaded to the host:
model_chunks.py), trained with megatron's DDP + distributed optimizer on a synthetic Markov-chain stream or an
indexed dataset through megatron-core's GPTDataset (data.py), saved with dist-checkpointing. Standard library +
torch + megatron-core only (shipped as a file).

Without TransformerEngine, stock megatron-core's local layer spec uses an unfused attention (half the speed,
2.3x the memory of SDPA: FACTS); this engine puts torch SDPA in its place (flash or cuDNN kernels, causal,
GQA), or flash-attn's kernel when flash-attn is importable. Context parallelism needs TE's attention and is
refused at render time; MoE experts run on torch._grouped_mm (experts_grouped.py) instead of SequentialMLP's loop.
Checkpoints need a directory that all ranks share (one node, or a shared FS).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import attention
import data
import experts_grouped
import layers
import megatron_ckpt
import model_chunks
import moe_stats
import torch
import torch.distributed as dist
import torch.nn.functional as F
import traces
from metrics import RankFiles, log
from schedule import lr_at

WEIGHT_DECAY = model_chunks.WEIGHT_DECAY


def transformer_config_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """megatron-core TransformerConfig arguments from workload.json (pure: testable without megatron)."""
    m, p = cfg["model"], cfg["parallel"]
    kwargs: dict[str, Any] = {
        "num_layers": m["num_layers"], "hidden_size": m["hidden_size"],
        "num_attention_heads": m["num_attention_heads"], "num_query_groups": m["num_query_groups"],
        "kv_channels": m["kv_channels"], "ffn_hidden_size": m["ffn_hidden_size"],
        "normalization": m["normalization"], "gated_linear_unit": m["gated_linear_unit"],
        "activation_func": F.silu if m["gated_linear_unit"] else F.gelu,
        "add_bias_linear": m["add_bias_linear"], "add_qkv_bias": m["add_qkv_bias"],
        "qk_layernorm": m["qk_layernorm"],
        "tensor_model_parallel_size": p["tp"], "pipeline_model_parallel_size": p["pp"],
        "context_parallel_size": p["cp"], "expert_model_parallel_size": p["ep"],
        "expert_tensor_parallel_size": p["etp"], "sequence_parallel": p["sequence_parallel"] and p["tp"] > 1,
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "bf16": True, "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16,
        # Fusions that need apex or TransformerEngine are off; torch SDPA replaces the unfused attention.
        "gradient_accumulation_fusion": False, "bias_activation_fusion": False, "masked_softmax_fusion": False,
        "persist_layer_norm": False, "apply_rope_fusion": False,
        # megatron-core's own fused vocab-parallel cross-entropy (no TE needed): measured on one H200, dense
        # proxy MBS 4: 59.4 % MFU against 58.3 % unfused, +1 GiB peak (docs/benchmarks.md, 2026-11-29)
        "cross_entropy_loss_fusion": p.get("cross_entropy_fusion", True), "cross_entropy_fusion_impl": "native",
    }
    kwargs |= model_chunks.pipeline_kwargs(p)  # virtual pipeline, p2p overlap, first/last stage sizes
    if p["recompute"] == "full":
        kwargs |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    elif p["recompute"] == "selective":
        kwargs["recompute_granularity"] = "selective"
    if m.get("mtp_num_layers"):
        kwargs["mtp_num_layers"] = m["mtp_num_layers"]  # megatron's MTP loss scale (0.1 over the layers) applies
    moe = m["moe"]
    if moe:
        dense = moe["first_dense_layers"]
        kwargs |= {
            "num_moe_experts": moe["num_experts"], "moe_router_topk": moe["topk"],
            "moe_ffn_hidden_size": moe["ffn_hidden_size"],
            "moe_shared_expert_intermediate_size": moe["shared_expert_ffn_hidden_size"] or None,
            "moe_layer_freq": [0] * dense + [1] * (m["num_layers"] - dense),
            "moe_router_score_function": moe["score_function"],
            "moe_router_enable_expert_bias": moe["router_expert_bias"],
            "moe_token_dispatcher_type": p["dispatcher"] if p["dispatcher"] != "flex" else "alltoall",
            "moe_grouped_gemm": False,
        } | load_balancing_kwargs(moe, router_bias_update(p))
        if moe["router_scaling_factor"]:
            kwargs["moe_router_topk_scaling_factor"] = moe["router_scaling_factor"]
        if moe.get("router_fp32"):
            kwargs["moe_router_dtype"] = "fp32"
    return kwargs


def router_bias_update(p: dict[str, Any]) -> bool:
    """workload.json `parallel.router_bias_update` (default on): off, the expert bias stays at zero -- the routers
    still choose with it (so the model, its checkpoints and the all-reduce are unchanged) but finalize_model_grads
    moves it by 0 x sign(...). For control runs: what the load does without the update."""
    value = p.get("router_bias_update", True)
    if isinstance(value, str):
        value = value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


def load_balancing_kwargs(moe: dict[str, Any], bias_update: bool = True) -> dict[str, Any]:
    """megatron's auxiliary loss (aux_loss_coeff; 0: none), and with `expert_bias` the router bias that
    finalize_model_grads moves after every step by rate x sign(mean load - load) (the slice has both: catalog);
    `bias_update` False holds that bias at zero (rate 0: router_bias_update)."""
    coeff = moe.get("aux_loss_coeff", 1e-2)
    rate = moe["bias_update_rate"] if bias_update else 0.0
    bias = {"moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": rate}
    return {"moe_router_load_balancing_type": "aux_loss" if coeff > 0 else "none", "moe_aux_loss_coeff": coeff} | (
        bias if moe.get("load_balancing", "aux_loss") == "expert_bias" else {})


def keep_router_counts_fp32(models: list[Any]) -> int:
    """Float16Module casts every buffer to bf16, the routers' token counters too (megatron-core 0.16.1 keeps
    only the expert bias in fp32). A bf16 counter stops counting once a micro-batch's tokens for an expert fall
    below half its spacing (a count of 65,536 ignores any addition under 256), and the expert-bias update then
    reads wrong loads; back to fp32 here. -> counters converted"""
    converted = 0
    for model in models:
        for module in model.modules():
            counts = getattr(module, "local_tokens_per_expert", None)
            if isinstance(counts, torch.Tensor) and counts.dtype != torch.float32:
                counts.data = counts.data.float()
                converted += 1
    return converted


def parallel_sizes(cfg: dict[str, Any]) -> dict[str, int]:
    p = cfg["parallel"]
    sizes = {"tensor_model_parallel_size": p["tp"], "pipeline_model_parallel_size": p["pp"],
             "context_parallel_size": p["cp"], "expert_model_parallel_size": p["ep"],
             "expert_tensor_parallel_size": p["etp"]}
    if p.get("vpp", 1) > 1:
        sizes["virtual_pipeline_model_parallel_size"] = p["vpp"]
    return sizes


def sdpa_core_attention() -> type:
    """The core attention of every layer of a uniform model (full causal attention): attention.py's."""
    return attention.core_attention_class(None)


def choose_experts(config: Any, experts: str) -> str | None:
    """Set up the grouped experts when workload.json asks for them and they can run (None), else say why not
    (megatron's SequentialMLP then). Logs the choice."""
    grouped = experts.startswith("grouped_mm")  # grouped_mm (compiled elementwise), grouped_mm_eager
    reason = experts_grouped.unsupported_reason(config) if grouped else f"workload.json: {experts}"
    if reason is None:
        experts_grouped.ELEMENTWISE = "eager" if experts == "grouped_mm_eager" else "compile"
    chosen = f"torch._grouped_mm, {experts_grouped.ELEMENTWISE} elementwise" if reason is None else None
    log(dist.get_rank() if dist.is_initialized() else 0, f"MoE experts: {chosen or f'SequentialMLP ({reason})'}")
    return reason


def layer_specs(config: Any, normalization: str, experts: str = "grouped_mm", vp_stage: int | None = None) -> Any:
    """megatron-core's local (no-TE) decoder block spec with SDPA as every layer's core attention, and MoE
    experts on torch._grouped_mm (experts_grouped.py) unless `experts` is "sequential" or it cannot run."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=normalization,
                                       vp_stage=vp_stage)
    core = sdpa_core_attention()
    for spec in block.layer_specs:
        spec.submodules.self_attention.submodules.core_attention = core
    if config.num_moe_experts and choose_experts(config, experts) is None:
        experts_grouped.use_in_block_spec(block, config)
    return block


def model_specs(cfg: dict[str, Any], config: Any, vp_stage: int | None = None) -> tuple[Any, Any]:
    """The decoder block spec and the MTP block spec (None without MTP or off its stage): megatron's stock spec
    for a uniform model, layers.py's per-layer specs otherwise (Step-3.5-Flash)."""
    m, experts = cfg["model"], cfg["parallel"].get("experts", "grouped_mm")
    if m.get("uniform_attention", True) and not m["mtp_layers"]:
        return layer_specs(config, m["normalization"], experts, vp_stage), None
    if config.num_moe_experts and choose_experts(config, experts) is not None:
        experts = "sequential"
    rank = dist.get_rank() if dist.is_initialized() else 0
    for kind in sorted({(layer["attention"], layer["window"]) for layer in m["layers"] + m["mtp_layers"]}, key=str):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        log(rank, f"{kind[0]} attention layers: {attention.kernel_name(kind[1], device)}")
    return (layers.block_spec(cfg, config, experts, vp_stage),
            layers.mtp_block_spec(cfg, config, experts, vp_stage))


def _define_missing_te_names() -> None:
    """megatron-core 0.16.1 leaves moe_utils.te_general_gemm undefined without TransformerEngine (0.19 sets None)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_model(cfg: dict[str, Any], config: Any, pre_process: bool = True, post_process: bool = True,
                vp_stage: int | None = None) -> Any:
    """GPTModel of this rank's pipeline stage (of its virtual stage `vp_stage` with an interleaved pipeline)."""
    from megatron.core.models.gpt import GPTModel

    _define_missing_te_names()
    m = cfg["model"]
    block, mtp = model_specs(cfg, config, vp_stage)
    return GPTModel(config=config, transformer_layer_spec=block, mtp_block_spec=mtp,
                    vocab_size=m["vocab_size"], max_sequence_length=m["max_position_embeddings"],
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not m["untie_embeddings_and_output_weights"],
                    position_embedding_type=m["position_embedding_type"], vp_stage=vp_stage)


def train(cfg: dict[str, Any], out_dir: Path, files: RankFiles) -> int:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    t = cfg["training"]
    seq, mbs, gbs = t["seq_length"], t["micro_batch_size"], t["global_batch_size"]
    ps.initialize_model_parallel(**parallel_sizes(cfg))
    model_parallel_cuda_manual_seed(t["seed"])
    dp = ps.get_data_parallel_world_size()
    micro_batches = gbs // (mbs * dp)
    overrides = config_overrides(rank, "STEPDEPLOY_MCORE_OVERRIDES")
    config = TransformerConfig(**(transformer_config_kwargs(cfg) | overrides))
    resume_from = megatron_ckpt.skip_initialization(config, out_dir / "checkpoints", rank)
    trace = traces.MemoryTrace(out_dir, rank)
    p = cfg["parallel"]
    ddp = ddp_config_kwargs(cfg) | config_overrides(rank, "STEPDEPLOY_DDP_OVERRIDES")
    chunks = model_chunks.wrap_chunks([c.cuda() for c in model_chunks.build_chunks(cfg, config, build_model)],
                                      config, ddp)
    keep_router_counts_fp32(chunks)
    model = model_chunks.as_one_model(chunks)  # the DDP model, or with VPP its chunks in one
    trace.mark("model")
    files.phase("model")
    model_chunks.attach_grad_sync(config, chunks, ddp["overlap_grad_reduce"])
    optimizer = model_chunks.build_optimizer(cfg, chunks)
    trace.mark("optimizer")
    files.phase("optimizer")
    params = sum(q.numel() for q in model.parameters())
    log(rank, f"megatron engine: {params:,} parameters on this rank, world {world}, DP {dp}, "
              f"{micro_batches} micro-batch(es) of {mbs}x{seq}, layout {p}")
    if config.moe_router_enable_expert_bias:
        log(rank, f"router expert bias: update rate {config.moe_router_bias_update_rate}"
                  + ("" if router_bias_update(p) else " (parallel.router_bias_update off: the bias stays at zero)"))
    m = cfg["model"]
    stats = moe_stats.RouterStats(m["num_layers"] + (m.get("mtp_num_layers") or 0), m["moe"]["num_experts"],
                                  m["moe"]["topk"], "cuda", micro_batches) if m["moe"] else None
    if stats is not None:
        stats.watch_megatron(model)
    mtp_layers = m.get("mtp_num_layers") or 0
    source = data.source_for(cfg, ps.get_data_parallel_rank(), micro_batches, "cuda", megatron=True)
    positions = torch.arange(seq, device="cuda").unsqueeze(0).expand(mbs, -1)

    def batches(iteration: int) -> Any:
        for micro in range(micro_batches):
            tokens = source.micro_batch(iteration, micro)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    forward_step = model_chunks.lm_forward_step(positions)
    forward_backward = get_forward_backward_func()
    ckpt_dir, load_parts = out_dir / "checkpoints", {}
    # the save's one-off set-up starts now, in the background, when this run saves at all: the writer processes it
    # spawns start while the checkpoint is read (the GPU idle), not beside the first step
    saver = megatron_ckpt.Saver(ckpt_dir, files, t.get("keep_checkpoints", 2), rank, prepare=bool(t["save_interval"]))
    loading = time.time()
    start = megatron_ckpt.resume(model, optimizer, ckpt_dir, rank, load_parts, resume_from)
    files.phase("resumed", iteration=start, load_s=round(time.time() - loading, 3), load_parts=load_parts)
    for group in optimizer.param_groups:
        # as megatron's OptimizerParamScheduler: no decay for the groups it marks wd_mult 0 (norms, biases)
        group["weight_decay"] = WEIGHT_DECAY * group.get("wd_mult", 1.0)
    torch.cuda.reset_peak_memory_stats()
    profile = traces.StepProfile(out_dir, rank, os.environ.get("STEPDEPLOY_PROFILE"), first_step=start + 1)
    backward_done, step_done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gather = ParamGather(model)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for iteration in range(start + 1, t["iterations"] + 1):
        # a step is timed from the end of the one before (so the report and the loop's own overhead count), to
        # the end of its optimizer step on the compute stream (an overlapped param gather may still be running)
        profile.before(iteration)
        lr = lr_at(iteration, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.zero_grad_buffer()
        optimizer.zero_grad()
        feeds = [batches(iteration) for _ in chunks]  # one stream per chunk: each sees every micro-batch once
        losses = forward_backward(forward_step_func=forward_step, data_iterator=feeds if len(chunks) > 1 else feeds[0],
                                  model=chunks,
                                  num_microbatches=micro_batches, seq_length=seq, micro_batch_size=mbs,
                                  decoder_seq_length=seq, forward_only=False)
        if iteration <= start + 2:
            trace.mark(f"forward_backward_{iteration - start}")
        # the phase split is read from CUDA events after the step: a synchronize here would idle the GPU while
        # the host starts the optimizer step (a fixed cost per step, which DP does not shrink)
        backward_done.record()
        _ok, grad_norm, _zeros = optimizer.step()
        gather.dispatch()
        if iteration <= start + 2:
            trace.mark(f"optimizer_step_{iteration - start}")
        step_done.record()
        step_done.synchronize()
        ended = time.perf_counter()
        step = ended - began
        optimizer_s = backward_done.elapsed_time(step_done) / 1e3
        phases: dict[str, Any] = {"forward_backward_s": round(step - optimizer_s, 4),
                                  "optimizer_s": round(optimizer_s, 4)}
        profiled = profile.after(iteration, step)
        if profiled:
            phases["profiled"] = True  # the profiler's overhead is in this step: means leave it out
        loss = (sum(x["lm loss"] for x in losses) / len(losses)).float() if losses else torch.zeros((), device="cuda")
        if stats is not None:
            phases |= stats.reduce()
        mtp = moe_stats.mtp_losses(mtp_layers, micro_batches, "cuda") if mtp_layers else None
        report(cfg, files, iteration, loss, grad_norm, lr, step, world, ps.is_pipeline_last_stage(), phases, mtp)
        if iteration == start + 1:
            files.phase("first_step", iteration=iteration, step_s=round(step, 4))
            saver.prepare_host_memory(model, optimizer)  # the optimizer's state exists now
            ended = time.perf_counter()  # the next step's time does not include it
        began = time.perf_counter() if profiled else ended  # not the profiler's write-out either
        if saver.poll():  # a save in flight ended everywhere and was committed
            began = time.perf_counter()  # its finalize is the checkpoint's time (save_committed), not a step's
        if t["save_interval"] and iteration % t["save_interval"] == 0:
            saver.save(model, optimizer, iteration)
            began = time.perf_counter()  # a save is not the next step's time
    saver.finish(t["iterations"])
    trace.mark("end")
    ps.destroy_model_parallel()
    return 0


class ParamGather:
    """The distributed optimizer's overlapped parameter all-gather, dispatched whole right after each optimizer
    step in forward order, instead of megatron's default: one bucket at a time from the next forward's module
    pre-hooks. Those launch NCCL from the host in the middle of the forward -- in the MoE layers just after the
    router's device-to-host sync, when the GPU has nothing queued -- so on 2 H200s overlapping cost more forward
    time than the gather it hid (docs/benchmarks.md). Dispatched here, the gather runs under the step's end and
    the next forward, and the pre-hooks only wait for their bucket (megatron's own skip for a gather already
    dispatched by the optimizer step). Off unless the DDP config overlaps the param gather."""

    def __init__(self, model: Any) -> None:
        self.groups: list[Any] = []
        if not model.ddp_config.overlap_param_gather:
            return
        model.overlap_param_gather_with_optimizer_step = True  # pre-hooks wait, never dispatch
        order = {id(param): i for i, param in enumerate(model.parameters())}  # registration = forward order
        groups = [*model.bucket_groups, *model.expert_parallel_bucket_groups]
        self.groups = sorted(groups, key=lambda g: min(order[id(q)] for b in g.buckets for q in b.params_list))

    def dispatch(self) -> None:
        for group in self.groups:
            group.start_param_sync()


def ddp_config_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """megatron-core DistributedDataParallelConfig arguments from workload.json (pure). Gradients are reduced in
    fp32 (what megatron's training loop does for bf16), and averaged by NCCL inside the collective: megatron's
    default instead multiplies the whole unsharded fp32 gradient buffer by 1/DP before it (one more pass over
    8 B/param on the compute stream; measured 7.5 ms a step for the MoE proxy on 2 H200s, docs/benchmarks.md).
    With the distributed optimizer and overlap_param_gather, the parameters' all-gather after the optimizer step
    runs under the next forward (dispatched whole by ParamGather); otherwise the step waits for it (the planner
    settles which: plan.search.settle_param_gather)."""
    p = cfg["parallel"]
    return {"grad_reduce_in_fp32": True, "average_in_collective": True, "overlap_grad_reduce": p["overlap_grad_reduce"],
            "use_distributed_optimizer": p["distributed_optimizer"],
            "overlap_param_gather": bool(p.get("overlap_param_gather") and p["distributed_optimizer"]
                                         and p["overlap_grad_reduce"])}


def config_overrides(rank: int, variable: str) -> dict[str, Any]:
    """megatron-core config fields from a JSON object in the environment (`render --env` sets it), for measuring
    an option before making it the engine's default: STEPDEPLOY_MCORE_OVERRIDES for TransformerConfig,
    STEPDEPLOY_DDP_OVERRIDES for DistributedDataParallelConfig. The planner does not know about them."""
    overrides = json.loads(os.environ.get(variable) or "{}")
    if not isinstance(overrides, dict):
        raise ValueError(f"{variable} must be a JSON object, got {overrides!r}")
    if overrides:
        log(rank, f"overrides from {variable}: {overrides}")
    return overrides


def report(cfg: dict[str, Any], files: RankFiles, iteration: int, loss: torch.Tensor, grad_norm: float | None,
           lr: float, step: float, world: int, last_stage: bool, phases: dict[str, Any] | None = None,
           mtp: torch.Tensor | None = None) -> None:
    """`phases`: extra keys for the metrics line; `mtp`: this rank's MTP losses (averaged like the LM loss)."""
    t = cfg["training"]
    # one collective and one device-to-host copy: [loss sum, last-stage ranks, each rank's step s, each rank's peak,
    # the MTP losses' sums]
    n_mtp = 0 if mtp is None else mtp.numel()
    mine = torch.zeros(2 + 2 * world + n_mtp)
    rank = dist.get_rank()
    mine[1], mine[2 + rank] = float(last_stage), step
    mine[2 + world + rank] = torch.cuda.max_memory_allocated() / 2**30
    stats = mine.cuda()
    if last_stage:
        stats[0] += loss.float()
        if mtp is not None:
            stats[2 + 2 * world:] += mtp
    dist.all_reduce(stats)
    got = stats.tolist()
    times, peak = got[2:2 + world], max(got[2 + world:2 + 2 * world])
    if n_mtp:
        phases = (phases or {}) | {"mtp_loss": [round(x / got[1], 5) for x in got[2 + 2 * world:]]}
    files.beat(iteration)
    if files.rank != 0:
        return
    slowest = max(times)
    tokens_per_s = t["global_batch_size"] * t["seq_length"] / slowest
    mfu = None
    if cfg.get("peak_tflops"):
        mfu = round(cfg["flops_per_token"] * tokens_per_s / (cfg["peak_tflops"] * 1e12 * world), 4)
    values = {"iteration": iteration, "loss": round(got[0] / got[1], 5),
              "grad_norm": None if grad_norm is None else round(float(grad_norm), 5), "lr": lr,
              "step_time_s": round(slowest, 4), "tokens_per_s": round(tokens_per_s, 1),
              "rank_step_time_s": [round(float(x), 4) for x in times],
              "mem_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
              "mem_reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2),
              "mem_peak_gib": round(float(peak), 2), "mfu": mfu, "time": time.time(), **(phases or {})}
    files.record(values)
    log(0, f"iter {iteration}/{t['iterations']} loss {values['loss']:.4f} step {slowest:.3f}s "
           f"{tokens_per_s:,.0f} tok/s MFU {mfu} peak {values['mem_peak_gib']} GiB")
