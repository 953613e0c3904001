"""A bare HTTP/1.1 endpoint on a real socket that records what clients send.

Not a stand-in for omni-server (the client tests run against the real one): it exists to observe
what the real server does not report back, namely the request headers a client sends and how many
TCP connections it opens, and to stall on purpose for timeout tests.
"""

from __future__ import annotations

import contextlib
import socket
import threading

REPLY = b'{"object": "list", "data": []}'


class RecordingServer:
    """Answers every request with an empty model list, keeping connections alive.

    `stall=True`: accepts connections but never answers (a client must time out).
    """

    def __init__(self, *, stall: bool = False) -> None:
        self.stall = stall
        self.requests: list[dict[str, str]] = []  # lower-cased header name -> value
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._accept_thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> RecordingServer:
        self._accept_thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() with an error (close does not)
        self._listener.close()
        for conn in self._sockets:
            with contextlib.suppress(OSError):  # the client may have closed it already
                conn.shutdown(socket.SHUT_RDWR)  # wakes a serving thread blocked in recv()
            conn.close()
        for thread in [self._accept_thread, *self._threads]:
            thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            self._sockets.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        try:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                headers = self._headers(head)
                length = int(headers.get("content-length", "0"))
                while len(buffer) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                buffer = buffer[length:]
                self.requests.append(headers)
                if self.stall:
                    self._stop.wait()
                    return
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(REPLY)}\r\n\r\n".encode()
                    + REPLY
                )
        except OSError:
            return  # closed by __exit__

    @staticmethod
    def _headers(head: bytes) -> dict[str, str]:
        lines = head.decode("latin-1").split("\r\n")[1:]
        pairs = (line.split(":", 1) for line in lines if ":" in line)
        return {name.strip().lower(): value.strip() for name, value in pairs}
