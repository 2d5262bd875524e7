"""A TCP forwarder between processes under test and a shared server (PostgreSQL, Redis): `down()`
cuts every relayed connection and refuses new ones until `up()`, so a test can take the server
away from its own processes without restarting the server other tests use."""
from __future__ import annotations

import contextlib
import socket
import threading


class TcpForwarder:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.accepted = 0

    def start(self) -> TcpForwarder:
        self.up()
        return self

    def up(self) -> None:
        """Listen (again, on the same port) and relay each connection to the target."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """Refuse new connections (nothing listens) and cut every relayed one."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            self._close(sock)

    stop = down

    @property
    def listening(self) -> bool:
        """Whether it relays (up) or refuses (down)."""
        return self._listener is not None

    @staticmethod
    def _close(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by down()
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                self._close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # taken down meanwhile
                    self._close(client)
                    self._close(server)
                    return
                self._open.update((client, server))
                self.accepted += 1
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):  # one side gone: the other goes too
            with self._lock:
                self._open.discard(sock)
            self._close(sock)
