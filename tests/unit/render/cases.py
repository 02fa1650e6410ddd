"""Fixed inputs for the render tests: clusters built in code (no inventory file), fixed time and version."""

from __future__ import annotations

from pathlib import Path

from stepdeploy.catalog import load_model
from stepdeploy.inventory.model import Cluster, Node, SlurmSettings
from stepdeploy.plan.layout import Layout
from stepdeploy.render import NodeFacts, RenderedRun, RenderOptions, render_run

CREATED = "2026-01-01T00:00:00Z"
VERSION = "0.0.0-golden"
# Goldens pin the rendering, not the workload code: a stand-in keeps them stable when train.py changes.
SOURCES = {"train.py": "# workload stand-in for golden files\n"}
INPUTS = {"inventory": {"path": "golden.ini", "sha256": "0" * 64}, "model": {"name": "golden"}}


def cpu_nodes(count: int = 2, **changes: object) -> list[Node]:
    base = {"gpus_per_node": 0, "train_iface": "eth0", "fabric": "ethernet"}
    return [Node(name=f"node{i + 1}", address=f"10.83.0.{11 + i}", **{**base, **changes}) for i in range(count)]


def cluster(nodes: list[Node]) -> Cluster:
    return Cluster(source=Path("golden.ini"), nodes=nodes)


def render(nodes: list[Node], model: str, layout: Layout, opts: RenderOptions,
           facts: dict[str, NodeFacts] | None = None, sources: dict[str, str] | None = None) -> RenderedRun:
    return render_run(cluster(nodes), load_model(model), layout, opts, inputs=INPUTS, created=CREATED,
                      version=VERSION, workload_sources=sources or SOURCES, facts=facts, peak_tflops=790.0)


def case_sim_cpu() -> RenderedRun:
    opts = RenderOptions(run_id="golden-cpu", iterations=20, seq_length=64, global_batch_size=8)
    return render(cpu_nodes(), "tiny-dense", Layout(mbs=2), opts)


def case_hgx_seed() -> RenderedRun:
    nodes = [Node(name=f"hgx-{i}", address=f"192.0.2.{31 + i}", gpus_per_node=8, gpu_model="H100",
                  train_iface="ib0", fabric="infiniband", ib_hcas=[f"mlx5_{k}" for k in range(4)]) for i in range(2)]
    opts = RenderOptions(run_id="golden-hgx", rendezvous="c10d", disable_nvls=True,
                         seed_options=("nccl-algo-tree", "cuda-malloc-async", "ib-timeout-22", "nccl-timeout-600"))
    return render(nodes, "proxy-0.7b-moe", Layout(tp=2, ep=4, mbs=1), opts)


def case_spark_roce() -> RenderedRun:
    nodes = [Node(name=f"spark-{i}", address=f"192.0.2.{41 + i}", gpus_per_node=1, gpu_model="GB10",
                  train_iface="enp1s0f1np1", fabric="roce", ib_hcas=["rocep1s0f1", "roceP2p1s0f1"]) for i in range(2)]
    opts = RenderOptions(run_id="golden-spark", stage="soak", save_interval=100)
    return render(nodes, "proxy-0.7b-dense", Layout(), opts, facts={"spark-0": NodeFacts(gid_index=3)})


def case_slurm_sim_cpu() -> RenderedRun:
    """The slurm executor on the simulated cluster: one task per node running its launch.sh (the ranks' launcher)."""
    slurm = Cluster(source=Path("golden.ini"), nodes=cpu_nodes(), executor="slurm")
    opts = RenderOptions(run_id="golden-slurm-cpu", stage="soak", iterations=20, seq_length=64, global_batch_size=8,
                         save_interval=5)
    return render_run(slurm, load_model("tiny-dense"), Layout(mbs=2), opts, inputs=INPUTS, created=CREATED,
                      version=VERSION, workload_sources=SOURCES, peak_tflops=790.0)


def case_slurm_hgx_per_gpu() -> RenderedRun:
    """The slurm executor chosen by option on 2 x 8 H100: one task per GPU (GRES), a named partition."""
    nodes = [Node(name=f"hgx-{i}", address=f"192.0.2.{31 + i}", gpus_per_node=8, gpu_model="H100",
                  train_iface="ib0", fabric="infiniband", ib_hcas=[f"mlx5_{k}" for k in range(4)]) for i in range(2)]
    slurm = Cluster(source=Path("golden.ini"), nodes=nodes, slurm=SlurmSettings(partition="gpu", tasks="gpu"))
    opts = RenderOptions(run_id="golden-slurm-hgx", executor="slurm")
    return render_run(slurm, load_model("proxy-0.7b-moe"), Layout(tp=2, ep=4, mbs=1), opts, inputs=INPUTS,
                      created=CREATED, version=VERSION, workload_sources=SOURCES, peak_tflops=790.0)


CASES = {"sim-cpu": case_sim_cpu, "hgx-h100-seed-options": case_hgx_seed, "spark-roce": case_spark_roce,
         "slurm-sim-cpu": case_slurm_sim_cpu, "slurm-hgx-per-gpu": case_slurm_hgx_per_gpu}
