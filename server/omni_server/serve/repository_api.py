"""Triton's model repository extension: list, load, reload and unload models while serving.

    POST /v2/repository/index                  [{"name", "version", "state", "reason"}, ...]
                                               body (optional): {"ready": true} for READY only
    POST /v2/repository/models/{name}/load     load or reload from the files as they are now;
                                               body (optional): {"parameters": {"config":
                                               {"stages.acoustic.parameters.length_scale": 1.2}}}
                                               (an object or its JSON text: dotted repository
                                               fields overriding the files for this model)
    POST /v2/repository/models/{name}/unload   drain and stop; body (optional):
                                               {"parameters": {"unload_dependents": true}}

Shaped as Triton's (same paths, bodies, states; 200 with an empty body on success) so its
habits and clients carry over; failures are this server's OpenAI error JSON like every other
route. The routes sit behind the API key when one is set, and `--disable-repository-api`
leaves them out. Load and unload need `--model-control-mode explicit` (400 otherwise); the
index answers in every mode. See docs/serving.md#model-control.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import Field, ValidationError

from omni_server.pipeline import ControlError, ModelControl
from omni_server.serve.errors import ApiError
from omni_server.serve.state import STATE, ServerState
from omni_server.serve.validation import RequestModel, api_error

Body = TypeVar("Body", bound=RequestModel)

INDEX = "/v2/repository/index"
LOAD = "/v2/repository/models/{model}/load"
UNLOAD = "/v2/repository/models/{model}/unload"
MAX_CONTROL_BODY_BYTES = 64 << 10  # a load's config overrides: a few lines of JSON
# where the bodies' nested objects live in /openapi.json (`openapi_schemas()` supplies them)
_REF = "#/components/schemas/{model}"


class IndexBody(RequestModel):
    ready: bool = False  # only models that are READY
    repository_name: str = ""  # Triton's field; one repository here, so only "" is valid


class LoadParameters(RequestModel):
    # dotted repository paths -> values (or that object as JSON text, as Triton sends it)
    config: dict[str, Any] | str | None = None


class LoadBody(RequestModel):
    parameters: LoadParameters = Field(default_factory=LoadParameters)


class UnloadParameters(RequestModel):
    unload_dependents: bool = False


class UnloadBody(RequestModel):
    parameters: UnloadParameters = Field(default_factory=UnloadParameters)


def add_routes(app: web.Application) -> None:
    """Register the three routes unless the options disable them."""
    state = app[STATE]
    if not state.options.repository_api:
        return
    app.router.add_post(INDEX, index)
    app.router.add_post(LOAD, load)
    app.router.add_post(UNLOAD, unload)
    for path in (INDEX, LOAD, UNLOAD):
        state.body_limits[path] = MAX_CONTROL_BODY_BYTES


async def index(request: web.Request) -> web.Response:
    body = await _body(request, IndexBody)
    state = request.app[STATE]
    if body.repository_name:
        raise ApiError(
            404,
            f"no repository '{body.repository_name}'; this server has one (name it \"\")",
            param="repository_name",
            code="not_found",
        )
    control = state.runtime
    if isinstance(control, ModelControl):
        return web.json_response(control.index(ready_only=body.ready))
    return web.json_response(_fixed_index(state))  # mode none without model control


async def load(request: web.Request) -> web.Response:
    body = await _body(request, LoadBody)
    config = body.parameters.config
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise _bad_config(f"not JSON: {exc.msg}") from None
        if not isinstance(config, dict):
            raise _bad_config(f"expected an object, got {type(config).__name__}")
    control = _control(request.app[STATE])
    await _run(control.load(request.match_info["model"], config))
    return web.Response(status=200)


async def unload(request: web.Request) -> web.Response:
    body = await _body(request, UnloadBody)
    control = _control(request.app[STATE])
    dependents = body.parameters.unload_dependents
    await _run(control.unload(request.match_info["model"], unload_dependents=dependents))
    return web.Response(status=200)


def openapi_paths() -> dict[str, Any]:
    """This module's part of /openapi.json (serve/openapi.py adds the door's statuses)."""
    entry = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string", "description": "the generation serving it"},
            "state": {"type": "string", "enum": ["READY", "UNAVAILABLE", "LOADING", "UNLOADING"]},
            "reason": {"type": "string"},
        },
        "required": ["name", "state", "reason"],
    }
    errors = {
        "400": "invalid body, a repository the compiler refuses (its one-line message), or "
        "model control mode is not explicit",
        "404": "no such model in the repository",
        "500": "the new version failed to start; the old one still serves",
        "503": "the server is not ready",
    }
    listing = {"type": "array", "items": entry}
    return {
        INDEX: {"post": _operation("every model and its state", IndexBody, listing, errors)},
        LOAD: {"post": _operation("load or reload a model (atomic swap)", LoadBody, None, errors)},
        UNLOAD: {"post": _operation("drain and unload a model", UnloadBody, None, errors)},
    }


def openapi_schemas() -> dict[str, Any]:
    """The bodies' nested objects (`LoadParameters`, `UnloadParameters`), for the document's
    `components.schemas`, where the bodies' `$ref`s point."""
    schemas: dict[str, Any] = {}
    for body in (IndexBody, LoadBody, UnloadBody):
        schemas.update(body.model_json_schema(ref_template=_REF).get("$defs", {}))
    return schemas


