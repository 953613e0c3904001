"""How both clients use httpx2 alike: connection options and a request's body arguments.

`timeout` bounds each wait (connecting, sending, the gap between received bytes), not a whole
request: a long synthesis that keeps streaming never times out. Waiting for a pooled connection
is not bounded by it: with more requests than `max_connections`, the others queue behind
requests that are themselves bounded.
"""

from __future__ import annotations

from typing import Any

import httpx2

from omni_client import protocol


def client_options(
    base_url: str, api_key: str | None, timeout: float, max_connections: int
) -> dict[str, Any]:
    """Keyword arguments of `httpx2.Client` and `httpx2.AsyncClient`."""
    return {
        "base_url": base_url,
        "headers": protocol.auth_headers(api_key),
        "timeout": httpx2.Timeout(timeout, pool=None),
        "limits": httpx2.Limits(max_connections=max_connections),
    }


def body(request: protocol.Request) -> dict[str, Any]:
    """The body arguments of `stream(method, path, ...)`: JSON, a multipart form, or none."""
    if request.files is not None:
        return {"data": _form_fields(request.form), "files": request.files}
    if request.json is not None:
        return {"json": request.json}
    return {}


def _form_fields(form: list[tuple[str, str]]) -> dict[str, str | list[str]]:
    """httpx2 takes a repeated field (`timestamp_granularities[]`) as one name with a list."""
    fields: dict[str, str | list[str]] = {}
    for name, value in form:
        if name in fields:
            previous = fields[name]
            fields[name] = [*previous, value] if isinstance(previous, list) else [previous, value]
        else:
            fields[name] = value
    return fields
