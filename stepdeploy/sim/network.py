"""Bridge, veth pairs and network namespaces of the simulated cluster (host side effects via `ip`)."""

from __future__ import annotations

import json

from stepdeploy.sim import host


def link_exists(name: str) -> bool:
    return host.run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def netns_exists(name: str) -> bool:
    out = host.run(["ip", "-json", "netns", "list"], check=False).stdout.strip()
    return any(entry.get("name") == name for entry in (json.loads(out) if out else []))


# The bridge and the host ends of the veths carry jumbo frames, like a switch configured for them; the nodes'
# eth0 start at the default 1500 and provisioning raises them (MTU 9000 on the training network).
SWITCH_MTU = 9000


def ensure_bridge(bridge: str, address_cidr: str) -> None:
    if not link_exists(bridge):
        host.run(["ip", "link", "add", bridge, "mtu", str(SWITCH_MTU), "type", "bridge"])
    addrs = host.run(["ip", "-json", "addr", "show", "dev", bridge]).stdout
    have = {f"{a['local']}/{a['prefixlen']}" for link in json.loads(addrs) for a in link.get("addr_info", [])}
    if address_cidr not in have:
        host.run(["ip", "addr", "add", address_cidr, "dev", bridge])
    host.run(["ip", "link", "set", bridge, "up"])


def ensure_node_link(netns: str, veth: str, bridge: str, address_cidr: str) -> None:
    """A namespace whose only interface (besides lo) is eth0, the peer of `veth` on the bridge.

    No default route is added: a node reaches the bridge and nothing beyond it.
    """
    if not netns_exists(netns):
        host.run(["ip", "netns", "add", netns])
    if not link_exists(veth):
        host.run(["ip", "link", "add", veth, "mtu", str(SWITCH_MTU), "type", "veth",
                  "peer", "name", "eth0", "mtu", "1500", "netns", netns])
    host.run(["ip", "link", "set", veth, "master", bridge, "mtu", str(SWITCH_MTU), "up"])
    addrs = host.run(["ip", "-n", netns, "-json", "addr", "show", "dev", "eth0"]).stdout
    have = {f"{a['local']}/{a['prefixlen']}" for link in json.loads(addrs) for a in link.get("addr_info", [])}
    if address_cidr not in have:
        host.run(["ip", "-n", netns, "addr", "add", address_cidr, "dev", "eth0"])
    host.run(["ip", "-n", netns, "link", "set", "lo", "up"])
    host.run(["ip", "-n", netns, "link", "set", "eth0", "up"])


def delete_link(name: str) -> None:
    if link_exists(name):
        host.run(["ip", "link", "del", "dev", name], check=False)


def delete_netns(name: str) -> None:
    if netns_exists(name):
        host.run(["ip", "netns", "del", name], check=False)
