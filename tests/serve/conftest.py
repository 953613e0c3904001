"""The suite's one real server on the embedded repository (tests/conftest.py `embedded_server`)
for `tests/serve`; tests that need another topology or repository start their own. Clients are
the official `openai` package.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.helpers.server import ServerProcess


@pytest.fixture(scope="session")
def server(embedded_server: ServerProcess) -> ServerProcess:
    return embedded_server


@pytest.fixture(scope="session")
def client(server) -> OpenAI:
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
async def stand_in_runtime(tmp_path):
    """A started inline runtime serving the stand-in voice (tests/serve/inline.py)."""
    from tests.serve.inline import inline_runtime

    async with inline_runtime(tmp_path / "repo") as runtime:
        yield runtime


@pytest.fixture
def app_client(stand_in_runtime, aiohttp_client):
    """`await app_client(**ServeOptions fields)`: aiohttp's test client on a fresh app."""
    from omni_server.serve import create_app
    from omni_server.serve.options import ServeOptions

    async def make(**options):
        return await aiohttp_client(create_app(stand_in_runtime, options=ServeOptions(**options)))

    return make
