"""`GET /openapi.json`: an OpenAPI 3.1 document of this server's routes, for this plan.

The request bodies' schemas are those of the models that validate them (`SpeechBody`,
`ChatBody`, `TranscriptionForm`: `model_json_schema()`, their nested objects under
`components/schemas`), with the plan's and the options' parts laid over them per app: the
served models and voices as enumerations, the input characters' bound. The document lists
exactly the routes `create_app` registers (a test compares the two), with every status a route
can answer and OpenAI's error object for the failures. Fields beyond OpenAI's are marked
`x-extension: true`.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from omni_server.compiler.plan import Plan
from omni_server.serve import repository_api
from omni_server.serve.access import OPEN_PATHS
from omni_server.serve.chat_body import ChatBody
from omni_server.serve.speech_request import SpeechBody
from omni_server.serve.speech_stream import ELEVENLABS_PATH
from omni_server.serve.speech_stream import PATH as STREAM_INPUT_PATH
from omni_server.serve.state import STATE, ServerState
from omni_server.serve.stream_settings import (
    DEFAULT_FORMAT,
    DEFAULT_INACTIVITY_S,
    ELEVENLABS_DEFAULT_FORMAT,
    MAX_INACTIVITY_S,
)
from omni_server.serve.transcription_request import TranscriptionForm
from omni_server.serve.voice_catalog import VoiceCatalog
from omni_server.serve.voices import VoiceForm

Schema = dict[str, Any]

# Statuses any API route may answer before its endpoint runs (the door, the body guard).
_DOOR = {
    "401": "missing or wrong API key (only with --api-key)",
    "403": "a foreign Origin, or a foreign Host on a loopback server",
    "413": "the body is over the size limit",
    "415": "a JSON route's body not sent as application/json, or a Content-Encoding other "
    "than identity, gzip, deflate",
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
        STREAM_INPUT_PATH: {"get": _stream_input(plan)},
        ELEVENLABS_PATH: {"get": _stream_input(plan, elevenlabs=True)},
        "/v1/audio/voices": {"get": _list_voices(plan), "post": _create_voice(state.voices)},
        "/v1/audio/voices/{voice}": {"delete": _delete_voice()},
        "/v1/models": {"get": _get("list the served models", _media(_MODEL_LIST))},
        "/v1/models/{model}": {"get": _retrieve_model(plan)},
        "/health": {"get": _get("readiness and health with detail", _media(_HEALTH), 503)},
        "/health/live": {"get": _get("the HTTP server answers", _media(_STATUS))},
        "/health/ready": {"get": _get("requests can be served", _media(_STATUS), 503)},
        "/metrics": {"get": _get("Prometheus metrics", {"text/plain": {"schema": _TEXT}})},
        "/": {"get": _get("the playground page", {"text/html": {"schema": _TEXT}}, 404)},
        "/openapi.json": {"get": _get("this document", _media({"type": "object"}))},
    }
    repository_schemas: Schema = {}
    if options.repository_api:
        paths.update(repository_api.openapi_paths())  # Triton's repository API
        repository_schemas = repository_api.openapi_schemas()  # its bodies' nested objects
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
            "schemas": {"Error": _ERROR, **copy.deepcopy(_NESTED), **repository_schemas},
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


_BODIES: tuple[type[BaseModel], ...] = (SpeechBody, ChatBody, TranscriptionForm, VoiceForm)
_REF = "#/components/schemas/{model}"


@functools.cache
def _schema(body: type[BaseModel]) -> Schema:
    """A body's schema without its nested objects' (in `_NESTED`); made once per process, as
    the models do not change (each document lays its plan's parts over a copy)."""
    schema = body.model_json_schema(ref_template=_REF)
    schema.pop("$defs", None)
    return schema


def _nested() -> Schema:
    nested: Schema = {}
    for body in _BODIES:
        for name, schema in body.model_json_schema(ref_template=_REF).get("$defs", {}).items():
            assert nested.setdefault(name, schema) == schema, f"two request objects named {name}"
    return nested


_NESTED = _nested()


def _body(body: type[BaseModel], **properties: Schema) -> Schema:
    """A copy of `body`'s schema with the given properties' parts laid over it."""
    schema = copy.deepcopy(_schema(body))
    for name, extra in properties.items():
        schema["properties"][name].update(extra)
    return schema


def _speech(plan: Plan, max_chars: int) -> Schema:
    voices = sorted(
        {
            name
            for model in plan.models.values()
            if "speech" in model.tasks
            for name in (*model.voices, *model.voice_aliases)
        }
    )
    body = _body(
        SpeechBody,
        model=_names_or_string(_model_names(plan, "speech")),
        input={"maxLength": max_chars},
    )
    if voices:  # the name and the object form's id
        _enumerate_strings(body["properties"]["voice"], voices)
    audio = {"schema": {"type": "string", "contentEncoding": "binary"}}
    content = {t: audio for t in ("audio/mpeg", "audio/ogg", "audio/aac", "audio/flac")}
    content |= {"audio/wav": audio, "audio/pcm": audio, "text/event-stream": {"schema": _TEXT}}
    content["application/json"] = {"schema": {"type": "object"}}  # `timestamps`, no stream
    return _post("text to speech", "application/json", body, content)


def _enumerate_strings(schema: Any, names: list[str]) -> None:
    """Every string schema inside `schema` becomes one of `names`; a referenced object is
    copied in first (the shared one keeps its plain strings)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            name = schema.pop("$ref").removeprefix("#/components/schemas/")
            schema.update(copy.deepcopy(_NESTED[name]))
        if schema.get("type") == "string":
            schema["enum"] = names
        for value in schema.values():
            _enumerate_strings(value, names)
    elif isinstance(schema, list):
        for item in schema:
            _enumerate_strings(item, names)


def _transcription(plan: Plan) -> Schema:
    body = _body(TranscriptionForm, model=_names_or_string(_model_names(plan, "transcription")))
    content = {
        "application/json": {"schema": {"type": "object"}},
        "text/plain": {"schema": _TEXT},
        "text/event-stream": {"schema": _TEXT},
    }
    return _post("audio to text", "multipart/form-data", body, content)


def _chat(plan: Plan) -> Schema:
    body = _body(ChatBody, model=_names_or_string(_model_names(plan, "chat")))
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
            "503": _error_response("the pipeline is not ready", retry_after=True),
        },
    }


def _stream_input(plan: Plan, *, elevenlabs: bool = False) -> Schema:
    """A WebSocket upgrade; the messages are docs/stream_input.md's (ElevenLabs' conventions).
    ElevenLabs' path names the voice in the path and defaults to their SDK's mp3_44100_128."""
    default_format = ELEVENLABS_DEFAULT_FORMAT if elevenlabs else DEFAULT_FORMAT
    query = {
        "model": _names_or_string(_model_names(plan, "speech")),
        "model_id": _names_or_string(_model_names(plan, "speech")),
        "voice": _TEXT,
        "output_format": {
            "type": "string",
            "pattern": "^(pcm_[0-9]+|mp3_[0-9]+(_[0-9]+)?|ulaw_8000|alaw_8000)$",
            "default": default_format,
        },
        "binary": {"type": "boolean", "default": False},
        "speed": {"type": "number", "minimum": 0.25, "maximum": 4.0},
        "seed": {"type": "integer", "minimum": 0},
        "inactivity_timeout": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": MAX_INACTIVITY_S,
            "default": DEFAULT_INACTIVITY_S,
        },
    }
    parameters = [
        {"name": name, "in": "query", "required": False, "schema": schema}
        for name, schema in query.items()
        if not (elevenlabs and name == "voice")
    ]
    if elevenlabs:
        parameters.insert(0, {"name": "voice_id", "in": "path", "required": True, "schema": _TEXT})
    return {
        "summary": (
            "ElevenLabs' path of the text-in WebSocket (their SDK's convert_realtime)"
            if elevenlabs
            else "text in as it is written, audio out (pcm, mp3, G.711), over a WebSocket"
        ),
        "parameters": parameters,
        "responses": {
            "101": {"description": "switching to the WebSocket protocol"},
            "400": _error_response("a bad setting, or not a WebSocket upgrade request"),
            "404": _error_response("unknown model"),
            "503": _error_response("the pipeline is not ready", retry_after=True),
        },
    }


def _list_voices(plan: Plan) -> Schema:
    operation = _get("the voices of every speaking model, or of one", _media(_VOICE_LIST), 404)
    names = [name for model in plan.models.values() for name in (model.id, *model.aliases)]
    operation["parameters"] = [
        {"name": "model", "in": "query", "required": False, "schema": _names_or_string(names)}
    ]
    return operation


def _create_voice(voices: VoiceCatalog) -> Schema:
    cloning = [
        name
        for model in voices.speaking_models()
        if voices.cloning_stage(model) is not None
        for name in (model.id, *model.aliases)
    ]
    body = _body(VoiceForm, model=_names_or_string(cloning))
    operation = _post(
        "a custom voice from a reference clip and its transcript (models that clone)",
        "multipart/form-data",
        body,
        _media(_VOICE_CREATED),
    )
    operation["responses"]["413"] = _error_response("the clip is over the size limit")
    return operation


def _delete_voice() -> Schema:
    operation = _get("a custom voice deleted", _media(_VOICE_DELETED), 404)
    operation["parameters"] = [{"name": "voice", "in": "path", "required": True, "schema": _TEXT}]
    return operation


def _retrieve_model(plan: Plan) -> Schema:
    operation = _get("one model, by id or alias", _media(_MODEL), 404)
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
    """`content` maps media types to their schema objects (what `_media` makes)."""
    responses: dict[str, Any] = {"200": {"description": summary, "content": content}}
    for status in errors:
        responses[str(status)] = _error_response(
            "not found" if status == 404 else "not ready", retry_after=status == 503
        )
    return {"summary": summary, "responses": responses}


def _errors(statuses: dict[str, str]) -> dict[str, Any]:
    return {
        status: _error_response(text, retry_after=status == "503")
        for status, text in statuses.items()
    }


def _error_response(description: str, *, retry_after: bool = False) -> Schema:
    """An error's response object; a 503's (`retry_after`) also documents Retry-After."""
    response = {"description": description, **_json({"$ref": "#/components/schemas/Error"})}
    if retry_after:
        response["headers"] = {"Retry-After": _RETRY_AFTER}
    return response


def _media(schema: Schema) -> dict[str, Any]:
    """A response's `content`: one JSON body of `schema`."""
    return {"application/json": {"schema": schema}}


