"""Run in a process of its own (megatron_on_cpu repoints torch's CUDA calls): a small version of a catalog MoE
model (default the Step-3.5-Flash slice: sigmoid scores, expert bias, top-k scaling, fp32 router, its balancing)
trained for a few dozen steps on byte-level text through the megatron engine's own pieces (model_chunks:
Float16Module + DDP, finalize_model_grads, megatron's optimizer, the engine's forward step and learning-rate
schedule; moe_stats for the load). Prints one JSON line: per step the loss, each MoE layer's max/mean tokens per
expert, the busiest expert's bias and its lead (margin), and how much of each router's input all tokens share
(common); and each router's expert bias with the tokens it counted on the last step.

    python megatron_cpu_router.py '{"steps": 30, "lr": 3e-4, "warmup": 3, ...}'   (keys: see SETTINGS; "schedule":
    the iterations the cosine decays over, when not "steps"; "overrides": TransformerConfig fields; "model": the
    catalog model; "hidden": its width, with "ffn", "moe_ffn", "kv" to slim the rest; "router_lr_mult": the
    routers' learning rate over the others', 0 holds them at their start; "optimizer": OptimizerConfig fields
    (adam_beta2, adam_eps, clip_grad); "embedding_lr_mult": the same for the embedding and output layer; "data":
    "docs" (the frozen docs, CORPUS, as bytes), "uniform" (independent uniform tokens) or "markov" (the synthetic
    stream the soak trains on by default, stepdeploy/workload/synthetic.py, over "vocab" tokens); "precision":
    "bf16" or "fp32" (much faster on a CPU); "probe_every": every so many steps (and the first) run the step
    twice, once with the auxiliary loss off, and split its gradient into the language-model loss's and the
    auxiliary loss's (grad_split))

Per step also the auxiliary loss of each MoE layer (aux, by layer: moe_stats reads megatron's tracker, E x sum_e
f_e P_e, 1 balanced, E/k when every token goes to the same k experts, mean over micro-batches); on "markov" data
the run's entropies (entropy: "unigram", what a model that predicts the token frequencies alone scores; "floor",
the chain's). A dense
equivalent of a MoE model: "experts": 1, "topk": 1 with overrides {"moe_router_pre_softmax": true,
"moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "none"} (the one expert's gate is 1).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import torch
from megatron_cpu import free_port, megatron_on_cpu

SETTINGS: dict[str, Any] = {
    "steps": 30, "schedule": 0, "lr": 3.0e-4, "warmup": 3, "seq": 64, "mbs": 4, "micro_batches": 2, "hidden": 128,
    "experts": 32, "topk": 8, "layers": 3, "seed": 1, "data": "docs", "fp32_counts": True, "overrides": {},
    "router_lr_mult": 1.0, "model": "step-3.5-flash-slice-1gpu", "ffn": 0, "moe_ffn": 0, "kv": 0,
    "optimizer": {}, "embedding_lr_mult": 1.0, "vocab": 256, "precision": "bf16", "probe_every": 0,
}
# The docs as they were at 760d22a (docs/*.md in name order), frozen: the soak's corpus was the docs, tokenized
# byte-level, but a test of the router's mechanism must not change its verdict with every edit of the docs (an edit
# of five docs made one layer's busiest expert at one step one whose bias had gone up and back down to 0, 2026-12-06)
CORPUS = Path(__file__).resolve().parents[2] / "fixtures" / "router" / "docs-760d22a.txt.gz"


def byte_stream() -> torch.Tensor:
    """The frozen docs (CORPUS) as bytes."""
    return torch.tensor(list(gzip.decompress(CORPUS.read_bytes())), dtype=torch.long)


def small_model(s: dict[str, Any]) -> Any:
    """The catalog model `s["model"]` (its router, norms, attention kinds, balancing) cut down: `s["layers"]` MoE
    layers (after the dense lead layers it has), 4 heads, byte vocabulary, hidden `s["hidden"]`. The router sees
    the hidden width only, so "ffn", "moe_ffn" and "kv" (0: 2 x, 1/2 x and 1/4 x the hidden) can slim the rest
    and keep a real width (the slice's 4,096, the proxy's 2,048) affordable on a CPU."""
    from stepdeploy.catalog import load_model
    from stepdeploy.catalog.loader import parse_model

    data = load_model(s["model"]).model_dump()
    h = s["hidden"]
    dense = data["moe"]["first_dense_layers"]
    data.update(name=f"small-{s['model']}", num_layers=s["layers"] + dense, hidden_size=h, num_attention_heads=4,
                num_query_groups=2, kv_channels=s["kv"] or h // 4, ffn_hidden_size=s["ffn"] or 2 * h,
                vocab_size=s["vocab"], max_position_embeddings=256, swiglu_limits={}, swiglu_limits_shared={},
                mtp_num_layers=0)
    if data.get("sliding_num_attention_heads"):
        data.update(sliding_num_attention_heads=4, sliding_window=32)
    if data["rope"].get("llama3_scaling"):
        data["rope"]["llama3_scaling"]["original_max_position_embeddings"] = 128
    moe_ffn = s["moe_ffn"] or h // 2
    data["moe"].update(num_experts=s["experts"], topk=s["topk"], ffn_hidden_size=moe_ffn)
    if data["moe"]["shared_expert_ffn_hidden_size"]:
        data["moe"]["shared_expert_ffn_hidden_size"] = moe_ffn
    data["training"].update(seq_length=s["seq"], global_batch_size=s["mbs"] * s["micro_batches"], lr=s["lr"])
    return parse_model(data)


def margin(router: Any, hidden: torch.Tensor, topk: int) -> list[float]:  # [] without an expert bias
    """The busiest expert (of the last micro-batch) and how far the bias would have to lower it to leave the
    top-k of half the tokens: the median over tokens of (its score + bias) - (the k-th best of the others')."""
    with torch.no_grad():
        scores = torch.sigmoid(hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.float().t())
        if router.expert_bias is None:
            return []
        biased = scores + router.expert_bias.float()
        busiest = int(biased.topk(topk, dim=-1).indices.flatten().bincount(minlength=scores.shape[1]).argmax())
        others = torch.cat([biased[:, :busiest], biased[:, busiest + 1:]], dim=1)
        gap = biased[:, busiest] - others.topk(topk, dim=-1).values[:, -1]
        return [busiest, round(float(gap.median()), 4), round(float(router.expert_bias[busiest]), 4)]


def markov_entropy(table: torch.Tensor, seq: int) -> dict[str, float]:
    """What the loss is measured against on the "markov" stream (nats): "unigram", the entropy of the targets'
    token frequencies (over the window's target positions 1..seq; each block of synthetic.BLOCK starts from a
    uniform token), the loss of a model that predicts the same distribution at every position; "floor", the
    loss of one that knows the chain (a block's first token stays uniform)."""
    from stepdeploy.workload.synthetic import BLOCK

    vocab, succ = table.shape
    marginal, mean = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    chain = torch.zeros(vocab, dtype=torch.float64)  # the entropy of each token's successors (repeats count twice)
    for row in range(vocab):
        _, counts = table[row].unique(return_counts=True)
        q = counts.double() / succ
        chain[row] = -(q * q.log()).sum()
    floor = 0.0
    for pos in range(1, BLOCK * (-(-(seq + 1) // BLOCK))):
        prev = marginal
        marginal = torch.zeros(vocab, dtype=torch.float64).index_add_(
            0, table.flatten(), prev.repeat_interleave(succ) / succ) if pos % BLOCK else prev * 0 + 1.0 / vocab
        if pos <= seq:
            mean += marginal / seq
            floor += (float((prev * chain).sum()) if pos % BLOCK else float(torch.tensor(vocab).log())) / seq
    return {"unigram": round(float(-torch.special.xlogy(mean, mean).sum()), 4), "floor": round(floor, 4),
            "uniform": round(float(torch.tensor(float(vocab)).log()), 4)}


def common_mode(hidden: torch.Tensor) -> float:
    """How much of the router's input all tokens share: |mean over tokens| / rms over tokens of |x| (1: every
    token the same vector, about 1/sqrt(tokens) for independent ones)."""
    x = hidden.reshape(-1, hidden.shape[-1]).float()
    return round(float(x.mean(dim=0).norm() / x.norm(dim=1).pow(2).mean().sqrt()), 3)


def grad_split(model: Any, lm_grads: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The step's gradient (main_grad, before clipping) split into the language-model loss's (`lm_grads`, the same
    step run with the auxiliary loss off) and the rest, the auxiliary loss's: their norms, the cosine between them,
    and the auxiliary part's norm on the routers' weights and on everything else."""
    total = lm = aux = dot = aux_router = 0.0
    for name, param in model.named_parameters():
        g, g_lm = param.main_grad.detach().float(), lm_grads[name].float()
        g_aux = g - g_lm
        total, lm, aux = total + float(g.pow(2).sum()), lm + float(g_lm.pow(2).sum()), aux + float(g_aux.pow(2).sum())
        dot += float((g_lm * g_aux).sum())
        if "router" in name:
            aux_router += float(g_aux.pow(2).sum())
    return {"total": round(total ** 0.5, 3), "lm": round(lm ** 0.5, 3), "aux": round(aux ** 0.5, 3),
            "cos": round(dot / max(1e-30, (lm * aux) ** 0.5), 3), "aux_router": round(aux_router ** 0.5, 3),
            "aux_rest": round(max(0.0, aux - aux_router) ** 0.5, 3)}


def main() -> None:
    s = SETTINGS | json.loads(sys.argv[1] if len(sys.argv) > 1 else "{}")
    megatron_on_cpu(0, 1, free_port())
    import engine_megatron as em
    import model_chunks
    import moe_stats
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig
    from schedule import lr_at

    from stepdeploy.plan.layout import Layout
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config
    from stepdeploy.workload.synthetic import markov_table, markov_tokens

    spec = small_model(s)
    gbs = s["mbs"] * s["micro_batches"]
    cfg = workload_config(spec, Layout(mbs=s["mbs"]), RenderOptions(run_id="t", seq_length=s["seq"],
                          global_batch_size=gbs, iterations=s["schedule"] or s["steps"],
                          warmup_iterations=s["warmup"]),
                          engine="megatron", world=1, peak_tflops=790.0)
    cfg["parallel"]["experts"] = "grouped_mm_eager"  # no compiler on CPU
    torch.manual_seed(s["seed"])
    ps.initialize_model_parallel(1, 1)
    kwargs = em.transformer_config_kwargs(cfg) | {"use_cpu_initialization": True,
                                                   "moe_token_dispatcher_type": "allgather",
        "moe_shared_expert_overlap": False} | s["overrides"]
    fp32 = s["precision"] == "fp32"
    if fp32:
        kwargs |= {"bf16": False, "params_dtype": torch.float32, "pipeline_dtype": torch.float32}
        s["optimizer"] = {"bf16": False} | s["optimizer"]
    config = TransformerConfig(**kwargs)
    ddp_kwargs = em.ddp_config_kwargs(cfg) | {"overlap_param_gather": False}
    if fp32:  # megatron's DDP round the bare chunk: Float16Module takes bf16 or fp16 only
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        chunks = [DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(**ddp_kwargs),
                                          module=chunk) for chunk in model_chunks.build_chunks(cfg, config,
                                                                                               em.build_model)]
    else:
        chunks = model_chunks.wrap_chunks(model_chunks.build_chunks(cfg, config, em.build_model), config,
                                          ddp_kwargs)
    counts_dtype = str(next((m.local_tokens_per_expert.dtype for m in chunks[0].modules()
                             if getattr(m, "local_tokens_per_expert", None) is not None), None))
    converted = em.keep_router_counts_fp32(chunks) if s["fp32_counts"] else 0
    model_chunks.attach_grad_sync(config, chunks, False)
    cfg["parallel"]["optimizer"] = "foreach"
    if s["router_lr_mult"] != 1.0 or s["embedding_lr_mult"] != 1.0 or s["optimizer"]:
        from megatron.core.optimizer import OptimizerConfig, ParamKey, get_megatron_optimizer
        from megatron.core.optimizer import get_standard_config_overrides as standard

        opt_config = OptimizerConfig(**model_chunks.optimizer_config_kwargs(cfg) | s["optimizer"])
        overrides = standard(opt_config)
        if s["router_lr_mult"] != 1.0:
            overrides[ParamKey(name="*router.weight")] = {"lr_mult": s["router_lr_mult"]}
        if s["embedding_lr_mult"] != 1.0:
            overrides[ParamKey(name=("*embedding*", "*output_layer*"))] = {"lr_mult": s["embedding_lr_mult"]}
        optimizer = get_megatron_optimizer(opt_config, chunks, config_overrides=overrides)
        model_chunks.set_adam_implementation(optimizer, "foreach")
    else:
        optimizer = model_chunks.build_optimizer(cfg, chunks)
    for group in optimizer.param_groups:
        group["weight_decay"] = em.WEIGHT_DECAY * group.get("wd_mult", 1.0)
    model = chunks[0]
    m = cfg["model"]
    stats = moe_stats.RouterStats(m["num_layers"], s["experts"], s["topk"], "cpu", s["micro_batches"])
    stats.watch_megatron(model)
    routers = [mod for mod in model.modules() if type(mod).__name__ == "TopKRouter"]
    inputs: dict[int, torch.Tensor] = {}
    for index, router in enumerate(routers):
        router.register_forward_pre_hook(lambda _m, args, index=index: inputs.__setitem__(index, args[0].detach()))
    stream, seq, mbs = byte_stream(), s["seq"], s["mbs"]
    if s["data"] == "uniform":  # the same length of independent uniform tokens: no structure to route on
        stream = torch.randint(0, s["vocab"], stream.shape, generator=torch.Generator().manual_seed(s["seed"]))
    gen = torch.Generator().manual_seed(s["seed"])
    table = markov_table(s["vocab"], s["seed"]) if s["data"] == "markov" else None
    positions = torch.arange(seq).unsqueeze(0).expand(mbs, -1)
    forward_step = model_chunks.lm_forward_step(positions)
    forward_backward = get_forward_backward_func()
    steps = []
    for iteration in range(1, s["steps"] + 1):
        lr = lr_at(iteration, cfg["training"])
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        starts = torch.randint(0, stream.numel() - seq - 1, (s["micro_batches"], mbs), generator=gen)
        windows = ([markov_tokens(table, s["seed"], iteration, micro, 0, mbs, seq + 1)
                    for micro in range(s["micro_batches"])] if table is not None else
                   [torch.stack([stream[i:i + seq + 1] for i in row.tolist()]) for row in starts])
        batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]
        probe = s["probe_every"] and (iteration == 1 or iteration % s["probe_every"] == 0)
        if probe:  # the language-model loss's gradient alone: the same step with the auxiliary loss off
            coeff, config.moe_aux_loss_coeff = config.moe_aux_loss_coeff, 0.0
            forward_backward(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks,
                             num_microbatches=s["micro_batches"], seq_length=seq, micro_batch_size=mbs,
                             decoder_seq_length=seq, forward_only=False)
            config.moe_aux_loss_coeff = coeff
            lm_grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
            model.zero_grad_buffer()
            stats.reduce()  # the probe's routing and auxiliary loss are not the step's (it clears both)
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks,
                                  num_microbatches=s["micro_batches"], seq_length=seq, micro_batch_size=mbs,
                                  decoder_seq_length=seq, forward_only=False)
        split = grad_split(model, lm_grads) if probe else None
        _ok, grad_norm, _ = optimizer.step()
        got = stats.reduce()
        steps.append({"it": iteration, "lr": round(lr, 7),
                      "loss": round(float(sum(x["lm loss"] for x in losses) / len(losses)), 4),
                      "grad_norm": round(float(grad_norm), 3), "load": got["moe_load"],
                      "aux": got.get("moe_aux_loss", {}),
                      **({"grad_split": split} if split else {}),
                      "bias": got.get("router_bias"), "busiest_bias": got.get("router_bias_busiest"),
                      "margin": [margin(r, inputs[i], s["topk"]) for i, r in enumerate(routers)],
                      "common": [common_mode(inputs[i]) for i in range(len(routers))]})
    last = [{"bias": [round(float(b), 4) for b in r.expert_bias] if r.expert_bias is not None else None,
             "counts_dtype": str(getattr(getattr(r, "local_tokens_per_expert", None), "dtype", None)),
             "weight_std": round(float(r.weight.float().std()), 5)} for r in routers]
    print(json.dumps({"settings": s, "ceiling": s["experts"] / s["topk"], "steps": steps, "routers": last,
                      **({"entropy": markov_entropy(table, seq)} if table is not None else {}),
                      "counts_dtype_wrapped": counts_dtype, "counts_converted": converted}))


if __name__ == "__main__":
    sys.exit(main())
