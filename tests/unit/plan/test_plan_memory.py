"""Memory components against values computed by hand for tiny-dense (h=256, 8x32 heads, 4 groups,
SwiGLU 688, vocab 8192, 7,096,576 parameters) at sequence 256."""

from __future__ import annotations

import pytest

from stepdeploy.catalog import MIB, load_hardware, load_model
from stepdeploy.plan.activations import in_flight_microbatches
from stepdeploy.plan.cluster import cluster_shape
from stepdeploy.plan.layout import Job, Layout
from stepdeploy.plan.memory import estimate_memory
from stepdeploy.plan.params import count_parameters
from stepdeploy.plan.search import judge

TINY = load_model("tiny-dense")
PARAMS = count_parameters(TINY)
TOTAL = 7_096_576
SEQ = 256
# Per token per layer, bytes (what autograd saves in megatron-core's local spec with SDPA, no dropout):
# norm + QKV inputs 2*256*2; the fused QKV output (256+2*128)*2, kept whole by the v view SDPA saves;
# RoPE'd q and k (256+128)*2; SDPA output = linear_proj input 256*2; log-sum-exp 8*4.
ATTENTION_PER_TOKEN = 2 * 256 * 2 + 512 * 2 + 384 * 2 + 256 * 2 + 8 * 4  # 3,360
# MLP: norm + fc1 inputs 2*256*2; SwiGLU fc1 out 2*688*2; silu out 688*2; product 688*2.
MLP_PER_TOKEN = 2 * 256 * 2 + 2 * 688 * 2 + 688 * 2 + 688 * 2  # 6,528
LAYER = SEQ * (ATTENTION_PER_TOKEN + MLP_PER_TOKEN)  # 2,531,328 bytes per micro-batch
# Output head: final-norm and output-layer inputs 2*256*2, bf16 logits + fp32 softmax 8192*(2+4).
# bf16 logits, their fp32 copy, and the fused cross entropy's second fp32 copy (the engine's default)
LOGITS = SEQ * (2 * 256 * 2 + 8192 * (2 + 4 + 4))


def _stage0(world: int, layout: Layout, gpu: str = "H200", gbs: int = 16):
    cluster = cluster_shape(1, world, gpu, "ib-400g")
    return estimate_memory(PARAMS, Job(TINY, SEQ, gbs, world), layout, cluster).stages[0]


def test_one_gpu_without_distributed_optimizer_is_18_bytes_per_parameter() -> None:
    parts = _stage0(1, Layout(distributed_optimizer=False)).components
    assert (parts["weights"], parts["gradients"], parts["optimizer"]) == (2 * TOTAL, 4 * TOTAL, 12 * TOTAL)


def test_distributed_optimizer_shards_the_12_bytes_over_dp() -> None:
    parts = _stage0(4, Layout(distributed_optimizer=True)).components
    assert parts["optimizer"] == 12 * TOTAL / 4
    assert parts["gradients"] == 4 * TOTAL  # the grad buffer stays whole


def test_activations_and_logits_of_one_microbatch_by_hand() -> None:
    parts = _stage0(1, Layout()).components
    assert parts["activations"] == 4 * LAYER == 10_125_312
    assert parts["logits"] == LOGITS == 21_233_664


def test_full_recompute_keeps_layer_inputs_plus_one_layer_to_recompute() -> None:
    inputs = SEQ * 256 * 2  # one layer input, bf16
    # Last stage: the re-run layer's working set comes after the logits are freed; only its excess counts.
    parts = _stage0(1, Layout(recompute="full")).components
    assert LAYER < LOGITS
    assert parts["activations"] == 4 * inputs
    # PP2 stage 0 (no logits): 2 layers x 2 in-flight micro-batches of inputs + one layer's working set.
    cluster = cluster_shape(1, 2, "H200", "ib-400g")
    first = estimate_memory(PARAMS, Job(TINY, SEQ, 16, 2), Layout(pp=2, recompute="full"), cluster).stages[0]
    assert first.components["activations"] == 2 * 2 * inputs + LAYER


def test_selective_recompute_drops_the_softmax_statistics() -> None:
    parts = _stage0(1, Layout(recompute="selective")).components
    assert parts["activations"] == 4 * (LAYER - SEQ * 8 * 4)


def test_tensor_parallel_with_sequence_parallel_divides_activations() -> None:
    parts = _stage0(2, Layout(tp=2)).components
    assert parts["activations"] == 4 * LAYER / 2
    assert parts["logits"] == LOGITS / 2


def test_one_f_one_b_first_stage_holds_pp_microbatches_and_decides() -> None:
    cluster = cluster_shape(1, 4, "H200", "ib-400g")
    memory = estimate_memory(PARAMS, Job(TINY, SEQ, 16, 4), Layout(pp=4), cluster)
    assert [stage.components["activations"] for stage in memory.stages] == [
        4 * LAYER,
        3 * LAYER,
        2 * LAYER,
        LAYER,
    ]
    assert memory.worst.stage in (0, 3)  # stage 0: most activations; stage 3: logits + output layer


def test_in_flight_microbatches_match_megatrons_interleaving_factor() -> None:
    assert in_flight_microbatches(Layout(pp=4), stage=0, microbatches=16) == 4
    assert in_flight_microbatches(Layout(pp=4), stage=3, microbatches=16) == 1
    assert in_flight_microbatches(Layout(pp=4), stage=0, microbatches=2) == 2  # fewer micro-batches than PP
    assert in_flight_microbatches(Layout(pp=4, vpp=2), stage=0, microbatches=16) == 4 * (1 + 3 / 8)


