"""`sim up`, `sim down`, `sim status`: the simulated cluster as a whole.

Every resource is recorded in the state file before it is created; `down` walks the state file, so it
removes exactly what `up` made (also after a crash half-way through `up`) and nothing else.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from stepdeploy.errors import BadInput, StepdeployError
from stepdeploy.sim import base, host, mirror, network, node, repo, standins
from stepdeploy.sim import state as statefile
from stepdeploy.sim.state import NodeState, SimState, is_ours

Progress = Callable[[str], None]
_NAME = re.compile(r"[a-z][a-z0-9]{0,7}")  # fullmatch: no trailing newline
MAX_NODES = 64


def _quiet(_msg: str) -> None:
    return None


@dataclass(frozen=True)
class SimConfig:
    name: str = "sim"
    subnet: str = "10.77.0.0/24"
    http_port: int = 8080
    state_dir: Path | None = None
    recipe: base.BaseRecipe = field(default_factory=base.BaseRecipe)

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise BadInput(f"cluster name {self.name!r} must be 1-8 lowercase letters/digits, "
                           "starting with a letter")
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError as exc:
            raise BadInput(f"subnet {self.subnet!r} is not an IPv4 network: {exc}") from None
        if net.prefixlen > 24 or not net.is_private:
            raise BadInput(f"subnet {self.subnet} must be a private IPv4 network of /24 or larger")

    @property
    def dir(self) -> Path:
        if self.state_dir is not None:
            return self.state_dir
        return Path(os.environ.get("STEPDEPLOY_SIM_DIR", "/var/lib/stepdeploy/sim")) / self.name

    @property
    def inventory(self) -> Path:
        return self.dir / "inventory.ini"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def client_key(self) -> Path:
        return self.dir / "id_ed25519"

    def address(self, index: int) -> str:
        return str(ipaddress.IPv4Network(self.subnet).network_address + 10 + index)

    def bridge_address(self) -> str:
        return str(ipaddress.IPv4Network(self.subnet).network_address + 1)

    def new_node(self, index: int) -> NodeState:
        return NodeState(
            index=index, name=f"node{index}", address=self.address(index),
            netns=f"sd-{self.name}-node{index}", veth=f"sd-{self.name}-{index}",
            root=str(self.dir / "nodes" / f"node{index}" / "root"),
        )


def up(cfg: SimConfig, nodes: int, progress: Progress = _quiet) -> SimState:
    """Bring the cluster to `nodes` running nodes; safe to repeat (running nodes are left alone)."""
    if not 1 <= nodes <= MAX_NODES:
        raise BadInput(f"--nodes must be between 1 and {MAX_NODES}, got {nodes}")
    host.require_prerequisites(need_build=not (base.base_dir(cfg.recipe) / ".stepdeploy-base.json").exists())
    with statefile.locked(cfg.dir):
        sim = statefile.load_state(cfg.dir)
        base_path = base.ensure_base(cfg.recipe, progress)
        sim = _check_compatible(cfg, sim, nodes, base_path)
        _ensure_client_key(cfg)
        progress(f"network: bridge {sim.bridge} {sim.bridge_address}/24, repository {repo.url(sim)}")
        statefile.save(cfg.dir, sim)
        network.ensure_bridge(sim.bridge, f"{sim.bridge_address}/{_prefix(cfg)}")
        repo.ensure_layout(cfg.dir, base.wheelhouse_dir())
        _seed_packages(cfg, base_path, progress)
        repo.ensure_server(cfg.dir, sim)
        statefile.save(cfg.dir, sim)
        for index in range(len(sim.nodes) + 1, nodes + 1):
            sim.nodes.append(cfg.new_node(index))
        statefile.save(cfg.dir, sim)
        host_keys = _start_nodes(cfg, sim, base_path, progress)
        _write_access_files(cfg, sim, host_keys)
        _wait_ready(sim)
        progress(f"{len(sim.nodes)} node(s) up; inventory {cfg.inventory}")
        return sim


def _check_compatible(cfg: SimConfig, sim: SimState | None, nodes: int, base_path: Path) -> SimState:
    if sim is None:
        return SimState(name=cfg.name, subnet=cfg.subnet, bridge=f"sd-{cfg.name}",
                        bridge_address=cfg.bridge_address(), http_port=cfg.http_port, base=str(base_path))
    if sim.subnet != cfg.subnet or sim.http_port != cfg.http_port:
        raise BadInput(f"cluster {cfg.name!r} already runs on {sim.subnet} port {sim.http_port}",
                       hint=f"stepdeploy sim down --name {cfg.name} first")
    if len(sim.nodes) > nodes:
        raise BadInput(f"cluster {cfg.name!r} has {len(sim.nodes)} nodes; `sim up` only adds nodes",
                       hint=f"stepdeploy sim down --name {cfg.name}, then sim up --nodes {nodes}")
    if sim.base != str(base_path) and any(node.is_running(n) for n in sim.nodes):
        raise BadInput(f"cluster {cfg.name!r} runs on an older base image than the current recipe",
                       hint=f"stepdeploy sim down --name {cfg.name}, then sim up again")
    sim.base = str(base_path)
    return sim


def _seed_packages(cfg: SimConfig, base_path: Path, progress: Progress) -> None:
    """What the provisioning roles install, offline: the Debian packages (with their dependency closure
    against the base, downloaded once and cached) and the stand-in NVIDIA packages (built once)."""
    debs = mirror.ensure_debs(base_path)
    if repo.add_missing(repo.repo_dir(cfg.dir) / "apt", debs):
        progress(f"apt repository: {len(debs)} Debian packages for the roles")
    standins.publish(cfg.dir, standins.build_all())


def _prefix(cfg: SimConfig) -> int:
    return ipaddress.IPv4Network(cfg.subnet).prefixlen


def _ensure_client_key(cfg: SimConfig) -> None:
    if not cfg.client_key.exists():
        host.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"stepdeploy-{cfg.name}",
                  "-f", str(cfg.client_key)])
    cfg.client_key.chmod(0o600)


def _start_nodes(cfg: SimConfig, sim: SimState, base_path: Path, progress: Progress) -> dict[str, str]:
    pubkey = cfg.client_key.with_suffix(".pub").read_text()
    logs = cfg.dir / "logs"
    logs.mkdir(exist_ok=True)
    host_keys: dict[str, str] = {}
    for n in sim.nodes:
        network.ensure_node_link(n.netns, n.veth, sim.bridge, f"{n.address}/{_prefix(cfg)}")
        root = node.mount_root(base_path, Path(n.root).parent)
        host_keys[n.name] = node.configure(root, n, sim, pubkey)
    for n in sim.nodes:  # every node's /etc/hosts lists every node, also those added later
        node.write_hosts(Path(n.root), sim)
    starting = [n for n in sim.nodes if not node.is_running(n)]
    for n in starting:
        node.start(n, logs / f"{n.name}.log")
    statefile.save(cfg.dir, sim)
    if starting:
        progress(f"started {', '.join(n.name for n in starting)}")
    return host_keys


def _write_access_files(cfg: SimConfig, sim: SimState, host_keys: dict[str, str]) -> None:
    lines = [f"{n.address},{n.name} {host_keys[n.name]}" for n in sim.nodes]
    cfg.known_hosts.write_text("\n".join(lines) + "\n")
    cfg.inventory.write_text(render_inventory(cfg, sim))


def render_inventory(cfg: SimConfig, sim: SimState) -> str:
    hosts = "\n".join(f"{n.name} ansible_host={n.address}" for n in sim.nodes)
    return f"""# Written by `stepdeploy sim up` for simulated cluster {cfg.name!r}; each `sim up` rewrites it.
