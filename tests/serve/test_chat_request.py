"""Chat request validation (serve/chat_request.py): every body -> the pipeline's inputs or one
400 naming the field. No server: the parser is a pure function of the body and the model."""

from __future__ import annotations

from typing import Any

import pytest

from omni_server.compiler.plan import ModelSpec, SamplingSpec
from omni_server.serve.chat_body import MAX_MESSAGES
from omni_server.serve.chat_request import parse_chat_request
from omni_server.serve.errors import ApiError

TEXT = ModelSpec(id="text", entry="thinker", tasks=("chat",))
OMNI = ModelSpec(
    id="omni",
    entry="thinker",
    tasks=("chat",),
    voices=("joe",),
    voice_aliases={"alloy": "joe"},
)
# a model whose entry stage declares [sampling] (top_k left out: OpenAI's default stays)
TUNED = ModelSpec(
    id="tuned",
    entry="thinker",
    tasks=("chat",),
    sampling=SamplingSpec(temperature=0.2, top_p=0.9, min_p=0.05, max_tokens=512),
)
USER = [{"role": "user", "content": "hi"}]
AUDIO = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}


def parse(model: ModelSpec = TEXT, **body: Any):
    return parse_chat_request({"model": model.id, "messages": USER, **body}, model)


def refused(model: ModelSpec = TEXT, **body: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_chat_request({"model": model.id, "messages": USER, **body}, model)
    assert err.value.status == 400
    return err.value


def test_defaults_are_openais():
    inputs = parse().thinker_input().to_dict()
    assert inputs == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": None,
        "stop": [],
        "speech": None,
    }


def test_a_field_left_out_is_the_models_default():
    inputs = parse(TUNED).thinker_input().to_dict()
    sampling = {k: inputs[k] for k in ("temperature", "top_p", "top_k", "min_p", "max_tokens")}
    assert sampling == {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 0,
        "min_p": 0.05,
        "max_tokens": 512,
    }
    # a null is the field left out
    assert parse(TUNED, temperature=None, max_tokens=None).thinker_input().to_dict() == inputs


def test_a_field_the_request_sets_wins_over_the_models_default():
    chat = parse(TUNED, temperature=0, top_p=1, top_k=5, min_p=0, max_completion_tokens=3)
    inputs = chat.thinker_input().to_dict()
    sampling = {k: inputs[k] for k in ("temperature", "top_p", "top_k", "min_p", "max_tokens")}
    assert sampling == {"temperature": 0.0, "top_p": 1.0, "top_k": 5, "min_p": 0.0, "max_tokens": 3}
    assert parse(TUNED, max_tokens=2000).sampling.max_tokens == 2000  # above the default, too


def test_roles_and_parts():
    messages = [
        {"role": "developer", "content": "a"},
        {"role": "system", "content": [{"type": "text", "text": t} for t in "bc"]},
        {"role": "assistant", "content": "d", "name": "bot"},
        {"role": "user", "content": ""},
    ]
    got = parse(messages=messages).thinker_input().to_dict()["messages"]
    assert got == [
        {"role": "system", "content": "a"},
        {"role": "system", "content": "bc"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": ""},
    ]


@pytest.mark.parametrize(
    ("messages", "param", "code"),
    [
        (None, "messages", "missing_required_parameter"),
        ([], "messages", "empty_array"),
        ({"role": "user"}, "messages", "invalid_type"),
        (["hi"], "messages[0]", "invalid_type"),
        ([{"role": "robot", "content": "x"}], "messages[0].role", "invalid_value"),
        ([{"role": "tool", "content": "x"}], "messages[0].role", "unsupported_value"),
        ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
        ([{"role": "user", "content": 3}], "messages[0].content", "invalid_type"),
        ([{"role": "user", "content": [3]}], "messages[0].content[0]", "invalid_type"),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": "x"}]}],
            "messages[0].content[0].input_audio",
            "invalid_type",
        ),
        (
            [{"role": "assistant", "content": [{"type": "input_audio", "input_audio": {}}]}],
            "messages[0].content[0].type",
            "unsupported_value",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0].type",
            "unsupported_value",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": None}]}],
            "messages[0].content[0].text",
            "invalid_type",
        ),
        ([{"role": "user", "content": "\ud800"}], "messages[0].content", "invalid_value"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
            "messages[0].tool_calls",
            "unsupported_parameter",
        ),
        (
            [{"role": "assistant", "content": None, "audio": {"id": "audio_1"}}],
            "messages[0].audio",
            "unsupported_parameter",
        ),
        ([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), "messages", None),
    ],
)
def test_bad_messages(messages, param, code):
    with pytest.raises(ApiError) as err:
        parse_chat_request({"model": "text", "messages": messages}, TEXT)
    assert err.value.status == 400 and err.value.param == param
    if code is not None:
        assert err.value.code == code


