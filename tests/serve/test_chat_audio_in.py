"""Audio in to chat: `input_audio` content parts are heard by the transcription model and answered
by the thinker (the official `openai` client, the embedded repository's session server)."""

from __future__ import annotations

import base64

import openai
import pytest
from openai import OpenAI

from omni_server.compiler.plan import ModelSpec
from omni_server.serve.chat_request import AudioContent, parse_chat_request
from omni_server.serve.errors import ApiError

pytestmark = pytest.mark.timeout(600)

QUESTION = "What is the capital of France?"


def _audio_message(data: str, fmt: str = "wav") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Please answer:"},
                {"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
            ],
        }
    ]


MODEL = ModelSpec(id="m", entry="thinker", tasks=("chat",))  # text out, no [sampling]


def test_input_audio_parts_are_kept_in_order_for_the_transcriber():
    data = base64.b64encode(b"RIFF....WAVE").decode()
    chat = parse_chat_request({"model": "m", "messages": _audio_message(data)}, MODEL)
    (part,) = chat.audio_parts
    assert isinstance(part, AudioContent) and part.data == b"RIFF....WAVE" and part.format == "wav"
    assert part.param == "messages[0].content[1]"
    heard = chat.transcribed({part.param: " the question "})
    assert heard.messages[0]["content"] == "Please answer: the question"
    assert not heard.audio_parts


@pytest.mark.parametrize(
    ("data", "fmt", "param"),
    [
        ("%%%", "wav", "messages[0].content[1].input_audio.data"),
        ("AAAA", "ogg", "messages[0].content[1].input_audio.format"),
    ],
)
def test_bad_input_audio_is_a_400_naming_the_part(data, fmt, param):
    with pytest.raises(ApiError) as err:
        parse_chat_request({"model": "m", "messages": _audio_message(data, fmt)}, MODEL)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.slow
def test_a_spoken_question_is_answered(client: OpenAI):
    speech = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input=QUESTION,
        response_format="wav",
        extra_body={"stream": False, "seed": 7},  # seeded: the voice's noise is no dice roll
    )
    data = base64.b64encode(speech.content).decode()
    spoken = client.chat.completions.create(
        model="smol-chat", messages=_audio_message(data), temperature=0, max_tokens=24
    )
    typed = client.chat.completions.create(
        model="smol-chat",
        messages=[{"role": "user", "content": f"Please answer: {QUESTION}"}],
        temperature=0,
        max_tokens=24,
    )
    answer = spoken.choices[0].message.content
    assert answer.strip()
    # Whisper hears the question; a greedy thinker then answers as it would the typed question
    # unless Whisper's words differ (punctuation, case): compare the substance
    assert "Paris" in answer or answer == typed.choices[0].message.content


@pytest.mark.slow
def test_audio_that_is_not_audio_is_a_400(client: OpenAI):
    data = base64.b64encode(b"this is not a wav file at all" * 10).decode()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smol-chat", messages=_audio_message(data))
    assert err.value.body["param"] == "messages[0].content[1]"
    assert err.value.body["code"] == "invalid_audio"
