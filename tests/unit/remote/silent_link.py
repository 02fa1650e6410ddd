"""A real SSH server in this process (paramiko's server side) behind a TCP relay whose link can go silent, for the
SSH bounds' tests: while `Link.silent` is set the relay passes nothing either way and answers nothing (as a node
whose cable was pulled: no reset, no FIN, the bytes wait), and a new connection gets no banner. Commands run on
this machine under `sh -c`. The client's key, the server's host key and a known_hosts naming it are written to
`tmp`; `endpoint` reaches the server through the relay with host keys verified."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import paramiko

from stepdeploy.remote.ssh import Endpoint


class _Server(paramiko.ServerInterface):
    def __init__(self, client_key: paramiko.PKey) -> None:
        self.client_key = client_key

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL if key == self.client_key else paramiko.AUTH_FAILED

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        threading.Thread(target=_execute, args=(channel, command.decode()), daemon=True).start()
        return True


def _execute(channel: paramiko.Channel, command: str) -> None:
    # paramiko answers the exec request after check_channel_exec_request returns: an answer and close sent before
    # it would read to the client as "Channel closed" (a real sshd never does that)
    time.sleep(0.2)
    with contextlib.suppress(Exception):
        proc = subprocess.run(["sh", "-c", command], capture_output=True, stdin=subprocess.DEVNULL, timeout=120,
                              check=False)
        channel.sendall(proc.stdout)
        channel.sendall_stderr(proc.stderr)
        channel.send_exit_status(proc.returncode)
        channel.close()


class Link:
    """The SSH server and its relay; `silent` set: nothing passes, new connections get nothing."""

    def __init__(self, tmp: Path) -> None:
        self.silent = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._transports: list[paramiko.Transport] = []
        self.host_key = paramiko.RSAKey.generate(2048)
        client = paramiko.RSAKey.generate(2048)
        self.key_file = tmp / "client_key"
        client.write_private_key_file(str(self.key_file))
        self._server = _Server(paramiko.RSAKey(filename=str(self.key_file)))
        self._sshd = self._listen()
        self._relay = self._listen()
        self.port = self._relay.getsockname()[1]
        self.known_hosts = tmp / "known_hosts"
        key = f"{self.host_key.get_name()} {self.host_key.get_base64()}"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {key}\n")
        for loop in (self._serve, self._relay_loop):
            threading.Thread(target=loop, daemon=True).start()

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(host="127.0.0.1", user="tester", port=self.port, key_file=self.key_file,
                        known_hosts=self.known_hosts)

    def _listen(self) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        self._sockets.append(sock)
        return sock

    def _accept_each(self, listener: socket.socket, handle: Callable[[socket.socket], None]) -> None:
        """`handle` every connection `listener` accepts, until it is closed."""
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            handle(conn)

    def _serve(self) -> None:
        self._accept_each(self._sshd, self._open_transport)

    def _open_transport(self, conn: socket.socket) -> None:
        transport = paramiko.Transport(conn)
        transport.add_server_key(self.host_key)
        self._transports.append(transport)
        threading.Thread(target=self._negotiate, args=(transport,), daemon=True).start()

    def _negotiate(self, transport: paramiko.Transport) -> None:  # one at a time would let a stuck client block all
        with contextlib.suppress(Exception):
            transport.start_server(server=self._server)

    def _relay_loop(self) -> None:
        self._accept_each(self._relay, self._relay_one)

    def _relay_one(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self._sshd.getsockname())
        self._sockets += [client, upstream]
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self._closed.is_set():
                while self.silent.is_set() and not self._closed.is_set():
                    time.sleep(0.05)  # a pulled cable: nothing read, nothing sent, nothing refused
                data = src.recv(65536)
                if not data:
                    break
                while self.silent.is_set() and not self._closed.is_set():
                    time.sleep(0.05)
                dst.sendall(data)

    def close(self) -> None:
        self._closed.set()
        self.silent.clear()
        for transport in self._transports:
            with contextlib.suppress(Exception):
                transport.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
