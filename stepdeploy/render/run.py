"""Render a run directory: per-node launch script and environment, the workload's configuration and code,
and a manifest of what was rendered from what (with hashes). Values in, text out; nothing is written here.

Layout of a run directory (the same locally and on every node):
    manifest.json            inputs, every file with its sha256 and the template it came from, notes, and the
                             software the layout needs on every node beyond the stock stack (`needs`, if any)
    workload.json            the workload's configuration (model, layout, schedule, timeouts)
    workload/*.py            the workload program (shipped as files; standard library + torch only)
    nodes/<rank>-<name>/launch.sh, env.sh   one directory per node, started on that node only
    sbatch.sh                (slurm executor only) the batch script: one srun task per node (or per GPU)
    data/corpus.bin, .idx    (with --data) the prepared dataset, megatron-core's indexed format
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from stepdeploy.catalog import ModelSpec
from stepdeploy.corpus import Corpus, ShippedDataset
from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Cluster, Node
from stepdeploy.plan import engines
from stepdeploy.plan.layout import Layout
from stepdeploy.render import sbatch, templating
from stepdeploy.render.environment import NodeFacts, node_environment
from stepdeploy.render.manifest import MANIFEST_FILE, Manifest, ManifestFile, ManifestNode, Needs
from stepdeploy.render.options import RenderOptions
from stepdeploy.render.workload import check_engine, choose_engine, workload_config
from stepdeploy.render.workload_file import WORKLOAD_FILE

DATASET_PATH = "data/corpus"  # where a run directory holds its prepared dataset (.bin, .idx)
WORKLOAD_MODULES = ("train.py", "engine_torch.py", "engine_megatron.py", "megatron_ckpt.py", "megatron_resume.py",
                    "megatron_writer.py", "model_chunks.py", "experts_grouped.py", "attention.py", "layers.py",
                    "moe_stats.py", "schedule.py", "synthetic.py", "data.py", "indexed.py", "traces.py", "ckpt.py",
                    "ckpt_read.py", "ckpt_room.py", "torch_ckpt.py", "compile_warm.py", "host_copy.py",
                    "megatron_state.py", "megatron_model.py", "metrics.py", "launch_ranks.py", "rope.py",
                    "compiled.py")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class RenderedFile:
    path: str  # relative to the run directory
    text: str
    template: str | None = None  # None: copied (workload code), or generated (manifest)
    executable: bool = False
    node: str | None = None
    blob: bytes | None = None  # a binary file (a prepared dataset), instead of text

    @property
    def content(self) -> bytes:
        return self.blob if self.blob is not None else self.text.encode()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()


@dataclass(frozen=True)
class Placement:
    """Where one node's part of the run lives."""

    node: Node
    node_rank: int
    node_dir: str  # relative to the run directory

    @property
    def launch_script(self) -> str:
        return f"{self.node_dir}/launch.sh"


@dataclass(frozen=True)
class RenderedRun:
    run_id: str
    run_dir: str  # absolute path on every node
    files: tuple[RenderedFile, ...]
    placements: tuple[Placement, ...]
    notes: tuple[str, ...]
    workload: dict[str, Any]
    manifest: Manifest  # what manifest.json (among `files`) holds

    def file(self, path: str) -> RenderedFile:
        return next(f for f in self.files if f.path == path)


def node_dir(rank: int, name: str) -> str:
    """`nodes/0-node1`: the rank keeps it unique and ordered; the name is only ever a readable hint."""
    return f"nodes/{rank}-{_UNSAFE.sub('_', name)[:40]}"


def load_workload_sources() -> dict[str, str]:
    package = resources.files("stepdeploy.workload")
    return {name: package.joinpath(name).read_text() for name in WORKLOAD_MODULES}


def _nproc(cluster: Cluster, opts: RenderOptions) -> int:
    if opts.nproc_per_node:
        return opts.nproc_per_node
    counts = {node.gpus_per_node or 0 for node in cluster.nodes}
    if len(counts) != 1:
        raise BadInput(f"nodes declare different GPU counts ({sorted(counts)}); torchrun starts the same number "
                       "of ranks on every node", hint="fix stepdeploy_gpus_per_node or pass --nproc-per-node")
    return counts.pop() or 1