[sim]
{hosts}

[sim:vars]
ansible_user=root
ansible_port=22
ansible_ssh_private_key_file={cfg.client_key}
ansible_ssh_common_args='-o UserKnownHostsFile={cfg.known_hosts} -o StrictHostKeyChecking=yes'
ansible_python_interpreter=/usr/bin/python3
stepdeploy_ssh_known_hosts={cfg.known_hosts}
stepdeploy_gpus_per_node=0
stepdeploy_profile=sim-cpu
stepdeploy_train_iface=eth0
stepdeploy_fabric=ethernet
# Provisioning roles: NVIDIA's packages come from the cluster's stand-in repository (an air-gapped mirror
# of NVIDIA's flat CUDA repository, unsigned); nodes share the host's kernel, so host-wide sysctls are
# written but not applied.
nvidia_repo_url={repo.url(sim)}/nvidia
nvidia_repo_suite=./
nvidia_repo_trusted=true
common_sysctl_apply=false
# Python environments from the cluster's wheelhouse (served over plain HTTP on the bridge).
python_env_pip_find_links={repo.url(sim)}/wheels/
python_env_pip_no_index=true
python_env_pip_trusted_hosts={sim.bridge_address}
# Slurm (the optional role slurm): simulated nodes have no cgroup filesystem.
slurm_proctrack_type=proctrack/linuxproc
slurm_task_plugin=task/none
"""


def _wait_ready(sim: SimState) -> None:
    with ThreadPoolExecutor(max_workers=min(16, len(sim.nodes))) as pool:
        ready = list(pool.map(lambda n: node.wait_ssh(n.address), sim.nodes))
    dead = [n.name for n, ok in zip(sim.nodes, ready, strict=True) if not ok]
    if dead:
        raise StepdeployError(f"sshd did not answer on {', '.join(dead)}",
                              hint="see the node logs under the cluster's logs/ directory")


@dataclass
class DownReport:
    removed: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)


def down(cfg: SimConfig, *, purge: bool = False, progress: Progress = _quiet) -> DownReport:
    """Remove every node process, mount, namespace, veth, the bridge and the repository server."""
    report = DownReport()
    if os.geteuid() != 0:
        host.require_prerequisites(need_build=False)
    with statefile.locked(cfg.dir):
        sim = statefile.load_state(cfg.dir)
        if sim is None:
            progress(f"no simulated cluster {cfg.name!r} is recorded under {cfg.dir}")
        else:
            _teardown(sim, report, progress)
            report.leftovers = leftovers(cfg, sim)
            if not report.leftovers:
                statefile.remove(cfg.dir)
                shutil.rmtree(cfg.dir / "nodes", ignore_errors=True)
        if purge and not report.leftovers:
            shutil.rmtree(cfg.dir, ignore_errors=True)
    return report


def _teardown(sim: SimState, report: DownReport, progress: Progress) -> None:
    def one(n: NodeState) -> None:
        node.stop(n)
        node.unmount_root(Path(n.root))
        network.delete_netns(n.netns)
        network.delete_link(n.veth)

    if sim.nodes:
        with ThreadPoolExecutor(max_workers=min(16, len(sim.nodes))) as pool:
            list(pool.map(one, sim.nodes))
        report.removed += [n.name for n in sim.nodes]
        progress(f"stopped and removed {', '.join(n.name for n in sim.nodes)}")
    if is_ours(sim.http_pid, sim.http_pid_start) and sim.http_pid is not None:
        node.kill_process(sim.http_pid, sim.http_pid_start)
        report.removed.append("repository server")
    network.delete_link(sim.bridge)
    report.removed.append(f"bridge {sim.bridge}")


def leftovers(cfg: SimConfig, sim: SimState) -> list[str]:
    """Anything of this cluster still present: namespaces, links, mounts, processes."""
    found: list[str] = []
    for n in sim.nodes:
        if network.netns_exists(n.netns):
            found.append(f"network namespace {n.netns}")
        if network.link_exists(n.veth):
            found.append(f"veth {n.veth}")
        if node.is_running(n):
            found.append(f"process {n.pid} ({n.name})")
    if network.link_exists(sim.bridge):
        found.append(f"bridge {sim.bridge}")
    if is_ours(sim.http_pid, sim.http_pid_start):
        found.append(f"repository server process {sim.http_pid}")
    found += [f"mount {m}" for m in node.mounts_under(cfg.dir)]
    found += [f"process {pid} rooted in the cluster" for pid in node.processes_rooted_under(cfg.dir)]
    return found


def status(cfg: SimConfig) -> dict:
    sim = statefile.load_state(cfg.dir)
    if sim is None:
        return {"name": cfg.name, "state_dir": str(cfg.dir), "up": False, "nodes": []}
    nodes = []
    for n in sim.nodes:
        running = node.is_running(n)
        nodes.append({"name": n.name, "address": n.address, "netns": n.netns, "pid": n.pid,
                      "running": running, "ssh": running and node.ssh_banner(n.address)})
    return {
        "name": sim.name, "state_dir": str(cfg.dir), "up": bool(nodes) and all(n["ssh"] for n in nodes),
        "subnet": sim.subnet, "bridge": sim.bridge, "repository": repo.url(sim),
        "repository_server": is_ours(sim.http_pid, sim.http_pid_start),
        "inventory": str(cfg.inventory), "known_hosts": str(cfg.known_hosts), "base": sim.base,
        "nodes": nodes,
    }
