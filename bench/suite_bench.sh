#!/usr/bin/env bash
# The test cases the suite's default run leaves out (marker `bench`, pyproject's addopts): wider cases of kinds
# the suite keeps one of, e.g. the Slurm role on 4 fresh nodes (the suite runs it on 2), the roles' check mode on
# a fresh node of test_roles.py's cluster (the suite's is test_wheel_provision.py's, same profile). Figures:
# docs/benchmarks-log.md, "Test suite". Integration cases need root and the simulated cluster, as in the suite.
#   bash bench/suite_bench.sh                 # every moved case
#   bash bench/suite_bench.sh tests/integration/test_slurm_role.py
#   bash bench/suite_bench.sh tests/integration/test_roles.py
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m pytest -m bench --durations=0 -p no:cacheprovider "$@"
