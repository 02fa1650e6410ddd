"""`stepdeploy render`: inventory + model + layout (chosen by the planner unless given) -> a run directory.

Exit codes: 0 rendered (or would be, with --dry-run), 1 no layout fits (or the --layout given does not, unless
--force), 2 bad input — an inventory stack profile that cannot run the model here included (compat.stack_verdict).
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from stepdeploy.catalog import model_slug
from stepdeploy.cli.common import finite_option
from stepdeploy.cli.output import emit_json, err, info, out, warn
from stepdeploy.render import RenderOptions, parse_env
from stepdeploy.render.build import build, check_out_dir, write_run
from stepdeploy.render.options import REMOTE_RUNS, SEED_OPTIONS, STAGE_ITERATIONS
from stepdeploy.render.run import RenderedRun

# `render --help`'s example (cli/app.py's epilog): it runs as written from a checkout (test_render_truths.py).
# Not inventory/dgx.ini since issue 38: its seed-2024 stack (megatron-core 0.8.0, PyTorch 2.3.1) is refused for the
# megatron engine (exit 2, compat.stack_verdict); the HGX pair's hopper-cu128 runs it.
EXAMPLE = "Example: stepdeploy render -i inventory/examples/hgx-h100-pair.ini --model proxy-0.7b-moe --out runs/r1"


def render(
    inventory: str = typer.Option(..., "--inventory", "-i", help="Ansible inventory (INI/YAML)."),
    model: str = typer.Option(..., "--model", "-m", help="Catalog model, e.g. tiny-dense, proxy-0.7b-moe."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Run directory to write: a new path or an empty directory "
                                 "(written whole, then renamed into place; never over files)."),
    layout: str | None = typer.Option(None, "--layout", help="tp=2,pp=1,ep=2,mbs=1,... (default: planner's best)."),
    force: bool = typer.Option(False, "--force", help="Render a --layout the planner says does not fit (exit 1 "
                               "otherwise); the manifest records fits: false, forced: true."),
    stage: str = typer.Option("warmup", "--stage", help=f"One of {', '.join(STAGE_ITERATIONS)}."),
    run_id: str | None = typer.Option(None, "--run-id", help="Default: MODEL-STAGE-UTC time."),
    engine: str | None = typer.Option(None, "--engine", help="torch or megatron (default: by GPUs)."),
    iterations: int | None = typer.Option(None, "--iterations", min=1, help="Default: by stage."),
    seq: int | None = typer.Option(None, "--seq", min=1, help="Sequence length (default: the model's)."),
    gbs: int | None = typer.Option(None, "--gbs", min=1, help="Global batch size (default: the model's)."),
    nproc: int | None = typer.Option(None, "--nproc-per-node", min=1, help="Ranks per node (default: GPUs)."),
    pg_timeout: int = typer.Option(120, "--pg-timeout", min=1, help="Process-group timeout, seconds."),
    save_interval: int = typer.Option(0, "--save-interval", min=0, help="Checkpoint every N steps (0: at end)."),
    keep_checkpoints: int = typer.Option(2, "--keep-checkpoints", min=1, help="Committed checkpoints kept (the "
                                         "newest K; older ones are deleted once a newer one is committed)."),
    lr: float | None = finite_option(None, "--lr", help="Peak learning rate (default: the model's, else 3e-3)."),
    warmup_iterations: int | None = typer.Option(None, "--warmup-iterations", min=1, help="Learning-rate warm-up "
                                                 "from peak/N to the peak (default: a tenth of the iterations)."),
    seed_option: list[str] = typer.Option([], "--seed-option", help=f"{', '.join(SEED_OPTIONS)}."),
    env: list[str] = typer.Option([], "--env", help="Extra KEY=VALUE for every rank (quoted when rendered)."),
    no_nvls: bool = typer.Option(False, "--no-nvls", help="NCCL_NVLS_ENABLE=0 and the other multicast switches."),
    remote_dir: str = typer.Option(REMOTE_RUNS, "--remote-dir", help="Parent of the run directory on nodes."),
    python: str = typer.Option("/opt/stepdeploy/venv/bin/python", "--python", help="Python on the nodes."),
    facts_dir: Path | None = typer.Option(
        None, "--facts-dir", help="NCCL facts `stepdeploy provision` saved, one NODE.json per node (default: "
        ".stepdeploy/facts next to the inventory, used when it exists)."),
    data: Path | None = typer.Option(None, "--data", help="A dataset `stepdeploy data prepare` wrote (its prefix): "
                                     "shipped in the run directory (default: synthetic tokens)."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Show what would be written; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON to stdout."),
) -> None:
    """Render per-node launch scripts, environment, workload config and a manifest into a run directory."""
    opts = RenderOptions(
        run_id=run_id or f"{model_slug(model)}-{stage}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}",
        stage=stage, engine=engine, iterations=iterations, seq_length=seq, global_batch_size=gbs,
        nproc_per_node=nproc, pg_timeout_s=pg_timeout, save_interval=save_interval, lr=lr,
        warmup_iterations=warmup_iterations, keep_checkpoints=keep_checkpoints,
        seed_options=tuple(seed_option), extra_env=parse_env(env), disable_nvls=no_nvls,
        remote_dir=remote_dir, python=python, data=str(data) if data else None)
    if not dry_run:
        check_out_dir(out_dir)  # before the work of rendering: a run directory is never written twice
    rendered = build(inventory, model, layout, opts, facts_dir, force=force)
    _notes(rendered)
    if not dry_run:
        write_run(rendered, out_dir)
    if as_json:
        emit_json(rendered.manifest.to_json())  # the keys of the file as written, in its order
        return
    _summary(rendered, out_dir, dry_run)


def _notes(rendered: RenderedRun) -> None:
    """What a reader of the rendering should know, to stderr: the planner's notes, a forced layout, where the NCCL
    settings came from."""
    for note in rendered.notes:
        err.print(f"note: {note}", markup=False, soft_wrap=True)
    manifest = rendered.manifest
    planned = manifest.inputs.get("layout") or {}
    if planned.get("forced"):
        warn(f"layout {manifest.layout} does not fit: {planned.get('shortfall')}; rendered anyway (--force)")
    with_facts = [node for node in manifest.nodes if node.facts]
    if with_facts:
        err.print(f"NCCL settings of {', '.join(n.name for n in with_facts)} from the facts provisioning saved "
                  f"in {Path(str(with_facts[0].facts['path'])).parent}", markup=False, soft_wrap=True)


def _summary(rendered: RenderedRun, out_dir: Path, dry_run: bool) -> None:
    """The run written (or that would be), each file with its hash, and the next command."""
    manifest = rendered.manifest
    verb = "would write" if dry_run else "wrote"
    parallel = rendered.workload["parallel"]
    adam = "fused AdamW on the host" if parallel["optimizer_cpu_offload"] else f"{parallel['optimizer']} AdamW"
    out.print(f"{verb} {out_dir} (run {rendered.run_id}, {rendered.workload['engine']} engine, "
              f"layout {manifest.layout}, {adam}, "
              f"{len(rendered.placements)} node(s), remote {rendered.run_dir})", markup=False)
    for item in rendered.files:
        out.print(f"  {item.sha256[:12]}  {item.path}", markup=False)
    if not dry_run:
        info(f"next: stepdeploy run launch {out_dir} --follow")