def render_run(cluster: Cluster, spec: ModelSpec, layout: Layout, opts: RenderOptions, *,
               inputs: dict[str, Any], created: str, version: str, workload_sources: dict[str, str],
               facts: dict[str, NodeFacts] | None = None, peak_tflops: float | None = None,
               dataset: ShippedDataset | None = None) -> RenderedRun:
    """Every file of the run directory, as text (a dataset's files as bytes). `inputs` and `created` go into the
    manifest verbatim. The stack profile is judged before this, once, by build_run (compat.require_stack)."""
    nproc = _nproc(cluster, opts)
    gpus = cluster.nodes[0].gpus_per_node or 0
    engine = choose_engine(opts, gpus)
    check_engine(engine, layout, spec, gpus)
    world = nproc * len(cluster.nodes)
    workload = workload_config(spec, layout, opts, engine=engine, world=world, peak_tflops=peak_tflops)
    data_files: list[RenderedFile] = []
    if dataset is not None:
        check_dataset(dataset.corpus, spec)
        workload["data"] = dataset.corpus.workload_entry(DATASET_PATH)
        data_files = [RenderedFile(f"{DATASET_PATH}{suffix}", "", blob=blob) for suffix, blob in dataset.blobs.items()]
    placements = tuple(Placement(node, rank, node_dir(rank, node.name)) for rank, node in enumerate(cluster.nodes))
    files = [RenderedFile(WORKLOAD_FILE, templating.render("workload.json.j2", workload=workload),
                          "workload.json.j2")]
    files += [RenderedFile(f"workload/{name}", text) for name, text in sorted(workload_sources.items())]
    files += data_files
    common = {"version": version, "run_id": opts.run_id, "run_dir": opts.run_dir, "nnodes": len(cluster.nodes),
              "nproc_per_node": nproc, "python": opts.python, "rendezvous": opts.rendezvous,
              "master_addr": cluster.nodes[0].address, "master_port": opts.master_port,
              "max_restarts": opts.max_restarts, "launcher": opts.launcher}
    node_files, notes = _node_files(placements, common, layout, opts, facts)
    files += node_files
    kind = sbatch.executor_kind(cluster, opts)
    slurm = kind == "slurm"
    if slurm:
        files.append(RenderedFile(sbatch.SBATCH_SCRIPT, sbatch.render_sbatch(cluster, opts, placements, common, nproc),
                                  "sbatch.sh.j2", executable=True))
    needs = engines.needs(spec, layout) if engine == "megatron" else []
    if needs:
        notes.append(f"layout {layout.short()} needs on every node: {'; '.join(needs)}; `rollout run` verifies it "
                     f"before each launch (now: stepdeploy preflight INVENTORY --model {spec.name} --layout "
                     f"{layout.short()})")
    # what the nodes need beyond the stock stack, and the interpreter the launch runs it with
    more: dict[str, Any] = {"needs": Needs(software=needs, python=opts.python)} if needs else {}
    if slurm:
        more |= {"executor": "slurm", "slurm": sbatch.slurm_entry(cluster, opts, nproc)}
    elif kind == "local":  # the run is driven on this machine, also by a later `run`/`rollout stop`
        more |= {"executor": "local"}
    manifest = Manifest(
        format=1, run_id=opts.run_id, created=created, stepdeploy=version, engine=engine, layout=layout.short(),
        stage=opts.stage, run_dir=opts.run_dir, inputs=inputs, nodes=_nodes(placements, facts or {}),
        files=[_entry(f) for f in files], notes=list(notes), **more)
    files.append(RenderedFile(MANIFEST_FILE, templating.render("manifest.json.j2", manifest=manifest.to_json()),
                              "manifest.json.j2"))
    return RenderedRun(opts.run_id, opts.run_dir, tuple(files), placements, tuple(notes), workload, manifest)


def _node_files(placements: tuple[Placement, ...], common: dict[str, Any], layout: Layout, opts: RenderOptions,
                facts: dict[str, NodeFacts] | None) -> tuple[list[RenderedFile], list[str]]:
    """Each node's env.sh and launch.sh, and the notes on what its environment came from (each said once)."""
    files: list[RenderedFile] = []
    notes: list[str] = []
    for place in placements:
        if facts is not None and place.node.name not in facts:
            notes.append(f"{place.node.name}: no NCCL facts saved by provisioning; its interface and HCAs come "
                         "from the inventory (stepdeploy provision saves them)")
        env, node_notes = node_environment(place.node, place.node_rank, layout, opts,
                                           (facts or {}).get(place.node.name))
        notes += [n for n in node_notes if n not in notes]
        values = {**common, "node": place.node, "node_rank": place.node_rank, "node_dir": place.node_dir,
                  "environment": env}
        files.append(RenderedFile(f"{place.node_dir}/env.sh", templating.render("env.sh.j2", **values),
                                  "env.sh.j2", node=place.node.name))
        files.append(RenderedFile(place.launch_script, templating.render("launch.sh.j2", **values),
                                  "launch.sh.j2", executable=True, node=place.node.name))
    return files, notes


def _nodes(placements: tuple[Placement, ...], facts: dict[str, NodeFacts]) -> list[ManifestNode]:
    nodes = []
    for p in placements:
        source = facts.get(p.node.name)  # only facts read from a file: renders without facts stay as they were
        fed = {"facts": {"path": source.source, "sha256": source.sha256}} if source and source.source else {}
        nodes.append(ManifestNode(name=p.node.name, address=p.node.address, node_rank=p.node_rank, dir=p.node_dir,
                                  **fed))
    return nodes


def _entry(item: RenderedFile) -> ManifestFile:
    return ManifestFile(path=item.path, sha256=item.sha256, origin=_origin(item), node=item.node,
                        template_sha256=templating.template_sha256(item.template) if item.template else None)


def _origin(item: RenderedFile) -> str:
    if item.template:
        return f"templates/{item.template}"
    return "stepdeploy data prepare" if item.blob is not None else "stepdeploy/workload"


def check_dataset(dataset: Corpus, spec: ModelSpec) -> None:
    """The dataset's ids fit the model: its largest id, and its tokenizer's vocabulary padded to a multiple of 128
    as Megatron pads it (make_vocab_size_divisible_by), are within the catalog's vocab_size."""
    most = spec.vocab_size // 128 * 128
    hint = (f"prepare it with a smaller tokenizer (stepdeploy data prepare FILES --train-tokenizer {most} --out "
            "PREFIX), or give a model with a larger vocab_size")
    if dataset.max_id >= spec.vocab_size:
        raise BadInput(f"{dataset.prefix}: its largest token id {dataset.max_id} does not fit {spec.name}'s "
                       f"vocabulary of {spec.vocab_size}", hint=hint)
    if dataset.padded_vocab > spec.vocab_size:
        raise BadInput(f"{dataset.prefix}: its tokenizer's {dataset.vocab} ids, padded to {dataset.padded_vocab} as "
                       f"Megatron pads them, do not fit {spec.name}'s vocabulary of {spec.vocab_size}", hint=hint)
