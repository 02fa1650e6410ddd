"""Running preflight's commands on nodes through the one transport (remote/transport.py: over SSH, or on this
machine), all nodes in parallel, each bounded by a deadline. The only side effects of preflight live here and in
`bandwidth`."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Sequence

from stepdeploy.preflight import probe
from stepdeploy.preflight.cluster import Probe
from stepdeploy.preflight.model import NodeOutput
from stepdeploy.remote.transport import Channel, describe, each


def probe_node(target: Channel, spec: probe.PreflightProbeSpec, timeout_s: float,
               now: Callable[[], float]) -> NodeOutput:
    started = time.monotonic()
    out = NodeOutput(node=target.name)
    before = now()
    clock = target.run("date +%s.%N", timeout_s)
    after = now()
    if clock.rc == 0:
        try:
            out.clock_skew_s = float(clock.stdout.strip()) - (before + after) / 2
            out.clock_uncertainty_s = (after - before) / 2
        except ValueError:
            pass
    res = target.run(probe.remote_command(spec), timeout_s)
    out.sections = probe.split(res.stdout)
    if not out.sections:
        out.error = f"probe produced no output (exit {res.rc}): {(res.stderr or res.stdout).strip()[-300:]}"
    out.seconds = time.monotonic() - started
    return out


def probe_all(targets: Sequence[Channel], specs: dict[str, probe.PreflightProbeSpec], timeout_s: float,
              now: Callable[[], float] = time.time) -> dict[str, NodeOutput]:
    """Run the probe everywhere; unreachable or hung nodes come back as NodeOutput(error=...)."""
    answers = each(targets, lambda t: probe_node(t, specs[t.name], timeout_s, now), timeout_s + 15)
    outputs = {}
    for name, ans in answers.items():
        outputs[name] = ans if isinstance(ans, NodeOutput) else NodeOutput(node=name, error=describe(ans))
    return outputs


def reach_command(peers: Sequence[tuple[str, str, int]], timeout_s: int = 3) -> str:
    """Connect from this node to every (name, address, port) at once; one line per peer. Every value is a
    quoted word (names and addresses come from the inventory and the nodes' own answers)."""
    q = shlex.quote
    connect = q('exec 3<>"/dev/tcp/$0/$1"')
    parts = []
    for name, address, port in peers:
        ok, failed = (q(f"reach {name} {address} {word}") for word in ("ok", "fail"))
        parts.append(f"( if timeout {int(timeout_s)} bash -c {connect} {q(address)} {q(str(port))} 2>/dev/null; "
                     f"then echo {ok}; else echo {failed}; fi ) &")
    return " ".join(parts) + " wait"


def parse_reach(source: str, stdout: str) -> list[Probe]:
    probes = []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "reach":
            probes.append(Probe(source, parts[1], parts[2], parts[3] == "ok",
                                "" if parts[3] == "ok" else "TCP connect failed"))
    return probes


def reach_all(targets: Sequence[Channel], addresses: dict[str, tuple[str, int]], timeout_s: float) -> list[Probe]:
    """Every node connects to every other node's training address (TCP, the SSH port)."""
    def one(t: Channel) -> list[Probe]:
        peers = [(n, a, p) for n, (a, p) in addresses.items() if n != t.name]
        res = t.run(reach_command(peers), timeout_s)
        got = parse_reach(t.name, res.stdout)
        missing = {n for n, _, _ in peers} - {p.target for p in got}
        return got + [Probe(t.name, n, addresses[n][0], False, "no answer") for n in sorted(missing)]

    answers = each(targets, one, timeout_s + 5)
    probes: list[Probe] = []
    for name, ans in answers.items():
        if isinstance(ans, BaseException):
            probes += [Probe(name, n, a, False, describe(ans)) for n, (a, _) in addresses.items() if n != name]
        else:
            probes += ans
    return probes
