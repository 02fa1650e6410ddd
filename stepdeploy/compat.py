"""The compatibility matrix: can a stack profile run on the hardware a node has, and can it run what the engine
calls? Pure: values in, values out.

Rules come from stepdeploy/data/compat.yaml (GPU arch <-> CUDA <-> driver <-> PyTorch <-> flash-attn <->
megatron-core <-> Python; CPU architecture; the megatron engine's megatron-core API level). Provisioning calls
`verdict` before it changes any node, preflight too; `plan`, `render` and the rollout call `stack_verdict` (the
inventory's declared hardware and the engine's needs, offline). Each conflict names the rule's source and the
profiles that would work instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING

import yaml
from packaging.version import InvalidVersion, Version

from stepdeploy.errors import BadInput
from stepdeploy.stack import StackProfile, load_profiles

if TYPE_CHECKING:
    from stepdeploy.catalog import ModelSpec
    from stepdeploy.inventory.model import Cluster
    from stepdeploy.plan.layout import Layout

SIMULATION_PREFIX = "sim-"  # profiles for simulated nodes: never suggested for real GPUs


@dataclass(frozen=True)
class GpuModel:
    name: str
    compute_cap: str | None = None  # "9.0" as nvidia-smi prints it


@dataclass(frozen=True)
class HostFacts:
    """What a node has (discovered by the facts play, or declared in the inventory when not discovered)."""

    host: str
    arch: str | None = None
    gpus: tuple[GpuModel, ...] = ()
    gpu_source: str = "discovered"  # or "declared in the inventory"


@dataclass(frozen=True)
class Conflict:
    host: str
    component: str
    found: str
    required: str
    source: str

    def line(self) -> str:
        return f"{self.host}: {self.component} {self.found} — needs {self.required} ({self.source})"


@dataclass(frozen=True)
class CompatVerdict:
    profile: str
    conflicts: tuple[Conflict, ...] = ()
    working_profiles: tuple[str, ...] = field(default_factory=tuple)
    subject: str = "on this hardware"  # what the profile was judged for

    @property
    def ok(self) -> bool:
        return not self.conflicts

    def message(self) -> str:
        if self.ok:
            return f"profile {self.profile} is compatible with the hardware found"
        lines = [f"profile {self.profile} cannot run {self.subject}:"]
        lines += [f"  - {c.line()}" for c in self.conflicts]
        if self.working_profiles:
            lines.append(f"profiles that would work: {', '.join(self.working_profiles)}")
        else:
            lines.append("no shipped profile fits; add one to stepdeploy/data/stack_profiles.yaml")
        return "\n".join(lines)

    def one_line(self) -> str:
        """The refusal as one line (errors print one line): every rule broken, with its source."""
        return f"profile {self.profile} cannot run {self.subject}: " + "; ".join(c.line() for c in self.conflicts)

    def hint(self) -> str:
        if self.working_profiles:
            return f"set stepdeploy_profile in the inventory to one that works: {', '.join(self.working_profiles)}"
        return "no shipped profile fits; add one to stepdeploy/data/stack_profiles.yaml and name it in the inventory"


@cache
def matrix() -> dict:
    text = resources.files("stepdeploy.data").joinpath("compat.yaml").read_text()
    return yaml.safe_load(text)


def gpu_arch(gpu: GpuModel) -> tuple[str, str] | None:
    """(sm, family) of a GPU from its compute capability, else from its name; None if unknown."""
    m = matrix()
    if gpu.compute_cap:
        sm = gpu.compute_cap.replace(".", "").strip()
        if sm in m["families"]:
            return sm, m["families"][sm]
    for entry in m["gpus"]:
        if re.search(rf"\b{re.escape(entry['match'])}\b", gpu.name, flags=re.IGNORECASE):
            return entry["sm"], entry["family"]
    return None


def _v(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def check(profile: StackProfile, facts: HostFacts) -> list[Conflict]:
    """Every rule of the matrix that `profile` breaks on `facts`."""
    conflicts = _software_rules(profile, facts.host) + _arch_rules(profile, facts)
    for sm, family in {a for a in (gpu_arch(g) for g in facts.gpus) if a is not None}:
        conflicts += _gpu_rules(profile, facts, sm, family)
    return conflicts


def _arch_rules(profile: StackProfile, facts: HostFacts) -> list[Conflict]:
    """A profile's packages (driver installer, wheels) are built for some CPU architectures only."""
    if not (profile.arch and facts.arch) or facts.arch in profile.arch:
        return []
    return [Conflict(facts.host, "CPU architecture", facts.arch, f"{' or '.join(profile.arch)} (the profile's "
                     "packages are built for it)", profile.sources.get("platform", "stack_profiles.yaml"))]


