"""The manifest.json of a rendered run, typed: `Manifest.load(run_dir)` reads it back for `stepdeploy run ...`,
the rollout and the executors, which act on what it names (node directories, the remote run directory, the Slurm
job). A broken file, one another tool wrote or one edited into something else is refused with one line before
anything connects or runs: the file must meet the schema render writes (`_OnDisk`), then the code reads it
through `Manifest` (the fields it uses, typed)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stepdeploy import safeio
from stepdeploy.errors import BadInput
from stepdeploy.inventory.model import ExecutorKind

HINT = "stepdeploy render -i INVENTORY -m MODEL --out runs/r1"  # where the manifest does not say what it was


def render_hint(data: Any, run_dir: Path) -> str:
    """The render that writes `run_dir` again, from the inventory and model its manifest names (`data`: the
    file as read, checked or not) into a new sibling directory; HINT where the manifest does not name them."""
    inputs = data.get("inputs") if isinstance(data, dict) else None
    inventory = inputs.get("inventory") if isinstance(inputs, dict) else None
    model = inputs.get("model") if isinstance(inputs, dict) else None
    path = inventory.get("path") if isinstance(inventory, dict) else None
    name = model.get("name") if isinstance(model, dict) else None
    if not (isinstance(path, str) and path and isinstance(name, str) and name):
        return HINT
    return shlex.join(["stepdeploy", "render", "-i", path, "-m", name, "--out", f"{run_dir.resolve()}-2"])


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


class _Needs(_Open):
    software: list[str] = Field(min_length=1, max_length=64)  # plan/engines.needs: 'package: why'
    python: str = Field(min_length=1, max_length=4096)  # the interpreter the launch runs: quoted where used


class _OnDisk(_Open):
    """What a manifest file must be (strict: render wrote it)."""

    format: Literal[1]
    run_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # render.options.RUN_ID
    run_dir: str = Field(pattern=r"^/", max_length=4096)  # any characters: it is quoted wherever it is used
    nodes: list[_Node] = Field(min_length=1, max_length=100_000)
    inputs: dict[str, Any]
    executor: ExecutorKind | None = None
    slurm: _Slurm | None = None
    needs: _Needs | None = None


class ManifestNode(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: str
    dir: str  # relative to the run directory: nodes/<rank>-<name>
    address: str | None = None
    node_rank: int | None = None
    facts: dict[str, Any] | None = None  # the NCCL facts file that fed the node: {path, sha256}


class SlurmEntry(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    script: str
    job_name: str
    tasks: Literal["node", "gpu"] | None = None
    tasks_per_node: int | None = None
    partition: str | None = None


class Needs(BaseModel):
    """What the run's layout needs on every node beyond the stock stack (plan/engines.needs, each 'package: why'),
    and the python the launch runs: the rollout checks it there before each launch (rollout/stages/needs.py)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    software: list[str]
    python: str


class Manifest(BaseModel):
    """A rendered run's manifest, as the code reads it (render/run.py writes it; unknown keys are kept)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    run_id: str
    run_dir: str  # absolute, on every node
    nodes: list[ManifestNode] = Field(min_length=1)
    inputs: dict[str, Any] = Field(default_factory=dict)
    executor: ExecutorKind | None = None  # None: decided by remote/registry.py
    slurm: SlurmEntry | None = None
    stage: str | None = None
    engine: str | None = None
    layout: str | None = None
    needs: Needs | None = None  # None: the stock stack runs it

    @classmethod
    def load(cls, run_dir: Path) -> Manifest:
        """The manifest of the run directory `run_dir`, checked; BadInput naming the file and the first problem."""
        return cls.model_validate(_checked(run_dir))

    @classmethod
    def of(cls, value: Manifest | Mapping[str, Any]) -> Manifest:
        """`value` as a Manifest (a mapping: a manifest held in memory, e.g. one just rendered)."""
        return value if isinstance(value, Manifest) else cls.model_validate(dict(value))

    @classmethod
    def from_text(cls, text: str) -> Manifest:
        """The manifest render_run produced (its manifest.json file's text)."""
        return cls.model_validate(json.loads(text))

    @property
    def node_names(self) -> list[str]:
        return [node.name for node in self.nodes]

    @property
    def rung(self) -> str | None:
        """The rollout rung the run was rendered for (inputs.rung.name), if any."""
        rung = self.inputs.get("rung")
        return rung.get("name") if isinstance(rung, dict) and isinstance(rung.get("name"), str) else None

    def inventory_path(self, where: Path) -> str:
        """The inventory the run was rendered from (inputs.inventory.path); `where`: the file, for the error."""
        source = self.inputs.get("inventory")
        if not isinstance(source, dict) or not isinstance(source.get("path"), str) or not source["path"]:
            raise BadInput(f"{where}: names no inventory (inputs.inventory.path); pass --inventory", hint=HINT)
        return source["path"]

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def _checked(run_dir: Path) -> dict[str, Any]:
    """The manifest file of `run_dir` as render wrote it (the _OnDisk schema and the checks across fields)."""
    path = run_dir / "manifest.json"
    if not run_dir.is_dir():
        raise BadInput(f"{run_dir}: not a directory; give a run directory written by `stepdeploy render`", hint=HINT)
    if not path.exists() and not path.is_symlink():
        raise BadInput(f"{run_dir}: no manifest.json; give a directory written by `stepdeploy render`", hint=HINT)
    data = safeio.read_json(path, "run manifest", hint=HINT)
    try:
        manifest = _OnDisk.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise BadInput(f"{path}: {where}: {first['msg']}; not a manifest `stepdeploy render` wrote",
                       hint=render_hint(data, run_dir)) from None
    if manifest.executor == "slurm" and manifest.slurm is None:
        raise BadInput(f"{path}: executor slurm without its slurm section; render the run again",
                       hint=render_hint(data, run_dir))
    names = [node.name for node in manifest.nodes]
    if len(set(names)) != len(names):
        raise BadInput(f"{path}: names a node twice; render the run again", hint=render_hint(data, run_dir))
    return data
