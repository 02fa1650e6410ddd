"""The manifest.json of a rendered run, typed: one schema (`Manifest`) that render builds and writes, and that
`stepdeploy run ...`, the rollout and the executors read back (`Manifest.load(run_dir)`) and act on (node
directories, the remote run directory, the Slurm job). A broken file, one another tool wrote or one edited into
something else is refused with one line before anything connects or runs.

The file is written as the model dumps it (`to_json`: the keys render set, in the schema's order, unknown keys
a later stepdeploy wrote kept), so a manifest read and written again is the same file."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stepdeploy import safeio
from stepdeploy.errors import BadInput
from stepdeploy.executor_kinds import ExecutorKind

HINT = "stepdeploy render -i INVENTORY -m MODEL --out runs/r1"  # where the manifest does not say what it was
MANIFEST_FILE = "manifest.json"


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


class _Entry(BaseModel):
    """Strict (render wrote it: no coercion), frozen, and keeping keys a later stepdeploy may add."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True, populate_by_name=True)


class ManifestNode(_Entry):
    name: str = Field(min_length=1, max_length=253)
    address: str | None = None
    node_rank: int | None = None
    dir: str = Field(pattern=r"^nodes/[0-9]{1,6}-[A-Za-z0-9._-]{1,40}$")  # render.run.node_dir
    facts: dict[str, Any] | None = None  # the NCCL facts file that fed the node: {path, sha256}


class ManifestFile(_Entry):
    """One rendered file: its hash, where it came from (a template, the workload code, a data prepare)."""

    path: str  # relative to the run directory
    sha256: str
    origin: str = Field(alias="from")
    template_sha256: str | None = None
    node: str | None = None  # the node it is started on (None: every node's)


class Needs(_Entry):
    """What the run's layout needs on every node beyond the stock stack (plan/engines.needs, each 'package: why'),
    and the python the launch runs: the rollout checks it there before each launch (rollout/stages/needs.py)."""

    software: list[str] = Field(min_length=1, max_length=64)
    python: str = Field(min_length=1, max_length=4096)  # the interpreter the launch runs: quoted where used


class SlurmEntry(_Entry):
    script: Literal["sbatch.sh"]
    job_name: str = Field(pattern=r"^sd-[a-z]+-[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # render.sbatch.job_name
    tasks: Literal["node", "gpu"] | None = None
    tasks_per_node: int | None = Field(default=None, ge=1, le=4096)
    partition: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Manifest(_Entry):
    """A rendered run's manifest (render/run.py builds it; fields in the order the file has them)."""

    format: Literal[1] = 1
    run_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # render.options.RUN_ID
    created: str | None = None
    stepdeploy: str | None = None  # the version that rendered it
    engine: str | None = None
    layout: str | None = None
    stage: str | None = None
    run_dir: str = Field(pattern=r"^/", max_length=4096)  # absolute on every node; quoted wherever it is used
    inputs: dict[str, Any] = Field(default_factory=dict)  # what it was rendered from (inventory, model, rung...)
    nodes: list[ManifestNode] = Field(min_length=1, max_length=100_000)
    files: list[ManifestFile] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    needs: Needs | None = None  # None: the stock stack runs it
    executor: ExecutorKind | None = None  # None: decided by remote/registry.py
    slurm: SlurmEntry | None = None

    @classmethod
    def load(cls, run_dir: Path) -> Manifest:
        """The manifest of the run directory `run_dir`, checked; BadInput naming the file and the first problem."""
        path = run_dir / MANIFEST_FILE
        if not run_dir.is_dir():
            raise BadInput(f"{run_dir}: not a directory; give a run directory written by `stepdeploy render`",
                           hint=HINT)
        if not path.exists() and not path.is_symlink():
            raise BadInput(f"{run_dir}: no manifest.json; give a directory written by `stepdeploy render`", hint=HINT)
        data = safeio.read_json(path, "run manifest", hint=HINT)
        if isinstance(data, dict) and "format" not in data:  # render always writes it (a default only in memory)
            raise BadInput(f"{path}: format: Field required; not a manifest `stepdeploy render` wrote",
                           hint=render_hint(data, run_dir))
        try:
            manifest = cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "(top level)"
            raise BadInput(f"{path}: {where}: {first['msg']}; not a manifest `stepdeploy render` wrote",
                           hint=render_hint(data, run_dir)) from None
        problem = manifest.problem()
        if problem:
            raise BadInput(f"{path}: {problem}; render the run again", hint=render_hint(data, run_dir))
        return manifest

    @staticmethod
    def written(run_dir: Path) -> bool:
        """Whether `run_dir` holds a manifest file (is a run directory render wrote, as far as a look tells)."""
        return (run_dir / MANIFEST_FILE).is_file()

    @classmethod
    def of(cls, value: Manifest | Mapping[str, Any]) -> Manifest:
        """`value` as a Manifest (a mapping: a manifest held in memory, e.g. one a test writes)."""
        return value if isinstance(value, Manifest) else cls.model_validate(dict(value))

    def problem(self) -> str | None:
        """What is wrong across its fields (None: nothing): render never writes such a manifest."""
        if self.executor == "slurm" and self.slurm is None:
            return "executor slurm without its slurm section"
        if len(set(self.node_names)) != len(self.nodes):
            return "names a node twice"
        return None

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
        """The manifest as its file holds it: the keys that were set (a null render wrote stays), `from` by name."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)
