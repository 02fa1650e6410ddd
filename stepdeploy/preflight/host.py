"""Host checks: OS, architecture, Python stack, NCCL, RDMA ports, limits, disk. Pure: sections in, results out."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from stepdeploy.preflight.model import Result, Section, fail, ok, skip, warning
from stepdeploy.stack import StackProfile

GIB = 1024**3
RDMA_FABRICS = ("infiniband", "roce")


@dataclass(frozen=True)
class Expect:
    """What a node should have: the inventory's declarations, the profile, and preflight's own bounds."""

    gpus: int | None = None
    gpu_model: str | None = None
    arch: str | None = None
    fabric: str | None = None
    train_iface: str | None = None
    ib_hcas: tuple[str, ...] = ()
    profile: StackProfile | None = None
    min_free_gib: float = 50.0
    min_shm_gib: float = 1.0
    checkpoint_dir: str = "/"
    disk_why: str | None = None  # where min_free_gib comes from
    needs: tuple[str, ...] = ()  # what the run's layout needs beyond the stock stack (plan/engines.needs)
    extra: dict = field(default_factory=dict)


def os_release(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k: v.strip().strip('"') for k, v in pairs}


def check_os(uname: Section, release: Section) -> Result:
    if not uname.ok:
        return fail("os", uname.text.strip() or f"uname exited {uname.rc}", "Linux", "check the node's shell")
    system, kernel, _arch = ([*uname.text.split(), "?", "?", "?"])[:3]
    name = os_release(release.text).get("PRETTY_NAME", "unknown OS")
    if system != "Linux":
        return fail("os", f"{system} {kernel}", "Linux", "stepdeploy supports Linux nodes only")
    return ok("os", f"{name}, kernel {kernel}")


def arch_of(uname: Section) -> str | None:
    parts = uname.text.split()
    return parts[2] if uname.ok and len(parts) >= 3 else None


def check_arch(uname: Section, declared: str | None) -> Result:
    found = arch_of(uname)
    if found is None:
        return fail("arch", uname.text.strip() or "unknown", declared or "x86_64 or aarch64", "check uname -m")
    if declared and found != declared:
        return fail("arch", found, f"{declared} (stepdeploy_arch)",
                    "set stepdeploy_arch to what the node is: wheels and packages are per architecture")
    return ok("arch", found, declared or "")


def python_env(section: Section) -> dict | None:
    """The JSON the probe's python section printed (warnings may precede it), or None."""
    for line in reversed(section.text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _same_release(found: str | None, wanted: str) -> bool:
    """'2.13.0+cpu' matches '2.13.0+cpu' and '2.13.0'; '3.11.2' matches '3.11'."""
    if not found:
        return False
    return found == wanted or found.split("+")[0] == wanted.split("+")[0] or found.startswith(wanted + ".")


def check_python(section: Section, exp: Expect) -> Result:
    env = python_env(section)
    if env is None:
        return fail("python", section.text.strip()[-200:] or "no output", "a Python with torch",
                    "create the training environment: stepdeploy provision (role python_env)")
    wanted = exp.profile.python if exp.profile else None
    observed = f"{env['python']} ({env['executable']})"
    if wanted and not _same_release(env["python"], wanted):
        return warning("python", observed, f"{wanted} (stack profile)",
                    "recreate the environment with the profile's Python")
    return ok("python", observed, wanted or "")


def check_torch(section: Section, exp: Expect) -> Result:
    env = python_env(section) or {}
    if not env.get("torch"):
        return fail("torch", env.get("torch_error", "torch not importable"), "torch importable",
                    "pip install the profile's torch into the training environment (stepdeploy provision)")
    build = f"{env['torch']} (CUDA {env.get('torch_cuda') or 'none'})"
    if exp.gpus and not env.get("torch_cuda"):
        return fail("torch", build, "a CUDA build of torch on a GPU node",
                    "install the CUDA wheel (e.g. --index-url https://download.pytorch.org/whl/cu128)")
    if exp.gpus and not env.get("cuda_available"):
        return fail("torch", build + ", CUDA not available", "torch.cuda.is_available()",
                    "the driver is too old for torch's CUDA, or no GPU is visible (CUDA_VISIBLE_DEVICES?)")
    wanted = exp.profile.torch if exp.profile else None
    if wanted and not _same_release(env["torch"], wanted):
        return warning("torch", build, f"{wanted} (stack profile)",
                       "install the profile's torch (stepdeploy provision)")
    return ok("torch", build, wanted or "")


def _optional_package(check: str, env: dict, key: str, wanted: str | None, module: str) -> Result:
    found, error = env.get(key), env.get(f"{key}_error")
    if found and error:
        return fail(check, f"{found} installed, import fails: {error}", f"{module} importable",
                    f"reinstall {check} against the installed torch/CUDA")
    if wanted and not found:
        return fail(check, "not installed", f"{wanted} (stack profile)", f"pip install {check}=={wanted}")
    if not found:
        return skip(check, "not installed (the profile does not ask for it)")
    if wanted and not _same_release(found, wanted):
        return warning(check, found, f"{wanted} (stack profile)", f"pip install {check}=={wanted}")
    return ok(check, found, wanted or "")


def check_megatron(section: Section, exp: Expect) -> Result:
    wanted = exp.profile.megatron_core if exp.profile else None
    return _optional_package("megatron-core", python_env(section) or {}, "megatron_core", wanted, "megatron.core")


def check_flash_attn(section: Section, exp: Expect) -> Result:
    wanted = exp.profile.flash_attn if exp.profile else None
    return _optional_package("flash-attn", python_env(section) or {}, "flash_attn", wanted, "flash_attn")


TE_FIX = ("install TransformerEngine into the training environment, built for the node's torch and CUDA "
          "(pip install --no-build-isolation 'transformer_engine[pytorch]'), or choose a layout with cp=1")


def why_needed(needs: tuple[str, ...], package: str) -> list[str]:
    """Why the layout needs `package`: plan/engines.needs writes each need as 'package: why'."""
    return [why.strip() for key, _, why in (n.partition(":") for n in needs) if key.strip() == package]


def check_transformer_engine(section: Section, exp: Expect) -> Result:
    """TransformerEngine against what the run's layout needs (exp.needs): a layout that needs it (context
    parallelism) fails on a node without it, or where it does not import; otherwise its absence is a fact."""
    env = python_env(section) or {}
    found, error = env.get("transformer_engine"), env.get("transformer_engine_error")
    why = why_needed(exp.needs, "transformer_engine")
    if why:
        wanted = f"installed: the layout needs {'; '.join(why)}"
        if not found:
            return fail("transformer_engine", "not installed", wanted, TE_FIX)
        if error:
            return fail("transformer_engine", f"{found} installed, import fails: {error}", wanted, TE_FIX)
        return ok("transformer_engine", f"{found}: the layout's need is met", wanted)
    if found and error:
        return warning("transformer_engine", f"{found} installed, import fails: {error}", "importable or not installed",
                    "reinstall TransformerEngine against the installed torch/CUDA, or uninstall it")
    if not found:
        return skip("transformer_engine", "not installed (no layout given needs it: preflight --model M --layout L)")
    return ok("transformer_engine", found)


# The package each need names (plan/engines.needs: 'package: why') -> the check that judges it on a node.
NEEDS_CHECKS = {"transformer_engine": check_transformer_engine}


def check_needs(section: Section, exp: Expect) -> list[Result]:
    """Every package the layout needs (exp.needs), judged by its own check over the probe's python section (what
    the rollout runs before a launch); a need no check knows fails, saying so."""
    packages = dict.fromkeys(need.partition(":")[0].strip() for need in exp.needs)
    return [NEEDS_CHECKS[package](section, exp) if package in NEEDS_CHECKS else
            fail(package, "no preflight check knows this package",
                 f"installed: {'; '.join(why_needed(exp.needs, package))}",
                 "add its check to stepdeploy/preflight/host.py NEEDS_CHECKS") for package in packages]


def nccl_versions(pkg: Section, py: Section) -> tuple[str | None, str | None]:
    """(libnccl2 package version, the NCCL torch bundles)."""
    lines = [line.split() for line in pkg.text.splitlines() if line.startswith("libnccl2 ")]
    package = lines[0][1] if lines and len(lines[0]) > 1 else None
    return package, (python_env(py) or {}).get("torch_nccl")


def check_nccl(pkg: Section, py: Section, exp: Expect) -> Result:
    package, bundled = nccl_versions(pkg, py)
    parts = ([f"libnccl2 {package}"] if package else []) + ([f"torch's {bundled}"] if bundled else [])
    wanted = exp.profile.nccl if exp.profile else None
    if not parts:
        if exp.gpus:
            return fail("nccl", "no NCCL (no libnccl2, torch without NCCL)", wanted or "NCCL",
                        "install libnccl2 (role nccl) or a CUDA build of torch")
        return skip("nccl", "no NCCL (CPU node: gloo)")
    observed = ", ".join(parts)
    if wanted and not any(v and v.startswith(wanted) for v in (package, bundled)):
        return warning("nccl", observed, f"{wanted} (stack profile)", "install the profile's NCCL (role nccl)")
    return ok("nccl", observed, wanted or "")


def check_memlock(section: Section, fabric: str | None) -> Result:
    value = section.text.strip()
    if value == "unlimited":
        return ok("memlock", "unlimited", "unlimited")
    fix = "set `* - memlock unlimited` in /etc/security/limits.d/ (Slurm: PropagateResourceLimitsExcept=MEMLOCK)"
    observed = f"{value} KiB" if value.isdigit() else value or f"exit {section.rc}"
    if fabric in RDMA_FABRICS:
        return fail("memlock", observed, "unlimited (RDMA registers pinned memory)", fix)
    return warning("memlock", observed, "unlimited", fix)


def df_available_bytes(text: str) -> tuple[str, int] | None:
    """(mount point, available bytes) from `df -P -k` output."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[3].isdigit():
            return parts[5], int(parts[3]) * 1024
    return None


def check_shm(section: Section, min_gib: float) -> Result:
    parsed = df_available_bytes(section.text) if section.ok else None
    if parsed is None:
        return fail("shm", section.text.strip()[-200:] or "no /dev/shm", f">= {min_gib:g} GiB",
                    "mount a tmpfs on /dev/shm (containers: --shm-size or --ipc=host)")
    gib = parsed[1] / GIB
    if gib < min_gib:
        return fail("shm", f"{gib:.2f} GiB free", f">= {min_gib:g} GiB",
                    "enlarge /dev/shm (mount -o remount,size=... /dev/shm; containers: --shm-size or --ipc=host): "
                    "NCCL and DataLoader workers use it")
    return ok("shm", f"{gib:.1f} GiB free", f">= {min_gib:g} GiB")


def check_disk(section: Section, min_gib: float, checkpoint_dir: str, why: str | None = None) -> Result:
    """`why`: where min_gib comes from (the checkpoints the run keeps, sized by the planner)."""
    lines = section.text.splitlines()
    parsed = df_available_bytes(section.text) if section.ok else None
    expected = f">= {min_gib:.4g} GiB free" + (f" ({why})" if why else "")
    if parsed is None:
        return fail("disk", section.text.strip()[-200:] or f"exit {section.rc}", expected,
                    f"create {checkpoint_dir} on a local or shared filesystem")
    where = lines[0] if lines else checkpoint_dir
    gib = parsed[1] / GIB
    observed = f"{gib:.1f} GiB free at {where}" + (f" (for {checkpoint_dir})" if where != checkpoint_dir else "")
    if gib < min_gib:
        return fail("disk", observed, expected,
                    "free space, keep fewer checkpoints (--keep-checkpoints) or point --checkpoint-dir at a larger "
                    "filesystem: a save that runs out of space loses the step")
    return ok("disk", observed, expected)


@dataclass(frozen=True)
class IbPortLink:
    """How one RDMA port is set up, as the preflight probe reads it once (the monitor's IbPort: its counters)."""

    device: str
    port: str
    state: str
    rate: str
    link_layer: str
    netdev: str
    mtu: str
    gid3: str


def parse_ib_ports(text: str) -> list[IbPortLink]:
    ports = []
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) == 8:
            ports.append(IbPortLink(*fields))
    return ports


def check_ib(section: Section, exp: Expect) -> Result:
    ports = parse_ib_ports(section.text)
    if exp.fabric not in RDMA_FABRICS:
        return skip("rdma", f"fabric {exp.fabric or 'not declared'}: no RDMA expected") if not ports else \
            ok("rdma", f"{len(ports)} port(s), not used (fabric {exp.fabric or 'not declared'})")
    wanted = [h.split(":")[0] for h in exp.ib_hcas] or sorted({p.device for p in ports})
    if not wanted:
        return fail("rdma", "no RDMA devices under /sys/class/infiniband", f"{exp.fabric} HCAs",
                    "load the NIC driver (mlx5_ib) and install rdma-core (role infiniband)")
    problems, good = [], []
    layer = "InfiniBand" if exp.fabric == "infiniband" else "Ethernet"
    for dev in wanted:
        mine = [p for p in ports if p.device == dev]
        if not mine:
            problems.append(f"{dev} missing")
            continue
        for p in mine:
            state = p.state.split(":")[-1].strip()
            if state != "ACTIVE":
                problems.append(f"{dev}/{p.port} {state}")
            elif p.link_layer and p.link_layer != layer:
                problems.append(f"{dev}/{p.port} link layer {p.link_layer}")
            elif exp.fabric == "roce" and p.mtu not in ("9000", "-"):
                problems.append(f"{dev}/{p.port} ({p.netdev}) MTU {p.mtu}")
            elif exp.fabric == "roce" and p.gid3 in ("-", "", "0000:0000:0000:0000:0000:0000:0000:0000"):
                problems.append(f"{dev}/{p.port} no GID at index 3")
            else:
                good.append(f"{dev}/{p.port} {p.rate.strip()}")
    if problems:
        return fail("rdma", "; ".join(problems), f"{', '.join(wanted)} ACTIVE, {layer}"
                    + (", MTU 9000, RoCEv2 GID at index 3" if exp.fabric == "roce" else ""),
                    "check cables/switch ports (ibstat), set MTU 9000 on RoCE netdevs, "
                    "and discover the GID index (show_gids) instead of hard-coding it")
    return ok("rdma", ", ".join(good), f"{', '.join(wanted)} ACTIVE")


def check_peermem(section: Section, exp: Expect) -> Result:
    if not exp.gpus or exp.fabric not in RDMA_FABRICS:
        return skip("peermem", "GPUDirect RDMA not used (no GPUs or no RDMA fabric)")
    if re.search(r"^nvidia_peermem\s", section.text, re.MULTILINE):
        return ok("peermem", "nvidia_peermem loaded")
    return warning("peermem", "nvidia_peermem not loaded", "loaded",
                "modprobe nvidia-peermem (the old nv_peer_mem module is gone since R470)")


def iface_facts(section: Section) -> tuple[int | None, str | None]:
    """(MTU, IPv4 address) of the training interface."""
    lines = section.text.splitlines()
    mtu = int(lines[0]) if lines and lines[0].strip().isdigit() else None
    match = re.search(r"inet (\d+\.\d+\.\d+\.\d+)/", section.text)
    return mtu, match.group(1) if match else None


def check_iface(section: Section, exp: Expect) -> Result:
    if not exp.train_iface:
        return skip("train_iface", "stepdeploy_train_iface not declared")
    mtu, address = iface_facts(section)
    if not section.ok or mtu is None:
        return fail("train_iface", f"{exp.train_iface} not found", f"{exp.train_iface} up with an address",
                    "set stepdeploy_train_iface to a netdev the node has (ip -br link)")
    if address is None:
        return fail("train_iface", f"{exp.train_iface} has no IPv4 address", "an address",
                    "configure the interface (netplan/ifupdown) or name another one")
    observed = f"{exp.train_iface} {address} MTU {mtu}"
    if exp.fabric in RDMA_FABRICS and mtu != 9000:
        return warning("train_iface", observed, "MTU 9000",
                       f"ip link set {exp.train_iface} mtu 9000 (and on the switch)")
    return ok("train_iface", observed)