def _json(schema: Schema) -> dict[str, Any]:
    """A response object's `content` field, to lay beside its description."""
    return {"content": _media(schema)}


_TEXT: Schema = {"type": "string"}
_RETRY_AFTER: Schema = {
    "description": "seconds to wait before trying again",
    "schema": {"type": "integer"},
}
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
_VOICE: Schema = {
    "type": "object",
    "required": ["id", "object", "model", "name", "language", "aliases", "default", "custom"],
    "properties": {
        "id": _TEXT,
        "object": {"const": "voice"},
        "model": _TEXT,
        "name": _TEXT,
        "language": _NULLABLE_STRING,
        "aliases": {"type": "array", "items": _TEXT},
        "default": {"type": "boolean"},
        "custom": {"type": "boolean"},
    },
}
_VOICE_LIST: Schema = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _VOICE}},
}
_VOICE_CREATED: Schema = {  # OpenAI's audio.voice, with the listing's fields
    "type": "object",
    "required": [*_VOICE["required"], "created_at", "type"],
    "properties": {
        **_VOICE["properties"],
        "object": {"const": "audio.voice"},
        "created_at": {"type": "integer"},
        "type": {"const": "audio_sample"},
    },
}
_VOICE_DELETED: Schema = {
    "type": "object",
    "required": ["id", "object", "deleted"],
    "properties": {
        "id": _TEXT,
        "object": {"const": "audio.voice.deleted"},
        "deleted": {"const": True},
    },
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