def _body_schema(body: type[RequestModel]) -> dict[str, Any]:
    schema = body.model_json_schema(ref_template=_REF)
    schema.pop("$defs", None)  # in components.schemas (openapi_schemas)
    return schema


def _operation(
    summary: str, body: type[RequestModel], answer: dict[str, Any] | None, errors: dict[str, str]
) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "done"}
    if answer is not None:
        ok["content"] = {"application/json": {"schema": answer}}
    responses: dict[str, Any] = {"200": ok}
    for status, why in errors.items():
        responses[status] = {
            "description": why,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        if status == "503":  # every 503 says when to come back (serve/errors.py)
            seconds = {"description": "seconds to wait", "schema": {"type": "integer"}}
            responses[status]["headers"] = {"Retry-After": seconds}
    operation: dict[str, Any] = {
        "summary": summary,
        "tags": ["model repository (Triton)"],
        "requestBody": {
            "required": False,
            "content": {"application/json": {"schema": _body_schema(body)}},
        },
        "responses": responses,
    }
    if body is not IndexBody:
        operation["parameters"] = [
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
        ]
    return operation


# ---- inside ------------------------------------------------------------------------------


async def _body(request: web.Request, model: type[Body]) -> Body:
    """The optional JSON body (empty: every default). A JSON null is refused like any wrong
    type where the field is not nullable (`repository_name: null` is no repository name), not
    read as the field left out as `validation.parse` reads OpenAI's bodies: Triton's clients
    leave a field out, and a null there is a caller's mistake worth a 400."""
    raw = await request.read()
    if not raw.strip():
        return model()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the body is not JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise api_error(exc.errors(include_url=False)) from None


def _control(state: ServerState) -> ModelControl:
    control = state.runtime
    if not isinstance(control, ModelControl):
        raise ApiError(
            400,
            "explicit model load / unload is not allowed in model control mode 'none' "
            "(start the server with --model-control-mode explicit)",
            code="not_allowed",
        )
    return control


async def _run(call: Any) -> None:
    try:
        await call
    except ControlError as exc:
        raise ApiError(exc.status, exc.message, code=exc.code) from None


def _bad_config(why: str) -> ApiError:
    return ApiError(
        400, f"parameters.config: {why}", param="parameters.config", code="invalid_value"
    )


def _fixed_index(state: ServerState) -> list[dict[str, Any]]:
    ready = bool(state.runtime.ready)
    return [
        {"name": m, "state": "READY" if ready else "UNAVAILABLE", "reason": ""}
        for m in state.plan.models
    ]
