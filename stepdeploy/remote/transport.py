"""The one transport: how preflight, the soak monitors (through an executor's run_command) and the executors
run commands and move files on a node, and how they do it on every node at once.

A `Channel` is one node: `run` a shell command under a deadline, `put`/`get` a file's bytes, `close`. Two kinds:
  SshChannel    Fabric over SSH, host keys verified (ssh.py); the connection opens on first use and is kept
  LocalChannel  this machine, no SSH (`--local`, `--executor local`, or ansible_connection=local)
`channel_for(node)` picks one from the inventory, with the same defaults everywhere (ssh.endpoint_for: the
inventory's ansible_user, else what ssh itself would use -- ~/.ssh/config's User, else the local user name).

`each(items, work, deadline_s)` runs `work` on every node at once and answers a per-node map {name: result or
the exception it raised}; a node still busy at the deadline gets a TimeoutError and is not waited for (a hung
node never hangs the others). Every command has its own deadline too (`CALL_TIMEOUT_S` unless the caller gives
another); a command past it answers `Ran(TIMED_OUT_RC, ..., timed_out=True)`.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from stepdeploy.inventory.model import Node

if TYPE_CHECKING:  # Fabric/paramiko take ~0.5 s to import: loaded when a connection is made
    from fabric import Connection

    from stepdeploy.remote.ssh import Endpoint

T = TypeVar("T")
Item = TypeVar("Item")
CALL_TIMEOUT_S = 60.0  # one command on one node, unless the caller says otherwise
CONNECT_TIMEOUT_S = 10
TIMED_OUT_RC = 124  # what coreutils `timeout` answers; a command past its deadline answers it too
MAX_PARALLEL = 64


@dataclass(frozen=True)
class Ran:
    """What one command answered: its exit status (TIMED_OUT_RC when it ran past its deadline) and output."""

    rc: int
    stdout: str
    stderr: str = ""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.rc == 0


class Channel(Protocol):
    """One node, as everything that runs commands on it sees it."""

    name: str

    @property
    def where(self) -> str: ...  # how it is reached, for messages: "10.0.0.2", "this machine"

    def run(self, command: str, timeout_s: float | None = CALL_TIMEOUT_S) -> Ran: ...

    def put(self, data: bytes, remote: str) -> None: ...

    def get(self, remote: str, limit: int | None = None) -> bytes: ...  # TooLarge past `limit` bytes

    def close(self) -> None: ...


class TooLarge(Exception):
    """A file a node sent is larger than the caller's limit (nothing of it is kept)."""


class _CappedBuffer(io.BytesIO):
    """A BytesIO that refuses to grow past `limit` bytes (what an SFTP download writes into)."""

    def __init__(self, remote: str, limit: int | None) -> None:
        super().__init__()
        self.remote, self.limit = remote, limit

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self.limit is not None and self.tell() + len(data) > self.limit:
            raise TooLarge(f"{self.remote} is larger than {self.limit:,} bytes")
        return super().write(data)