def test_overheads_outside_torch() -> None:
    parts = _stage0(1, Layout()).components
    assert parts["cuda_context"] == 600 * MIB
    assert parts["checkpoint_writer"] == 518 * MIB  # the persistent writer's context, measured on the H200
    assert parts["nccl"] == 256 * MIB
    state = sum(parts[k] for k in ("weights", "gradients", "optimizer"))
    allocated = state + max(parts["activations"] + parts["logits"] + parts["dispatcher"], parts["optimizer_step"])
    assert parts["fragmentation"] == pytest.approx(0.05 * allocated)


def test_offload_frees_gpu_memory_but_not_on_unified_memory() -> None:
    offload = Layout(optimizer_cpu_offload=True, precision_aware_optimizer=True)
    assert _stage0(1, offload).components["optimizer"] == 0
    assert _stage0(1, offload, gpu="GB10").components["optimizer"] == 12 * TOTAL
    assert _stage0(1, offload).host_offload == 12 * TOTAL  # the state moved to the host, not away
    assert _stage0(1, offload, gpu="GB10").host_offload == 0


def test_offloaded_state_must_fit_in_host_memory() -> None:
    """175B on TP8 x DP2 without the distributed optimizer: each GPU offloads 12 B x 175B / 8 = ~244 GiB of
    optimizer state, more than the 256 GiB (less the 10 % margin) a DGX has per GPU."""
    seed = load_model("gpt3-175b-seed")
    cluster = cluster_shape(2, 8, "H200", "ib-400g")
    layout = Layout(tp=8, pp=1, recompute="full", distributed_optimizer=False, optimizer_cpu_offload=True,
                    precision_aware_optimizer=True)
    verdict = judge(count_parameters(seed), Job(seed, 2048, 16, 16), layout, cluster, load_hardware())
    assert verdict.memory is not None and not verdict.memory.host_fits
    assert verdict.memory.host_worst.host_offload == pytest.approx(12 * count_parameters(seed).total / 8, rel=0.01)
    assert "does not fit in host memory" in verdict.reason()


def test_moe_activations_use_expert_width_and_topk() -> None:
    moe = load_model("tiny-moe")
    params = count_parameters(moe)
    cluster = cluster_shape(1, 1, "H200", "ib-400g")
    job = Job(moe, SEQ, 16, 1)
    parts = estimate_memory(params, job, Layout(grouped_gemm=False), cluster).stages[0].components
    # MoE layer, SequentialMLP: norm input and output 2*256*2; router logits+scores 2*8*4; 2 routed copies of
    # (fc1 in 256 + SwiGLU fc1 out 512 + silu out 256 + product 256 + product x router probability 256)*2;
    # shared expert (512 + 256 + 256)*2.
    shared = (512 + 256 + 256) * 2
    moe_ffn = 2 * 256 * 2 + 2 * 8 * 4 + 2 * (256 + 512 + 256 + 256 + 256) * 2 + shared
    expected = SEQ * (4 * ATTENTION_PER_TOKEN + MLP_PER_TOKEN + 3 * moe_ffn)
    assert parts["activations"] == expected
    # Grouped experts (experts_grouped.py) save only their input and fc1's output: (256 + 512)*2 per copy.
    grouped = estimate_memory(params, job, Layout(), cluster).stages[0].components
    moe_grouped = 2 * 256 * 2 + 2 * 8 * 4 + 2 * (256 + 512) * 2 + shared
    assert grouped["activations"] == SEQ * (4 * ATTENTION_PER_TOKEN + MLP_PER_TOKEN + 3 * moe_grouped)
    assert parts["dispatcher"] == 2 * SEQ * 2 * 256 * 2  # permuted + received rows, top-2


def test_seed_layout_does_not_fit_16_h200_and_optimizer_state_is_why() -> None:
    seed = load_model("gpt3-175b-seed")
    params = count_parameters(seed)
    cluster = cluster_shape(2, 8, "H200", "ib-400g")
    memory = estimate_memory(
        params, Job(seed, 2048, 64, 16), Layout(tp=8, pp=2, distributed_optimizer=False), cluster
    )
    assert not memory.fits
    assert memory.worst.largest() == "optimizer"
    # 87.3B parameters per stage / TP8 = 10.9B per GPU -> 12 bytes each of optimizer state
    assert memory.worst.components["optimizer"] == pytest.approx(12 * params.total / 16, rel=0.01)


def test_optimizer_step_adds_adams_fp32_sqrt_v_and_the_larger_transient_is_the_peak() -> None:
    stage = _stage0(1, Layout())
    parts = stage.components
    assert parts["optimizer_step"] == 4 * TOTAL  # torch foreach AdamW: sqrt(v) of the whole param group
    state = 18 * TOTAL
    assert stage.state == state
    assert stage.torch_allocated == max(state + 4 * LAYER + LOGITS, state + 4 * TOTAL)
    assert stage.total == pytest.approx(stage.torch_allocated + parts["nccl"] + parts["cuda_context"]
                                        + parts["checkpoint_writer"] + parts["fragmentation"])


def test_experts_get_their_own_adam_group_only_with_expert_process_groups() -> None:
    moe = load_model("tiny-moe")
    params = count_parameters(moe)
    cluster = cluster_shape(1, 2, "H200", "ib-400g")
    expert = sum(layer.experts_total for layer in params.layers)
    dense = params.total - expert

    def step(layout: Layout) -> float:
        return estimate_memory(params, Job(moe, SEQ, 16, 2), layout, cluster).stages[0].components["optimizer_step"]

    # EP1 DP2: one optimizer, experts and dense share the param group; both sharded over DP2.
    assert step(Layout()) == pytest.approx(4 * (dense + expert) / 2)
    # EP2 DP2: a ChainedOptimizer steps the dense (sharded over DP2) and the expert optimizer (EDP 1) in turn.
    assert step(Layout(ep=2)) == pytest.approx(4 * max(dense / 2, expert / 2))
