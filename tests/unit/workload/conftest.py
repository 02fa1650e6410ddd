"""The workload modules import their siblings by plain name (they run as files on the nodes)."""

import sys
from pathlib import Path

import stepdeploy.workload

WORKLOAD_DIR = str(Path(stepdeploy.workload.__file__).parent)
if WORKLOAD_DIR not in sys.path:
    sys.path.insert(0, WORKLOAD_DIR)
