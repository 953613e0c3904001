"""The suite's one real omni-server on the embedded repository (tests/conftest.py
`embedded_server`) for all client tests.

Set OMNI_CLIENT_TESTS_URL to run the tests against a server that is already running instead.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.server import free_port


@pytest.fixture(scope="package")
def server_url(request: pytest.FixtureRequest) -> str:
    external = os.environ.get("OMNI_CLIENT_TESTS_URL")
    if external:
        return external.rstrip("/")
    return request.getfixturevalue("embedded_server").url


@pytest.fixture
def unreachable_url() -> str:
    """A local port nothing listens on (connection refused at once)."""
    return f"http://127.0.0.1:{free_port()}"
