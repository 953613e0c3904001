"""`GET /v1/models` and `GET /v1/models/{id}`: the served models of `repository.toml`.

Each entry is OpenAI's model object (`id`, `object`, `created`, `owned_by`) plus what a client of
this server needs to know: the API tasks the model serves, the other ids it answers to, its
voices, and its sampling defaults. A lookup by alias answers with the model it names.
`resolve_model` is the same lookup for the API endpoints: the model a request names, and that it
serves the endpoint's task. A model that model control is loading now is not served yet: a
request naming it gets 503 `model_loading` with Retry-After (come back), never 404 (it exists).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.pipeline.generation import ServedPlan
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.state import STATE, ServerState

OWNER = "omni-server"


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [_model_object(state, model) for model in state.plan.models.values()]
    return web.json_response({"object": "list", "data": data})


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    model = state.plan.model(name)
    if model is None:
        raise model_not_found(state.plan, name)
    return web.json_response(_model_object(state, model))


def model_not_found(plan: Plan, name: str) -> ApiError:
    """The error for a request naming `name`, which `plan` does not serve: 503 while model
    control loads it (`model_loading`), else 404."""
    loading = model_loading(plan, name)
    if loading is not None:
        return loading
    return ApiError(
        404,
        f"The model '{name}' does not exist. Served models: {describe_models(plan)}",
        param="model",
        code="model_not_found",
    )


def model_loading(plan: Plan, name: str) -> ApiError | None:
    """503 `model_loading` (with Retry-After, as every 503) when `name` is a model being
    loaded, else None."""
    spec = plan.loading_model(name) if isinstance(plan, ServedPlan) else None
    if spec is None:
        return None
    return ApiError(
        503,
        f"The model '{spec.id}' is loading; retry shortly (its state: /v2/repository/index)",
        param="model",
        code="model_loading",
    )


def loading_models(plan: Plan) -> list[ModelSpec]:
    """The models model control is loading now (none for a fixed plan)."""
    return list(plan.loading.values()) if isinstance(plan, ServedPlan) else []


def resolve_model(plan: Plan, name: str, *, task: str) -> ModelSpec:
    """The served model called `name` (id or alias), which must serve the API `task`."""
    model = plan.model(name)
    if model is None:
        raise model_not_found(plan, name)
    if task not in model.tasks:
        serving = [m.id for m in plan.models.values() if task in m.tasks]
        raise invalid_field(
            "model",
            f"the model '{model.id}' does not serve {task} (it serves "
            f"{', '.join(model.tasks) or 'nothing'}); models serving {task}: "
            f"{', '.join(serving) or 'none'}",
            code="unsupported_task",
        )
    return model


def describe_models(plan: Plan) -> str:
    parts = []
    for model in plan.models.values():
        aliases = f" (aliases: {', '.join(model.aliases)})" if model.aliases else ""
        parts.append(model.id + aliases)
    return ", ".join(parts) or "none"


def _model_object(state: ServerState, model: ModelSpec) -> dict[str, Any]:
    return {
        "id": model.id,
        "object": "model",
        "created": state.created,
        "owned_by": OWNER,
        "description": model.description,
        "tasks": list(model.tasks),
        "aliases": list(model.aliases),
        "voices": list(model.voices),
        "voice_aliases": dict(model.voice_aliases),
        "default_voice": model.default_voice,
        # what a request that leaves a sampling field (or max_tokens) out gets: the entry
        # stage's [sampling]; a field missing here is OpenAI's default
        "sampling": model.sampling.declared(),
        # how it hears input_audio: "native" (its own audio encoder) or "transcribe"
        "audio_input": model.audio_input,
    }
