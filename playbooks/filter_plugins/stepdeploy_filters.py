"""Jinja filters that hand the facts play's data to stepdeploy's own (pure) compatibility matrix, so the
playbook, preflight and the planner all judge a stack with the same rules and the same data file."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

from stepdeploy.compat import GpuModel, HostFacts, gpu_arch, verdict
from stepdeploy.errors import StepdeployError
from stepdeploy.stack import COMPONENTS, get_profile


def stepdeploy_profile(name: str) -> dict[str, Any]:
    """The versions of the named stack profile (None = not installed)."""
    try:
        profile = get_profile(name)
    except StepdeployError as exc:
        raise AnsibleFilterError(exc.message) from None
    return {"name": profile.name, **{c: getattr(profile, c) for c in COMPONENTS}}


def stepdeploy_hw(smi_csv: str, facts: dict[str, Any], lspci: str = "", declared_model: str | None = None,
                  declared_count: int | None = None) -> dict[str, Any]:
    """Hardware facts: GPUs from nvidia-smi; without a driver, NVIDIA PCI devices; without either tool, the
    inventory's declared model (marked as declared, not discovered)."""
    gpus, source = _from_smi(smi_csv), "discovered (nvidia-smi)"
    if not gpus and lspci.strip():
        gpus, source = [{"name": line.strip(), "compute_cap": None, "memory_mib": None}
                        for line in lspci.strip().splitlines()], "discovered (lspci)"
    if not gpus and declared_model and (declared_count or 0) > 0 and not facts.get("__lspci_ran"):
        gpus = [{"name": declared_model, "compute_cap": None, "memory_mib": None}] * int(declared_count or 0)
        source = "declared in the inventory"
    arch = gpu_arch(GpuModel(gpus[0]["name"], gpus[0]["compute_cap"])) if gpus else None
    return {
        "arch": facts.get("architecture"), "os_id": str(facts.get("distribution", "")).lower(),
        "os_version": facts.get("distribution_version"), "has_nvidia_gpu": bool(gpus), "gpus": gpus,
        "gpu_count": len(gpus), "sm": arch[0] if arch else None, "family": arch[1] if arch else None,
        "gpu_source": source if gpus else "none found",
    }


def _from_smi(csv_text: str) -> list[dict[str, Any]]:
    gpus = []
    for line in (csv_text or "").strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0]:
            memory = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
            gpus.append({"name": parts[0], "compute_cap": parts[1], "memory_mib": memory})
    return gpus


def stepdeploy_compat(profile_name: str, hosts: list[dict[str, Any]]) -> dict[str, Any]:
    """Judge the profile on the given hosts' stepdeploy_hw facts (each with a `host` key)."""
    try:
        profile = get_profile(profile_name)
    except StepdeployError as exc:
        raise AnsibleFilterError(exc.message) from None
    facts = [HostFacts(host=h.get("host", "?"), arch=h.get("arch"), gpu_source=h.get("gpu_source", ""),
                       gpus=tuple(GpuModel(g["name"], g.get("compute_cap")) for g in h.get("gpus", [])))
             for h in hosts]
    v = verdict(profile, facts)
    return {"ok": v.ok, "message": v.message(), "working_profiles": list(v.working_profiles),
            "conflicts": [c.line() for c in v.conflicts]}


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"stepdeploy_profile": stepdeploy_profile, "stepdeploy_hw": stepdeploy_hw,
                "stepdeploy_compat": stepdeploy_compat}
