"""Run playbooks/site.yml on an inventory through ansible-runner, feeding events to a callback."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdeploy import ansible_run
from stepdeploy.errors import BadInput, MissingPrerequisite
from stepdeploy.inventory import load_cluster
from stepdeploy.provision.progress import Progress

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ProvisionRequest:
    inventory: Path
    check: bool = False
    diff: bool = False
    tags: str | None = None
    limit: str | None = None
    log_dir: Path | None = None
    playbook: str = "site.yml"


@dataclass
class ProvisionResult:
    progress: Progress
    status: str  # ansible-runner's: successful | failed | timeout | canceled
    rc: int
    log_dir: Path
    seconds: float

    @property
    def stdout_log(self) -> Path:
        return self.log_dir / "stdout.log"


def playbooks_dir() -> Path:
    path = Path(os.environ.get("STEPDEPLOY_HOME", PROJECT_ROOT)) / "playbooks"
    if not path.is_dir():
        raise MissingPrerequisite(f"no playbooks directory at {path}",
                                  hint="install stepdeploy from its source tree (pip install -e .) "
                                       "or set STEPDEPLOY_HOME to it")
    return path


def default_log_dir() -> Path:
    state = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state"))
    return state / "stepdeploy" / "provision" / time.strftime("%Y%m%d-%H%M%S")


def validate(request: ProvisionRequest) -> None:
    """Everything that can be refused before Ansible starts: the inventory and its profile."""
    cluster = load_cluster(request.inventory)
    if cluster.profile is None:
        raise BadInput(f"{request.inventory}: sets no stepdeploy_profile; provisioning needs one",
                       hint="add `stepdeploy_profile: <name>` to the inventory's group_vars")
    playbook = playbooks_dir() / request.playbook
    if not playbook.is_file():
        raise BadInput(f"no playbook {playbook}")


def cmdline(request: ProvisionRequest) -> str:
    args = []
    if request.check:
        args.append("--check")
    if request.diff:
        args.append("--diff")
    return " ".join(args)


def run(request: ProvisionRequest, on_event: Callable[[Progress, str | None], None] | None = None
        ) -> ProvisionResult:
    validate(request)
    log_dir = (request.log_dir or default_log_dir()).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress()

    def handler(event: dict[str, Any]) -> bool:
        line = progress.handle(event)
        if on_event is not None:
            on_event(progress, line)
        return True

    started = time.monotonic()
    runner = ansible_run.run(
        log_dir, request.inventory.resolve(),
        playbook=str(playbooks_dir() / request.playbook),
        cmdline=cmdline(request) or None, tags=request.tags, limit=request.limit,
        envvars={"ANSIBLE_ROLES_PATH": str(playbooks_dir().parent / "roles")},
        event_handler=handler, ident="run", rotate_artifacts=1,
    )
    seconds = time.monotonic() - started
    stdout = runner.stdout.read() if runner.stdout else ""
    (log_dir / "stdout.log").write_text(stdout)
    return ProvisionResult(progress=progress, status=runner.status, rc=runner.rc, log_dir=log_dir,
                           seconds=seconds)
