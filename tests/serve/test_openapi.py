"""`/openapi.json` is true to the app's routes, and a property-based fuzz of the HTTP API built
from it finds no 5xx.

The fuzz runs against a real server process whose models are the stand-in voice of
tests/fixtures/silence.py (three 10 ms chunks of silence for any text) and the stand-in
cloning voice of tests/fixtures/cloning_voice.py (for custom voices, kept in a data directory
of the test's), so every request that passes validation is served for real, fast. Each
operation gets request bodies generated from its schema, the same with one field replaced by
an arbitrary JSON value, arbitrary JSON, and arbitrary bytes. Examples are bounded and
derandomized: the run is the same every time.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate

from omni_server.serve import create_app
from omni_server.serve.chat_body import ChatBody
from omni_server.serve.openapi import document
from omni_server.serve.speech_request import SpeechBody
from omni_server.serve.state import STATE
from omni_server.serve.transcription_request import TranscriptionForm
from omni_server.serve.voices import VoiceForm
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


async def test_the_document_lists_exactly_the_app_routes(stand_in_runtime, aiohttp_client):
    app = create_app(stand_in_runtime)
    client = await aiohttp_client(app)
    response = await client.get("/openapi.json")
    assert response.status == 200
    doc = await response.json()
    assert doc["openapi"].startswith("3.1")
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    served = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD"  # aiohttp adds HEAD beside every GET
    }
    assert documented == served
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            success = {"200", "101"} & set(operation["responses"])  # 101: the WebSocket
            assert success, (method, path)
    assert doc == document(app[STATE])  # what is served is what the builder makes
    speech = doc["paths"]["/v1/audio/speech"]["post"]["requestBody"]["content"]
    properties = speech["application/json"]["schema"]["properties"]
    assert properties["model"]["enum"] == ["quiet"]
    assert properties["stream_format"]["default"] == "audio"
    assert properties["seed"]["x-extension"] is True and "x-extension" not in properties["speed"]
    assert properties["input"]["maxLength"] == app[STATE].options.max_input_chars


async def test_the_document_is_valid_openapi_3_1(stand_in_runtime):
    """openapi-spec-validator reads the whole document (issue 27.11: five GET operations had
    their response content wrapped twice); every response's content maps media types to
    media objects, and every 503 documents its Retry-After header."""
    from omni_server.serve.options import ServeOptions

    for options in (ServeOptions(), ServeOptions(api_key="k")):
        doc = document(create_app(stand_in_runtime, options=options)[STATE])
        validate(doc)
        for path, operations in doc["paths"].items():
            for method, operation in operations.items():
                for status, response in operation["responses"].items():
                    where = (method, path, status)
                    for media, item in response.get("content", {}).items():
                        assert "/" in media and set(item) <= {"schema"}, where
                    if status == "503":
                        assert "Retry-After" in response["headers"], where


async def test_every_ref_in_the_document_resolves(stand_in_runtime):
    """Every `$ref` of the document is a JSON pointer into it that names an object (issue
    42.5: the repository API's load / unload bodies pointed at `#/$defs/...`, which does not
    resolve, so schemathesis skipped them)."""
    from omni_server.serve.options import ServeOptions

    doc = document(create_app(stand_in_runtime, options=ServeOptions())[STATE])
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    assert "#/components/schemas/LoadParameters" in refs  # the repository API's bodies
    assert "#/components/schemas/UnloadParameters" in refs
    for ref in set(refs):
        assert ref.startswith("#/"), ref
        target: Any = doc
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            assert isinstance(target, dict) and part in target, f"{ref} does not resolve"
            target = target[part]
        assert isinstance(target, dict) and target, ref


@pytest.mark.parametrize(
    ("path", "media", "body"),
    [
        ("/v1/audio/speech", "application/json", SpeechBody),
        ("/v1/chat/completions", "application/json", ChatBody),
        ("/v1/audio/transcriptions", "multipart/form-data", TranscriptionForm),
        ("/v1/audio/voices", "multipart/form-data", VoiceForm),
    ],
)
async def test_request_schemas_are_the_models_that_validate_them(
    stand_in_runtime, aiohttp_client, path, media, body
):
    """The document's request bodies come from the models: every field (by its wire name,
    e.g. `include[]`), the required ones, unknown fields refused, the nested objects defined."""
    client = await aiohttp_client(create_app(stand_in_runtime))
    doc = await (await client.get("/openapi.json")).json()
    served = doc["paths"][path]["post"]["requestBody"]["content"][media]["schema"]
    fields = {f.alias or name: f for name, f in body.model_fields.items()}
    assert set(served["properties"]) == set(fields)
    assert set(served["required"]) == {name for name, f in fields.items() if f.is_required()}
    if path == "/v1/audio/speech":
        assert "voice" in served["required"]  # as at OpenAI, whatever the default_voice
    if path == "/v1/audio/voices":  # issue 42 item 5: the name, and the clip under either name
        assert served["required"] == ["name"]
        assert served["anyOf"] == [{"required": ["audio_sample"]}, {"required": ["file"]}]
    assert served["additionalProperties"] is False
    refs = {ref for ref in json.dumps(served).split('"') if ref.startswith("#/components/")}
    for ref in refs:
        assert ref.removeprefix("#/components/schemas/") in doc["components"]["schemas"], ref


def strategy(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values a JSON schema (the subset the document uses, its $refs resolved) describes."""
    for union in ("oneOf", "anyOf"):
        if union in schema:
            # a null is a field left out, which leaving optional keys out already covers
            branches = [s for s in schema[union] if s.get("type") != "null"] or schema[union]
            return st.one_of([strategy(s) for s in branches])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        if schema.get("contentEncoding") == "binary":
            return st.binary(max_size=2000)
        top = min(schema.get("maxLength", 300), 300)
        return st.text(min_size=schema.get("minLength", 0), max_size=top)
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = strategy(schema.get("items", {}))
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=4)
    if kind == "object":
        props = schema.get("properties", {})
        required = {k: strategy(props.get(k, {})) for k in schema.get("required", [])}
        optional = {k: strategy(v) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(required, optional=optional)
    return ANY_JSON


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


def json_bodies(schema: dict[str, Any]) -> st.SearchStrategy[bytes]:
    valid = strategy(schema)
    names = sorted(schema.get("properties", {}))
    spoiled = st.tuples(valid, st.sampled_from(names), ANY_JSON).map(lambda t: {**t[0], t[1]: t[2]})
    values = st.one_of(valid, spoiled, ANY_JSON)
    return st.one_of(values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=300))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """A served silence model, its OpenAPI document and an HTTP client."""
    root = tmp_path_factory.mktemp("fuzz")
    repo = make_repo(
        root / "repo",
        stages={
            "speaker": toml("""
                backend = "Silence"
                terminal = true
                [scheduler]
                kind = "stream"
                """),
            "cloner": toml("""
                backend = "CloningVoice"
                terminal = true
                voice_cloning = true
                [scheduler]
                kind = "stream"
                """),
        },
        repository=toml("""
            [models.quiet]
            entry = "speaker"
            tasks = ["speech"]
            voices = ["hush"]
            [models.copycat]
            entry = "cloner"
            tasks = ["speech"]
            voices = ["hush"]
            """),
        models={"speaker": FIXTURES / "silence.py", "cloner": FIXTURES / "cloning_voice.py"},
    )
    data = root / "data"
    with (
        ServerProcess.start(repo, root / "server.log", "--data-dir", str(data)) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        yield server, client.get("/openapi.json").json(), client


def request_schema(doc: dict, path: str, media: str) -> dict[str, Any]:
    """A request body's schema with its `#/components/schemas/...` references inlined."""
    schemas = doc["components"]["schemas"]

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(schemas[node["$ref"].removeprefix("#/components/schemas/")])
            return {key: inline(value) for key, value in node.items()}
        return [inline(item) for item in node] if isinstance(node, list) else node

    return inline(doc["paths"][path]["post"]["requestBody"]["content"][media]["schema"])


def assert_no_server_error(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]  # OpenAI's shape, every time
        assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/chat/completions"])
def test_fuzz_json_endpoints(fuzzed, path):
    _, doc, client = fuzzed
    statuses: list[int] = []

    @FUZZ
    @given(json_bodies(request_schema(doc, path, "application/json")))
    def post(body: bytes) -> None:
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
        statuses.append(response.status_code)
        assert_no_server_error(response)

    post()
    if path == "/v1/audio/speech":  # the fuzz reaches the pipeline, not only the validation
        assert statuses.count(200) >= 5, sorted(set(statuses))
    assert len(set(statuses)) >= 2, statuses


@pytest.mark.parametrize(
    ("path", "url"),
    [
        ("/v2/repository/index", "/v2/repository/index"),
        ("/v2/repository/models/{model}/load", "/v2/repository/models/quiet/load"),
        ("/v2/repository/models/{model}/unload", "/v2/repository/models/quiet/unload"),
    ],
)
def test_fuzz_repository_api(fuzzed, path, url):
    """The repository API's bodies from their schemas, $refs resolved (issue 42.5: the load
    and unload bodies' refs did not resolve, so a schema-driven fuzz skipped them). The
    server runs in model control mode none: load and unload are refused, never a 5xx."""
    _, doc, client = fuzzed
    statuses: list[int] = []

    @FUZZ
    @given(json_bodies(request_schema(doc, path, "application/json")))
    def post(body: bytes) -> None:
        response = client.post(url, content=body, headers={"Content-Type": "application/json"})
        statuses.append(response.status_code)
        assert_no_server_error(response)

    post()
    if path.endswith("index"):
        assert {200, 400} <= set(statuses), sorted(set(statuses))
    else:
        assert set(statuses) == {400}, sorted(set(statuses))


def test_fuzz_transcription_form(fuzzed):
    _, doc, client = fuzzed
    schema = request_schema(doc, "/v1/audio/transcriptions", "multipart/form-data")
    fields = {k: v for k, v in schema["properties"].items() if k not in ("file", "audio_sample")}
    form = st.fixed_dictionaries(
        {}, optional={k: strategy(v).map(str) | st.text(max_size=30) for k, v in fields.items()}
    )

    @FUZZ
    @given(form, st.binary(max_size=2000) | st.none())
    def post(data: dict[str, str], file: bytes | None) -> None:
        files = {"file": ("a.wav", file)} if file is not None else {"x": ("x", b"")}
        response = client.post("/v1/audio/transcriptions", data=data, files=files)
        assert_no_server_error(response)

    post()


def test_fuzz_voice_form_and_delete(fuzzed):
    """Forms from the schema (a real clip among the files, so some voices are made), then
    deletes of what was made and of arbitrary ids."""
    from tests.serve.test_voices import wav_clip

    _, doc, client = fuzzed
    schema = request_schema(doc, "/v1/audio/voices", "multipart/form-data")
    fields = {k: v for k, v in schema["properties"].items() if k not in ("file", "audio_sample")}
    form = st.fixed_dictionaries(
        {}, optional={k: strategy(v).map(str) | st.text(max_size=30) for k, v in fields.items()}
    )
    files = st.sampled_from([wav_clip(), wav_clip(seconds=0.2)]) | st.binary(max_size=2000)
    made: list[str] = []
    statuses: list[int] = []

    @FUZZ
    @given(form, files | st.none())
    def post(data: dict[str, str], file: bytes | None) -> None:
        parts = {"file": ("a.wav", file)} if file is not None else {"x": ("x", b"")}
        response = client.post("/v1/audio/voices", data=data, files=parts)
        statuses.append(response.status_code)
        assert_no_server_error(response)
        if response.status_code == 200:
            made.append(response.json()["id"])

    post()
    valid = {"model": "copycat", "name": "n", "transcript": "hello there"}
    response = client.post("/v1/audio/voices", data=valid, files={"file": ("a.wav", wav_clip())})
    assert response.status_code == 200, response.text
    made.append(response.json()["id"])
    assert len(set(statuses)) >= 2, statuses

    @FUZZ
    @given(st.sampled_from(made) | st.text(max_size=60))
    def delete(voice: str) -> None:
        response = client.delete("/v1/audio/voices/" + quote(voice, safe=""))
        assert response.status_code in (200, 404, 405), response.status_code
        assert_no_server_error(response)

    delete()


def test_fuzz_get_routes_and_path_parameters(fuzzed):
    _, doc, client = fuzzed
    paths = [p for p, ops in doc["paths"].items() if "get" in ops and "{" not in p]

    @FUZZ
    @given(st.sampled_from(paths), st.text(max_size=60), st.sampled_from(["GET", "POST", "PUT"]))
    def call(path: str, model: str, method: str) -> None:
        response = client.request(method, path)
        if path == "/health/ready" or method != "GET":
            assert response.status_code < 500
        else:  # 400: a WebSocket route asked without the upgrade
            assert response.status_code in (200, 400, 404), (path, response.status_code)
        if response.status_code != 200:
            assert_no_server_error(response)
        assert_no_server_error(client.get("/v1/models/" + quote(model, safe="")))

    call()
