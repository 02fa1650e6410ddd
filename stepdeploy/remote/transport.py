"""The one transport: how preflight, the soak monitors (through an executor's run_command) and the executors
run commands and move files on a node, and how they do it on every node at once.

A `Channel` is one node: `run` a shell command under a deadline, `put`/`get` a file's bytes, `close`. Two kinds:
  SshChannel    Fabric over SSH, host keys verified (ssh.py); the connection opens on first use and is kept.
                Every operation is bounded as a whole, connecting included: a watchdog closes the connection (every
                hop) when the operation passes its bound, which ends whatever paramiko waits for (TCP connect,
                banner, key exchange, authentication, opening the session, the command, an SFTP transfer), so a
                node whose link went silent answers a timeout instead of holding its caller for minutes
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
import socket
import subprocess
import threading
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
CONNECT_TIMEOUT_S = 10  # TCP connect, SSH banner, authentication and opening a session, each
TRANSFER_TIMEOUT_S = 600.0  # one put or get (fetch's limit is 1 GiB a node: ~1.7 MB/s at least)
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

    def put(self, data: bytes, remote: str, timeout_s: float = TRANSFER_TIMEOUT_S) -> None: ...

    # TooLarge past `limit` bytes; TimeoutError (SSH) past `timeout_s`
    def get(self, remote: str, limit: int | None = None, timeout_s: float = TRANSFER_TIMEOUT_S) -> bytes: ...

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

    def put(self, data: bytes, remote: str, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        del timeout_s  # a local file: nothing to wait for
        # O_NOFOLLOW: a link planted at the name is refused, never written through; 0600 until the caller says
        fd = os.open(remote, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    def get(self, remote: str, limit: int | None = None, timeout_s: float = TRANSFER_TIMEOUT_S) -> bytes:
        del timeout_s
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


class SshTimeout(TimeoutError):
    """An SSH operation passed its bound (connecting included); the connection was closed to end it."""


@dataclass
class SshChannel:
    """One node over SSH (Fabric, host keys verified); the connection opens on first use, is kept for the
    calls after, and is dropped after a failure (the next call connects again).

    Bounds: a command gets `timeout_s` to run, plus `connect_timeout_s` when it must connect first; a transfer
    gets its `timeout_s` (plus the same). Past its bound the watchdog closes the connection from another thread:
    a command answers `Ran(TIMED_OUT_RC, ..., timed_out=True)`, a transfer raises SshTimeout. Every phase of
    connecting (TCP, banner, authentication, opening a session) is bounded by `connect_timeout_s` as well."""

    name: str
    endpoint: Endpoint
    connect_timeout_s: int = CONNECT_TIMEOUT_S
    _conn: Connection | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def where(self) -> str:
        return self.endpoint.host

    def _connection(self) -> Connection:
        with self._lock:
            if self._conn is None:
                from stepdeploy.remote.ssh import connection

                self._conn = connection(self.endpoint, connect_timeout=self.connect_timeout_s)
            return self._conn

    def _bounded(self, op: Callable[[Connection], T], limit_s: float | None, what: str) -> T:
        """op(connection) under a watchdog: past `limit_s` (plus the connect timeout when not yet connected) the
        connection is closed, which ends any wait inside paramiko; SshTimeout then. Any failure drops the
        connection (the next call connects again)."""
        conn = self._connection()
        bound = None if limit_s is None else limit_s + (0 if conn.is_connected else self.connect_timeout_s)
        expired = threading.Event()

        def fire() -> None:
            expired.set()
            _abort(conn)

        timer = threading.Timer(bound, fire) if bound is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            return op(conn)
        except Exception as exc:
            self._drop(conn)
            if expired.is_set():
                raise SshTimeout(f"{what} on {self.endpoint.host}: no answer within {bound:g} s") from None
            if isinstance(exc, (socket.timeout, TimeoutError)) and not isinstance(exc, SshTimeout):
                raise SshTimeout(f"{what} on {self.endpoint.host}: {describe(exc)}") from None
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def run(self, command: str, timeout_s: float | None = CALL_TIMEOUT_S) -> Ran:
        from invoke.exceptions import CommandTimedOut

        def op(conn: Connection) -> Ran:
            try:
                res = conn.run(command, hide=True, warn=True, timeout=timeout_s)
            except CommandTimedOut as exc:  # invoke's own timer closed the session: the connection goes too
                self._drop(conn)
                return Ran(TIMED_OUT_RC, exc.result.stdout, f"timed out after {timeout_s:g} s", timed_out=True)
            return Ran(res.exited, res.stdout, res.stderr)

        # a little past the command's own timeout: invoke's timer, which keeps what the command printed, goes first
        try:
            return self._bounded(op, None if timeout_s is None else timeout_s + 2, "command")
        except SshTimeout as exc:
            return Ran(TIMED_OUT_RC, "", str(exc), timed_out=True)

    def put(self, data: bytes, remote: str, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        self._bounded(lambda conn: conn.put(io.BytesIO(data), remote), timeout_s, f"upload of {remote}")

    def get(self, remote: str, limit: int | None = None, timeout_s: float = TRANSFER_TIMEOUT_S) -> bytes:
        buffer = _CappedBuffer(remote, limit)
        self._bounded(lambda conn: conn.get(remote, buffer), timeout_s, f"download of {remote}")
        return buffer.getvalue()

    def _drop(self, conn: Connection) -> None:
        """Forget `conn` (if it is still ours) and close it, without waiting on a silent peer."""
        with self._lock:
            if self._conn is conn:
                self._conn = None
        _abort(conn)

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            _abort(conn)


def _abort(conn: Connection) -> None:
    """Close a connection and every jump connection behind it, from any thread: the SFTP session, then the
    paramiko client (its transport thread notices within 0.1 s; every channel's waiter is woken). Closing sends
    at most one message into the socket's buffer, never waits for the peer."""
    from fabric import Connection

    hop: object = conn
    while isinstance(hop, Connection):
        sftp, hop._sftp = hop._sftp, None
        with contextlib.suppress(Exception):
            if sftp is not None:
                sftp.close()
        with contextlib.suppress(Exception):
            hop.client.close()
        hop = hop.gateway


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
