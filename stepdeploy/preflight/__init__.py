"""Preflight: per-node and cross-node readiness checks, and an all_reduce bandwidth gate.

Layout: `probe` builds the one shell script run on every node and splits its output into sections;
`host`, `gpu` and `cluster` are pure checks (sections in, `Result`s out); `collect` runs the probe over
SSH (or locally) in parallel with per-node deadlines; `bandwidth` launches the sweep; `runner` ties them
together; `report` renders the table.
"""

from stepdeploy.preflight.model import Report, Result, Status

__all__ = ["Report", "Result", "Status"]
