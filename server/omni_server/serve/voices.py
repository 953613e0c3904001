"""`/v1/audio/voices`: the voices of the served models as a resource, and custom voices.

    GET    /v1/audio/voices[?model=ID]   every voice of every speaking model (or of one)
    POST   /v1/audio/voices              multipart: model, name, file (a reference clip),
                                         transcript (what the clip says), language (optional)
    DELETE /v1/audio/voices/{id}         a custom voice

POST works for models that clone (a stage of theirs declares `voice_cloning = true`); any
other model answers 400 `voice_cloning_unsupported`. The clip is bounded before it is decoded
(bytes), while it is decoded (seconds: decoding stops at the limit) and after (sample rate,
shortest length, not silent); it is stored mono PCM16 at its own rate (serve/voice_store.py)
and usable at once in speech, chat audio and realtime under its id (`voice_<hex>`).
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

import numpy as np
from aiohttp import web
from pydantic import AfterValidator, ConfigDict, Field

from omni_server.audio.decode import TooLong, decode
from omni_server.compiler.plan import ModelSpec
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.models import model_not_found
from omni_server.serve.multipart import FORM_OVERHEAD_BYTES, read_form
from omni_server.serve.state import STATE, ServerState
from omni_server.serve.validation import RequestModel, Text, parse
from omni_server.serve.voice_catalog import VoiceCatalog, custom_entry
from omni_server.serve.voice_store import StoreFull

MAX_CLIP_BYTES = 10 * 1024 * 1024  # OpenAI's limit for a voice sample
MIN_CLIP_SECONDS, MAX_CLIP_SECONDS = 1.0, 30.0
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 16_000, 192_000
MAX_NAME_CHARS, MAX_TRANSCRIPT_CHARS = 64, 2000
SILENCE_PEAK = 1e-3  # a clip whose loudest sample is below this has no voice to clone
BODY_LIMIT = MAX_CLIP_BYTES + FORM_OVERHEAD_BYTES
_LANGUAGE = re.compile(r"[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8}){0,3}")


def _stripped(value: str) -> str:
    value = value.strip()
    if not value:
        raise ValueError("must not be empty or only spaces")
    return value


def _language_tag(value: str) -> str:
    if not _LANGUAGE.fullmatch(value):
        raise ValueError(f"must be a BCP 47 language tag such as en-US; got {value[:40]!r}")
    return value


class VoiceForm(RequestModel):
    """The multipart form of `POST /v1/audio/voices`."""

    model_config = ConfigDict(strict=False)

    file: bytes = Field(
        description=f"the reference clip: any container PyAV decodes, at most "
        f"{MAX_CLIP_BYTES // 2**20} MiB, {MIN_CLIP_SECONDS:g} to {MAX_CLIP_SECONDS:g} s, "
        f"sampled at {MIN_SAMPLE_RATE} Hz or more"
    )
    model: str = Field(description="a model that clones voices (id or alias)")
    name: Annotated[Text, AfterValidator(_stripped)] = Field(
        description="a label for the voice", max_length=MAX_NAME_CHARS
    )
    transcript: Annotated[Text, AfterValidator(_stripped)] = Field(
        description="what the clip says, word for word", max_length=MAX_TRANSCRIPT_CHARS
    )
    language: Annotated[str, AfterValidator(_language_tag)] | None = Field(
        None, description="BCP 47 tag of the clip's language; default: the model's"
    )


async def list_voices(request: web.Request) -> web.Response:
    state = request.app[STATE]
    catalog = state.voices
    name = request.query.get("model")
    if name is None:
        models = catalog.speaking_models()
    else:
        model = state.plan.model(name)
        if model is None:
            raise model_not_found(state.plan, name)
        models = [model] if catalog.speaks(model) else []
    data = [entry for model in models for entry in catalog.listing(model)]
    return web.json_response({"object": "list", "data": data})


async def create_voice(request: web.Request) -> web.Response:
    state = request.app[STATE]
    form = await read_form(request, MAX_CLIP_BYTES)
    model, scope = _cloning_model(state, form.one("model"))
    if form.file is None:
        raise invalid_field(
            "file", "'file' (the reference clip) is required", "missing_required_parameter"
        )
    fields = parse(VoiceForm, form.values(VoiceForm), form=True)
    store = state.voices.store
    if store is None:
        raise ApiError(
            400,
            "this server keeps no custom voices: it was started without a data directory",
            code="voice_storage_unavailable",
        )
    samples, rate = await asyncio.to_thread(_checked_clip, fields.file)
    try:
        voice = await asyncio.to_thread(
            store.add,
            name=fields.name,
            scope=scope,
            model=model.id,
            language=fields.language or model.language,
            transcript=fields.transcript,
            samples=samples,
            sample_rate=rate,
            limit=state.options.max_custom_voices,
        )
    except StoreFull as err:
        raise ApiError(
            400,
            f"{err}; delete one first (DELETE /v1/audio/voices/{{id}})",
            code="voice_limit_reached",
        ) from None
    return web.json_response(custom_entry(voice, model.id))


async def delete_voice(request: web.Request) -> web.Response:
    state = request.app[STATE]
    voice_id = request.match_info["voice"]
    store = state.voices.store
    if store is None or not await asyncio.to_thread(store.delete, voice_id):
        declared = any(voice_id in m.voices for m in state.plan.models.values())
        why = (
            "it is declared by the repository, not a custom voice" if declared else "no such voice"
        )
        raise ApiError(
            404, f"no custom voice '{voice_id[:80]}': {why}", param="voice", code="voice_not_found"
        )
    return web.json_response({"id": voice_id, "object": "voice", "deleted": True})


def _cloning_model(state: ServerState, name: str | None) -> tuple[ModelSpec, str]:
    """The model a new voice is for, and its cloning stage; 400 for a model that cannot clone."""
    if not name:
        raise invalid_field("model", "'model' is required", code="missing_required_parameter")
    model = state.plan.model(name)
    if model is None:
        raise model_not_found(state.plan, name)
    catalog: VoiceCatalog = state.voices
    scope = catalog.cloning_stage(model)
    if scope is None:
        cloning = [m.id for m in state.plan.models.values() if catalog.cloning_stage(m)]
        raise invalid_field(
            "model",
            f"the model '{model.id}' cannot clone voices (none of its stages declares "
            f"voice_cloning); models that clone: {', '.join(cloning) or 'none'}",
            code="voice_cloning_unsupported",
        )
    return model, scope


def _checked_clip(file: bytes) -> tuple[np.ndarray, int]:
    """The clip decoded and checked (see the module docstring); 400 naming `file` if not."""
    try:
        samples, rate = decode(file, max_seconds=MAX_CLIP_SECONDS)
    except TooLong:
        raise _bad_clip(
            f"the clip is longer than {MAX_CLIP_SECONDS:g} s", "audio_too_long"
        ) from None
    except ValueError:
        raise _bad_clip("the file is no audio this server can decode", "invalid_audio") from None
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise _bad_clip(
            f"the clip is sampled at {rate} Hz; give {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz",
            "unsupported_sample_rate",
        )
    seconds = len(samples) / rate
    if seconds < MIN_CLIP_SECONDS:
        raise _bad_clip(
            f"the clip is {seconds:.2f} s long; give at least {MIN_CLIP_SECONDS:g} s",
            "audio_too_short",
        )
    if not np.isfinite(samples).all() or float(np.max(np.abs(samples))) < SILENCE_PEAK:
        raise _bad_clip("the clip is silent: there is no voice in it to clone", "invalid_audio")
    return samples, rate


def _bad_clip(message: str, code: str) -> ApiError:
    return invalid_field("file", message, code)
