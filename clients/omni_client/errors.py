"""Typed errors of the client: every failure a caller can meet is one of these.

`APIError` carries the server's OpenAI error body (`{"error": {message, type, param, code}}`);
`OmniConnectionError` means no usable answer came back (refused, reset, closed mid-stream);
`OmniTimeoutError` means the server went silent for longer than the client's `timeout`.

`translated(url)` is the one place where the HTTP library's exceptions become these, for the
blocking and the asyncio client alike (both run on httpx2, which raises the same types).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx2


class OmniError(Exception):
    """Base of every error raised by `omni_client`."""


class OmniUsageError(OmniError, ValueError):
    """The call itself is invalid before anything is sent (e.g. an unknown file extension)."""


class APIError(OmniError):
    """The server answered with an HTTP error status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @property
    def is_client_error(self) -> bool:
        """4xx: the request was wrong; retrying it unchanged will not help."""
        return 400 <= self.status < 500

    @classmethod
    def from_body(cls, status: int, body: bytes, reason: str = "") -> APIError:
        """Build from an error response; a body that is not OpenAI error JSON is kept as text."""
        try:
            error = json.loads(body)["error"]
            message = str(error["message"])
        except (ValueError, KeyError, TypeError):
            text = body.decode("utf-8", "replace").strip()
            return cls(status, text[:500] or reason or "no error message")
        fields: dict[str, Any] = error if isinstance(error, dict) else {}
        return cls(
            status,
            message,
            type=_str_or_none(fields.get("type")),
            param=_str_or_none(fields.get("param")),
            code=_str_or_none(fields.get("code")),
        )


class OmniConnectionError(OmniError, ConnectionError):
    """The server could not be reached, or the connection broke before the answer was complete."""


class OmniTimeoutError(OmniConnectionError, TimeoutError):
    """No byte arrived (or could be sent) within the client's timeout."""


@contextmanager
def translated(url: str) -> Iterator[None]:
    """Transport failures inside the block become typed errors naming the server."""
    try:
        yield
    except httpx2.TimeoutException as e:
        raise timed_out(url, e) from e
    except httpx2.ConnectError as e:
        raise cannot_connect(url, e) from e
    except httpx2.RemoteProtocolError as e:
        raise broken_off(url, str(e)) from e
    except httpx2.TransportError as e:
        raise OmniConnectionError(f"{url}: {type(e).__name__}: {e}") from e


# The wording of transport failures.


def timed_out(url: str, cause: BaseException) -> OmniTimeoutError:
    return OmniTimeoutError(f"{url}: timed out ({type(cause).__name__})")


def cannot_connect(url: str, cause: BaseException) -> OmniConnectionError:
    return OmniConnectionError(f"{url}: cannot connect ({cause})")


def broken_off(url: str, detail: str) -> OmniConnectionError:
    return OmniConnectionError(
        f"{url}: connection broken before the answer was complete ({detail})"
    )


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
