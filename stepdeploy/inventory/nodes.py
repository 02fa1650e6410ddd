"""One host's resolved variables -> a typed Node, or BadInput naming file, host, variable and the fix."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stepdeploy.errors import BadInput
from stepdeploy.executor_kinds import EXECUTOR_KINDS, INVENTORY_ALIASES
from stepdeploy.inventory import values as v
from stepdeploy.inventory.ansible_source import RawHost
from stepdeploy.inventory.model import Node, SshSettings
from stepdeploy.stack import did_you_mean, profile_names

# Our own variables; anything else starting with `stepdeploy_` is a typo (or a newer stepdeploy's).
STEPDEPLOY_VARS = (
    "stepdeploy_gpus_per_node", "stepdeploy_gpu_model", "stepdeploy_arch", "stepdeploy_train_iface",
    "stepdeploy_fabric", "stepdeploy_ib_hcas", "stepdeploy_ib_rate", "stepdeploy_profile", "stepdeploy_ssh_known_hosts",
    *("stepdeploy_executor", "stepdeploy_slurm_controller", "stepdeploy_slurm_partition", "stepdeploy_slurm_tasks"),
    "stepdeploy_slurm",  # playbooks/site.yml: run the slurm role on every host (no `slurm` group)
)
# Cluster-wide settings: every host must agree (set them once in group_vars/all.yml or [all:vars]).
CLUSTER_VARS = ("stepdeploy_executor", "stepdeploy_slurm_controller", "stepdeploy_slurm_partition",
                "stepdeploy_slurm_tasks")
# stepdeploy_executor: the registry's names (executor_kinds.py), and the inventory's older spellings of them.
EXECUTOR_CHOICES: dict[str, str] = {**{kind: kind for kind in EXECUTOR_KINDS}, **INVENTORY_ALIASES}
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Ansible's connection variables we read. Where ansible knows two spellings it takes the one later in its own
# list (ansible_ssh_host over ansible_host, ...): that one comes first here. Both set to different values is
# refused rather than guessed.
HOST_VARS = ("ansible_ssh_host", "ansible_host")
PORT_VARS = ("ansible_ssh_port", "ansible_port")
USER_VARS = ("ansible_ssh_user", "ansible_user")
KEY_VARS = ("ansible_ssh_private_key_file", "ansible_private_key_file")
SSH_ARGS_VARS = ("ansible_ssh_common_args", "ansible_ssh_extra_args", "ansible_ssh_args")
# Variables with which an inventory turns host-key checking off (ssh and paramiko connections).
HOST_KEY_CHECKING_VARS = ("ansible_host_key_checking", "ansible_ssh_host_key_checking",
                          "ansible_paramiko_host_key_checking")
ANSIBLE_VARS = frozenset(
    (*HOST_VARS, *PORT_VARS, *USER_VARS, *KEY_VARS, *SSH_ARGS_VARS, *HOST_KEY_CHECKING_VARS, "ansible_connection")
)


def wanted(name: str) -> bool:
    """The variables read_inventory should hand over."""
    return name.startswith("stepdeploy_") or name in ANSIBLE_VARS


class HostVars:
    """A host's variables with error messages that say where each value was set."""

    def __init__(self, raw: RawHost, source: Path) -> None:
        self.raw = raw
        self.source = source

    @property
    def name(self) -> str:
        return self.raw.name

    def where(self, key: str | None = None) -> str:
        return (self.raw.origins.get(key) if key else None) or str(self.source)

    def error(self, key: str, message: str) -> BadInput:
        return BadInput(f"{self.where(key)}: host {self.name!r}: {key} {message}")

    def set_keys(self, keys: tuple[str, ...]) -> list[str]:
        return [k for k in keys if self.raw.variables.get(k) is not None]

    def read(self, keys: tuple[str, ...] | str, reader: Callable[[Any], Any]) -> Any:
        """The value of `keys` (one variable, or the spellings of one setting, the one ansible prefers first)
        converted by `reader`; None when none is set. Two spellings with different values are refused: ansible
        and stepdeploy must never connect to different places."""
        found = self.set_keys((keys,) if isinstance(keys, str) else keys)
        values = [self._convert(key, reader) for key in found]
        for key, value in zip(found[1:], values[1:], strict=True):
            if value != values[0]:
                raise self.error(found[0], f"= {v.show(self.raw.variables[found[0]])} and {key} = "
                                 f"{v.show(self.raw.variables[key])} ({self.where(key)}) disagree; ansible uses "
                                 f"{found[0]}: set only one of them")
        return values[0] if values else None

    def _convert(self, key: str, reader: Callable[[Any], Any]) -> Any:
        value = self.raw.variables[key]
        try:
            v.reject_template(value)
            return reader(value)
        except v.ValueProblem as exc:
            raise self.error(key, f"= {v.show(value)} {exc.problem}; {exc.valid}") from None


