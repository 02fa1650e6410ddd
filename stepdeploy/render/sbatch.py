"""The Slurm batch script of a run (`sbatch.sh`, from templates/sbatch.sh.j2): rendered only when the run
goes through the slurm executor. Pure: values in, text out.

Values in `#SBATCH` lines are read by sbatch itself, not by a shell, so quoting cannot make them inert:
they are refused unless they are plain names and paths.
"""

from __future__ import annotations

import re
from typing import Any

from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Cluster
from stepdeploy.render import templating
from stepdeploy.render.manifest import SlurmEntry
from stepdeploy.render.options import RenderOptions

SBATCH_SCRIPT = "sbatch.sh"
# fullmatch: with `$` a trailing newline would pass and split the #SBATCH line (sbatch ignores the rest)
_SLURM_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIRECTIVE_PATH = re.compile(r"/[A-Za-z0-9._/+-]{1,200}")


def executor_kind(cluster: Cluster, opts: RenderOptions) -> str:
    """fabric, slurm or local: the render option, else the inventory's stepdeploy_executor, else fabric."""
    return opts.executor or cluster.executor or "fabric"


def job_name(opts: RenderOptions) -> str:
    """Says which run and which stage (squeue shows it; `scancel --name` finds every job of the run)."""
    return f"sd-{opts.stage}-{opts.run_id}"


def tasks_per_node(cluster: Cluster, nproc: int) -> int:
    return 1 if cluster.slurm.tasks == "node" else nproc


def render_sbatch(cluster: Cluster, opts: RenderOptions, placements: tuple[Any, ...], common: dict[str, Any],
                  nproc: int) -> str:
    names = [p.node.name for p in placements]
    bad = [n for n in names if not _SLURM_NODE.fullmatch(n)]
    if bad:
        raise BadInput(f"node name {bad[0]!r} cannot be a Slurm node name (letters, digits, '_', '-', '.'); "
                       "the slurm executor pins the job to the inventory's node names")
    if not _DIRECTIVE_PATH.fullmatch(opts.run_dir):
        raise BadInput(f"run directory {opts.run_dir!r} cannot go into an #SBATCH line; use a path of letters, "
                       "digits and ._/+- (--remote-dir)")
    gpus = cluster.nodes[0].gpus_per_node or 0
    return templating.render(
        "sbatch.sh.j2", **common, stage=opts.stage, job_name=job_name(opts), nodelist=",".join(names),
        tasks=cluster.slurm.tasks, tasks_per_node=tasks_per_node(cluster, nproc), gpus_per_node=gpus if gpus else 0,
        partition=cluster.slurm.partition, placements=placements)


def slurm_entry(cluster: Cluster, opts: RenderOptions, nproc: int) -> SlurmEntry:
    """The manifest's `slurm` section: the script, the job's name (scancel finds it), its tasks and partition."""
    return SlurmEntry(script=SBATCH_SCRIPT, job_name=job_name(opts), tasks=cluster.slurm.tasks,
                      tasks_per_node=tasks_per_node(cluster, nproc), partition=cluster.slurm.partition)
