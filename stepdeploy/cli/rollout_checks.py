"""What `rollout run` checks before anything exists (the run's name, the inventory, the models, the stack, a given
layout) and what its --dry-run prints. Writes nothing."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stepdeploy.cli.common import connecting_cluster
from stepdeploy.cli.output import out
from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import Cluster
from stepdeploy.remote import registry
from stepdeploy.render.options import RUN_ID
from stepdeploy.rollout import stages
from stepdeploy.rollout.config import RolloutConfig

# A rollout's name prefixes every attempt's run id (`<name>-scale-target-all-nodes-a12`), which render takes
# up to 64 characters: the name keeps 36.
MAX_RUN_NAME = 36


def default_run_name(model: str, when: time.struct_time) -> str:
    """MODEL-STAMP, the model's name (a file's: its slug) cut to fit MAX_RUN_NAME (step-3.5-flash-slice-1gpu's whole
    name does not)."""
    from stepdeploy.catalog import model_slug

    stamp = time.strftime("%Y%m%dT%H%M%SZ", when)
    return f"{model_slug(model)[:MAX_RUN_NAME - len(stamp) - 1].rstrip('._-')}-{stamp}"


def model_argument(model: str) -> str:
    """`--model` as the ledger keeps it: a catalog name as given, a model file (catalog/loader.py) by its absolute
    path, so that `rollout resume` from another directory reads the same file."""
    from stepdeploy.catalog import model_names

    path = Path(model)
    return model if model in model_names() or not path.exists() else str(path.resolve())


def check_run_name(run_id: str) -> None:
    if not RUN_ID.fullmatch(run_id) or len(run_id) > MAX_RUN_NAME:
        raise BadInput(f"rollout name {run_id!r} (the --run-dir's last part) must be 1-{MAX_RUN_NAME} letters, "
                       "digits, '.', '_' or '-', starting with a letter or digit: it names every attempt's run")


def check_before_rollout(config: RolloutConfig, insecure: bool) -> Cluster:
    """The checks a rollout passes before it starts (or is resumed, or dry-run): the inventory (and its SSH
    host-key checking), the model, and the layout if one is given."""
    from stepdeploy import compat
    from stepdeploy.catalog import load_model
    from stepdeploy.plan.layout import parse_layout
    from stepdeploy.render import RenderOptions
    from stepdeploy.render.build import choose_layout
    from stepdeploy.render.workload import check_engine, choose_engine
    from stepdeploy.rollout.ladder import proxy_for

    cluster = connecting_cluster(config.inventory, insecure)
    spec = load_model(config.model)
    gpus = cluster.nodes[0].gpus_per_node or 0
    engine = choose_engine(RenderOptions(run_id="layout-check"), gpus)
    # the stack as every stage's rendering will judge it (exit 2 before the run directory exists): the target with
    # its layout, and the scaling ladder's proxy
    compat.require_stack(cluster, spec, parse_layout(config.layout) if config.layout else None, engine=engine)
    if "scale" in config.stages:
        compat.require_stack(cluster, load_model(config.proxy_model or proxy_for(cluster, config.model)),
                             engine=engine)
    if config.layout:  # judged as the warmup's rendering will judge it
        seq = config.seq_length or spec.training.seq_length
        gbs = config.global_batch_size or spec.training.global_batch_size
        chosen, _summary = choose_layout(cluster, spec, config.layout, seq, gbs)
        check_engine(engine, chosen, spec, gpus)
    return cluster


def _layout_needs(config: RolloutConfig) -> list[str]:
    """What the target's given layout needs on the nodes beyond the stock stack (plan/engines.needs). A layout the
    planner picks at render time is known only then: each launch verifies what its manifest says it needs."""
    if not config.layout:
        return []
    from stepdeploy.catalog import load_model
    from stepdeploy.plan import engines
    from stepdeploy.plan.layout import parse_layout

    return engines.needs(load_model(config.model), parse_layout(config.layout))


def print_plan(config: RolloutConfig, cluster: Cluster) -> None:
    """What the registered stages (rollout/stages/) will run, each stage's part from its own plan(): its rungs,
    iterations or duration, and the gates it will judge."""
    plan: dict[str, Any] = {"stages": list(config.stages), "gates": asdict(config.thresholds)}
    for name in config.stages:
        plan[name] = stages.load(name).plan(config, cluster)
    needs = _layout_needs(config)
    if needs:  # verified on the nodes before each launch (rollout/stages/needs.py), as preflight --layout does
        plan["needs"] = {"software": needs, "verified": "on every node of a rung before each launch of the target, "
                         "with preflight's check (stepdeploy preflight INVENTORY --model M --layout L)"}
    if config.extra_env:
        plan["env"] = dict(config.extra_env)  # every rank of every stage (env.sh)
    plan["commands"] = ("per node: setsid nohup bash <run>/nodes/<i>-<node>/launch.sh "
                        "(the ranks' launcher; see `stepdeploy render`)")
    kind = registry.default_kind(cluster, config.executor)
    if kind == "local":
        plan["commands"] = ("on this machine, no SSH: setsid nohup bash <run>/nodes/<i>-<node>/launch.sh "
                            "(the ranks' launcher; see `stepdeploy render`)")
    if kind == "slurm":
        controller = cluster.slurm.controller or cluster.nodes[0].name
        plan["commands"] = (f"on {controller}: sbatch --parsable <run>/sbatch.sh (one srun task per "
                            f"{cluster.slurm.tasks}: the node's launch.sh or one rank per GPU); squeue/sacct to "
                            "follow, scancel to stop")
    out.print(json.dumps(plan, indent=2), markup=False)
