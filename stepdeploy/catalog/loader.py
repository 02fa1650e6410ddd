"""Read the catalog's YAML files (shipped in stepdeploy/data) into typed specs."""

from __future__ import annotations

from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

import yaml
from pydantic import ValidationError

from stepdeploy.catalog.hardware import GpuSpec, Hardware, LinkSpec
from stepdeploy.catalog.model import ModelSpec
from stepdeploy.errors import BadInput


def _data_dir() -> Traversable:
    return resources.files("stepdeploy") / "data"


def _read_yaml(path: Traversable) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise BadInput(f"{path.name}: expected a mapping at the top level")
    return data


def model_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml") for p in (_data_dir() / "models").iterdir() if p.name.endswith(".yaml")
    )


def parse_model(data: dict[str, Any], origin: str = "<model>") -> ModelSpec:
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise BadInput(f"{origin}: {where}: {first['msg']}") from exc


@cache
def load_model(name: str) -> ModelSpec:
    """The catalog model `name`; BadInput listing the known names when there is none."""
    if name not in model_names():
        raise BadInput(f"unknown model {name!r}; known: {', '.join(model_names())}")
    path = _data_dir() / "models" / f"{name}.yaml"
    return parse_model(_read_yaml(path), origin=path.name)


@cache
def load_hardware() -> Hardware:
    data = _read_yaml(_data_dir() / "hardware.yaml")
    gpus = {name: {"name": name, **spec} for name, spec in data["gpus"].items()}
    links = {name: {"name": name, **spec} for name, spec in data["links"].items()}
    return Hardware.model_validate({**data, "gpus": gpus, "links": links})


def gpu(name: str) -> GpuSpec:
    gpus = load_hardware().gpus
    key = name.upper()
    if key not in gpus:
        raise BadInput(f"unknown GPU {name!r}; known: {', '.join(sorted(gpus))}")
    return gpus[key]


def link(name: str) -> LinkSpec:
    links = load_hardware().links
    if name not in links:
        raise BadInput(f"unknown link {name!r}; known: {', '.join(sorted(links))}")
    return links[name]