@dataclass
class LocalChannel:
    """This machine, no SSH. Each command runs under `sh -c` in a session of its own, so a deadline kills it
    and everything it started (a detached run leaves that session with setsid first). `env`: the environment
    commands get (None: the controller's own); `cwd`: where they start (None: the controller's directory)."""

    name: str
    env: Mapping[str, str] | None = None
    cwd: str | None = None

    @property
    def where(self) -> str:
        return "this machine"

    def run(self, command: str, timeout_s: float | None = CALL_TIMEOUT_S) -> Ran:
        proc = subprocess.Popen(["sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
                                env=None if self.env is None else dict(self.env), cwd=self.cwd)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            stdout, _ = proc.communicate()
            return Ran(TIMED_OUT_RC, stdout or "", f"timed out after {timeout_s:g} s", timed_out=True)
        except BaseException:  # interrupted: leave nothing of the command behind
            _kill_group(proc)
            proc.communicate()
            raise
        return Ran(proc.returncode, stdout, stderr)

    def put(self, data: bytes, remote: str) -> None:
        # O_NOFOLLOW: a link planted at the name is refused, never written through; 0600 until the caller says
        fd = os.open(remote, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    def get(self, remote: str, limit: int | None = None) -> bytes:
        fd = os.open(remote, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as handle:
            data = handle.read() if limit is None else handle.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise TooLarge(f"{remote} is larger than {limit:,} bytes")
        return data

    def close(self) -> None:
        return None


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@dataclass
class SshChannel:
    """One node over SSH (Fabric, host keys verified); the connection opens on first use, is kept for the
    calls after, and is dropped after a failure (the next call connects again)."""

    name: str
    endpoint: Endpoint
    connect_timeout_s: int = CONNECT_TIMEOUT_S
    _conn: Connection | None = field(default=None, repr=False)

    @property
    def where(self) -> str:
        return self.endpoint.host

    def _connection(self) -> Connection:
        if self._conn is None:
            from stepdeploy.remote.ssh import connection

            self._conn = connection(self.endpoint, connect_timeout=self.connect_timeout_s)
        return self._conn

    def run(self, command: str, timeout_s: float | None = CALL_TIMEOUT_S) -> Ran:
        from invoke.exceptions import CommandTimedOut

        try:
            res = self._connection().run(command, hide=True, warn=True, timeout=timeout_s)
        except CommandTimedOut as exc:
            self.close()
            return Ran(TIMED_OUT_RC, exc.result.stdout, f"timed out after {timeout_s:g} s", timed_out=True)
        except Exception:
            self.close()
            raise
        return Ran(res.exited, res.stdout, res.stderr)

    def put(self, data: bytes, remote: str) -> None:
        self._connection().put(io.BytesIO(data), remote)

    def get(self, remote: str, limit: int | None = None) -> bytes:
        buffer = _CappedBuffer(remote, limit)
        self._connection().get(remote, buffer)
        return buffer.getvalue()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


# What a run started on this machine keeps of the controller's environment: what an SSH login would give it, and
# the GPU and collective settings of this box (as `preflight --local` passes them on). The rest -- PYTHONPATH, a
# virtualenv, STEPDEPLOY_* -- stays with the controller, as it would on a node reached over SSH.
SESSION_KEYS = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
                "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
SESSION_PREFIXES = ("LC_", "NCCL_", "NVSHMEM_", "TORCH_SYMM", "GLOO_")


def session_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a command a local channel runs for an executor (see SESSION_KEYS)."""
    environ = os.environ if environ is None else environ
    kept = {k: v for k, v in environ.items() if k in SESSION_KEYS or k.startswith(SESSION_PREFIXES)}
    kept.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    return kept


def is_local(node: Node) -> bool:
    """Whether the inventory says the node is this machine (ansible_connection=local)."""
    return node.ssh.connection == "local"


def channel_for(node: Node, *, local: bool = False, connect_timeout_s: int = CONNECT_TIMEOUT_S,
                env: Mapping[str, str] | None = None) -> Channel:
    """The node's channel: this machine when `local` or the inventory says ansible_connection=local, else
    SSH with ssh.endpoint_for's defaults (the same for preflight, the monitors and the executors)."""
    if local or is_local(node):
        return LocalChannel(node.name, env=env)
    from stepdeploy.remote.ssh import endpoint_for

    return SshChannel(node.name, endpoint_for(node), connect_timeout_s)


def describe(exc: BaseException) -> str:
    """An exception as one line that names its type."""
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def each(items: Iterable[Item], work: Callable[[Item], T], deadline_s: float,
         name: Callable[[Item], str] = lambda item: item.name) -> dict[str, T | BaseException]:  # type: ignore[attr-defined]
    """work(item) for every node at once: {name: its answer, or the exception it raised}, in the items' order.
    An item still busy after `deadline_s` gets a TimeoutError; its thread is abandoned, not waited for."""
    chosen = list(items)
    pool = ThreadPoolExecutor(max_workers=max(1, min(MAX_PARALLEL, len(chosen))))
    futures = {name(item): pool.submit(work, item) for item in chosen}
    wait(futures.values(), timeout=deadline_s)
    results: dict[str, T | BaseException] = {}
    for key, fut in futures.items():
        if not fut.done():
            fut.cancel()
            results[key] = TimeoutError(f"no answer within {deadline_s:g} s")
        elif fut.exception() is not None:
            results[key] = fut.exception()  # type: ignore[assignment]
        else:
            results[key] = fut.result()
    pool.shutdown(wait=False, cancel_futures=True)
    return results


__all__ = ["CALL_TIMEOUT_S", "CONNECT_TIMEOUT_S", "TIMED_OUT_RC", "Channel", "LocalChannel", "Ran", "SshChannel",
           "TooLarge", "channel_for", "describe", "each", "is_local", "session_environment"]
