"""Run ON a node by the Fabric executor as `python3 -I -c SOURCE MODE RUN_DIR RUN_ID NODE_DIR [GRACE]`
(standard library only). Prints one JSON document.

poll: the launch script's state (running / exited / not started), the run's live processes, this node's name
      and clock, and the raw text of every rank's status and heartbeat file (at most MAX_BYTES each, bytes
      that are not UTF-8 replaced). The controller checks each of them (stepdeploy/noderecords.py, through
      poll_answer.py): what a rank wrote is judged there, so a broken file never breaks the probe.
stop: SIGTERM to the launch script's process group and to every process carrying this run's
      STEPDEPLOY_RUN_ID (the launcher's workers run in sessions of their own), wait up to GRACE seconds,
      SIGKILL what is left, then list what still exists (must be nothing).
"""

import json
import os
import re
import shlex
import signal
import stat
import sys
import time

mode, run_dir, run_id, node_dir = ([*sys.argv[1:5], "", "", "", ""])[:4]
tag = b"STEPDEPLOY_RUN_ID=" + run_id.encode() + b"\0"
MAX_BYTES = 65536  # read of one status, heartbeat, pid or exit code file (one byte more says "longer")
MAX_RANK_FILES = 4096
STOP_CHECK_S = 0.05  # a stop looks for what is left this often (one /proc scan, milliseconds): a restart waits on it
STATUS_NAME = re.compile(r"rank(\d{1,7})\.json")


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
    """At most MAX_BYTES + 1 of a regular file as text (None: missing or not a regular file); never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_BYTES + 1).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def small_int(text):
    text = (text or "").strip()
    digits = text[1:] if text.startswith("-") else text
    return int(text) if digits.isdigit() and len(digits) <= 9 else None


def launch_pid():
    pid = small_int(read(os.path.join(run_dir, node_dir, "launch.pid")))
    return pid if pid is not None and pid > 0 else None


def alive(pid):
    return pid is not None and pid in ours()


def poll():
    pid, code = launch_pid(), small_int(read(os.path.join(run_dir, node_dir, "exit_code")))
    live = ours()
    if pid is not None and pid in live:
        state = "running"
    elif code is not None:
        state = "exited"
    elif pid is None:
        state = "not-started"
    else:
        state = "exited"  # gone without an exit code: killed together with its group
    status_dir = os.path.join(run_dir, "out", "status")
    try:
        names = sorted(os.listdir(status_dir))[:MAX_RANK_FILES] if os.path.isdir(status_dir) else []
    except OSError:
        names = []
    ranks = []
    for name in names:
        match = STATUS_NAME.fullmatch(name)
        beat = read(os.path.join(run_dir, "out", "heartbeat", f"rank{match.group(1)}")) if match else None
        ranks.append({"file": name[:255], "status": read(os.path.join(status_dir, name)), "heartbeat": beat})
    return {"state": state, "exit_code": code if state == "exited" else None, "launch_pid": pid,
            "processes": live, "node": node_name(), "now": time.time(), "ranks": ranks}


def node_name():
    text = read(os.path.join(run_dir, node_dir, "env.sh")) or ""
    for line in text.splitlines():
        if line.startswith("export STEPDEPLOY_NODE_NAME="):
            try:
                return shlex.split(line.split("=", 1)[1])[0]
            except (ValueError, IndexError):
                return None
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
        time.sleep(STOP_CHECK_S)
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
