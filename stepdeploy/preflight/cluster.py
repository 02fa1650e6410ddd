"""Cross-node checks: same versions everywhere, clock skew, reachability on the training network, the
compatibility matrix for the GPUs found, and the all_reduce bandwidth gate. Pure: values in, results out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stepdeploy import compat
from stepdeploy.catalog.hardware import Hardware
from stepdeploy.preflight.model import Result, fail, ok, skip, warning
from stepdeploy.stack import StackProfile

CLOCK_SKEW_BOUND_S = 1.0
BUSBW_FRACTION = 0.8  # of the link's measured busbw (hardware catalog)
GLOO_FLOOR_GBPS = 0.05  # CPU nodes: no hardware figure to compare with, only "the network moves data at all"


def check_same_versions(versions: Mapping[str, Mapping[str, str | None]]) -> Result:
    """versions: node -> {component: version}. Every component must be the same on every node."""
    if len(versions) < 2:
        return skip("same_versions", "one node")
    components = sorted({c for v in versions.values() for c in v})
    differing = []
    for component in components:
        seen = {node: v.get(component) for node, v in versions.items()}
        if len(set(seen.values())) > 1:
            differing.append(f"{component}: " + ", ".join(f"{n}={seen[n] or 'none'}" for n in sorted(seen)))
    if differing:
        return fail("same_versions", "; ".join(differing), "identical on every node",
                    "run `stepdeploy provision` on the nodes that differ (or pin the version in the profile)")
    return ok("same_versions", f"{', '.join(components)} identical on {len(versions)} nodes")


def check_clock(skews: Mapping[str, tuple[float, float]], bound_s: float = CLOCK_SKEW_BOUND_S) -> Result:
    """skews: node -> (node clock - controller clock, uncertainty). Fails only beyond the uncertainty."""
    if not skews:
        return skip("clock", "no clock readings")
    worst = max(skews, key=lambda n: abs(skews[n][0]))
    skew, uncertainty = skews[worst]
    observed = f"max |skew| {abs(skew):.3f} s ({worst}, ±{uncertainty:.3f} s)"
    late = sorted(n for n, (s, u) in skews.items() if abs(s) - u > bound_s)
    if late:
        return fail("clock", observed + f"; beyond the bound: {', '.join(late)}",
                    f"within {bound_s:g} s of the controller",
                    "enable time sync (systemctl enable --now chrony or systemd-timesyncd) on those nodes: "
                    "skewed clocks break checkpoint ordering, logs and Kerberos/TLS")
    return ok("clock", observed, f"within {bound_s:g} s")


@dataclass(frozen=True)
class Probe:
    source: str
    target: str
    address: str
    ok: bool
    detail: str = ""


def check_reachability(probes: Sequence[Probe], nodes: int) -> Result:
    if nodes < 2:
        return skip("reachability", "one node")
    broken = [p for p in probes if not p.ok]
    if broken:
        listed = "; ".join(f"{p.source} -> {p.target} ({p.address}) {p.detail}".strip() for p in broken)
        return fail("reachability", listed, "every node reaches every other on the training interface",
                    "check the training interface's addresses, routes, MTU and firewall between those nodes")
    return ok("reachability", f"{len(probes)} of {nodes * (nodes - 1)} directed pairs connect",
              "every pair")


def check_compat(profile: StackProfile | None, hosts: Sequence[compat.HostFacts]) -> Result:
    if profile is None:
        return skip("compat", "no stack profile (stepdeploy_profile or --profile)")
    verdict = compat.verdict(profile, hosts)
    if verdict.ok:
        found = sorted({g.name for h in hosts for g in h.gpus}) or ["no GPUs"]
        return ok("compat", f"profile {profile.name} fits {', '.join(found)}")
    return fail("compat", "; ".join(c.line() for c in verdict.conflicts), f"profile {profile.name} compatible",
                f"use a profile that works: {', '.join(verdict.working_profiles) or 'none shipped fits'}")


@dataclass(frozen=True)
class Gate:
    gbps: float
    why: str


def bandwidth_gate(hardware: Hardware, gpu_model: str | None, nodes: int, fabric: str | None) -> Gate:
    """The busbw the largest message must reach: a fraction of what the link between the ranks achieves."""
    if not gpu_model:
        return Gate(GLOO_FLOOR_GBPS, "sanity floor for gloo on CPU nodes (no GPU link to compare with)")
    spec = hardware.gpus.get(gpu_model)
    link_name = spec.intra_node_link if (spec and nodes == 1) else hardware.fabric_links.get(fabric or "")
    link = hardware.links.get(link_name or "")
    if link is None:
        return Gate(GLOO_FLOOR_GBPS, f"no link figure for {gpu_model} over {fabric or 'an undeclared fabric'}")
    return Gate(round(link.busbw_gbps * BUSBW_FRACTION, 2),
                f"{BUSBW_FRACTION:.0%} of {link.name} busbw {link.busbw_gbps:g} GB/s (hardware catalog)")


def check_bandwidth(rows: Sequence[Mapping], gate: Gate, error: str | None = None) -> Result:
    """rows: the sweep's per-size results (size_bytes, busbw_gbps, ok); judged at the largest size."""
    if error:
        return fail("busbw", error, f">= {gate.gbps:g} GB/s", "run the sweep by hand (see docs/preflight.md) and "
                                                              "read the NCCL_DEBUG=INFO output")
    if not rows:
        return fail("busbw", "the sweep produced no results", f">= {gate.gbps:g} GB/s",
                    "run the sweep by hand (see docs/preflight.md)")
    wrong = [r for r in rows if not r.get("correct", True)]
    if wrong:
        return fail("busbw", f"wrong all_reduce result at {len(wrong)} size(s)", "correct sums",
                    "a rank computes wrong results: check GPU health (ECC, XID) on every node")
    top = max(rows, key=lambda r: r["size_bytes"])
    observed = f"{top['busbw_gbps']:.2f} GB/s busbw at {_size(top['size_bytes'])} ({top.get('backend', '?')}, " \
               f"{top.get('world', '?')} ranks)"
    if top["busbw_gbps"] < gate.gbps:
        return fail("busbw", observed, f">= {gate.gbps:g} GB/s: {gate.why}",
                    "find the slow link: NCCL_DEBUG=INFO shows the transport (NET/Socket instead of IB/NVLink?), "
                    "check MTU, NCCL_IB_HCA, NCCL_SOCKET_IFNAME and nvidia-smi topo -m")
    return ok("busbw", observed, f">= {gate.gbps:g} GB/s ({gate.why})")


def _size(n: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:g} {unit}"
    return f"{n} B"


def warn_if_partial(checked: int, total: int) -> Result | None:
    if checked < total:
        return warning("coverage", f"{checked} of {total} nodes answered", "all nodes",
                    "cross-node checks cover only the nodes that answered; fix the unreachable ones and re-run")
    return None