def _software_rules(profile: StackProfile, host: str) -> list[Conflict]:
    m, out = matrix(), []
    cuda, driver = _v(profile.cuda), _v(profile.driver)
    if cuda and driver:
        rules = m["cuda_min_driver"]
        need = rules["table"].get(_major_minor(profile.cuda or ""))
        need = need or rules["major_floor"].get(str(cuda.major))
        if need and driver < Version(need):
            out.append(Conflict(host, "driver", profile.driver or "", f">= {need} for CUDA {profile.cuda}",
                                rules["source"]))
    fa = _v(profile.flash_attn)
    if fa and str(fa.major) not in m["flash_attn"]["existing_majors"]:
        out.append(Conflict(host, "flash-attn", profile.flash_attn or "",
                            "a release that exists (2.x is FA2)", m["flash_attn"]["majors_source"]))
    mc, py = _v(profile.megatron_core), _v(profile.python)
    rule = m["megatron_core_python"]
    if mc and py and mc >= Version(rule["from_version"]) and py < Version(rule["min_python"]):
        out.append(Conflict(host, "Python", profile.python or "",
                            f">= {rule['min_python']} for megatron-core {profile.megatron_core}",
                            rule["source"]))
    return out


def torch_cuda_build(torch_version: str | None) -> str | None:
    """The CUDA a torch build targets: its local tag (2.7.0+cu128 -> 12.8, +cpu -> "none"), else the default PyPI
    wheel's of its minor release (torch_default_wheel_cuda); None when neither says."""
    if not torch_version:
        return None
    _, _, local = torch_version.partition("+")
    if local:
        tag = re.fullmatch(r"cu(\d+)(\d)", local)
        return f"{tag.group(1)}.{tag.group(2)}" if tag else "none"
    entry = matrix()["torch_default_wheel_cuda"]["table"].get(_major_minor(torch_version))
    return entry["cuda"] if entry else None


def _gpu_rules(profile: StackProfile, facts: HostFacts, sm: str, family: str) -> list[Conflict]:
    m, out, host = matrix(), [], facts.host
    where = f"sm_{sm} ({family}, {facts.gpu_source})"
    need = m["sm_min_cuda"]["table"].get(sm)
    cuda = _v(profile.cuda)
    if cuda is None:
        out.append(Conflict(host, "CUDA", "none", f"a CUDA toolkit for the GPU {where}",
                            "profile has no CUDA"))
    elif need and cuda < Version(need["cuda"]):
        out.append(Conflict(host, "CUDA", profile.cuda or "", f">= {need['cuda']} for {where}", need["source"]))
    out += _torch_rules(profile, host, family, where)
    out += _flash_attn_rules(profile, host, family, where)
    return out


def _torch_rules(profile: StackProfile, host: str, family: str, where: str) -> list[Conflict]:
    rule = matrix()["torch_min_for_family"]["table"].get(family)
    torch = _v(profile.torch)
    if not (torch and rule):
        return []
    if Version(torch.base_version) < Version(rule["torch"]):
        return [Conflict(host, "PyTorch", profile.torch or "", f">= {rule['torch']} for {where}", rule["source"])]
    build = torch_cuda_build(profile.torch)
    if build is not None and (build == "none" or Version(build) < Version(rule["cuda"])):
        return [Conflict(host, "PyTorch", f"{profile.torch} (built for CUDA {build})",
                         f"a build for CUDA >= {rule['cuda']} (e.g. +cu{rule['cuda'].replace('.', '')}) for {where}",
                         rule["source"])]
    return []


