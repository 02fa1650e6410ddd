"""The rollout's stage names, in the order a rollout runs them, and the module that implements each: what the
configuration (rollout/config.py) and the CLI check names against, without importing a stage or the attempt
service (rollout/stages/ loads the modules; a stage module imports the configuration, so the names live below both).
"""

from __future__ import annotations

from stepdeploy.errors import BadInput

REGISTRY = {
    "warmup": "stepdeploy.rollout.stages.warmup",  # the target on every node, a few iterations
    "scale": "stepdeploy.rollout.stages.scale",  # the scaling ladder: a proxy on 1 GPU .. the target on all nodes
    "soak": "stepdeploy.rollout.stages.soak",  # the target for a duration: checkpoints, monitors, restarts
}
STAGES = tuple(REGISTRY)


def parse_stages(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise BadInput(f"unknown stage {', '.join(unknown) or '(none)'}; stages are {', '.join(STAGES)}")
    return tuple(s for s in STAGES if s in names)  # always in rollout order
