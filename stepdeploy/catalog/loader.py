"""Read the catalog's YAML files (shipped in stepdeploy/data) into typed specs; a model may also be a file of
the user's: a YAML of the catalog's schema, or a Hugging Face config.json (hf_config.py)."""

from __future__ import annotations

import os
import re
from functools import cache, lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from stepdeploy import safeio
from stepdeploy.catalog.hardware import GpuSpec, Hardware, LinkSpec
from stepdeploy.catalog.hf_config import read_hf_config, spec_from_hf_config
from stepdeploy.catalog.model import ModelSpec, parse_model
from stepdeploy.errors import BadInput

MAX_MODEL_YAML_BYTES = 1024 * 1024  # the catalog's largest model file is 4 KiB
MODEL_FILE_HINT = "--model takes a catalog name, a model YAML of the catalog's schema, or a Hugging Face config.json"


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


def load_model(name: str) -> ModelSpec:
    """The catalog model `name`, or the model of a file: `name` a path to a YAML of the catalog's schema or to a
    Hugging Face config.json (or a directory holding one). A model given by path is named by that path, so the
    commands a plan or render suggests (`plan -m ...`) find it again. BadInput listing the known names when
    `name` is neither."""
    if name in model_names():
        return _catalog_model(name)
    if not _looks_like_path(name):
        raise BadInput(f"unknown model {name!r}; known: {', '.join(model_names())}", hint=MODEL_FILE_HINT)
    path = Path(name)
    file = path / "config.json" if path.is_dir() else path
    info = safeio.require_regular(file, "model file")
    return _model_file(name, str(file.resolve()), info.st_mtime_ns, info.st_size)


def model_slug(name: str) -> str:
    """A short name of `--model` for run ids (letters, digits, '.', '_', '-'): a catalog name as it is; for a
    file its stem, for a config.json or a directory holding one the directory's name."""
    if name in model_names():
        return name
    path = Path(name)
    if path.is_dir() or path.name == "config.json":
        base = (path if path.is_dir() else path.parent).resolve().name
    else:
        base = path.stem
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("._-") or "model"


@cache
def _catalog_model(name: str) -> ModelSpec:
    path = _data_dir() / "models" / f"{name}.yaml"
    return parse_model(_read_yaml(path), origin=path.name)


def _looks_like_path(name: str) -> bool:
    return (os.sep in name or "/" in name or name.endswith((".yaml", ".yml", ".json"))
            or Path(name).exists())


@lru_cache(maxsize=32)
def _model_file(name: str, resolved: str, mtime_ns: int, size: int) -> ModelSpec:
    """The model of a file, read again whenever the file changes (its time and size are the cache key)."""
    path = Path(name)
    if path.is_dir() or path.suffix == ".json":
        config, file = read_hf_config(path)
        return spec_from_hf_config(config, name=name, source=str(file))
    if path.suffix not in (".yaml", ".yml"):
        raise BadInput(f"{path}: not a model file (.yaml, .yml, or a Hugging Face config .json)", hint=MODEL_FILE_HINT)
    text = safeio.read_text(path, "model file", limit=MAX_MODEL_YAML_BYTES)
    safeio.check_yaml(text, str(path))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise BadInput(f"{path}: not YAML{where}: {getattr(exc, 'problem', None) or 'cannot parse'}") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: a model file is a mapping of the catalog's fields, not a {type(data).__name__}")
    return parse_model({**data, "name": name}, origin=str(path))


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
