"""Before a launch: the software the run's layout needs beyond the stock stack (the manifest's `needs`, which render
writes from plan/engines.needs: TransformerEngine for context parallelism), verified on every node of the run with
preflight's own checks (preflight/host.py check_needs over the probe's python section, run with the interpreter the
launch runs). A node without it fails the attempt before anything starts there, as a launch a node refuses does."""

from __future__ import annotations

from stepdeploy.preflight import host, probe
from stepdeploy.preflight.model import Result, Section, Status
from stepdeploy.remote.executor import CommandResult, Executor
from stepdeploy.render.manifest import Manifest
from stepdeploy.rollout.config import StageFailed
from stepdeploy.rollout.service import AttemptService

HINT = ("install what the layout needs on every node (e.g. TransformerEngine into the training environment), or "
        "choose a layout that needs nothing more (cp=1); check with: stepdeploy preflight INVENTORY --model M "
        "--layout L")


def judge(answers: list[CommandResult], software: tuple[str, ...]) -> list[Result]:
    """Each node's answer to probe.python_command, judged by preflight's checks of what `software` needs. Pure."""
    results = []
    expect = host.Expect(needs=software)
    for answer in answers:
        section = Section(rc=answer.exit_code if answer.exit_code is not None else 255,
                          text=answer.stdout + answer.stderr)
        if host.python_env(section) is None:
            why = (answer.stdout + answer.stderr).strip()[-200:] or "no answer"
            results.append(Result("python", Status.FAIL, f"the run's python did not answer: {why}",
                                  "the training environment's python", "provision the node (stepdeploy provision)",
                                  answer.node))
            continue
        results += [result.on(answer.node) for result in host.check_needs(section, expect)]
    return results


def verify(service: AttemptService, executor: Executor, manifest: Manifest, stage: str, rung: str) -> None:
    """Nothing when the run needs nothing more; else run the check on every node: an event when all pass,
    StageFailed naming every node that does not."""
    if manifest.needs is None:
        return
    software = tuple(manifest.needs.software)
    results = judge(executor.run_command(probe.python_command((manifest.needs.python,))), software)
    failed = [r for r in results if r.status is Status.FAIL]
    if failed:
        raise StageFailed(f"{stage}/{rung}: the layout {manifest.layout} needs {'; '.join(software)}: "
                          + "; ".join(f"{r.node}: {r.check} {r.observed}" for r in failed), hint=HINT)
    found = ", ".join(f"{r.node} {r.observed}" for r in results)
    service.event(stage, "needs", f"what the layout needs is on every node: {found}",
                  {"needs": list(software), "nodes": [r.to_json() for r in results]}, rung=rung)
