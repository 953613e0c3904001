"""A TLS front for a plain HTTP server on loopback, as an operator's reverse proxy would be.

For clients that speak only `wss://`: ElevenLabs' SDK builds its WebSocket URL with `wss`
whatever its base URL says. The certificate is self-signed for 127.0.0.1; a client trusts it
through `SSL_CERT_FILE` (which Python's default SSL context reads when it is created).
Bytes are relayed as they come, both ways, one thread per direction; `close()` ends them all.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import ssl
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) PEM files for 127.0.0.1, valid for a day."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


class TlsProxy:
    """`https://127.0.0.1:{port}` in front of `http://{host}:{port}` (`upstream`)."""

    def __init__(self, upstream: tuple[str, int], certificate: Path, key: Path) -> None:
        self._upstream = upstream
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(certificate, key)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            self._start(self._connect, client)

    def _connect(self, client: socket.socket) -> None:
        self._keep(client)
        try:
            secure = self._context.wrap_socket(client, server_side=True)
            upstream = socket.create_connection(self._upstream)
        except OSError:
            client.close()
            return
        self._keep(secure, upstream)
        self._start(self._relay, upstream, secure)
        self._relay(secure, upstream)

    def _relay(self, source: socket.socket, sink: socket.socket) -> None:
        """Copy until either side ends, then end both: shutdown, not just close, because the
        other direction's thread is blocked in recv() on them (a close alone would neither wake
        it nor send the FIN the peers wait for)."""
        with contextlib.suppress(OSError, ValueError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError, ValueError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _keep(self, *sockets: socket.socket) -> None:
        with self._lock:
            self._sockets.extend(sockets)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() waiting on it
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for end in sockets:
            with contextlib.suppress(OSError, ValueError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()
        for thread in threads:
            thread.join(timeout=10)

    def __enter__(self) -> TlsProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
