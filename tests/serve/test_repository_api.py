"""The repository API's HTTP side: Triton's shapes, OpenAI's error JSON, the option that turns
it off. Model control runs over inline runtimes of the stand-in stage (real compiler, real
runtime, real app; no stage processes: their side is tests/serve/test_model_control_server.py).
"""

from __future__ import annotations

import pytest

from omni_server.pipeline import ControlMode, ModelControl, Runtime
from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def control(tmp_path):
    stage = toml("""
        backend = "StandIn"
        terminal = true
        [scheduler]
        kind = "stream"
        """)
    root = make_repo(
        tmp_path / "repo",
        stages={"a": stage, "b": stage},
        repository=toml("""
            [models.first]
            entry = "a"
            tasks = ["speech"]
            aliases = ["one"]
            voices = ["v"]
            [models.second]
            entry = "b"
            tasks = ["speech"]
            voices = ["v"]
            """),
        models={"a": FIXTURES / "serve_stand_in.py", "b": FIXTURES / "serve_stand_in.py"},
    )
    control = ModelControl(
        root,
        mode=ControlMode.EXPLICIT,
        load=["first"],
        runtime=lambda plan: Runtime(plan, inline=True),
    )
    await control.start()
    yield control
    await control.stop()


async def test_index_load_unload_round_trip(control, aiohttp_client):
    client = await aiohttp_client(create_app(control))
    response = await client.post("/v2/repository/index")
    assert response.status == 200
    assert await response.json() == [
        {"name": "first", "state": "READY", "version": "1", "reason": ""},
        {"name": "second", "state": "UNAVAILABLE", "reason": "not loaded"},
    ]
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["first"]

    response = await client.post("/v2/repository/models/second/load", json={})
    assert (response.status, await response.read()) == (200, b"")
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["first", "second"]
    ready = await (await client.post("/v2/repository/index", json={"ready": True})).json()
    assert [e["name"] for e in ready] == ["first", "second"]

    speech = {"model": "second", "input": "hello", "voice": "v", "response_format": "pcm"}
    response = await client.post("/v1/audio/speech", json=speech)
    assert response.status == 200 and len(await response.read()) == 3 * 480

    response = await client.post(  # by alias, as every endpoint takes it
        "/v2/repository/models/one/unload", json={"parameters": {"unload_dependents": False}}
    )
    assert response.status == 200
    response = await client.post("/v1/audio/speech", json={**speech, "model": "first"})
    assert response.status == 404
    assert (await response.json())["error"]["code"] == "model_not_found"
    index = await (await client.post("/v2/repository/index")).json()
    assert index[0] == {"name": "first", "state": "UNAVAILABLE", "reason": "unloaded"}
    health = await (await client.get("/health")).json()
    assert health["models"] == ["second"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v2/repository/index", b"[1]", 400, None),
        ("/v2/repository/index", b"{not json", 400, None),
        ("/v2/repository/index", b'{"ready": "yes"}', 400, "ready"),
        ("/v2/repository/index", b'{"repository_name": "other"}', 404, "repository_name"),
        # the probe's null (issue 42.5): no repository name, not the field left out
        ("/v2/repository/index", b'{"repository_name": null}', 400, "repository_name"),
        ("/v2/repository/index", b'{"repository_name": 0}', 400, "repository_name"),
        ("/v2/repository/index", b'{"ready": null}', 400, "ready"),
        ("/v2/repository/models/first/load", b'{"parameters": null}', 400, "parameters"),
        (
            "/v2/repository/models/first/unload",
            b'{"parameters": {"unload_dependents": null}}',
            400,
            "parameters.unload_dependents",
        ),
        (
            "/v2/repository/models/first/load",
            b'{"parameters": {"config": "{"}}',
            400,
            "parameters.config",
        ),
        (
            "/v2/repository/models/first/load",
            b'{"parameters": {"config": "[1]"}}',
            400,
            "parameters.config",
        ),
        ("/v2/repository/models/first/load", b'{"parameters": {"nope": 1}}', 400, None),
        ("/v2/repository/models/nope/load", b"", 404, None),
        ("/v2/repository/models/nope/unload", b"", 404, None),
    ],
)
async def test_bad_calls_get_openai_errors(control, aiohttp_client, path, body, status, param):
    client = await aiohttp_client(create_app(control))
    response = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert response.status == status
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param


