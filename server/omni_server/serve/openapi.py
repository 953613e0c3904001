"""`GET /openapi.json`: an OpenAPI 3.1 document of this server's routes, for this plan.

Built per app from the plan, so enumerations are the served ones (speech models and their
voices, transcription models, chat models) and the bounds are the options' (input characters,
body bytes). The document lists exactly the routes `create_app` registers (a test compares the
two), with every status a route can answer and OpenAI's error object for the failures. Fields
beyond OpenAI's are marked `x-extension: true`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from omni_server.audio import FORMATS
from omni_server.compiler.plan import Plan
from omni_server.serve.access import OPEN_PATHS
from omni_server.serve.speech_request import MAX_SEED, MAX_SPEED, MIN_SPEED, STREAM_FORMATS
from omni_server.serve.state import STATE, ServerState

Schema = dict[str, Any]

# Statuses any API route may answer before its endpoint runs (the door, the body guard).
_DOOR = {
    "401": "missing or wrong API key (only with --api-key)",
    "403": "a foreign Origin, or a foreign Host on a loopback server",
    "413": "the body is over the size limit",
    "415": "a Content-Encoding other than identity, gzip, deflate",
}
_POST_ERRORS = {
    "400": "invalid request (the message and `param` name the field)",
    "404": "unknown model",
    "408": "the body did not arrive in time",
    "429": "the model is at capacity (`Retry-After`)",
    "500": "a stage failed (the message names it; the server log has the details)",
    "503": "the pipeline is not ready, unhealthy or stopping",
    "504": "a stage ran past its time",
}


async def serve_openapi(request: web.Request) -> web.Response:
    return web.json_response(document(request.app[STATE]))


def document(state: ServerState) -> Schema:
    plan, options = state.plan, state.options
    paths: dict[str, Any] = {
        "/v1/audio/speech": {"post": _speech(plan, options.max_input_chars)},
        "/v1/audio/transcriptions": {"post": _transcription(plan)},
        "/v1/chat/completions": {"post": _chat(plan)},
        "/v1/realtime": {"get": _realtime(plan)},
        "/v1/models": {"get": _get("list the served models", _json(_MODEL_LIST))},
        "/v1/models/{model}": {"get": _retrieve_model(plan)},
        "/health": {"get": _get("readiness and health with detail", _json(_HEALTH), 503)},
        "/health/live": {"get": _get("the HTTP server answers", _json(_STATUS))},
        "/health/ready": {"get": _get("requests can be served", _json(_STATUS), 503)},
        "/metrics": {"get": _get("Prometheus metrics", {"text/plain": {"schema": _TEXT}})},
        "/": {"get": _get("the playground page", {"text/html": {"schema": _TEXT}}, 404)},
        "/openapi.json": {"get": _get("this document", _json({"type": "object"}))},
    }
    for path, operations in paths.items():
        for operation in operations.values():
            if path in OPEN_PATHS:
                operation["security"] = []  # open even with --api-key
            else:
                operation["responses"].update(_errors(_DOOR))
    doc: Schema = {
        "openapi": "3.1.0",
        "info": {
            "title": "omni-server",
            "version": "1",
            "description": "OpenAI-compatible speech, transcription and chat over a model "
            "repository; see docs/serving.md",
        },
        "paths": paths,
        "components": {
            "schemas": {"Error": _ERROR},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    if options.api_key is not None:
        doc["security"] = [{"bearer": []}]
    return doc


def _model_names(plan: Plan, task: str) -> list[str]:
    names: list[str] = []
    for model in plan.models.values():
        if task in model.tasks:
            names += [model.id, *model.aliases]
    return names


def _names_or_string(names: list[str]) -> Schema:
    return {"type": "string", "enum": names} if names else {"type": "string"}


def _speech(plan: Plan, max_chars: int) -> Schema:
    voices = sorted(
        {
            name
            for model in plan.models.values()
            if "speech" in model.tasks
            for name in (*model.voices, *model.voice_aliases)
        }
    )
    voice = _names_or_string(voices)
    body = {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": _names_or_string(_model_names(plan, "speech")),
            "input": {
                "type": "string",
                "minLength": 1,
                "maxLength": max_chars,
                "description": "counted after NFKC normalization; must contain a letter, "
                "digit or symbol",
            },
            "voice": {
                "oneOf": [
                    voice,
                    {"type": "object", "required": ["id"], "properties": {"id": voice}},
                ]
            },
            "instructions": {"type": "string"},
            "response_format": {"type": "string", "enum": list(FORMATS), "default": "mp3"},
            "speed": {"type": "number", "minimum": MIN_SPEED, "maximum": MAX_SPEED, "default": 1},
            "stream_format": {"type": "string", "enum": list(STREAM_FORMATS), "default": "audio"},
            "stream": {
                "type": "boolean",
                "x-extension": True,
                "description": "true: the default stream; false: one whole response with "
                "Content-Length (not with stream_format)",
            },
            "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED, "x-extension": True},
            "sample_rate": {"type": "integer", "minimum": 1, "x-extension": True},
        },
    }
    audio = {"schema": {"type": "string", "contentEncoding": "binary"}}
    content = {t: audio for t in ("audio/mpeg", "audio/ogg", "audio/aac", "audio/flac")}
    content |= {"audio/wav": audio, "audio/pcm": audio, "text/event-stream": {"schema": _TEXT}}
    return _post("text to speech", "application/json", body, content)


def _transcription(plan: Plan) -> Schema:
    body = {
        "type": "object",
        "required": ["file", "model"],
        "properties": {
            "file": {"type": "string", "contentEncoding": "binary"},
            "model": _names_or_string(_model_names(plan, "transcription")),
            "language": {"type": "string"},
            "prompt": {"type": "string"},
            "response_format": {
                "type": "string",
                "enum": ["json", "text", "srt", "verbose_json", "vtt"],
            },
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "timestamp_granularities[]": {
                "type": "array",
                "items": {"type": "string", "enum": ["segment", "word"]},
            },
            "include[]": {"type": "array", "items": {"type": "string", "enum": ["logprobs"]}},
            "stream": {"type": "boolean"},
        },
    }
    content = {
        "application/json": {"schema": {"type": "object"}},
        "text/plain": {"schema": _TEXT},
        "text/event-stream": {"schema": _TEXT},
    }
    return _post("audio to text", "multipart/form-data", body, content)


def _chat(plan: Plan) -> Schema:
    part = {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["text", "input_audio"]},
            "text": {"type": "string"},
            "input_audio": {
                "type": "object",
                "properties": {
                    "data": {"type": "string", "contentEncoding": "base64"},
                    "format": {"type": "string", "enum": ["wav", "mp3"]},
                },
            },
        },
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]},
        },
    }
    body = {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": _names_or_string(_model_names(plan, "chat")),
            "messages": {"type": "array", "minItems": 1, "items": message},
            "modalities": {"type": "array", "items": {"type": "string", "enum": ["text", "audio"]}},
            "audio": {
                "type": "object",
                "properties": {
                    "voice": {"type": "string"},
                    "format": {"type": "string", "enum": ["wav", "mp3", "flac", "opus", "pcm16"]},
                },
            },
            "max_tokens": {"type": "integer", "minimum": 1},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "min_p": {"type": "number", "minimum": 0, "maximum": 1},
            "seed": {"type": "integer", "minimum": 0},
            "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
            "stream": {"type": "boolean"},
            "stream_options": {
                "type": "object",
                "properties": {"include_usage": {"type": "boolean"}},
            },
            "n": {"type": "integer", "minimum": 1, "maximum": 1},
        },
    }
    content = {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}}
    return _post(
        "chat completion (text, and audio from a speech stage)", "application/json", body, content
    )


def _realtime(plan: Plan) -> Schema:
    """A WebSocket upgrade; the events are OpenAI's Realtime protocol (docs/realtime.md)."""
    return {
        "summary": "OpenAI's Realtime protocol over a WebSocket (upgrade required)",
        "parameters": [
            {
                "name": "model",
                "in": "query",
                "required": False,
                "schema": _names_or_string(_model_names(plan, "realtime")),
            }
        ],
        "responses": {
            "101": {"description": "switching to the WebSocket protocol"},
            "400": _error_response("not a WebSocket upgrade request"),
            "404": _error_response("no realtime model, or not this one"),
            "503": _error_response("the pipeline is not ready"),
        },
    }


