"""Root of the `stepdeploy` command: global options, sub-commands, and the error -> exit-code boundary."""

from __future__ import annotations

import errno
import sqlite3
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
from stepdeploy.cli.output import err, printable
from stepdeploy.errors import EXIT_BAD_INPUT, EXIT_FAILED, StepdeployError

try:  # typer >= 0.2x carries its own click (typer._click); its exceptions derive from TyperException
    from typer import TyperException as UsageProblem
except ImportError:  # pragma: no cover - an older typer on the real click
    from click import ClickException as UsageProblem

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
app.command("render", epilog=render_cmd.EXAMPLE)(
    render_cmd.render
)
app.command("report", epilog="Example: stepdeploy report runs/r1 --html runs/r1/report.html")(report_cmd.report)
app.command("demo", epilog="Example: stepdeploy demo --nodes 2")(demo_cmd.demo)
app.command("plan", epilog="Example: stepdeploy plan --model step-3.5-flash "
            "-i inventory/examples/hgx-h100-pair.ini --nodes 4")(
    plan_cmd.plan
)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: every StepdeployError, every option click refuses and every file the OS
    refuses becomes one `error:` line on stderr (and often a `hint:` line) and its exit code."""
    try:
        code = app(args=argv, prog_name="stepdeploy", standalone_mode=False)
    except UsageProblem as exc:  # an unknown option, a value of the wrong type or range
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help, then what is missing
            exc.show()  # type: ignore[attr-defined]
            path = ctx.command_path if ctx else "stepdeploy"
            commands = ", ".join(getattr(ctx.command, "commands", {})) if ctx else ""
            _fail(f"{path} needs a command: {commands}", f"{path} --help", EXIT_BAD_INPUT)
        _fail(exc.format_message(), f"{ctx.command_path if ctx else 'stepdeploy'} --help", EXIT_BAD_INPUT)
    except StepdeployError as exc:
        _fail(exc.message, exc.hint, exc.exit_code)
    except typer.Abort:
        _fail("aborted", None, EXIT_FAILED)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except sqlite3.DatabaseError as exc:  # a ledger damaged after it was opened and checked
        _fail(f"a rollout ledger cannot be read: {exc}", "stepdeploy rollout list", EXIT_BAD_INPUT)
    except OSError as exc:
        if exc.errno == errno.EPIPE:  # stdout closed early (`| head`): nothing more to say
            sys.exit(EXIT_FAILED)
        if exc.filename is None:
            raise
        _fail(f"{exc.filename}: {exc.strerror or exc}", None, EXIT_BAD_INPUT)
    sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, hint: str | None, code: int) -> None:
    """One `error:` line (and a `hint:` line): newlines and control characters in the message are written
    out, so user data can neither split the line nor reach the terminal as escape sequences."""
    err.print(f"error: {_one_line(message)}", soft_wrap=True)
    if hint:
        err.print(f"hint: {_one_line(hint)}", soft_wrap=True)
    sys.exit(code)


def _one_line(text: str) -> str:
    return printable(text.strip()).replace("\n", "\\n").replace("\t", " ")
