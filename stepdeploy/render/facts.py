"""The NCCL facts provisioning saved for each node, read into `NodeFacts` for the renderer.

The infiniband role discovers them on the node (/etc/stepdeploy/nccl.json) and `stepdeploy provision`
brings every node's file back to the controller as `<facts dir>/<node>.json`; by default the facts directory
is `.stepdeploy/facts/` next to the inventory file. This module reads local files only (never a connection):
a file that is not valid facts is bad input naming the file; a node without a file simply has no facts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stepdeploy import safeio
from stepdeploy.errors import BadInput
from stepdeploy.render.environment import NodeFacts

FACTS_SUBDIR = Path(".stepdeploy") / "facts"


class SavedFacts(BaseModel):
    """The part of the infiniband role's nccl.json the renderer uses (the module writes more)."""

    model_config = ConfigDict(extra="ignore")

    socket_ifname: str | None = Field(default=None, pattern=r"^[^\s/:]{1,15}$")  # a Linux netdev name
    ib_hca: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_]+(:[0-9]+)?(,[A-Za-z0-9_]+(:[0-9]+)?)*$")
    gid_index: int | None = Field(default=None, ge=0)
    gid_indexes: list[int] = []


def default_facts_dir(inventory: Path | str) -> Path:
    """`<inventory dir>/.stepdeploy/facts` (for an inventory directory: inside it)."""
    path = Path(inventory).absolute()
    return (path if path.is_dir() else path.parent) / FACTS_SUBDIR


def facts_file(facts_dir: Path, node_name: str) -> Path | None:
    """Where provisioning saves `node_name`'s facts; None for a name that cannot be a file name."""
    if not node_name or "/" in node_name or "\0" in node_name:
        return None
    return facts_dir / f"{node_name}.json"


def parse_facts(data: bytes, source: str) -> NodeFacts:
    """One facts file's content -> NodeFacts; BadInput naming `source` when it is not valid facts."""
    hint = "provision the node again (stepdeploy provision INVENTORY --tags infiniband) or delete the file"
    raw = safeio.loads_json(data, source, what="facts file", hint=hint)
    if not isinstance(raw, dict):
        raise BadInput(f"{source}: not a facts file (a JSON object was expected)", hint=hint)
    try:
        saved = SavedFacts.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise BadInput(f"{source}: {where}: {first['msg']}", hint=hint) from None
    return NodeFacts(gid_index=saved.gid_index, socket_ifname=saved.socket_ifname,
                     ib_hcas=tuple(saved.ib_hca.split(",")) if saved.ib_hca else (),
                     gid_indexes=tuple(saved.gid_indexes), source=source,
                     sha256=hashlib.sha256(data).hexdigest())


def load_facts(facts_dir: Path, node_names: Iterable[str]) -> dict[str, NodeFacts]:
    """The facts of every named node that has a file in `facts_dir` (nodes without one are left out)."""
    facts: dict[str, NodeFacts] = {}
    for name in node_names:
        path = facts_file(facts_dir, name)
        if path is not None and (path.exists() or path.is_symlink()):  # there, it must be a regular file
            facts[name] = parse_facts(safeio.read_bytes(path, "facts file"), str(path))
    return facts


def facts_for(inventory: Path | str, node_names: Iterable[str],
              facts_dir: Path | None = None) -> dict[str, NodeFacts] | None:
    """The nodes' facts from `facts_dir` (which must exist when given) or else from the default directory of
    `inventory`; None when no directory was given and the default one does not exist (render without facts)."""
    if facts_dir is not None:
        if not facts_dir.is_dir():
            raise BadInput(f"facts directory {facts_dir} does not exist",
                           hint="run stepdeploy provision INVENTORY first, or leave out --facts-dir")
        return load_facts(facts_dir, node_names)
    default = default_facts_dir(inventory)
    return load_facts(default, node_names) if default.is_dir() else None
