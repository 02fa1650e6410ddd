#!/usr/bin/python
"""Discover what NCCL needs to know about a node's fabric, from sysfs only (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: stepdeploy_nccl_facts
short_description: Discover RDMA devices, their netdevs and RoCE GID indexes for NCCL
description:
  - Reads /sys/class/infiniband and /sys/class/net (what ibdev2netdev and show_gids show) and returns the
    settings NCCL needs - NCCL_SOCKET_IFNAME, NCCL_IB_HCA (every selected port, so both halves of a split
    ConnectX-7 port appear), NCCL_IB_GID_INDEX - plus the per-port details. Changes nothing.
options:
  netdevs:
    description: Training netdevs, in order of preference; the first one up is NCCL_SOCKET_IFNAME.
    type: list
    elements: str
    default: []
  hcas:
    description: RDMA devices ("dev" or "dev:port") to select; empty selects every ACTIVE port.
    type: list
    elements: str
    default: []
  gid_index:
    description: GID index to report; null discovers the RoCE v2 GID of an IPv4 address on each port.
    type: int
  sysfs:
    description: Root of sysfs (tests point it elsewhere).
    type: path
    default: /sys
author: stepdeploy
"""

EXAMPLES = r"""
- name: Discover NCCL settings
  stepdeploy_nccl_facts:
    netdevs: [enp1s0f1np1]
    hcas: [rocep1s0f1, roceP2p1s0f1]
  register: fabric
"""

RETURN = r"""
nccl:
  description: socket_ifname, ib_hca, gid_index, env (NCCL_*/UCX_* variables), netdevs, hcas.
  returned: always
  type: dict
"""

import os  # noqa: E402 - Ansible modules start with their documentation strings

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

_ROCE_V2 = "RoCE v2"
_IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def _read(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def netdev_info(sysfs, name):
    base = os.path.join(sysfs, "class/net", name)
    mtu = _read(os.path.join(base, "mtu"))
    return {"name": name, "present": os.path.isdir(base), "operstate": _read(os.path.join(base, "operstate")),
            "mtu": int(mtu) if mtu and mtu.isdigit() else None}


def roce_v2_ipv4_gid(port_dir):
    """The lowest GID index whose type is RoCE v2 and whose GID is an IPv4-mapped address."""
    for entry in sorted(_listdir(os.path.join(port_dir, "gids")), key=lambda s: int(s) if s.isdigit() else 0):
        gid = _read(os.path.join(port_dir, "gids", entry)) or ""
        kind = _read(os.path.join(port_dir, "gid_attrs/types", entry))
        if kind == _ROCE_V2 and gid.startswith(_IPV4_MAPPED):
            return int(entry)
    return None


def port_info(sysfs, device, port):
    port_dir = os.path.join(sysfs, "class/infiniband", device, "ports", port)
    state = (_read(os.path.join(port_dir, "state")) or "").split(":")[-1].strip()
    phys = (_read(os.path.join(port_dir, "phys_state")) or "").split(":")[-1].strip()
    link_layer = _read(os.path.join(port_dir, "link_layer"))
    netdev = _read(os.path.join(port_dir, "gid_attrs/ndevs/0"))
    if not netdev:
        nets = _listdir(os.path.join(sysfs, "class/infiniband", device, "device/net"))
        netdev = nets[0] if nets else None
    return {"device": device, "port": int(port), "state": state, "phys_state": phys,
            "link_layer": link_layer, "rate": _read(os.path.join(port_dir, "rate")), "netdev": netdev,
            "gid_index": roce_v2_ipv4_gid(port_dir) if link_layer == "Ethernet" else None}


def discover(sysfs, netdevs, hcas, gid_index):
    ports = [port_info(sysfs, dev, port) for dev in _listdir(os.path.join(sysfs, "class/infiniband"))
             for port in _listdir(os.path.join(sysfs, "class/infiniband", dev, "ports"))]
    if hcas:
        wanted = [h.split(":") for h in hcas]
        selected = [p for w in wanted for p in ports  # in the declared order
                    if p["device"] == w[0] and (len(w) == 1 or str(p["port"]) == w[1])]
        missing = [h for h, w in zip(hcas, wanted, strict=True)
                   if not any(p["device"] == w[0] and (len(w) == 1 or str(p["port"]) == w[1]) for p in ports)]
    else:
        selected = [p for p in ports if p["state"] == "ACTIVE"]
        missing = []
    nets = [netdev_info(sysfs, n) for n in netdevs]
    up = [n["name"] for n in nets if n["operstate"] == "up"]
    if not up:  # no declared netdev is up: the netdevs of the selected ports that are
        up = [p["netdev"] for p in selected if p["netdev"] and netdev_info(sysfs, p["netdev"])["operstate"] == "up"]
    gids = sorted({p["gid_index"] for p in selected if p["gid_index"] is not None})
    gid = gid_index if gid_index is not None else (gids[0] if len(gids) == 1 else None)
    ib_hca = ",".join(f"{p['device']}:{p['port']}" for p in selected)
    env = {}
    if up:
        env.update(NCCL_SOCKET_IFNAME=up[0], GLOO_SOCKET_IFNAME=up[0], OMPI_MCA_btl_tcp_if_include=up[0])
    if selected:
        env.update(NCCL_IB_HCA="=" + ib_hca, UCX_NET_DEVICES=",".join(f"{p['device']}:{p['port']}" for p in selected))
    if gid is not None:
        env["NCCL_IB_GID_INDEX"] = str(gid)
    return {"socket_ifname": up[0] if up else None, "ib_hca": ib_hca or None, "gid_index": gid,
            "gid_indexes": gids, "netdevs": nets, "hcas": selected, "missing_hcas": missing, "env": env}


def main():
    module = AnsibleModule(
        argument_spec={"netdevs": {"type": "list", "elements": "str", "default": []},
                       "hcas": {"type": "list", "elements": "str", "default": []},
                       "gid_index": {"type": "int"}, "sysfs": {"type": "path", "default": "/sys"}},
        supports_check_mode=True,
    )
    p = module.params
    facts = discover(p["sysfs"], p["netdevs"], p["hcas"], p["gid_index"])
    if facts["missing_hcas"]:
        found = sorted(os.listdir(os.path.join(p["sysfs"], "class/infiniband"))) if os.path.isdir(
            os.path.join(p["sysfs"], "class/infiniband")) else []
        module.fail_json(msg=f"RDMA device(s) {', '.join(facts['missing_hcas'])} not found on this node; "
                             f"found: {', '.join(found) or 'none'}", nccl=facts)
    module.exit_json(changed=False, nccl=facts)


if __name__ == "__main__":
    main()
