"""Software stack profiles: named sets of versions (driver, CUDA, ... megatron-core) an inventory picks.

The data lives in stepdeploy/data/stack_profiles.yaml, each version with its source. This module only reads
and types it; checking a profile against the hardware found is the compatibility matrix's job.
"""

from __future__ import annotations

import difflib
from functools import cache
from importlib import resources
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from stepdeploy.errors import BadInput

COMPONENTS = (
    "driver", "cuda", "cudnn", "nccl", "python", "torch", "flash_attn", "megatron_core", "transformer_engine",
    "env_manager",
)
# `platform: {arch: [...], gpu_families: [...], source}`: the CPU architectures the profile's packages are built
# for (a profile without one is not tied to any) and the GPU families it is made for (suggestions list those first)
PLATFORM = "platform"
EnvManager = Literal["conda", "venv"]


class StackProfile(BaseModel):
    """One named stack. A version of None means the profile does not install that component."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    driver: str | None = None
    cuda: str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    python: str | None = None
    torch: str | None = None
    flash_attn: str | None = None
    megatron_core: str | None = None
    transformer_engine: str | None = None
    env_manager: EnvManager = "venv"
    arch: tuple[str, ...] = ()  # empty: any CPU architecture
    gpu_families: tuple[str, ...] = ()
    # component -> where its version comes from (and why, when it is not obvious)
    sources: dict[str, str] = {}


def profile_names() -> list[str]:
    """The known profile names, in the order the data file lists them."""
    return list(load_profiles())


def get_profile(name: str) -> StackProfile:
    """The profile called `name`; BadInput listing the known ones (and the closest) if there is none."""
    profiles = load_profiles()
    if name in profiles:
        return profiles[name]
    raise BadInput(f"unknown stack profile {name!r}{did_you_mean(name, profiles)}; "
                   f"known profiles: {', '.join(profiles)}")


def did_you_mean(word: str, choices: Any) -> str:
    """' (did you mean X?)' when one of `choices` is close to `word`, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


@cache
def load_profiles() -> dict[str, StackProfile]:
    """Read and validate the shipped profile file once per process."""
    text = resources.files("stepdeploy").joinpath("data/stack_profiles.yaml").read_text(encoding="utf-8")
    return parse_profiles(yaml.safe_load(text))


def parse_profiles(document: Any) -> dict[str, StackProfile]:
    """Turn the YAML document ({profiles: {name: {description, component: {version, source, note}}}})
    into profiles. A malformed document is a bug in the shipped data, reported as ValueError."""
    if not isinstance(document, dict) or not isinstance(document.get("profiles"), dict):
        raise ValueError("stack profile data must be a mapping with a 'profiles' mapping")
    return {str(name): _parse_profile(str(name), body) for name, body in document["profiles"].items()}


def _parse_profile(name: str, body: Any) -> StackProfile:
    if not isinstance(body, dict):
        raise ValueError(f"stack profile {name!r} must be a mapping")
    unknown = set(body) - {"description", PLATFORM, *COMPONENTS}
    if unknown:
        raise ValueError(f"stack profile {name!r} has unknown keys: {sorted(unknown)}")
    fields: dict[str, Any] = {"name": name, "description": body.get("description", "")}
    sources: dict[str, str] = {}
    if PLATFORM in body:
        fields |= _parse_platform(name, body[PLATFORM])
        sources[PLATFORM] = str(body[PLATFORM]["source"])
    for component in COMPONENTS:
        entry = body.get(component)
        if entry is None:
            continue
        if not isinstance(entry, dict) or "version" not in entry or not entry.get("source"):
            raise ValueError(f"stack profile {name!r}: {component} needs 'version' and 'source'")
        if entry["version"] is not None:
            fields[component] = str(entry["version"])
        note = entry.get("note")
        sources[component] = f"{entry['source']}; {note}" if note else str(entry["source"])
    try:
        return StackProfile(**fields, sources=sources)
    except ValidationError as exc:
        raise ValueError(f"stack profile {name!r}: {exc}") from exc


def _parse_platform(name: str, entry: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(entry, dict) or not entry.get("source") or not isinstance(entry.get("arch"), list):
        raise ValueError(f"stack profile {name!r}: platform needs 'arch' (a list) and 'source'")
    return {"arch": tuple(map(str, entry["arch"])), "gpu_families": tuple(map(str, entry.get("gpu_families", [])))}
