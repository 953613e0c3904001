"""A blocking WebSocket client on a plain socket, for what library clients hide: it sends one
frame whole (as a client that does not read while it sends, like the issue-42 probe's) and
then reads the server's frames up to its close frame. A connection the server resets raises
(ConnectionResetError / BrokenPipeError) instead of passing for a close."""

from __future__ import annotations

import base64
import socket
import struct

import numpy as np

OP_CLOSE = 0x8


def masked_text_frame(payload: bytes) -> bytes:
    """One client text frame (FIN, masked, 64-bit length) as RFC 6455 lays it out."""
    mask = bytes([0x5A, 0xC3, 0x3C, 0xA5])
    head = bytes([0x81, 0x80 | 127]) + struct.pack(">Q", len(payload))
    tiled = np.frombuffer(mask * (len(payload) // 4 + 1), np.uint8)[: len(payload)]
    return head + mask + (np.frombuffer(payload, np.uint8) ^ tiled).tobytes()


def send_then_read_close(port: int, path: str, frame: bytes) -> tuple[int, bytes]:
    """Upgrade `path` on 127.0.0.1:`port`, send `frame` whole, then read the server's frames
    up to its close frame: (its code, its reason)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        key = base64.b64encode(bytes(16)).decode()
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        received = b""
        while b"\r\n\r\n" not in received:
            received += _more(sock)
        head, received = received.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head
        sock.sendall(frame)
        while True:
            opcode, payload, received = _frame(sock, received)
            if opcode == OP_CLOSE:
                return struct.unpack(">H", payload[:2])[0], payload[2:]


def _frame(sock: socket.socket, buffer: bytes) -> tuple[int, bytes, bytes]:
    """The next server frame (unmasked): (opcode, payload, the bytes after it)."""
    while len(buffer) < 2:
        buffer += _more(sock)
    length, start = buffer[1] & 0x7F, 2
    if length >= 126:
        size = 2 if length == 126 else 8
        while len(buffer) < 2 + size:
            buffer += _more(sock)
        length = int.from_bytes(buffer[2 : 2 + size], "big")
        start += size
    while len(buffer) < start + length:
        buffer += _more(sock)
    return buffer[0] & 0x0F, buffer[start : start + length], buffer[start + length :]


def _more(sock: socket.socket) -> bytes:
    data = sock.recv(1 << 16)
    if not data:
        raise ConnectionError("the server closed the connection without a close frame")
    return data
