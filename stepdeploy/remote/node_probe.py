"""Run ON a node by the Fabric executor as `python3 -I -c SOURCE MODE RUN_DIR RUN_ID NODE_DIR [GRACE]`
(standard library only). Prints one JSON document.

poll: the launch script's state (running / exited with code / not started) and every rank's status file,
      with the rank's process checked for life (a status that says running over a dead pid = died).
stop: SIGTERM to the launch script's process group and to every process carrying this run's
      STEPDEPLOY_RUN_ID (torchrun's workers run in sessions of their own), wait up to GRACE seconds,
      SIGKILL what is left, then list what still exists (must be nothing).
"""

import json
import os
import shlex
import signal
import sys
import time

mode, run_dir, run_id, node_dir = ([*sys.argv[1:5], "", "", "", ""])[:4]
tag = b"STEPDEPLOY_RUN_ID=" + run_id.encode() + b"\0"


def ours():
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                environ = b"\0" + handle.read()
            with open(f"/proc/{name}/stat") as handle:
                zombie = handle.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if b"\0" + tag in environ and not zombie:
            pids.append(int(name))
    return sorted(pids)


def read(path):
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def launch_pid():
    text = read(os.path.join(run_dir, node_dir, "launch.pid"))
    return int(text) if text and text.strip().isdigit() else None


def alive(pid):
    return pid is not None and pid in ours()


def poll():
    pid, code = launch_pid(), read(os.path.join(run_dir, node_dir, "exit_code"))
    live = ours()
    if pid is not None and pid in live:
        state = "running"
    elif code is not None and code.strip().lstrip("-").isdigit():
        state = "exited"
    elif pid is None:
        state = "not-started"
    else:
        state = "exited"  # gone without an exit code: killed together with its group
    ranks, here = [], node_name()
    status_dir = os.path.join(run_dir, "out", "status")
    for name in sorted(os.listdir(status_dir)) if os.path.isdir(status_dir) else []:
        status = json.loads(read(os.path.join(status_dir, name)) or "{}")
        if status.get("node") not in (None, here):  # a shared run directory holds other nodes' ranks too
            continue
        beat = json.loads(read(os.path.join(run_dir, "out", "heartbeat", f"rank{status.get('rank')}")) or "{}")
        if status.get("state") == "running" and status.get("pid") not in live:
            status["state"] = "died"
        status["iteration"] = beat.get("iteration")
        status["heartbeat_age_s"] = round(time.time() - beat["time"], 2) if "time" in beat else None
        ranks.append(status)
    return {"state": state, "exit_code": int(code) if code and state == "exited" else None,
            "launch_pid": pid, "processes": live, "ranks": ranks}


def node_name():
    text = read(os.path.join(run_dir, node_dir, "env.sh")) or ""
    for line in text.splitlines():
        if line.startswith("export STEPDEPLOY_NODE_NAME="):
            return shlex.split(line.split("=", 1)[1])[0]
    return None


def signal_all(sig, pids):
    done = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            done.append(pid)
        except ProcessLookupError:
            pass
    return done


def stop(grace):
    pid = launch_pid()
    signalled = []
    if pid is not None and alive(pid):
        try:
            os.killpg(os.getpgid(pid), signal.SIGTERM)
            signalled.append(pid)
        except ProcessLookupError:
            pass
    signalled += signal_all(signal.SIGTERM, ours())
    deadline = time.monotonic() + grace
    while ours() and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = signal_all(signal.SIGKILL, ours())
    deadline = time.monotonic() + 5
    while ours() and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"signalled": sorted(set(signalled)), "killed": killed, "left": ours()}


if __name__ == "__main__":
    if mode == "poll":
        print(json.dumps(poll()))
    elif mode == "stop":
        print(json.dumps(stop(float(sys.argv[5]))))
    else:
        print(json.dumps({"error": f"unknown mode {mode!r}; use poll or stop"}))
