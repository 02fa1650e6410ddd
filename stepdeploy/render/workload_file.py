"""workload.json as the controller reads it back from a rendered run: typed, the parts the controller acts on
(the rollout's soak judges its gates after the run's learning-rate warm-up; the simulated cluster trains for its
iterations). render/workload.py writes the whole file; the workload on the nodes reads it there with the standard
library (stepdeploy/workload/ is shipped as files and imports neither pydantic nor stepdeploy), so this schema is
the controller's alone. Unknown keys are kept, as in the manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stepdeploy import safeio
from stepdeploy.errors import BadInput
from stepdeploy.render.manifest import HINT

WORKLOAD_FILE = "workload.json"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class Training(_Open):
    iterations: int = Field(ge=1)  # the run exits 0 after the last
    warmup_iterations: int = Field(ge=0)  # of the learning rate (the soak's gates judge after it)


class Workload(_Open):
    format: int = 1
    run_id: str | None = None
    stage: str | None = None
    engine: str | None = None
    model: dict[str, Any] = Field(default_factory=dict)  # the catalog's model as the engine builds it
    training: Training

    @property
    def moe(self) -> dict[str, Any]:
        """The model's experts (empty: a dense model)."""
        moe = self.model.get("moe")
        return moe if isinstance(moe, dict) else {}

    @classmethod
    def load(cls, run_dir: Path) -> Workload:
        """The workload.json of the rendered run `run_dir`; BadInput naming the file and the first problem."""
        path = run_dir / WORKLOAD_FILE
        data = safeio.read_json(path, "workload configuration", hint=HINT)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "(top level)"
            raise BadInput(f"{path}: {where}: {first['msg']}; not a workload.json `stepdeploy render` wrote",
                           hint=HINT) from None
