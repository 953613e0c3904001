"""One real omni-server process for all client tests (`python -m omni_server --repo repository`).

Set OMNI_CLIENT_TESTS_URL to run the tests against a server that is already running instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.helpers.server import EMBEDDED_REPO, ServerProcess, free_port


@pytest.fixture(scope="package")
def server_url(tmp_path_factory) -> Iterator[str]:
    external = os.environ.get("OMNI_CLIENT_TESTS_URL")
    if external:
        yield external.rstrip("/")
        return
    log = tmp_path_factory.mktemp("omni-server") / "server.log"
    with ServerProcess.start(EMBEDDED_REPO, log) as server:
        yield server.url


@pytest.fixture
def unreachable_url() -> str:
    """A local port nothing listens on (connection refused at once)."""
    return f"http://127.0.0.1:{free_port()}"
