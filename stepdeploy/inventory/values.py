"""Readers for single inventory values: plain value in, typed value out, or a ValueProblem saying what
was wrong and what is valid. Pure: no ansible, no files."""

from __future__ import annotations

import ipaddress
import re
import shlex
from typing import Any

MAX_GPUS_PER_NODE = 64
_LABEL = r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*\.?$")
_NETDEV = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")  # Linux IFNAMSIZ is 16 with the NUL
_HCA = re.compile(r"^[A-Za-z0-9_.-]{1,64}(:\d{1,3})?$")  # NCCL_IB_HCA entries: device[:port]
_FABRICS = {"infiniband": "infiniband", "ib": "infiniband", "roce": "roce", "ethernet": "ethernet"}
_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
_CONNECTIONS = {
    "ssh": "ssh", "smart": "ssh", "paramiko": "ssh", "paramiko_ssh": "ssh",
    "ansible.builtin.ssh": "ssh", "ansible.builtin.paramiko_ssh": "ssh",
    "local": "local", "ansible.builtin.local": "local",
}


class ValueProblem(ValueError):
    """What is wrong with a value and what would be valid; the caller adds file, host and variable."""

    def __init__(self, problem: str, valid: str) -> None:
        super().__init__(f"{problem}; {valid}")
        self.problem = problem
        self.valid = valid


def show(value: Any, limit: int = 60) -> str:
    """A short, printable, single-line rendering of a value for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reject_template(value: Any) -> None:
    """Inventory values are read literally: a Jinja expression would need ansible's templating (and its
    lookups, which can run commands), so it is refused rather than silently used as text."""
    items = value if isinstance(value, list) else [value]
    if any(isinstance(item, str) and ("{{" in item or "{%" in item) for item in items):
        raise ValueProblem("is a Jinja template, which stepdeploy does not evaluate",
                           "write the value itself")


def read_count(value: Any) -> int:
    valid = f"use a whole number from 0 to {MAX_GPUS_PER_NODE}"
    number = _whole_number(value, valid)
    if not 0 <= number <= MAX_GPUS_PER_NODE:
        raise ValueProblem("is out of range", valid)
    return number


def read_port(value: Any) -> int:
    valid = "use a TCP port from 1 to 65535"
    number = _whole_number(value, valid)
    if not 1 <= number <= 65535:
        raise ValueProblem("is out of range", valid)
    return number


def _whole_number(value: Any, valid: str) -> int:
    if isinstance(value, bool):
        raise ValueProblem("is a boolean, not a number", valid)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d{1,9}\s*", value):
        return int(value)
    raise ValueProblem("is not a whole number", valid)


def read_choice(value: Any, choices: dict[str, str]) -> str:
    canonical = sorted(set(choices.values()))
    valid = "use one of " + ", ".join(canonical)
    if not isinstance(value, str):
        raise ValueProblem("is not text", valid)
    key = value.strip().lower()
    if key not in choices:
        raise ValueProblem("is not a known value", valid)
    return choices[key]


def read_fabric(value: Any) -> str:
    return read_choice(value, _FABRICS)


def read_arch(value: Any) -> str:
    return read_choice(value, _ARCHES)


def read_connection(value: Any) -> str:
    try:
        return read_choice(value, _CONNECTIONS)
    except ValueProblem as exc:
        raise ValueProblem(exc.problem, "stepdeploy drives nodes over ssh or local") from None


def read_text(value: Any, what: str, limit: int = 128) -> str:
    valid = f"use a non-empty {what} of at most {limit} printable characters"
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueProblem("is not text", valid)
    text = str(value).strip()
    if not text or len(text) > limit or not text.isprintable():
        raise ValueProblem(f"is not a valid {what}", valid)
    return text


def read_netdev(value: Any) -> str:
    valid = "use a Linux network interface name (1-15 letters, digits, '_', '-', '.'), e.g. eth0"
    if not isinstance(value, str) or not _NETDEV.match(value.strip()) or value.strip() in (".", ".."):
        raise ValueProblem("is not a network interface name", valid)
    return value.strip()


def read_hcas(value: Any) -> list[str]:
    valid = "use a list of RDMA device names such as ['mlx5_0', 'mlx5_1'] (or 'mlx5_0,mlx5_1')"
    if isinstance(value, str):
        items: list[Any] = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, list):
        items = value
    else:
        raise ValueProblem("is not a list of device names", valid)
    if not all(isinstance(item, str) and _HCA.match(item) for item in items):
        raise ValueProblem("is not a list of device names", valid)
    if len(set(items)) != len(items):
        raise ValueProblem("lists a device twice", valid)
    return list(items)


def read_path(value: Any) -> str:
    valid = "use a file path"
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise ValueProblem("is not a file path", valid)
    return value.strip()


def read_address(value: Any) -> str:
    valid = "use an IPv4/IPv6 address or a DNS name"
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueProblem("is not an address", valid)
    text = value.strip()
    if is_ip(text) or is_hostname(text):
        return text
    raise ValueProblem("is not an address", valid)


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_hostname(text: str) -> bool:
    """A syntactically valid DNS name whose last label is not all digits (so '10.0.0.300' is not one)."""
    if len(text) > 253 or not _HOSTNAME.match(text):
        return False
    return not text.rstrip(".").rsplit(".", 1)[-1].isdigit()


def is_dotted_hostname(text: str) -> bool:
    return is_hostname(text) and "." in text.rstrip(".")


def known_hosts_from_ssh_args(value: Any) -> str | None:
    """The UserKnownHostsFile an `-o UserKnownHostsFile=...` option in ansible's ssh args names, if any."""
    if not isinstance(value, str):
        raise ValueProblem("is not text", "use ssh command-line options, e.g. '-o StrictHostKeyChecking=yes'")
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise ValueProblem(f"cannot be split into ssh arguments ({exc})",
                           "balance the quotes in the ssh options") from None
    options = [w[2:] if w.startswith("-o") and len(w) > 2 else w for w in words if w != "-o"]
    for option in options:
        key, sep, path = option.partition("=")
        if not sep:
            key, _, path = option.partition(" ")
        if key.strip().lower() == "userknownhostsfile" and path.strip():
            return path.strip().split()[0]
    return None
