"""A TLS front for a plain HTTP server on loopback, as an operator's reverse proxy would be.

For clients that speak only `wss://`: ElevenLabs' SDK builds its WebSocket URL with `wss`
whatever its base URL says. The certificate is self-signed for 127.0.0.1; a client trusts it
through `SSL_CERT_FILE` (which Python's default SSL context reads when it is created).

One thread a connection relays both directions, waiting on both sockets at once (selectors).
Not a thread a direction: an `ssl.SSLSocket` read in one thread while written in another is one
OpenSSL object used concurrently (OpenSSL's server writes its session tickets on the first read
or write after the handshake), and CI saw a handshake stall that way. Nor asyncio's TLS: a
client's request that arrives with its last handshake message sat unread in the SSL object
until more bytes came (reproduced here about 1 run in 15), a 10 s stall for a client that
waits for its answer. Here every read first takes what the SSL object already holds
(`pending()`), then waits on the sockets.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import selectors
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

    POLL_S = 0.2  # how often an idle relay looks whether the proxy is closing

    def __init__(self, upstream: tuple[str, int], certificate: Path, key: Path) -> None:
        self._upstream = upstream
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(certificate, key)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            thread = threading.Thread(target=self._connect, args=(client,), daemon=True)
            with self._lock:
                self._threads.append(thread)
            thread.start()

    def _connect(self, client: socket.socket) -> None:
        with contextlib.ExitStack() as ends:
            ends.callback(client.close)
            try:
                client.settimeout(10)  # the handshake's bound
                secure = self._context.wrap_socket(client, server_side=True)
                ends.callback(secure.close)
                upstream = socket.create_connection(self._upstream, timeout=10)
                ends.callback(upstream.close)
            except OSError:
                return
            with contextlib.suppress(OSError, ValueError):
                self._relay(secure, upstream)

    def _relay(self, secure: ssl.SSLSocket, upstream: socket.socket) -> None:
        """Both directions until both have ended; a direction's end (EOF) is passed on as a
        half close where the sink can take one (plain TCP), else the connection ends."""
        secure.settimeout(self.POLL_S)  # a read waits for a whole record at most this long
        upstream.settimeout(None)
        selector = selectors.DefaultSelector()
        with selector:
            selector.register(secure, selectors.EVENT_READ)
            selector.register(upstream, selectors.EVENT_READ)
            open_ = {secure, upstream}
            while open_ and not self._closing.is_set():
                held = secure in open_ and secure.pending() > 0  # decrypted, not yet read
                ready = [key.fileobj for key, _ in selector.select(0 if held else self.POLL_S)]
                if held or (not ready and secure in open_):
                    # an idle poll also asks the SSL object itself: bytes it took off the socket
                    # with a handshake record but has not decrypted show in neither pending()
                    # nor the selector (a full suite saw a 10 s handshake stall once more)
                    ready.append(secure)
                for source in dict.fromkeys(ready):
                    if source not in open_:
                        continue
                    try:
                        data = source.recv(65536)  # type: ignore[union-attr]
                    except (TimeoutError, ssl.SSLWantReadError):
                        continue  # a partial record: the rest comes with the next wake
                    if data:
                        self._send(upstream if source is secure else secure, data)
                        continue
                    open_.discard(source)  # type: ignore[arg-type]
                    selector.unregister(source)
                    if source is secure:
                        upstream.shutdown(socket.SHUT_WR)  # the client is done sending
                    else:
                        return  # the server is done: TLS has no half close, end it whole

    def _send(self, sink: socket.socket, data: bytes) -> None:
        """All of `data`, however slowly the peer reads (the poll timeout is for reads)."""
        timeout = sink.gettimeout()
        sink.settimeout(None)
        try:
            sink.sendall(data)
        finally:
            sink.settimeout(timeout)

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() waiting on it
        self._listener.close()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=10)

    def __enter__(self) -> TlsProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
