"""A TLS front for a plain HTTP server on loopback, as an operator's reverse proxy would be.

For clients that speak only `wss://`: ElevenLabs' SDK builds its WebSocket URL with `wss`
whatever its base URL says. The certificate is self-signed for 127.0.0.1; a client trusts it
through `SSL_CERT_FILE` (which Python's default SSL context reads when it is created).

Bytes are relayed as they come, both ways, by one asyncio loop on a thread of its own. Not a
thread per direction: an `ssl.SSLSocket` read in one thread while written in another is one
OpenSSL object used concurrently, which OpenSSL does not support (a TLS 1.3 read may write);
it stalled a handshake in CI once. asyncio's TLS runs on memory BIOs in one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
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
        self._loop = asyncio.new_event_loop()
        self._relays: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"https://127.0.0.1:{self.port}"

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._connect, "127.0.0.1", 0, ssl=self._context)

    async def _connect(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter):
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)  # close() cancels what is still relaying
        try:
            upstream_in, upstream_out = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_out.close()
            self._relays.discard(task)
            return
        try:
            await asyncio.gather(
                self._relay(client_in, upstream_out), self._relay(upstream_in, client_out)
            )
        finally:
            for end in (client_out, upstream_out):
                end.close()
            self._relays.discard(task)

    @staticmethod
    async def _relay(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Copy until the source ends, then end the sink's writing half (the peer's FIN),
        so the other direction runs until its own end."""
        with contextlib.suppress(OSError, ConnectionError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        with contextlib.suppress(OSError, RuntimeError):
            if sink.can_write_eof():
                sink.write_eof()
            else:
                sink.close()  # a TLS stream has no half close: end it whole

    async def _stop(self) -> None:
        self._server.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        await self._server.wait_closed()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> TlsProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