def test_sampling_fields():
    chat = parse(temperature=0, top_p=0.9, seed=3, stop=["a", "b"], max_completion_tokens=5)
    inputs = chat.thinker_input().to_dict()
    assert (inputs["temperature"], inputs["top_p"], inputs["seed"]) == (0.0, 0.9, 3)
    assert inputs["stop"] == ["a", "b"] and inputs["max_tokens"] == 5
    assert parse(stop="x").sampling.stop == ("x",)
    assert parse(max_tokens=7).sampling.max_tokens == 7
    assert parse(max_tokens=7, max_completion_tokens=7).sampling.max_tokens == 7
    assert parse(n=1).sampling.max_tokens is None


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"n": 2}, "n", "unsupported_value"),
        ({"n": 0}, "n", "integer_below_min_value"),
        ({"temperature": 3}, "temperature", "decimal_above_max_value"),
        ({"temperature": True}, "temperature", "invalid_type"),
        ({"top_p": -0.1}, "top_p", "decimal_below_min_value"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "integer_below_min_value"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens", "invalid_type"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens", "invalid_value"),
        ({"seed": -1}, "seed", "integer_below_min_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"stop": [""]}, "stop", "invalid_value"),
        ({"stop": 3}, "stop", "invalid_type"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, None, "invalid_type"),
        ({"tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
        ({"tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
        ({"logprobs": True}, "logprobs", "unsupported_parameter"),
        ({"logit_bias": {"1": 2}}, "logit_bias", "unsupported_parameter"),
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
        ({"response_format": {"type": "json_object"}}, "response_format", None),
        ({"modalities": ["audio"]}, "modalities", "invalid_value"),
        ({"modalities": "text"}, "modalities", "invalid_value"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "invalid_value"),
    ],
)
def test_bad_fields(body, param, code):
    error = refused(**body)
    if param is not None:
        assert error.param == param
    assert error.code == code or code is None


def test_neutral_values_of_unsupported_parameters_are_served():
    chat = parse(
        tools=[],
        tool_choice="none",
        logprobs=False,
        presence_penalty=0,
        frequency_penalty=0.0,
        response_format={"type": "text"},
        user="someone",
        metadata={"a": "b"},
        store=False,
    )
    assert chat.audio is None
    assert refused(logprobs=0).param == "logprobs"  # 0 is not JSON's false


def test_include_usage_needs_stream():
    assert parse(stream=True, stream_options={"include_usage": True}).include_usage
    assert not parse(stream=True, stream_options={}).include_usage
    assert not parse(stream=True).include_usage


def test_audio_out_resolves_the_voice_and_the_encoder_format():
    chat = parse(OMNI, seed=9, **AUDIO)
    speech = chat.thinker_input().to_dict()["speech"]
    assert speech == {
        "voice": "joe",
        "speed": 1.0,
        "seed": 9,
        "response_format": "wav",
        "stream": False,
        "sample_rate": 24000,  # OpenAI's rate in every format, whatever the voice's
        "reference": None,
        "instructions": None,
        "temperature": None,
        "timing": False,  # chat shows no word timings
    }
    streamed = parse(
        OMNI,
        stream=True,
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "pcm16"},
    )
    assert streamed.thinker_input().to_dict()["speech"]["response_format"] == "pcm"
    assert streamed.thinker_input().to_dict()["speech"]["stream"] is True
    assert streamed.thinker_input().to_dict()["speech"]["sample_rate"] == 24000


@pytest.mark.parametrize(
    ("model", "body", "param", "code"),
    [
        (TEXT, AUDIO, "modalities", "unsupported_value"),
        (OMNI, {"modalities": ["text", "audio"]}, "audio", "missing_required_parameter"),
        (OMNI, {**AUDIO, "audio": {"voice": "alloy"}}, "audio.format", None),
        (OMNI, {**AUDIO, "audio": {"voice": "alloy", "format": "aiff"}}, "audio.format", None),
        (OMNI, {**AUDIO, "audio": {"voice": "nobody", "format": "wav"}}, "audio.voice", None),
        (OMNI, {**AUDIO, "audio": {"format": "wav"}}, "audio.voice", None),
        (OMNI, {**AUDIO, "stream": True}, "audio.format", "unsupported_value"),
        (OMNI, {**AUDIO, "audio": "alloy"}, "audio", "invalid_type"),
    ],
)
def test_bad_audio(model, body, param, code):
    error = refused(model, **body)
    assert error.param == param
    assert error.code == code or code is None


def test_a_model_with_a_default_voice_needs_none_named():
    model = ModelSpec(id="m", entry="t", tasks=("chat",), voices=("joe",), default_voice="joe")
    chat = parse(model, modalities=["text", "audio"], audio={"format": "mp3"})
    assert chat.audio is not None and chat.audio.voice == "joe"


def test_unknown_fields_are_refused_with_openais_words():
    error = refused(chat_template_kwargs={}, top_a=1)
    assert error.message == "Unrecognized request argument supplied: chat_template_kwargs, top_a"
    assert (error.param, error.code) == (None, None)
    # an unknown field is refused even as null, and before any other problem of the body
    assert refused(temperature=9, foo=None).message.endswith("supplied: foo")
    nested = refused(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]
    )
    assert nested.message == (
        "Additional properties are not allowed ('x' was unexpected) - 'messages.0.content.0'"
    )


def test_a_null_is_the_field_left_out():
    chat = parse(temperature=None, stop=None, seed=None, modalities=None, n=None)
    sampling = chat.sampling
    assert (sampling.temperature, sampling.stop, sampling.seed, chat.audio) == (1.0, (), None, None)


def test_messages_and_their_parts_are_read_by_role():
    """A role's own fields are accepted and refused where OpenAI has them: `refusal` on an
    assistant message, `input_audio` only in a user message, no content only with tools."""
    assert parse(messages=[{"role": "assistant", "content": "a", "refusal": None}]).messages
    error = refused(messages=[{"role": "system", "content": [{"type": "input_audio"}]}])
    assert (error.param, error.code) == ("messages[0].content[0].type", "unsupported_value")
    error = refused(messages=[{"role": "assistant", "content": None}])
    assert (error.param, error.code) == ("messages[0].content", "missing_required_parameter")
    error = refused(messages=[{"content": "who?"}])
    assert (error.param, error.code) == ("messages[0].role", "missing_required_parameter")
    error = refused(messages=[{"role": "user", "content": "hi"}] * 2 + [{"role": "user"}])
    assert error.param == "messages[2].content"
