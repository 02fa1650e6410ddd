"""Reading back the manifest.json of a rendered run: `stepdeploy run ...` and the rollout act on what it names
(node directories, the remote run directory, the Slurm job), so a broken file, one another tool wrote or one
edited into something else is refused with one line before anything connects or runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stepdeploy import safeio
from stepdeploy.errors import BadInput

HINT = "stepdeploy render -i INVENTORY -m MODEL --out runs/r1"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Node(_Open):
    name: str = Field(min_length=1, max_length=253)
    dir: str = Field(pattern=r"^nodes/[0-9]{1,6}-[A-Za-z0-9._-]{1,40}$")  # render.run.node_dir


class _Slurm(_Open):
    script: Literal["sbatch.sh"]
    job_name: str = Field(pattern=r"^sd-[a-z]+-[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    tasks: Literal["node", "gpu"]
    tasks_per_node: int = Field(ge=1, le=4096)
    partition: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class _Manifest(_Open):
    format: Literal[1]
    run_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # render.options.RUN_ID
    run_dir: str = Field(pattern=r"^/", max_length=4096)  # any characters: it is quoted wherever it is used
    nodes: list[_Node] = Field(min_length=1, max_length=100_000)
    inputs: dict[str, Any]
    executor: Literal["fabric", "slurm", "local"] | None = None
    slurm: _Slurm | None = None


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """The manifest of the run directory `run_dir`, checked; BadInput naming the file and the first problem."""
    path = run_dir / "manifest.json"
    if not run_dir.is_dir():
        raise BadInput(f"{run_dir}: not a directory; give a run directory written by `stepdeploy render`", hint=HINT)
    if not path.exists() and not path.is_symlink():
        raise BadInput(f"{run_dir}: no manifest.json; give a directory written by `stepdeploy render`", hint=HINT)
    data = safeio.read_json(path, "run manifest", hint=HINT)
    try:
        manifest = _Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise BadInput(f"{path}: {where}: {first['msg']}; not a manifest `stepdeploy render` wrote",
                       hint=HINT) from None
    if manifest.executor == "slurm" and manifest.slurm is None:
        raise BadInput(f"{path}: executor slurm without its slurm section; render the run again", hint=HINT)
    names = [node.name for node in manifest.nodes]
    if len(set(names)) != len(names):
        raise BadInput(f"{path}: names a node twice; render the run again", hint=HINT)
    return data


def inventory_of(manifest: dict[str, Any], path: Path) -> str:
    """The inventory the run was rendered from (manifest inputs.inventory.path)."""
    source = manifest["inputs"].get("inventory")
    if not isinstance(source, dict) or not isinstance(source.get("path"), str) or not source["path"]:
        raise BadInput(f"{path}: names no inventory (inputs.inventory.path); pass --inventory", hint=HINT)
    return source["path"]
