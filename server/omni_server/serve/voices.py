"""`/v1/audio/voices`: the voices of the served models as a resource, and custom voices.

    GET    /v1/audio/voices[?model=ID]   every voice of every speaking model (or of one)
    POST   /v1/audio/voices              multipart, OpenAI's form: audio_sample (the reference
                                         clip), name, consent (the consent recording's id),
                                         type ("audio_sample"); this server's own parts beside
                                         them: model, transcript, language; `file` is an alias
                                         of audio_sample (the form this server took first)
    DELETE /v1/audio/voices/{id}         a custom voice

POST works for models that clone (a stage of theirs declares `voice_cloning = true`); any
other model answers 400 `voice_cloning_unsupported`. Left out, `model` is the cloning model
when all of the server's cloning models share one cloning stage, and `transcript` (what the
clip says, which a cloning stage speaks from) is heard by the server's transcription model.
The clip is bounded before it is decoded (bytes), while it is decoded (seconds: decoding stops
at the limit) and after (whole: not cut short, checked as transcription checks an upload;
sample rate, shortest length, not silent); it is stored mono PCM16 at
its own rate (serve/voice_store.py) and usable at once in speech, chat audio and realtime under
its id (`voice_<hex>`). Answers are OpenAI's objects (`audio.voice`, `audio.voice.deleted`),
the created one with this server's listing fields added.
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated, Any

import numpy as np
from aiohttp import web
from pydantic import AfterValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from omni_server.audio.decode import TooLong, Truncated, decode
from omni_server.compiler.plan import ModelSpec
from omni_server.contracts import AsrOptions
from omni_server.pipeline import PipelineError
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.models import model_not_found
from omni_server.serve.multipart import FORM_OVERHEAD_BYTES, read_form
from omni_server.serve.pipeline_call import admitted, request_error, submitted
from omni_server.serve.state import STATE, ServerState
from omni_server.serve.validation import RequestModel, Text, parse
from omni_server.serve.voice_catalog import VoiceCatalog, custom_entry
from omni_server.serve.voice_store import StoredVoice, StoreFull

MAX_CLIP_BYTES = 10 * 1024 * 1024  # OpenAI's limit for a voice sample
MIN_CLIP_SECONDS, MAX_CLIP_SECONDS = 1.0, 30.0
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 16_000, 192_000
MAX_NAME_CHARS, MAX_TRANSCRIPT_CHARS, MAX_CONSENT_CHARS = 64, 2000, 128
CLIP_PARTS = ("audio_sample", "file")  # OpenAI's name, then this server's first one
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


def _sample_type(value: str) -> str:
    if value == "prompt":
        raise PydanticCustomError(
            "unsupported_value",
            "is 'prompt': this server makes voices from an audio sample only; send "
            "'audio_sample' (the clip) and leave 'type' out or 'audio_sample'",
        )
    if value != "audio_sample":
        raise PydanticCustomError(
            "invalid_value", "must be 'audio_sample'; got {got}", {"got": repr(value)}
        )
    return value


class VoiceForm(RequestModel):
    """The multipart form of `POST /v1/audio/voices`: OpenAI's parts, then this server's.
    Required: `name`, and the clip under one of its two names (the schema's `anyOf`, so the
    OpenAPI document says so; `create_voice` refuses a form without it by the first name)."""

    model_config = ConfigDict(
        strict=False, json_schema_extra={"anyOf": [{"required": [part]} for part in CLIP_PARTS]}
    )

    audio_sample: bytes | None = Field(
        None,
        description=f"the reference clip: any container PyAV decodes, at most "
        f"{MAX_CLIP_BYTES // 2**20} MiB, {MIN_CLIP_SECONDS:g} to {MAX_CLIP_SECONDS:g} s, "
        f"sampled at {MIN_SAMPLE_RATE} Hz or more",
    )
    name: Annotated[Text, AfterValidator(_stripped)] = Field(
        description="a label for the voice", max_length=MAX_NAME_CHARS
    )
    consent: Annotated[Text, AfterValidator(_stripped)] | None = Field(
        None,
        description="the id of the speaker's consent recording (OpenAI's `cons_...`), "
        "kept with the voice as given",
        max_length=MAX_CONSENT_CHARS,
    )
    type: Annotated[str, AfterValidator(_sample_type)] = Field(
        "audio_sample", description="how the voice is made: only 'audio_sample'"
    )
    file: bytes | None = Field(None, description="alias of audio_sample")
    model: str | None = Field(
        None,
        description="a model that clones voices (id or alias); left out: the server's cloning "
        "model, when its cloning models share one cloning stage",
    )
    transcript: Annotated[Text, AfterValidator(_stripped)] | None = Field(
        None,
        description="what the clip says, word for word; left out: heard by the server's "
        "transcription model",
        max_length=MAX_TRANSCRIPT_CHARS,
    )
    language: Annotated[str, AfterValidator(_language_tag)] | None = Field(
        None, description="BCP 47 tag of the clip's language; default: the model's"
    )

    @property
    def clip(self) -> bytes | None:
        return self.audio_sample if self.audio_sample is not None else self.file


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
    form = await read_form(request, MAX_CLIP_BYTES, file_parts=CLIP_PARTS)
    fields = parse(VoiceForm, form.values(VoiceForm), form=True)
    model, scope = _cloning_model(state, fields.model)
    if fields.clip is None:
        raise invalid_field(
            "audio_sample",
            "'audio_sample' (the reference clip; 'file' is its alias) is required",
            "missing_required_parameter",
        )
    store = state.voices.store
    if store is None:
        raise ApiError(
            400,
            "this server keeps no custom voices: it was started without a data directory",
            code="voice_storage_unavailable",
        )
    samples, rate = await asyncio.to_thread(_checked_clip, fields.clip, form.file_part)
    transcript = fields.transcript or await _heard(state, fields.clip, form.file_part)
    try:
        voice = await asyncio.to_thread(
            store.add,
            name=fields.name,
            scope=scope,
            model=model.id,
            language=fields.language or model.language,
            transcript=transcript,
            samples=samples,
            sample_rate=rate,
            limit=state.options.max_custom_voices,
            consent=fields.consent,
        )
    except StoreFull as err:
        raise ApiError(
            400,
            f"{err}; delete one first (DELETE /v1/audio/voices/{{id}})",
            code="voice_limit_reached",
        ) from None
    return web.json_response(created_voice(voice, model.id))


def created_voice(voice: StoredVoice, model: str) -> dict[str, Any]:
    """OpenAI's `audio.voice` object, with this server's listing fields (`custom_entry`)."""
    return {
        **custom_entry(voice, model),
        "object": "audio.voice",
        "created_at": voice.created_at,
        "type": "audio_sample",
    }


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
    return web.json_response({"id": voice_id, "object": "audio.voice.deleted", "deleted": True})


def _cloning_model(state: ServerState, name: str | None) -> tuple[ModelSpec, str]:
    """The model a new voice is for, and its cloning stage; 400 for a model that cannot clone.
    Without a name (OpenAI's form has no model): the first cloning model, when every cloning
    model shares its cloning stage (the voice is the same for all of them)."""
    catalog: VoiceCatalog = state.voices
    cloning = [m for m in state.plan.models.values() if catalog.cloning_stage(m)]
    if not name:
        scopes = {catalog.cloning_stage(m) for m in cloning}
        if len(scopes) > 1:
            raise invalid_field(
                "model",
                "this server's cloning models do not share one cloning stage; name the model "
                f"the voice is for: one of {', '.join(m.id for m in cloning)}",
                code="missing_required_parameter",
            )
        if not cloning:
            raise invalid_field(
                "model",
                "no model of this server can clone voices (none of their stages declares "
                "voice_cloning)",
                code="voice_cloning_unsupported",
            )
        name = cloning[0].id
    model = state.plan.model(name)
    if model is None:
        raise model_not_found(state.plan, name)
    scope = catalog.cloning_stage(model)
    if scope is None:
        raise invalid_field(
            "model",
            f"the model '{model.id}' cannot clone voices (none of its stages declares "
            f"voice_cloning); models that clone: {', '.join(m.id for m in cloning) or 'none'}",
            code="voice_cloning_unsupported",
        )
    return model, scope


async def _heard(state: ServerState, clip: bytes, part: str) -> str:
    """What the clip says, heard by the server's (first) transcription model: a cloning stage
    speaks from a clip and its transcript, and OpenAI's form carries no transcript."""
    asr = next((m for m in state.plan.models.values() if "transcription" in m.tasks), None)
    if asr is None:
        raise invalid_field(
            "transcript",
            "'transcript' (what the clip says, word for word) is required: this server serves "
            "no transcription model to hear it (with the openai client: "
            "extra_body={'transcript': ...})",
            code="missing_required_parameter",
        )
    try:
        inputs = AsrOptions().payload(clip)
        async with admitted(state, asr), submitted(state, asr, inputs) as handle:
            async for _chunk in handle:
                pass  # the text comes whole in the result
            result = await handle.result()
    except PipelineError as exc:
        raise request_error(exc) from exc
    text = result.get("text") if isinstance(result, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise _bad_clip(part, f"{asr.id} heard no words in the clip; send 'transcript'")
    return text.strip()[:MAX_TRANSCRIPT_CHARS]


def _checked_clip(file: bytes, part: str) -> tuple[np.ndarray, int]:
    """The clip decoded and checked (see the module docstring); 400 naming its `part` if not."""
    try:
        # whole: a clip cut short is refused as transcription refuses it (containers.cut_short)
        samples, rate = decode(file, max_seconds=MAX_CLIP_SECONDS, whole=True)
    except TooLong:
        raise _bad_clip(
            part, f"the clip is longer than {MAX_CLIP_SECONDS:g} s", "audio_too_long"
        ) from None
    except Truncated as cut:
        raise _bad_clip(part, f"the clip is no whole file: {cut}", "invalid_audio") from None
    except ValueError:
        raise _bad_clip(
            part, "the file is no audio this server can decode", "invalid_audio"
        ) from None
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise _bad_clip(
            part,
            f"the clip is sampled at {rate} Hz; give {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz",
            "unsupported_sample_rate",
        )
    seconds = len(samples) / rate
    if seconds < MIN_CLIP_SECONDS:
        raise _bad_clip(
            part,
            f"the clip is {seconds:.2f} s long; give at least {MIN_CLIP_SECONDS:g} s",
            "audio_too_short",
        )
    if not np.isfinite(samples).all() or float(np.max(np.abs(samples))) < SILENCE_PEAK:
        raise _bad_clip(
            part, "the clip is silent: there is no voice in it to clone", "invalid_audio"
        )
    return samples, rate


def _bad_clip(part: str, message: str, code: str = "invalid_audio") -> ApiError:
    return invalid_field(part, message, code)
