"""Run site.yml on an inventory through ansible-runner, feeding events to a callback.

The playbooks and roles are the checkout's top-level playbooks/ and roles/, shipped in the wheel as
stepdeploy/playbooks and stepdeploy/roles (stepdeploy/resources.py), so an installed wheel provisions as a source
checkout does. STEPDEPLOY_HOME, when set, names a directory holding
`playbooks/` and `roles/` to use instead (a site's own copy of them).

The infiniband role fetches every node's NCCL facts (/etc/stepdeploy/nccl.json) back to the controller, into
the facts directory this module passes it (`infiniband_nccl_facts_fetch_dir`): by default
`.stepdeploy/facts/` next to the inventory, where `stepdeploy render` and the rollout look for them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stepdeploy import ansible_run, resources
from stepdeploy.errors import BadInput, MissingPrerequisite
from stepdeploy.inventory import load_cluster
from stepdeploy.provision.progress import Progress
from stepdeploy.render.facts import default_facts_dir, facts_file


@dataclass(frozen=True)
class ProvisionRequest:
    inventory: Path
    check: bool = False
    diff: bool = False
    tags: str | None = None
    limit: str | None = None
    log_dir: Path | None = None
    playbook: str = "site.yml"
    facts_dir: Path | None = None  # None: .stepdeploy/facts next to the inventory

    @property
    def nccl_facts_dir(self) -> Path:
        """Where the nodes' NCCL facts are saved on the controller (absolute)."""
        return (self.facts_dir or default_facts_dir(self.inventory)).absolute()


@dataclass
class ProvisionResult:
    progress: Progress
    status: str  # ansible-runner's: successful | failed | timeout | canceled
    rc: int
    log_dir: Path
    seconds: float
    facts_dir: Path | None = None
    facts_saved: tuple[str, ...] = ()  # hosts whose facts file is in facts_dir after the run

    @property
    def stdout_log(self) -> Path:
        return self.log_dir / "stdout.log"


def playbooks_dir() -> Path:
    """STEPDEPLOY_HOME/playbooks when STEPDEPLOY_HOME is set, else the ones stepdeploy ships."""
    home = os.environ.get("STEPDEPLOY_HOME")
    path = Path(home) / "playbooks" if home else resources.playbooks_dir()
    if not path.is_dir():
        hint = ("unset STEPDEPLOY_HOME to use the playbooks stepdeploy ships, or point it at a directory holding "
                "playbooks/ and roles/" if home
                else "reinstall stepdeploy (its package ships playbooks/ and roles/ as stepdeploy/playbooks and "
                "stepdeploy/roles)")
        raise MissingPrerequisite(f"no playbooks directory at {path}", hint=hint)
    return path


def roles_dir() -> Path:
    """STEPDEPLOY_HOME/roles when STEPDEPLOY_HOME is set, else the ones stepdeploy ships."""
    home = os.environ.get("STEPDEPLOY_HOME")
    return Path(home) / "roles" if home else resources.roles_dir()


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


def extravars(request: ProvisionRequest) -> dict[str, str]:
    """Variables stepdeploy sets for the play (a fetch is skipped in check mode, so --check writes nothing)."""
    return {"infiniband_nccl_facts_fetch_dir": str(request.nccl_facts_dir)}


def saved_facts(facts_dir: Path, hosts: list[str]) -> tuple[str, ...]:
    return tuple(h for h in hosts if (path := facts_file(facts_dir, h)) is not None and path.is_file())


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
        cmdline=cmdline(request) or None, tags=request.tags, limit=request.limit, extravars=extravars(request),
        envvars={"ANSIBLE_ROLES_PATH": str(roles_dir())},
        event_handler=handler, ident="run", rotate_artifacts=1,
    )
    seconds = time.monotonic() - started
    stdout = runner.stdout.read() if runner.stdout else ""
    (log_dir / "stdout.log").write_text(stdout)
    facts_dir = request.nccl_facts_dir
    return ProvisionResult(progress=progress, status=runner.status, rc=runner.rc, log_dir=log_dir,
                           seconds=seconds, facts_dir=facts_dir,
                           facts_saved=saved_facts(facts_dir, list(progress.hosts)))
