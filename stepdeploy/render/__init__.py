"""Pure rendering of a run directory from the inventory, the model, the chosen layout and the options.

Values in, text out: nothing here opens a connection or writes a file (stepdeploy.cli.render writes).
"""

from stepdeploy.render.environment import EnvVar, NodeFacts, node_environment
from stepdeploy.render.options import SEED_OPTIONS, RenderOptions, parse_env
from stepdeploy.render.run import Placement, RenderedFile, RenderedRun, load_workload_sources, render_run

__all__ = [
    "SEED_OPTIONS",
    "EnvVar",
    "NodeFacts",
    "Placement",
    "RenderOptions",
    "RenderedFile",
    "RenderedRun",
    "load_workload_sources",
    "node_environment",
    "parse_env",
    "render_run",
]
