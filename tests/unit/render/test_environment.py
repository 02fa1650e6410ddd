"""What the environment says and why: NCCL settings from node facts, and the seed's options with the truth."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from stepdeploy.inventory.model import Node
from stepdeploy.plan.layout import Layout
from stepdeploy.render import NodeFacts, RenderOptions, node_environment, templating


def env_of(node: Node, layout: Layout = Layout(), facts: NodeFacts | None = None, **opts: object) -> tuple[dict, list]:
    variables, notes = node_environment(node, 0, layout, RenderOptions(run_id="r", **opts), facts)
    return {v.key: v.value for v in variables}, notes


SPARK = Node(name="spark-1", address="192.0.2.1", gpus_per_node=1, gpu_model="GB10", train_iface="enp1s0f1np1",
             fabric="roce", ib_hcas=["rocep1s0f1", "roceP2p1s0f1"])


def test_roce_lists_both_halves_exactly_and_uses_the_discovered_gid() -> None:
    env, notes = env_of(SPARK, facts=NodeFacts(gid_index=3))
    assert env["NCCL_IB_HCA"] == "=rocep1s0f1,roceP2p1s0f1"
    assert env["NCCL_SOCKET_IFNAME"] == env["UCX_NET_DEVICES"] == env["OMPI_MCA_btl_tcp_if_include"] == "enp1s0f1np1"
    assert env["NCCL_IB_GID_INDEX"] == "3" and env["NCCL_IB_TIMEOUT"] == "20" and env["NCCL_IB_RETRY_CNT"] == "7"
    assert "NCCL_IB_DISABLE" not in env
    assert not notes


def test_undiscovered_gid_is_left_to_nccl_and_said() -> None:
    env, notes = env_of(SPARK)
    assert "NCCL_IB_GID_INDEX" not in env
    assert any("GID index not discovered" in n for n in notes)


def test_tp_sets_device_max_connections_and_nvls_switches_all_three() -> None:
    env, _ = env_of(SPARK, Layout(tp=2), disable_nvls=True)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    env, _ = env_of(SPARK)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env and "NCCL_NVLS_ENABLE" not in env


def test_seed_options_render_with_what_they_really_do() -> None:
    env, notes = env_of(SPARK, seed_options=("nccl-algo-tree", "nccl-timeout-600", "ib-timeout-22",
                                             "cuda-malloc-async"))
    assert env["NCCL_ALGO"] == "Tree" and env["NCCL_IB_TIMEOUT"] == "22"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert "NCCL_TIMEOUT" not in env, "NCCL_TIMEOUT is not an NCCL variable: never rendered"
    text = " ".join(notes)
    assert "NCCL_TIMEOUT=600 is not an NCCL variable" in text
    assert "forcing Tree is rarely faster" in text
    assert "137 s" in text
    assert RenderOptions(run_id="r", seed_options=("nccl-timeout-600",)).effective_pg_timeout_s == 600


def test_cpu_node_gets_gloo_interface_and_no_cuda_settings() -> None:
    env, _ = env_of(Node(name="n", address="10.0.0.1", gpus_per_node=0, train_iface="eth0", fabric="ethernet"))
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["NCCL_IB_DISABLE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK" not in env  # a triton (GPU) kernel setting


def test_gpu_node_turns_off_inductors_load_time_rblock_halving() -> None:
    """A halved reduction block is a second config inductor benchmarks at every start, warm cache or not: 3 s of a
    restart's first step on the H200 (docs/benchmarks.md, calls AK and AL)."""
    env, _ = env_of(SPARK)
    assert env["TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK"] == "0"
    env, _ = env_of(SPARK, extra_env=(("TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK", "1"),))
    assert env["TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK"] == "1"  # an operator's --env still wins


def test_extra_env_wins_over_derived_values() -> None:
    env, _ = env_of(SPARK, extra_env=(("NCCL_IB_TIMEOUT", "18"),))
    assert env["NCCL_IB_TIMEOUT"] == "18"


def test_compile_caches_live_beside_the_runs_not_in_tmp() -> None:
    env, _ = env_of(SPARK)
    opts = RenderOptions(run_id="r")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == f"{opts.remote_dir}/.compile-cache/inductor"
    assert env["TRITON_CACHE_DIR"] == f"{opts.remote_dir}/.compile-cache/triton"
    assert not env["TORCHINDUCTOR_CACHE_DIR"].startswith("/tmp")
    other, _ = node_environment(SPARK, 0, Layout(), RenderOptions(run_id="other-run"))
    # shared by every run on the node: the soak reuses the warm-up's kernels
    assert {v.key: v.value for v in other}["TORCHINDUCTOR_CACHE_DIR"] == env["TORCHINDUCTOR_CACHE_DIR"]


HGX = Node(name="hgx-0", address="192.0.2.2", gpus_per_node=8, gpu_model="H100", train_iface="eth0",
           fabric="ethernet")


def test_optimizer_offload_gives_each_rank_its_share_of_the_nodes_cpus(tmp_path: Path) -> None:
    """torchrun sets OMP_NUM_THREADS=1 when a node starts more than one rank, unless it is set: the host AdamW of an
    offloaded optimizer would then run on one thread per rank."""
    env, _ = env_of(HGX, Layout(optimizer_cpu_offload=True, precision_aware_optimizer=True))
    assert env["OMP_NUM_THREADS"] == "$(( $(nproc) / 8 > 1 ? $(nproc) / 8 : 1 ))"
    for layout, node in ((Layout(), HGX), (Layout(optimizer_cpu_offload=True, precision_aware_optimizer=True), SPARK)):
        assert "OMP_NUM_THREADS" not in env_of(node, layout)[0]  # no offload, or one rank per node

    variables, _ = node_environment(HGX, 0, Layout(optimizer_cpu_offload=True, precision_aware_optimizer=True),
                                    RenderOptions(run_id="r", extra_env=(("STEPDEPLOY_NOTE", "$(( 1 + 1 ))"),)))
    script = tmp_path / "env.sh"
    script.write_text(templating.render("env.sh.j2", version="t", node=HGX, node_rank=0, environment=variables))
    shown = subprocess.run(["bash", "-c", f'. "{script}"; echo "$OMP_NUM_THREADS $STEPDEPLOY_NOTE"'],
                           capture_output=True, text=True, check=True).stdout.split()
    expected = max(1, len(os.sched_getaffinity(0)) // 8)  # nproc: the CPUs this process may use
    assert shown == [str(expected), "$((", "1", "+", "1", "))"]  # a value given by the user stays literal


def test_torch_asks_for_huge_pages_on_gpu_and_cpu_nodes() -> None:
    """The checkpoint read's host copies (issue 20's restart): THP_MEM_ALLOC_ENABLE is torch's own switch."""
    cpu = Node(name="cpu-1", address="192.0.2.9")
    assert env_of(SPARK)[0]["THP_MEM_ALLOC_ENABLE"] == env_of(cpu)[0]["THP_MEM_ALLOC_ENABLE"] == "1"