def _retrieve_model(plan: Plan) -> Schema:
    operation = _get("one model, by id or alias", _json(_MODEL), 404)
    names = [name for model in plan.models.values() for name in (model.id, *model.aliases)]
    operation["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": _names_or_string(names)}
    ]
    return operation


def _post(summary: str, media: str, body: Schema, content: dict[str, Any]) -> Schema:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {media: {"schema": body}}},
        "responses": {"200": {"description": "the result", "content": content}}
        | _errors(_POST_ERRORS),
    }


def _get(summary: str, content: dict[str, Any], *errors: int) -> Schema:
    responses: dict[str, Any] = {"200": {"description": summary, "content": content}}
    for status in errors:
        responses[str(status)] = _error_response("not found" if status == 404 else "not ready")
    return {"summary": summary, "responses": responses}


def _errors(statuses: dict[str, str]) -> dict[str, Any]:
    return {status: _error_response(text) for status, text in statuses.items()}


def _error_response(description: str) -> Schema:
    return {"description": description, **_json({"$ref": "#/components/schemas/Error"})}


def _json(schema: Schema) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


_TEXT: Schema = {"type": "string"}
_NULLABLE_STRING: Schema = {"type": ["string", "null"]}
_ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STRING,
                "code": _NULLABLE_STRING,
            },
        }
    },
}
_MODEL: Schema = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "tasks": {"type": "array", "items": {"type": "string"}},
        "aliases": {"type": "array", "items": {"type": "string"}},
        "voices": {"type": "array", "items": {"type": "string"}},
    },
}
_MODEL_LIST: Schema = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}},
}
_STATUS: Schema = {"type": "object", "required": ["status"], "properties": {"status": _TEXT}}
_HEALTH: Schema = {
    "type": "object",
    "required": ["status", "ready", "healthy", "models"],
    "properties": {
        "status": _TEXT,
        "ready": {"type": "boolean"},
        "healthy": {"type": "boolean"},
        "models": {"type": "array", "items": _TEXT},
    },
}
