"""Readers for single inventory values: plain value in, typed value out, or a ValueProblem saying what
was wrong and what is valid. Pure: no ansible, no files."""

from __future__ import annotations

import ipaddress
import re
import shlex
from typing import Any

MAX_GPUS_PER_NODE = 64
_LABEL = r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)"
# Whole values are matched with fullmatch: `$` alone would let a trailing newline through.
_HOSTNAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")
_NETDEV = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")  # Linux IFNAMSIZ is 16 with the NUL
_HCA = re.compile(r"[A-Za-z0-9_.-]{1,64}(:\d{1,3})?")  # NCCL_IB_HCA entries: device[:port]
# An inventory host's name reaches node directories, logs, SSH commands and the terminal: plain characters only.
_HOST_NAME = re.compile(r"[A-Za-z0-9_:][A-Za-z0-9_.:-]{0,252}")
_JUMP_HOP = re.compile(r"(?:(?P<user>[^@\s]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^@:\s\[\]]+)(?::(?P<port>\d{1,5}))?")
# ansible's boolean words (ansible.module_utils.parsing.convert_bool)
_FALSE = frozenset(("no", "false", "off", "0", "n", "f", "0.0"))
_TRUE = frozenset(("yes", "true", "on", "1", "y", "t", "1.0"))
# OpenSSH StrictHostKeyChecking values that let an unknown or changed key through
_UNCHECKED = frozenset(("no", "off", "accept-new"))
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


MAX_LINK_RATE_GBIT = 3200  # Gb/s: well above any HCA port made so far (XDR is 800)


def read_link_rate(value: Any) -> int:
    """An HCA port's link rate in Gb/s, as `ibstat` prints it (Rate: 400)."""
    valid = f"use the HCA's link rate in Gb/s as ibstat shows it (e.g. 400 or 200), from 1 to {MAX_LINK_RATE_GBIT}"
    number = _whole_number(value, valid)
    if not 1 <= number <= MAX_LINK_RATE_GBIT:
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
    if not isinstance(value, str) or not _NETDEV.fullmatch(value.strip()) or value.strip() in (".", ".."):
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
    if not all(isinstance(item, str) and _HCA.fullmatch(item) for item in items):
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
    if len(text) > 253 or not _HOSTNAME.fullmatch(text):
        return False
    return not text.rstrip(".").rsplit(".", 1)[-1].isdigit()


def is_dotted_hostname(text: str) -> bool:
    return is_hostname(text) and "." in text.rstrip(".")


def read_host_name(name: str) -> str:
    """An inventory host's name: letters, digits, '.', '_', '-' and ':' (IPv6), at most 253 characters."""
    if not _HOST_NAME.fullmatch(name):
        raise ValueProblem("is not a host name stepdeploy accepts",
                           "name hosts with letters, digits, '.', '_', '-' and ':' (at most 253 characters, "
                           "not starting with '.' or '-'), and put anything else in a variable")
    return name


def read_bool(value: Any) -> bool:
    """A boolean as ansible reads one (true/false, yes/no, on/off, 1/0, ...)."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower() if isinstance(value, str | int | float) else None
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueProblem("is not a boolean", "use true or false")


def ssh_options(value: Any) -> list[tuple[str, str]]:
    """The (option, value) pairs of ssh command-line arguments: `-o Key=Value`, `-oKey=Value`, `-o 'Key Value'`
    (option lower-cased) and `-J hops` as ('proxyjump', hops)."""
    if not isinstance(value, str):
        raise ValueProblem("is not text", "use ssh command-line options, e.g. '-o StrictHostKeyChecking=yes'")
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise ValueProblem(f"cannot be split into ssh arguments ({exc})",
                           "balance the quotes in the ssh options") from None
    found: list[tuple[str, str]] = []
    for index, word in enumerate(words):
        following = words[index + 1] if index + 1 < len(words) else ""
        if word in ("-o", "-J"):
            option = following if word == "-o" else f"ProxyJump={following}"
        elif word.startswith(("-o", "-J")) and len(word) > 2:
            option = word[2:] if word.startswith("-o") else f"ProxyJump={word[2:]}"
        else:
            continue
        key, sep, setting = option.partition("=")
        if not sep:
            key, _, setting = option.strip().partition(" ")
        found.append((key.strip().lower(), setting.strip()))
    return found


def known_hosts_from_ssh_args(value: Any) -> str | None:
    """The UserKnownHostsFile an `-o UserKnownHostsFile=...` option in ansible's ssh args names, if any."""
    for key, setting in ssh_options(value):
        if key == "userknownhostsfile" and setting:
            return setting.split()[0]
    return None


def host_key_checking_from_ssh_args(value: Any) -> bool | None:
    """False when the ssh args let unknown host keys through (StrictHostKeyChecking=no/off/accept-new), True
    when they ask for checking, None when they do not say. ssh takes the first occurrence of an option."""
    for key, setting in ssh_options(value):
        if key == "stricthostkeychecking":
            return setting.lower() not in _UNCHECKED
    return None


def proxy_jump_from_ssh_args(value: Any) -> str | None:
    """The ProxyJump (`-J` or `-o ProxyJump=`) the ssh args name, validated; None when none (or 'none')."""
    for key, setting in ssh_options(value):
        if key == "proxyjump":
            return read_proxy_jump(setting)
    return None


def read_proxy_jump(value: Any) -> str | None:
    """`[user@]host[:port][,...]`, as OpenSSH's ProxyJump and Fabric's gateway take it; 'none' is None."""
    valid = "use [user@]host[:port], several separated by commas, e.g. admin@bastion.example.org:2222"
    if not isinstance(value, str) or not value.strip():
        raise ValueProblem("is not a ProxyJump", valid)
    text = value.strip()
    if text.lower() == "none":
        return None
    for hop in text.split(","):
        match = _JUMP_HOP.fullmatch(hop)
        host = match.group("host").strip("[]") if match else ""
        port = int(match.group("port") or 22) if match else 0
        user_ok = match is not None and (match.group("user") is None or match.group("user").isprintable())
        if not (match and user_ok and (is_ip(host) or is_hostname(host)) and 1 <= port <= 65535):
            raise ValueProblem(f"names a jump host {hop!r} stepdeploy cannot read", valid)
    return text
