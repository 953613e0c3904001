"""The door: API key, CORS and Origin, Host names (DNS rebinding), the Server header."""

from __future__ import annotations

import pytest

from omni_server.serve.access import host_name, loopback_hosts
from tests.serve.inline import SPEECH

pytestmark = pytest.mark.timeout(60)

KEY = "sk-test-0123456789abcdef"
BEARER = {"Authorization": f"Bearer {KEY}"}


async def test_without_a_key_configured_everything_is_open(app_client):
    client = await app_client()
    assert (await client.post("/v1/audio/speech", json=SPEECH)).status == 200
    assert (await client.get("/v1/models")).status == 200


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/quiet", "/health", "/metrics"])
async def test_every_api_route_needs_the_key(app_client, path):
    client = await app_client(api_key=KEY)
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
        response = await client.get(path, headers=headers)
        assert response.status == 401
        assert response.headers["WWW-Authenticate"] == "Bearer"
        error = (await response.json())["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert "sk-wrong" not in error["message"]  # a wrong key is never echoed
    assert (await client.get(path, headers=BEARER)).status == 200


async def test_speech_needs_the_key_and_works_with_it(app_client):
    client = await app_client(api_key=KEY)
    refused = await client.post("/v1/audio/speech", json=SPEECH)
    assert refused.status == 401
    answered = await client.post("/v1/audio/speech", json=SPEECH, headers=BEARER)
    assert answered.status == 200 and await answered.read() == bytes(1440)
    metrics = await (await client.get("/metrics", headers=BEARER)).text()
    assert 'omni_http_rejections_total{reason="unauthorized"} 1.0' in metrics


async def test_probes_stay_open_and_metrics_open_on_request(app_client):
    client = await app_client(api_key=KEY)
    assert (await client.get("/health/live")).status == 200
    assert (await client.get("/health/ready")).status == 200
    assert (await client.get("/metrics")).status == 401
    open_metrics = await app_client(api_key=KEY, metrics_need_key=False)
    assert (await open_metrics.get("/metrics")).status == 200
    assert (await open_metrics.get("/health")).status == 401


async def test_websocket_clients_may_send_the_key_as_a_subprotocol(app_client):
    client = await app_client(api_key=KEY)
    protocol = {"Sec-WebSocket-Protocol": f"realtime, openai-insecure-api-key.{KEY}"}
    assert (await client.get("/v1/models", headers=protocol)).status == 200


async def test_no_cors_headers_and_foreign_origins_refused_by_default(app_client):
    client = await app_client()
    plain = await client.post("/v1/audio/speech", json=SPEECH)
    assert not [h for h in plain.headers if h.lower().startswith("access-control-")]
    # a page elsewhere posting text/plain needs no preflight: the Origin check stops it
    foreign = await client.post(
        "/v1/audio/speech",
        data=b'{"model": "quiet", "input": "hello"}',
        headers={"Origin": "https://evil.example", "Content-Type": "text/plain"},
    )
    assert foreign.status == 403
    assert (await foreign.json())["error"]["code"] == "origin_not_allowed"
    assert "Access-Control-Allow-Origin" not in foreign.headers
    preflight = await client.options(
        "/v1/audio/speech",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status == 403 and "Access-Control-Allow-Origin" not in preflight.headers
    # the server's own pages (the playground) are same-origin
    own = f"http://{client.server.host}:{client.server.port}"
    same = await client.post("/v1/audio/speech", json=SPEECH, headers={"Origin": own})
    assert same.status == 200 and "Access-Control-Allow-Origin" not in same.headers


async def test_allowed_origins_get_preflight_and_cors_headers(app_client):
    app = "https://app.example"
    client = await app_client(allowed_origins=(app,), api_key=KEY)
    preflight = await client.options(
        "/v1/audio/speech",
        headers={
            "Origin": app,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        },
    )
    assert preflight.status == 204  # no key: browsers send none on a preflight
    assert preflight.headers["Access-Control-Allow-Origin"] == app
    assert preflight.headers["Access-Control-Allow-Methods"] == "POST"
    assert "authorization" in preflight.headers["Access-Control-Allow-Headers"]
    assert preflight.headers["Vary"] == "Origin"
    wrong_method = await client.options(
        "/v1/audio/speech", headers={"Origin": app, "Access-Control-Request-Method": "DELETE"}
    )
    assert wrong_method.status == 405
    answered = await client.post("/v1/audio/speech", json=SPEECH, headers={"Origin": app, **BEARER})
    assert answered.status == 200
    assert answered.headers["Access-Control-Allow-Origin"] == app
    assert "X-Request-Id" in answered.headers["Access-Control-Expose-Headers"]
    # errors carry the headers too, so the page can read them
    refused = await client.post("/v1/audio/speech", json=SPEECH, headers={"Origin": app})
    assert refused.status == 401 and refused.headers["Access-Control-Allow-Origin"] == app
    other = await client.post(
        "/v1/audio/speech", json=SPEECH, headers={"Origin": "https://other.example", **BEARER}
    )
    assert other.status == 403


async def test_foreign_host_is_refused_when_bound_to_loopback(app_client):
    client = await app_client(allowed_hosts=loopback_hosts("127.0.0.1"))
    for host in ("rebound.evil.example:8000", "evil.example", "127.0.0.2"):
        response = await client.post("/v1/audio/speech", json=SPEECH, headers={"Host": host})
        assert response.status == 403, host
        assert (await response.json())["error"]["code"] == "host_not_allowed"
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST."):
        response = await client.get("/v1/models", headers={"Host": host})
        assert response.status == 200, host


def test_loopback_hosts_and_host_names():
    assert loopback_hosts("0.0.0.0") is None
    assert loopback_hosts("192.168.1.4") is None
    assert "localhost" in loopback_hosts("::1")
    assert "127.0.0.5" in loopback_hosts("127.0.0.5")
    assert host_name("[::1]:8000") == "::1"
    assert host_name("Example.COM.:80") == "example.com"
    assert host_name("::1") == "::1"


async def test_server_header_names_no_version(app_client):
    client = await app_client()
    for response in (
        await client.get("/v1/models"),
        await client.get("/no/such/route"),
        await client.post("/v1/audio/speech", json=SPEECH),
    ):
        assert response.headers["Server"] == "omni-server"
