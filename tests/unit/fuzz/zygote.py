"""The fuzz suite's process factory: imports stepdeploy (and what its commands load: ansible, Fabric, matplotlib)
once, then runs each case as `stepdeploy ARGV` in a forked child with its own session, working directory,
environment and files, under a memory limit (RLIMIT_AS) and a wall-clock limit (the whole process group is
killed when it runs out). A fork costs milliseconds where a fresh interpreter costs seconds.

Protocol, one JSON object per line: a case on stdin, its result on stdout.
    case   {"argv": [...], "cwd": str, "env": {...}, "stdout": path, "stderr": path, "timeout": s, "memory": bytes}
    result {"rc": int (negative: killed by that signal), "timed_out": bool, "seconds": float, "maxrss_kib": int}
Run as `python -I tests/unit/fuzz/zygote.py` (an absolute path, isolated mode: nothing from the working directory).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import signal
import sys
import time
import traceback

PRELOAD = ("matplotlib.pyplot", "ansible.inventory.manager", "ansible.parsing.dataloader", "ansible.vars.manager",
           "fabric", "stepdeploy.cli.app", "stepdeploy.preflight.runner", "stepdeploy.provision.runner",
           "stepdeploy.render.build", "stepdeploy.report.html", "stepdeploy.rollout.runner")


def preload() -> None:
    """What the commands import: loaded once here, shared by every forked case."""
    import matplotlib

    matplotlib.use("Agg")
    for module in PRELOAD:
        importlib.import_module(module)


def child(case: dict) -> None:
    """In the forked child: become `stepdeploy ARGV` in the case's world; never returns."""
    code = 1
    try:
        os.setsid()
        memory = int(case["memory"])
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        cpu = int(case["timeout"]) + 5
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, case["stdout"]), (2, case["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        os.chdir(case["cwd"])
        os.environ.clear()
        os.environ.update(case["env"])
        sys.argv = ["stepdeploy", *case["argv"]]
        from stepdeploy.cli.app import main

        try:
            main(case["argv"])
            code = 0
        except SystemExit as exc:  # what the interpreter would make of it
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
    except BaseException:  # an escaping exception: exactly what `python -m stepdeploy` would print
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):  # nothing left to report it to
                stream.flush()
        os._exit(code)


def run(case: dict) -> dict:
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(case)
    deadline, timed_out = started + float(case["timeout"]), False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            timed_out = True
            _kill_group(pid)
            done, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.005)
    _kill_group(pid)  # whatever the case started and left behind (ssh, ansible-playbook, torchrun)
    return {"rc": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
            "seconds": round(time.monotonic() - started, 3), "maxrss_kib": usage.ru_maxrss}


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def main() -> None:
    preload()
    protocol_in, protocol_out = sys.stdin, sys.stdout
    print(json.dumps({"ready": True}), file=protocol_out, flush=True)
    for line in protocol_in:
        if not line.strip():
            continue
        protocol_out.flush()
        result = run(json.loads(line))
        print(json.dumps(result), file=protocol_out, flush=True)


if __name__ == "__main__":
    main()
