"""Root of the `stepdeploy` command: global options, sub-commands, and the error -> exit-code boundary."""

from __future__ import annotations

import sys

import typer

from stepdeploy import __version__
from stepdeploy.cli import data as data_cmd
from stepdeploy.cli import demo as demo_cmd
from stepdeploy.cli import inventory as inventory_cmd
from stepdeploy.cli import plan as plan_cmd
from stepdeploy.cli import preflight as preflight_cmd
from stepdeploy.cli import provision as provision_cmd
from stepdeploy.cli import render as render_cmd
from stepdeploy.cli import report as report_cmd
from stepdeploy.cli import rollout as rollout_cmd
from stepdeploy.cli import run as run_cmd
from stepdeploy.cli import sim as sim_cmd
from stepdeploy.cli.output import err
from stepdeploy.errors import StepdeployError

EXIT_CODES = """Exit codes: 0 ok, 1 checks or stages failed, 2 bad input, 3 nodes unreachable,
4 missing prerequisite on this machine (root, host package)."""

app = typer.Typer(
    name="stepdeploy",
    help="Take GPU nodes in an Ansible inventory from a bare OS to a validated Megatron training run.",
    epilog="Example: stepdeploy sim up --nodes 2 && stepdeploy inventory show "
    "/var/lib/stepdeploy/sim/sim/inventory.ini\n\n" + EXIT_CODES,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"stepdeploy {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Take GPU nodes in an Ansible inventory from a bare OS to a validated Megatron training run."""


app.add_typer(sim_cmd.app, name="sim")
app.add_typer(inventory_cmd.app, name="inventory")
app.add_typer(rollout_cmd.app, name="rollout")
app.add_typer(run_cmd.app, name="run")
app.add_typer(data_cmd.app, name="data")
app.command("provision", epilog="Example: stepdeploy provision inventory/dgx.ini --check")(
    provision_cmd.provision
)
app.command("preflight", epilog="Example: stepdeploy preflight inventory/dgx.ini --json")(preflight_cmd.preflight)
app.command("render", epilog="Example: stepdeploy render -i inventory/dgx.ini --model step-3.5-flash --out runs/r1")(
    render_cmd.render
)
app.command("report", epilog="Example: stepdeploy report runs/r1 --html runs/r1/report.html")(report_cmd.report)
app.command("demo", epilog="Example: stepdeploy demo --nodes 2")(demo_cmd.demo)
app.command("plan", epilog="Example: stepdeploy plan --model step-3.5-flash -i inventory/dgx.ini")(
    plan_cmd.plan
)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: every StepdeployError becomes one line on stderr and its exit code."""
    try:
        app(args=argv, prog_name="stepdeploy")
    except StepdeployError as exc:
        err.print(f"error: {exc.message}", markup=False, soft_wrap=True)
        if exc.hint:
            err.print(f"hint: {exc.hint}", markup=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        sys.exit(130)
