"""What every stage's launch shares: the attempt marker written into the logs before a start, the lines of
one attempt's logs (what its diagnosis reads), a failed launch named (a full disk as such, with what `df` says).

The soak's recovery after a failure (stop, wait for lost nodes, diagnose) is rollout/stages/soak_recovery.py."""

from __future__ import annotations

import shlex
import time

from stepdeploy.monitor import diagnose
from stepdeploy.remote.executor import Executor, NodeResult
from stepdeploy.rollout import inject

LOG_TAIL = 400  # lines of each node's log the diagnosis reads (of the failed attempt's: after its marker)


# --- the attempt's own log lines ---------------------------------------------------------------------------------
def marker_command(label: str, now: float) -> str:
    """Shell: append an attempt marker line to every log the run directory holds on the node (a fresh run
    directory has none: its log is one attempt's anyway). The diagnosis reads only what follows the last one."""
    line = f"{diagnose.ATTEMPT_MARKER}: {label}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now))} ===="
    return (f"mkdir -p logs && for f in logs/*.log; do if [ -f \"$f\" ]; then printf '%s\\n' {shlex.quote(line)} "
            ">> \"$f\"; fi; done; true")


def attempt_log_lines(executor: Executor, nodes: list[str]) -> list[str]:
    """The last LOG_TAIL lines of each node's log that the current attempt wrote."""
    logs = executor.logs(tail=LOG_TAIL)
    return [line for n in nodes for line in diagnose.attempt_lines(logs.get(n, []))]


def launch_failure(executor: Executor, where: str, bad: list[NodeResult]) -> str:
    """The one-line error of a launch (prepare or start) that failed on some node: a full disk named as such,
    with what `df` says of the run directory's disk when the node answers."""
    first = bad[0]
    if any(d.signature == diagnose.DISK_FULL for d in diagnose.diagnose(first.detail)):
        return f"{where}: no space left on device on {first.node}: {first.detail}{_df(executor, first.node)}"
    return f"{where}: {first.node}: {first.detail}"


def _df(executor: Executor, node: str) -> str:
    try:
        ok, out = inject.run_on(executor, node, "df -P -k . | tail -n 1")
    except Exception:  # best effort: the error above stands without it
        return ""
    fields = out.splitlines()[-1].split() if out.strip() else []
    if not ok or len(fields) < 6 or not fields[3].isdigit():
        return ""
    return f" (df: {int(fields[3]) // 1024} MiB free on {fields[5]})"
