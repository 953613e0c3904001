"""One real server on the embedded repository for the whole `tests/serve` run.

Starting it costs seconds (stage processes load the voice), so it is session-scoped; tests that
need another topology or repository start their own. Clients are the official `openai` package.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.helpers.server import EMBEDDED_REPO, ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess.start(EMBEDDED_REPO, log) as running:
        yield running


@pytest.fixture(scope="session")
def client(server) -> OpenAI:
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