def _flash_attn_rules(profile: StackProfile, host: str, family: str, where: str) -> list[Conflict]:
    rules = matrix()["flash_attn"]
    fa, cuda = _v(profile.flash_attn), _v(profile.cuda)
    if not fa or fa.major != 2 or family in rules["fa2_families"]:
        return []
    blackwell = rules["fa2_blackwell"]
    if family == "blackwell" and fa >= Version(blackwell["min_version"]) and cuda \
            and cuda >= Version(blackwell["min_cuda"]):
        return []
    if family == "blackwell":
        return [Conflict(host, "flash-attn", profile.flash_attn or "",
                         f">= {blackwell['min_version']} built with CUDA >= {blackwell['min_cuda']} for {where}",
                         blackwell["source"])]
    return [Conflict(host, "flash-attn", profile.flash_attn or "",
                     f"an FA2-capable GPU (Ampere/Ada/Hopper/Blackwell), not {where}", rules["fa2_source"])]


def model_conflicts(profile: StackProfile, *, sliding_window: bool, per_layer: bool, where: str) -> list[Conflict]:
    """What `profile` lacks for the megatron engine to run a model with these features (engine_features)."""
    rules, out = matrix()["engine_features"], []
    torch, need = _v(profile.torch), rules["sliding_window"]["torch"]
    if sliding_window and torch and Version(torch.base_version) < Version(need):
        out.append(Conflict(where, "PyTorch", profile.torch or "", f">= {need} for sliding-window attention",
                            rules["sliding_window"]["source"]))
    mc, need = _v(profile.megatron_core), rules["per_layer_specs"]["megatron_core"]
    if per_layer and mc and mc < Version(need):
        out.append(Conflict(where, "megatron-core", profile.megatron_core or "",
                            f">= {need} for per-layer attention, gates and MTP", rules["per_layer_specs"]["source"]))
    return out


def verdict(profile: StackProfile, hosts: Iterable[HostFacts],
            profiles: Mapping[str, StackProfile] | None = None) -> CompatVerdict:
    """Check every host; on conflict, list the shipped profiles that pass on all of them."""
    hosts = list(hosts)
    conflicts = [c for h in hosts for c in check(profile, h)]
    working: list[str] = []
    if conflicts:
        catalog = profiles if profiles is not None else load_profiles()
        needs_gpu_stack = any(h.gpus for h in hosts)
        working = [name for name, p in catalog.items()
                   if not any(check(p, h) for h in hosts) and (p.cuda or not needs_gpu_stack)
                   and not (needs_gpu_stack and name.startswith(SIMULATION_PREFIX))]
    return CompatVerdict(profile=profile.name, conflicts=tuple(conflicts), working_profiles=tuple(working))


def facts_from_nvidia_smi(host: str, arch: str | None, csv_text: str) -> HostFacts:
    """HostFacts from `nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader` output."""
    gpus = []
    for line in csv_text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if parts and parts[0]:
            gpus.append(GpuModel(name=parts[0], compute_cap=parts[1] if len(parts) > 1 else None))
    return HostFacts(host=host, arch=arch, gpus=tuple(gpus))


def engine_api_level() -> Version:
    """The oldest megatron-core that has everything the megatron engine calls (megatron_engine_api)."""
    return max(Version(api["since"]) for api in matrix()["megatron_engine_api"]["apis"])


def engine_conflicts(profile: StackProfile, engine: str, spec: ModelSpec,
                     layout: Layout | None = None) -> list[Conflict]:
    """What `profile` lacks for `engine` to run `spec` (and `layout`, when given): the megatron engine's
    megatron-core API level, the model's features (engine_features), TransformerEngine for context parallelism."""
    where = f"{spec.name} ({engine} engine)"
    if engine != "megatron":
        return [] if profile.torch else [Conflict(where, "PyTorch", "none", "a PyTorch for the torch engine",
                                                  "stepdeploy/workload/engine_torch.py")]
    mc = _v(profile.megatron_core)
    if mc is None:
        out = [Conflict(where, "megatron-core", profile.megatron_core or "none",
                        f">= {engine_api_level()} (the megatron engine's API level)",
                        "compat.yaml megatron_engine_api (stepdeploy/workload/engine_megatron.py)")]
    else:
        out = [Conflict(where, "megatron-core", profile.megatron_core or "", f">= {api['since']} for "
                        f"{' '.join(api['name'].split())}", " ".join(api["source"].split()))
               for api in matrix()["megatron_engine_api"]["apis"] if mc < Version(api["since"])]
    out += model_conflicts(profile, sliding_window=spec.sliding_window is not None,
                           per_layer=not spec.uniform_attention or spec.mtp_num_layers > 0, where=where)
    if layout is not None and layout.cp > 1 and not profile.transformer_engine:
        out.append(Conflict(where, "TransformerEngine", "none", f"TransformerEngine's attention for CP={layout.cp}",
                            matrix()["transformer_engine"]["source"]))
    return out