def build_node(raw: RawHost, source: Path) -> tuple[Node, str | None]:
    """The Node for `raw` and the stack profile name it declares (None if it declares none)."""
    host = HostVars(raw, source)
    try:
        v.read_host_name(raw.name)
    except v.ValueProblem as exc:
        raise BadInput(f"{host.where()}: host {raw.name!r} {exc.problem}; {exc.valid}") from None
    _check_unknown_vars(host)
    ssh = _ssh_settings(host)
    node = Node(
        name=raw.name,
        address=_address(host, ssh.connection),
        groups=list(raw.groups),
        ssh=ssh,
        gpus_per_node=host.read("stepdeploy_gpus_per_node", v.read_count),
        gpu_model=host.read("stepdeploy_gpu_model", lambda x: v.read_text(x, "GPU model name", 64)),
        arch=host.read("stepdeploy_arch", v.read_arch),
        train_iface=host.read("stepdeploy_train_iface", v.read_netdev),
        fabric=host.read("stepdeploy_fabric", v.read_fabric),
        ib_hcas=host.read("stepdeploy_ib_hcas", v.read_hcas) or [],
        ib_rate_gbit=host.read("stepdeploy_ib_rate", v.read_link_rate),
    )
    return node, host.read("stepdeploy_profile", _read_profile_name)


def cluster_settings(raw: RawHost, source: Path) -> dict[str, tuple[Any, str]]:
    """The cluster-wide settings this host declares: variable -> (typed value, where it was set)."""
    host = HostVars(raw, source)
    readers: dict[str, Callable[[Any], Any]] = {
        "stepdeploy_executor": lambda x: v.read_choice(x, EXECUTOR_CHOICES),
        "stepdeploy_slurm_controller": v.read_address,
        "stepdeploy_slurm_partition": _read_slurm_name,
        "stepdeploy_slurm_tasks": lambda x: v.read_choice(x, {"node": "node", "gpu": "gpu"}),
    }
    found = {key: host.read(key, reader) for key, reader in readers.items()}
    return {key: (value, host.where(key)) for key, value in found.items() if value is not None}


def _read_slurm_name(value: Any) -> str:
    if not isinstance(value, str) or not _SLURM_NAME.fullmatch(value.strip()):
        raise v.ValueProblem("is not a Slurm partition name", "use letters, digits, '_', '-', '.' (at most 64)")
    return value.strip()


def _check_unknown_vars(host: HostVars) -> None:
    for key in sorted(host.raw.variables):
        if key.startswith("stepdeploy_") and key not in STEPDEPLOY_VARS:
            raise host.error(key, f"is not a stepdeploy variable{did_you_mean(key, STEPDEPLOY_VARS)}; "
                                  f"known: {', '.join(STEPDEPLOY_VARS)}")


def _ssh_settings(host: HostVars) -> SshSettings:
    connection = host.read("ansible_connection", v.read_connection) or "ssh"
    return SshSettings(
        user=host.read(USER_VARS, lambda x: v.read_text(x, "user name", 64)),
        port=host.read(PORT_VARS, v.read_port) or 22,
        private_key_file=_expand(host.read(KEY_VARS, v.read_path)),
        known_hosts_file=_expand(_known_hosts(host)),
        connection=connection,
        unverified_by=_unverified_by(host),
        proxy_jump=_first_of_ssh_args(host, v.proxy_jump_from_ssh_args),
    )


def _unverified_by(host: HostVars) -> str | None:
    """Which variable turns host-key checking off for this host ('name=value (file:line)'), if any."""
    for key in HOST_KEY_CHECKING_VARS:
        if host.read(key, v.read_bool) is False:
            return f"{key}={host.raw.variables[key]} ({host.where(key)})"
    for key in SSH_ARGS_VARS:
        if host.read(key, v.host_key_checking_from_ssh_args) is False:
            return f"{key}={host.raw.variables[key]!r} ({host.where(key)})"
    return None


def _first_of_ssh_args(host: HostVars, reader: Callable[[Any], Any]) -> Any:
    """What the first of ansible's ssh-args variables that says anything says (ssh takes an option's first
    occurrence; ansible passes the common args before the extra args)."""
    for key in SSH_ARGS_VARS:
        found = host.read(key, reader)
        if found:
            return found
    return None


def _known_hosts(host: HostVars) -> str | None:
    """stepdeploy_ssh_known_hosts, else the UserKnownHostsFile ansible's ssh arguments already pass."""
    declared = host.read("stepdeploy_ssh_known_hosts", v.read_path)
    if declared is not None:
        return declared
    return _first_of_ssh_args(host, v.known_hosts_from_ssh_args)


def _address(host: HostVars, connection: str) -> str:
    address = host.read(HOST_VARS, v.read_address)
    if address is not None:
        return address
    if connection == "local" or v.is_ip(host.name) or v.is_dotted_hostname(host.name):
        return host.name
    raise BadInput(f"{host.where()}: host {host.name!r} has no address: set ansible_host to its IP address "
                   "or DNS name, or name the host by its IP address or fully qualified DNS name")


def _read_profile_name(value: Any) -> str:
    known = profile_names()
    if not isinstance(value, str):
        raise v.ValueProblem("is not a profile name", f"known profiles: {', '.join(known)}")
    name = value.strip()
    if name not in known:
        raise v.ValueProblem(f"is not a known stack profile{did_you_mean(name, known)}",
                             f"known profiles: {', '.join(known)}")
    return name


def _expand(path: str | None) -> Path | None:
    if not path:
        return None
    try:
        return Path(path).expanduser()
    except RuntimeError:  # '~someone' without such a user: keep it as written, ssh will say
        return Path(path)