async def test_a_bad_config_override_is_the_compilers_400(control, aiohttp_client):
    client = await aiohttp_client(create_app(control))
    body = {"parameters": {"config": {"stages.a.no_such_field": 1}}}
    response = await client.post("/v2/repository/models/first/load", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "invalid_repository"
    assert "no_such_field" in error["message"]
    index = await (await client.post("/v2/repository/index")).json()
    assert index[0]["state"] == "READY" and "no_such_field" in index[0]["reason"]


async def test_the_api_can_be_disabled_and_the_key_guards_it(control, aiohttp_client):
    off = await aiohttp_client(create_app(control, options=ServeOptions(repository_api=False)))
    assert (await off.post("/v2/repository/index")).status == 404
    doc = await (await off.get("/openapi.json")).json()
    assert not [p for p in doc["paths"] if p.startswith("/v2/")]

    keyed = await aiohttp_client(create_app(control, options=ServeOptions(api_key="k" * 24)))
    assert (await keyed.post("/v2/repository/index")).status == 401
    response = await keyed.post(
        "/v2/repository/index", headers={"Authorization": "Bearer " + "k" * 24}
    )
    assert response.status == 200
    doc = await (await keyed.get("/openapi.json")).json()
    assert "401" in doc["paths"]["/v2/repository/models/{model}/load"]["post"]["responses"]


async def test_none_mode_refuses_load_and_unload(control, aiohttp_client):
    fixed = ModelControl(control.repository, mode=ControlMode.NONE)
    # none mode is served by a plain Runtime (server.py); ModelControl refuses the same way
    with pytest.raises(Exception, match="not allowed in model control mode 'none'"):
        await fixed.load("first")


async def test_a_loads_config_lasts_until_the_models_next_load(control, aiohttp_client):
    client = await aiohttp_client(create_app(control))
    body = {"parameters": {"config": '{"stages.a.parameters.tone": 3}'}}  # JSON text, as Triton
    assert (await client.post("/v2/repository/models/first/load", json=body)).status == 200
    assert control.plan.stages["a"].parameters == {"tone": 3}
    version = control.generations()["first"]
    assert (await client.post("/v2/repository/models/second/load")).status == 200
    assert control.plan.stages["a"].parameters == {"tone": 3}  # another model's load keeps it
    assert control.generations()["first"] == version  # and does not touch its group
    assert (await client.post("/v2/repository/models/first/load")).status == 200
    assert control.plan.stages["a"].parameters == {}  # the files again
    assert control.generations()["first"] > version


class GatedRuntime(Runtime):
    """A real inline runtime whose start first waits for the test's gate: it holds a model in
    LOADING as long as the test needs (the stand-in for a slow `initialize`)."""

    def __init__(self, plan, gate):
        super().__init__(plan, inline=True)
        self._gate = gate

    async def start(self) -> None:
        await self._gate.wait()
        await super().start()


async def test_a_loading_model_answers_503_with_retry_after_on_its_routes(control, aiohttp_client):
    """Issue 42.4: requests naming a model whose load is under way got 404 model_not_found;
    the model exists and is coming, so every route naming it says 503 `model_loading` with
    Retry-After, and the index says LOADING, until the load answers and it serves."""
    import asyncio

    gate = asyncio.Event()

    def runtime(plan):
        return GatedRuntime(plan, gate) if "second" in plan.models else Runtime(plan, inline=True)

    loading = ModelControl(
        control.repository, mode=ControlMode.EXPLICIT, load=["first"], runtime=runtime
    )
    await loading.start()
    try:
        client = await aiohttp_client(create_app(loading))
        call = asyncio.ensure_future(client.post("/v2/repository/models/second/load"))
        for _ in range(200):  # until the load has compiled and started the generation
            index = {e["name"]: e for e in loading.index()}
            if index["second"]["state"] == "LOADING":
                break
            await asyncio.sleep(0.01)
        assert index["second"]["state"] == "LOADING", index
        speech = {"model": "second", "input": "hello", "voice": "v", "response_format": "pcm"}
        chat = {"model": "second", "messages": [{"role": "user", "content": "hi"}]}
        answers = [
            await client.post("/v1/audio/speech", json=speech),
            await client.post("/v1/chat/completions", json=chat),
            await client.get("/v1/models/second"),
            await client.get("/v1/audio/voices", params={"model": "second"}),
            await client.get("/v1/realtime", params={"model": "second"}),
        ]
        for response in answers:
            assert response.status == 503, (response.url, await response.text())
            assert int(response.headers["Retry-After"]) > 0
            error = (await response.json())["error"]
            assert (error["code"], error["param"]) == ("model_loading", "model"), error
            assert "loading" in error["message"]
        listed = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in listed["data"]] == ["first"]  # what serves now
        gone = await client.post("/v1/audio/speech", json={**speech, "model": "nope"})
        assert gone.status == 404  # a name that is no model is still a 404

        gate.set()
        assert (await call).status == 200
        assert {e["name"]: e["state"] for e in loading.index()}["second"] == "READY"
        response = await client.post("/v1/audio/speech", json=speech)
        assert response.status == 200 and len(await response.read()) == 3 * 480
    finally:
        gate.set()
        await loading.stop()


async def test_a_load_may_not_fork_more_processes_than_the_machine_has_cores(
    control, aiohttp_client
):
    """Issue 42.2, the probe's body: `processes.<p>.num_replicas: 6` on a machine of two cores
    is the compiler's 400 naming the file and field; nothing starts, the old version serves."""
    from omni_server.compiler.compiler import compile_repository
    from omni_server.compiler.plan import MachineFacts

    machine = MachineFacts(cpus=2, memory_bytes=8 << 30)
    bounded = ModelControl(
        control.repository,
        plan=compile_repository(control.repository, machine=machine),
        mode=ControlMode.EXPLICIT,
        load=["first"],
        runtime=lambda plan: Runtime(plan, inline=True),
    )
    await bounded.start()
    try:
        client = await aiohttp_client(create_app(bounded))
        version = bounded.generations()["first"]
        body = {"parameters": {"config": {"processes.a.num_replicas": 6}}}
        response = await client.post("/v2/repository/models/first/load", json=body)
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["code"] == "invalid_repository"
        assert "repository.toml, field 'processes.a.num_replicas'" in error["message"]
        assert "2 CPU cores" in error["message"] and "at most 2 replicas" in error["message"]
        assert bounded.generations() == {"first": version}  # nothing was started
        assert bounded.plan.processes["a"].num_replicas == 1
        body = {"parameters": {"config": {"processes.a.num_replicas": 2}}}  # what fits
        assert (await client.post("/v2/repository/models/first/load", json=body)).status == 200
        assert bounded.plan.processes["a"].num_replicas == 2
    finally:
        await bounded.stop()