def cluster_facts(cluster: Cluster, gpu: str | None = None) -> list[HostFacts]:
    """What the inventory declares of each node (`gpu`: another GPU model, as `plan --gpu` asks)."""
    facts = []
    for node in cluster.nodes:
        name = gpu or node.gpu_model or "unknown GPU"
        gpus = (GpuModel(name=name),) if (node.gpus_per_node or gpu) else ()
        facts.append(HostFacts(node.name, node.arch, gpus, gpu_source="declared in the inventory"))
    return facts


def _merged(conflicts: Iterable[Conflict]) -> list[Conflict]:
    """One conflict per rule broken, naming every host that breaks it."""
    hosts: dict[tuple[str, str, str, str], list[str]] = {}
    for c in conflicts:
        hosts.setdefault((c.component, c.found, c.required, c.source), []).append(c.host)
    return [Conflict(", ".join(dict.fromkeys(names)), *key) for key, names in hosts.items()]


def stack_verdict(cluster: Cluster, spec: ModelSpec, layout: Layout | None = None, *, engine: str | None = None,
                  gpu: str | None = None, profiles: Mapping[str, StackProfile] | None = None) -> CompatVerdict:
    """Can the inventory's stack profile run `spec` (and `layout`) on the hardware the inventory declares, with
    `engine` (default: megatron on GPU nodes, torch on CPU nodes, as render chooses)? Offline: hardware rules,
    CPU architecture and the engine's needs. On conflict, the shipped profiles that pass all of them on these
    nodes (never a simulation profile for GPUs; those made for the GPUs' family first). An inventory that names
    no profile is not judged (ok)."""
    hosts = cluster_facts(cluster, gpu)
    on_gpus = any(h.gpus for h in hosts)
    engine = engine or ("megatron" if on_gpus else "torch")
    gpus = {h.gpus[0].name for h in hosts if h.gpus}
    arches = {h.arch for h in hosts if h.arch}
    subject = (f"{spec.name} with the {engine} engine on {len(hosts)} node(s) of "
               f"{', '.join(sorted(gpus)) or 'CPUs'}{' (' + ', '.join(sorted(arches)) + ')' if arches else ''}")
    if cluster.profile is None:
        return CompatVerdict(profile="(none)", subject=subject)

    def conflicts_of(p: StackProfile) -> list[Conflict]:
        return _merged([c for h in hosts for c in check(p, h)] + engine_conflicts(p, engine, spec, layout))

    conflicts = conflicts_of(cluster.profile)
    working: list[str] = []
    if conflicts:
        catalog = profiles if profiles is not None else load_profiles()
        working = [name for name, p in catalog.items()
                   if (p.cuda or not on_gpus) and not (on_gpus and name.startswith(SIMULATION_PREFIX))
                   and not conflicts_of(p)]
        families = {a[1] for h in hosts for g in h.gpus if (a := gpu_arch(g))}
        working.sort(key=lambda name: not families & set(catalog[name].gpu_families))
    return CompatVerdict(cluster.profile.name, tuple(conflicts), tuple(working), subject)


def require_stack(cluster: Cluster, spec: ModelSpec, layout: Layout | None = None, *, engine: str | None = None,
                  gpu: str | None = None) -> CompatVerdict:
    """stack_verdict, raising BadInput (exit 2) with every rule broken, its source and the profiles that work."""
    found = stack_verdict(cluster, spec, layout, engine=engine, gpu=gpu)
    if not found.ok:
        raise BadInput(found.one_line(), hint=found.hint())
    return found
