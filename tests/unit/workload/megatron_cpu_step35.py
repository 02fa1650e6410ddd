"""Run by test_step35_equivalence.py in a process of its own (megatron_on_cpu repoints torch's CUDA calls): the
megatron engine's Step-3.5-Flash layers (layers.py, attention.py, the grouped experts; megatron-core 0.16.1 on CPU,
fp32) against the independent reference (step35_reference.py) with the same weights.

A tiny variant of step-3.5-flash-slice-1gpu keeps every feature and makes each one matter at this size: a window
of 8 in a 32-token sequence, RoPE scaling whose original context is 64 tokens (so it changes the frequencies a
32-token sequence uses), SwiGLU limits low enough to clamp, a router bias large enough to change the choice.
Prints one JSON line: per layer kind (full/dense, sliding/MoE, sliding/MoE clamped, MTP) the largest relative
difference of the output and of every gradient (input and weights), the same with each reference feature switched
off in turn (each must then differ), the main model's per-token loss against the reference's, and the router bias
before and after megatron's finalize_model_grads (the auxiliary-loss-free update).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from megatron_cpu import free_port, megatron_on_cpu

SEQ, BATCH = 32, 2


def tiny_step_model() -> Any:
    from stepdeploy.catalog import load_model
    from stepdeploy.catalog.loader import parse_model

    data = load_model("step-3.5-flash-slice-1gpu").model_dump()
    data.update(name="tiny-step35", hidden_size=64, num_attention_heads=4, sliding_num_attention_heads=6,
                num_query_groups=2, kv_channels=16, sliding_window=8, ffn_hidden_size=96, vocab_size=128,
                max_position_embeddings=64, swiglu_limits={2: 0.02, 3: 0.02}, swiglu_limits_shared={3: 0.02})
    data["rope"]["llama3_scaling"]["original_max_position_embeddings"] = 64
    # aux_loss_coeff 0: the reference is the architecture; the slice's auxiliary loss is a training term that
    # adds to the router's gradient (test_router_balance.py)
    data["moe"].update(num_experts=4, topk=2, ffn_hidden_size=32, shared_expert_ffn_hidden_size=32, aux_loss_coeff=0.0)
    data["training"].update(seq_length=SEQ, global_batch_size=BATCH)
    return parse_model(data)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (0 where both are zero)."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.abs().max() > 0 else float(a.abs().max())


# --- megatron's weights in HF's layout ----------------------------------------------------------------------

def attention_weights(attn: Any, heads: int, groups: int, d: int, get: Any) -> dict[str, torch.Tensor]:
    """linear_qkv holds, per query group, its heads' q rows, then k, then v (megatron's interleaved layout)."""
    qkv = get(attn.linear_qkv.weight).view(groups, heads // groups + 2, d, -1)
    return {"q_proj": qkv[:, :-2].reshape(heads * d, -1), "k_proj": qkv[:, -2].reshape(groups * d, -1),
            "v_proj": qkv[:, -1].reshape(groups * d, -1), "o_proj": get(attn.linear_proj.weight),
            "g_proj": get(attn.linear_gate.weight), "q_norm": get(attn.q_layernorm.weight),
            "k_norm": get(attn.k_layernorm.weight)}


def mlp_weights(mlp: Any, get: Any) -> dict[str, torch.Tensor]:
    gate, up = get(mlp.linear_fc1.weight).chunk(2, dim=0)  # megatron's fc1: [gate; up], silu on the first half
    return {"gate_proj": gate, "up_proj": up, "down_proj": get(mlp.linear_fc2.weight)}


def layer_weights(layer: Any, shape: dict[str, Any], model: Any, get: Any) -> dict[str, Any]:
    w: dict[str, Any] = {
        "input_layernorm": get(layer.input_layernorm.weight),
        "post_attention_layernorm": get(layer.pre_mlp_layernorm.weight),
        "attn": attention_weights(layer.self_attention, shape["num_heads"], model.num_query_groups,
                                  model.kv_channels, get)}
    if shape["ffn"] == "dense":
        w["mlp"] = mlp_weights(layer.mlp, get)
        return w
    experts = layer.mlp.experts
    w1, w2 = get(experts.weight1), get(experts.weight2)  # [E, h, 2 ffn], [E, ffn, h]
    w["moe"] = {"gate": get(layer.mlp.router.weight), "router_bias": layer.mlp.router.expert_bias.detach().clone(),
                "shared": mlp_weights(layer.mlp.shared_experts, get),
                "experts": [dict(zip(("gate_proj", "up_proj"), w1[e].T.chunk(2, dim=0), strict=True))
                            | {"down_proj": w2[e].T} for e in range(w1.shape[0])]}
    return w


def leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in leaves(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in leaves(v)]
    return [tree]


def as_leaves(tree: Any) -> Any:
    """The same weights as fresh fp32 leaves that collect gradients (the router bias is a buffer: none)."""
    if isinstance(tree, dict):
        return {k: (v.clone() if k == "router_bias" else as_leaves(v)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [as_leaves(v) for v in tree]
    return tree.detach().clone().requires_grad_()


# --- comparisons ---------------------------------------------------------------------------------------------

def compare(name: str, run_megatron: Any, run_reference: Any, weights_of: Any, module: Any, inputs: list[Any],
            switches: list[str]) -> dict[str, Any]:
    """Output and gradients of a megatron module against the reference, plus the reference with each switch off."""
    import step35_reference as ref

    torch.manual_seed(7)
    module.zero_grad(set_to_none=True)
    mega_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = run_megatron(*mega_inputs)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    mega_grads = leaves(weights_of(lambda p: p.grad))

    ref_w = as_leaves(weights_of(lambda p: p.detach()))
    ref_inputs = [x.detach().clone().transpose(0, 1).contiguous().requires_grad_() for x in inputs]  # [b, s, h]
    expected = run_reference(ref_inputs, ref_w, ref.Switches())
    (expected * weights.transpose(0, 1)).sum().backward()
    ref_leaves = [t for t in leaves(ref_w) if t.requires_grad]
    for t in ref_leaves:  # an expert no token reached
        if t.grad is None:
            t.grad = torch.zeros_like(t)
    grads = [relative(m.grad.transpose(0, 1), r.grad) for m, r in zip(mega_inputs, ref_inputs, strict=True)]
    grads += [relative(m, r.grad) for m, r in zip([g for g, t in zip(mega_grads, leaves(ref_w), strict=True)
                                                  if t.requires_grad], ref_leaves, strict=True)]
    off = {}
    with torch.no_grad():
        plain = [x.detach().transpose(0, 1) for x in inputs]
        for switch in switches:
            changed = run_reference(plain, ref_w, ref.Switches().without(switch))
            off[switch] = relative(out.detach().transpose(0, 1), changed)
    return {"kind": name, "output": relative(out.detach().transpose(0, 1), expected.detach()),
            "grads": len(grads), "grad_max": max(grads), "switched_off": off}


def main() -> None:
    megatron_on_cpu(0, 1, free_port())
    import engine_megatron as em
    import step35_reference as ref
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from stepdeploy.plan.layout import Layout
    from stepdeploy.plan.params import count_parameters
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    spec = tiny_step_model()
    cfg = workload_config(spec, Layout(mbs=BATCH), RenderOptions(run_id="t", seq_length=SEQ, global_batch_size=BATCH),
                          engine="megatron", world=1, peak_tflops=790.0)
    cfg["parallel"]["experts"] = "grouped_mm_eager"  # no compiler on CPU (the compiled backward: test_experts_grouped)
    ps.initialize_model_parallel(1, 1)
    kwargs = em.transformer_config_kwargs(cfg) | {
        "bf16": False, "params_dtype": torch.float32, "pipeline_dtype": torch.float32, "use_cpu_initialization": True,
        "moe_token_dispatcher_type": "allgather",
        "moe_shared_expert_overlap": False}  # 0.16.1's alltoall dispatcher allocates a CUDA stream
    torch.manual_seed(3)
    config = TransformerConfig(**kwargs)
    gpt = em.build_model(cfg, config)
    with torch.no_grad():  # every weight non-trivial: norms off zero, a router bias that changes the choice
        for name, param in gpt.named_parameters():
            if "layernorm" in name or name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
        for module in gpt.modules():
            if hasattr(module, "expert_bias") and module.expert_bias is not None:
                module.expert_bias.copy_(torch.tensor([0.04, -0.04, 0.02, -0.02]))
    model, m = cfg["model"], spec
    x = torch.randn(SEQ, BATCH, m.hidden_size)
    layers = gpt.decoder.layers
    cases = []
    # the features each kind of layer has (a sliding layer's RoPE is megatron's default one: no switch for it)
    attention_switches = ["head_gate", "zero_centered", "qk_norm"]
    for index, name, switches in (
            (0, "full/dense", [*attention_switches, "layer_rope", "llama3"]),
            (1, "sliding/moe", [*attention_switches, "window", "window_edge", "router_bias", "renormalise",
                                "shared_expert"]),
            (3, "sliding/moe clamped", [*attention_switches, "window", "router_bias", "clamp"])):
        layer, shape = layers[index], model["layers"][index]
        cases.append(compare(
            name, lambda h, layer=layer: layer(hidden_states=h, attention_mask=None)[0],
            lambda ins, w, sw, shape=shape: ref.decoder_layer(ins[0], w, shape, model, sw),
            lambda get, layer=layer, shape=shape: layer_weights(layer, shape, m, get), layer, [x], switches))
    mtp = gpt.mtp.layers[0]
    shape = model["mtp_layers"][0]
    embedding = torch.randn(SEQ, BATCH, m.hidden_size)

    def mtp_weights(get: Any) -> dict[str, Any]:
        return {"enorm": get(mtp.enorm.weight), "hnorm": get(mtp.hnorm.weight), "eh_proj": get(mtp.eh_proj.weight),
                "final_norm": get(mtp.final_layernorm.weight),
                "layer": layer_weights(mtp.transformer_layer, shape, m, get)}

    cases.append(compare(
        "mtp", lambda h, e: mtp._proj_and_transformer_layer(hidden_states=h, decoder_input=e, attention_mask=None),
        lambda ins, w, sw: ref.mtp_layer(ins[1], ins[0], w, shape, model, sw), mtp_weights, mtp, [x, embedding],
        ["mtp_concat_embedding_first", "head_gate", "window", "zero_centered"]))

    # the main model end to end: per-token losses
    tokens = torch.randint(0, m.vocab_size, (BATCH, SEQ + 1))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    with torch.no_grad():
        losses = gpt(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
        ident = lambda p: p.detach()  # noqa: E731
        whole = {"embedding": gpt.embedding.word_embeddings.weight.detach(), "output": gpt.output_layer.weight.detach(),
                 "final_norm": gpt.decoder.final_layernorm.weight.detach(),
                 "layers": [layer_weights(layers[i], model["layers"][i], m, ident) for i in range(m.num_layers)]}
        expected = ref.model_losses(tokens, whole, model, ref.Switches())

    # the router bias update: one training step through megatron's DDP and finalize_model_grads
    bias_before, bias_after, loads, stats, mtp = router_bias_step(gpt, config, tokens, positions, m.num_layers)
    print(json.dumps({"router_stats": stats, "mtp_loss": mtp, "catalog_params": catalog_parameter_counts(),
        "cases": cases, "model_loss": relative(losses, expected), "params": sum(p.numel() for p in gpt.parameters()),
        "planner_params": count_parameters(spec).total, "bias_before": bias_before, "bias_after": bias_after,
        "loads": loads, "bias_update_rate": model["moe"]["bias_update_rate"]}))


def catalog_parameter_counts() -> dict[str, list[int]]:
    """The engine's model of both slices and of the full Step-3.5-Flash, built as the engine builds them (bf16,
    weights allocated but not initialised: torch.empty touches no memory) -> [built, planner's count]."""
    import engine_megatron as em
    from megatron.core.transformer.transformer_config import TransformerConfig

    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import Layout
    from stepdeploy.plan.params import count_parameters
    from stepdeploy.render.options import RenderOptions
    from stepdeploy.render.workload import workload_config

    counts = {}
    for name in ("step-3.5-flash-slice-1gpu", "step-3.5-flash-slice-ep2", "step-3.5-flash"):
        spec = load_model(name)
        cfg = workload_config(spec, Layout(), RenderOptions(run_id="t", seq_length=64, global_batch_size=1),
                              engine="megatron", world=1, peak_tflops=790.0)
        kwargs = em.transformer_config_kwargs(cfg) | {"use_cpu_initialization": True, "perform_initialization": False,
                                                       "moe_token_dispatcher_type": "allgather",
        "moe_shared_expert_overlap": False}
        model = em.build_model(cfg, TransformerConfig(**kwargs))
        counts[name] = [sum(p.numel() for p in model.parameters()), count_parameters(spec).total]
        del model
    return counts


def router_bias_step(gpt: Any, config: Any, tokens: torch.Tensor, positions: torch.Tensor, layers: int
                     ) -> tuple[Any, ...]:
    """One step; also what the engine's RouterStats (hooks on every router) and MTP tracker read made of it."""
    import moe_stats
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    stats = moe_stats.RouterStats(layers + 1, 4, 2, "cpu")
    hooked = stats.watch_megatron(gpt)
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=gpt)
    router = gpt.decoder.layers[1].mlp.router
    before = router.expert_bias.tolist()
    for layer in gpt.decoder.layers[1:]:
        layer.mlp.router.local_tokens_per_expert.zero_()  # the model-loss forward above counted too
    model.zero_grad_buffer()
    with torch.no_grad():  # not counted: no gradients (an evaluation, a full recompute's first forward)
        gpt(tokens[:, :-1], positions, None, labels=tokens[:, 1:])
    moe_stats.mtp_losses(1, 1, "cpu")  # clears what the forward above left in megatron's MTP tracker (if any)
    gpt(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean().backward()
    loads = router.local_tokens_per_expert.tolist()
    mtp = moe_stats.mtp_losses(1, 1, "cpu").tolist()
    finalize_model_grads([model])
    counted = stats.counts[1].tolist()
    summary = stats.reduce()
    after_reduce = stats.counts.sum().item()
    return before, router.expert_bias.tolist(), loads, {"hooked": hooked, "summary": summary, "counted": counted,
                                                        "counts_after_reduce": after_reduce}, mtp


if __name__ == "__main__":
    sys.exit(main())
