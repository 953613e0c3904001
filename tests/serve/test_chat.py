"""`POST /v1/chat/completions` through the official `openai` client, on a real server.

The server is `python -m omni_server` on a test repository whose thinker is a stand-in for the
LLM (tests/fixtures/fake_thinker.py: it answers "You said: ..." a word a token, and its magic
inputs fail, overflow or go slow) and whose voice is a stand-in too (fake_voice.py: a tone per
character through the real audio encoder). Everything between them is real: the thinker and the
voice run in processes of their own, the text streams between them over the shared-memory ring,
and the two models share the thinker stage as the embedded `smol-chat` and `smol-omni` do.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from openai import OpenAI

from omni_server.audio import decode
from tests.fixtures import FIXTURES
from tests.fixtures.fake_thinker import LIBRARY_DETAIL, UNICODE_ANSWER
from tests.fixtures.fake_voice import SECONDS_PER_CHARACTER
from tests.helpers.metrics import samples, value
from tests.helpers.repo import make_repo
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(180)

STREAM = '[scheduler]\nkind = "stream"\n'
STAGES = {
    "thinker": 'backend = "model.py:FakeThinker"\nprocess = "thinker"\nterminal = true\n'
    'stream_to = "voice"\n' + STREAM,
    "voice": 'backend = "model.py:FakeVoice"\nprocess = "voice"\nterminal = true\n' + STREAM,
}
MODELS = """
[models.fake-chat]
entry = "thinker"
stages = ["thinker"]
tasks = ["chat"]
aliases = ["gpt-4o-mini"]

[models.fake-omni]
entry = "thinker"
tasks = ["chat"]
aliases = ["gpt-4o-audio-preview"]
voices = ["joe"]

[models.fake-omni.voice_aliases]
alloy = "joe"

[models.fake-voice]
entry = "voice"
stages = ["voice"]
tasks = ["speech"]
voices = ["joe"]
"""
HELLO = [{"role": "user", "content": "hello there friend"}]
ANSWER = "You said: hello there friend"


def chat_repo(root: Path) -> Path:
    files = {"thinker": FIXTURES / "fake_thinker.py", "voice": FIXTURES / "fake_voice.py"}
    return make_repo(root, STAGES, MODELS, files)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("chat")
    with ServerProcess.start(chat_repo(root / "repo"), root / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> Iterator[OpenAI]:
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def post(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


# ---- text


def test_plain_answer(client):
    completion = client.chat.completions.create(model="fake-chat", messages=HELLO)
    assert completion.object == "chat.completion"
    assert completion.model == "fake-chat"
    assert completion.id.startswith("chatcmpl-")
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == ANSWER
    assert choice.message.audio is None
    assert choice.finish_reason == "stop"
    usage = completion.usage
    assert usage.prompt_tokens == 4  # three words and the message
    assert usage.completion_tokens == len(ANSWER.split())
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_the_request_id_is_the_completion_id(server):
    response = post(server, {"model": "fake-chat", "messages": HELLO})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == response.json()["id"]


def test_pipeline_inputs_follow_the_contract(client):
    """The thinker gets the contract's inputs: developer -> system, text parts joined, the
    sampling fields with OpenAI's defaults, stop as a list, no speech for text."""
    completion = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "INPUTS "}, {"type": "text", "text": "now"}],
            },
        ],
        max_completion_tokens=1000,
        seed=7,
        stop="@@",
        top_p=0.5,
        extra_body={"top_k": 40},
    )
    inputs = json.loads(completion.choices[0].message.content)
    assert inputs == {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "INPUTS now"},
        ],
        "max_tokens": 1000,
        "temperature": 1.0,
        "top_p": 0.5,
        "top_k": 40,  # an extension
        "min_p": 0.0,
        "seed": 7,
        "stop": ["@@"],
        "speech": None,
    }


def test_max_tokens_ends_with_length(client):
    for limit in ({"max_tokens": 3}, {"max_completion_tokens": 3}):
        completion = client.chat.completions.create(model="fake-chat", messages=HELLO, **limit)
        assert completion.choices[0].finish_reason == "length"
        assert completion.choices[0].message.content == "You said: hello"
        assert completion.usage.completion_tokens == 3


def test_stop_sequences_end_the_answer(client):
    completion = client.chat.completions.create(
        model="fake-chat", messages=HELLO, stop=["nothing", " there"]
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].message.content == "You said: hello"


def test_streamed_text_equals_the_whole_answer(client):
    chunks = list(client.chat.completions.create(model="fake-chat", messages=HELLO, stream=True))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in chunks]
    assert len([d for d in deltas if d]) == len(ANSWER.split())  # one chunk a word
    assert "".join(deltas) == ANSWER
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)


def test_stream_options_include_usage(client):
    chunks = list(
        client.chat.completions.create(
            model="fake-chat",
            messages=HELLO,
            stream=True,
            max_tokens=2,
            stream_options={"include_usage": True},
        )
    )
    *body, last = chunks
    assert last.choices == []
    assert last.usage.prompt_tokens == 4
    assert last.usage.completion_tokens == 2
    assert last.usage.total_tokens == 6
    assert all(c.usage is None for c in body)
    assert body[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in body) == "You said:"


def test_raw_stream_is_openai_sse_ending_with_done(server):
    response = post(server, {"model": "fake-chat", "messages": HELLO, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert json.loads(events[-2])["choices"][0]["delta"] == {}


def test_multibyte_text_streams_whole_characters(client):
    messages = [{"role": "user", "content": "UNICODE"}]
    chunks = list(client.chat.completions.create(model="fake-chat", messages=messages, stream=True))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert deltas == list(UNICODE_ANSWER)
    whole = client.chat.completions.create(model="fake-chat", messages=messages)
    assert whole.choices[0].message.content == UNICODE_ANSWER


# ---- audio out


@pytest.mark.parametrize("fmt", ["wav", "aac", "mp3", "flac", "opus", "pcm16"])
def test_audio_answer_in_every_format(client, fmt):
    completion = client.chat.completions.create(
        model="fake-omni",
        messages=HELLO,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": fmt},
    )
    message = completion.choices[0].message
    assert message.content is None  # as OpenAI: the text is the audio's transcript
    assert message.audio.transcript == ANSWER
    assert message.audio.id.startswith("audio_")
    assert isinstance(message.audio.expires_at, int)
    data = base64.b64decode(message.audio.data)
    clip = decode(data, "pcm" if fmt == "pcm16" else fmt)
    expected = len(ANSWER) * SECONDS_PER_CHARACTER
    # compressed formats pad or trim a codec frame or two
    assert clip.samples.size / clip.sample_rate == pytest.approx(expected, abs=0.08)
    # OpenAI's 24 kHz in every format, though the voice speaks at 22.05 kHz (raw pcm16 has no
    # header: its rate is the duration's, above, read at 24 kHz)
    assert _coded_rate(data, clip.sample_rate, fmt) == 24000
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == len(ANSWER.split())


def _coded_rate(data: bytes, decoded_rate: int, fmt: str) -> int:
    """The rate a file was coded at. Opus always decodes at 48 kHz; the rate it was coded from
    is its OpusHead's input sample rate (RFC 7845: a u32 at byte 12 of the packet)."""
    if fmt != "opus":
        return decoded_rate
    head = data.index(b"OpusHead")
    return int.from_bytes(data[head + 12 : head + 16], "little")


def test_streamed_audio_is_pcm16_deltas_with_the_transcript(client):
    stream = client.chat.completions.create(
        model="gpt-4o-audio-preview",
        messages=HELLO,
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "pcm16"},
        stream=True,
    )
    chunks = list(stream)
    audios = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    assert all(c.choices[0].delta.content is None for c in chunks)
    ids = [a.id for a in audios if a.id is not None]
    assert len(ids) == 1 and ids[0].startswith("audio_") and audios[0].id == ids[0]
    transcript = "".join(a.transcript or "" for a in audios)
    assert transcript == ANSWER
    data = [base64.b64decode(a.data) for a in audios if a.data is not None]
    assert len(data) > 1  # streamed, not one whole file
    pcm = b"".join(data)
    assert len(pcm) == 2 * int(len(ANSWER) * SECONDS_PER_CHARACTER * 24000)
    assert audios[-1].expires_at is not None
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_speech_streams_while_the_answer_is_written(client):
    """The thinker writes a word every 100 ms (2 s in all): audio of its first words reaches the
    client before the last words are written (nothing waits for the whole answer)."""
    stream = client.chat.completions.create(
        model="fake-omni",
        messages=[{"role": "user", "content": "SLOW 20"}],
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        stream=True,
    )
    kinds = []
    for chunk in stream:
        audio = chunk.choices[0].delta.audio if chunk.choices else None
        if audio is not None and audio.transcript:
            kinds.append("text")
        if audio is not None and audio.data:
            kinds.append("audio")
    assert kinds.count("text") == 20
    assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("text")


def test_a_text_only_model_refuses_audio(server):
    response = post(
        server,
        {
            "model": "fake-chat",
            "messages": HELLO,
            "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "wav"},
        },
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "modalities"


def test_the_omni_model_answers_text_without_audio(client):
    completion = client.chat.completions.create(model="fake-omni", messages=HELLO)
    assert completion.choices[0].message.content == ANSWER
    assert completion.choices[0].message.audio is None


# ---- errors


@pytest.mark.parametrize("stream", [False, True])
def test_context_overflow_is_a_400(client, stream):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="fake-chat", messages=[{"role": "user", "content": "OVERFLOW"}], stream=stream
        )
    assert err.value.status_code == 400
    assert err.value.code == "context_length_exceeded"
    assert err.value.param == "messages"
    assert "context window" in err.value.message


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "fake-chat", "messages": []}, "messages", "empty_array"),
        ({"model": "fake-chat"}, "messages", "missing_required_parameter"),
        ({"model": "fake-chat", "messages": "hi"}, "messages", "invalid_type"),
        ({"model": "fake-chat", "messages": HELLO, "n": 2}, "n", "unsupported_value"),
        ({"model": "fake-chat", "messages": HELLO, "temperature": "hot"}, "temperature", None),
        ({"model": "fake-chat", "messages": HELLO, "tools": [{"type": "function"}]}, "tools", None),
        ({"model": "fake-voice", "messages": HELLO}, "model", "unsupported_task"),
        (
            {
                "model": "fake-chat",
                "messages": [{"role": "user", "content": [{"type": "image_url"}]}],
            },
            "messages[0].content[0].type",
            "unsupported_value",
        ),
        (
            {
                "model": "fake-omni",
                "messages": HELLO,
                "stream": True,
                "modalities": ["text", "audio"],
                "audio": {"voice": "alloy", "format": "wav"},
            },
            "audio.format",
            "unsupported_value",
        ),
    ],
)
def test_bad_requests_are_400_with_openai_json(server, body, param, code):
    response = post(server, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_unknown_arguments_are_refused_as_openai_refuses_them(client):
    """OpenAI: 400 "Unrecognized request argument supplied: NAME", param and code null; an
    unknown key of a message is its schema's "Additional properties are not allowed"."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="fake-chat",
            messages=HELLO,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    error = err.value.body  # the error object (`message` adds the status)
    assert error["message"] == "Unrecognized request argument supplied: chat_template_kwargs"
    assert (err.value.param, err.value.code) == (None, None)
    assert err.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="fake-chat", messages=[{"role": "user", "content": "hi", "id": "m1"}]
        )
    assert err.value.body["message"] == (
        "Additional properties are not allowed ('id' was unexpected) - 'messages.0'"
    )
    assert (err.value.param, err.value.code) == (None, None)


def test_openais_bookkeeping_and_our_extensions_are_accepted(client):
    """What the official client sends for OpenAI's own parameters, and the sampling
    extensions docs/serving.md lists, are served."""
    completion = client.chat.completions.create(
        model="fake-chat",
        messages=[{"role": "user", "content": "INPUTS", "name": "ann"}],
        user="someone",
        metadata={"run": "1"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=False,
        safety_identifier="abc",
        prompt_cache_key="k",
        stream_options=None,
        extra_body={"top_k": 5, "min_p": 0.25},
    )
    inputs = json.loads(completion.choices[0].message.content)
    assert (inputs["top_k"], inputs["min_p"]) == (5, 0.25)


def test_unknown_model_is_a_404_listing_the_served_ones(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-5", messages=HELLO)
    assert err.value.code == "model_not_found"
    assert "fake-chat" in err.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_a_thinker_failure_is_a_500_without_its_internals(client, stream):
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(
            model="fake-chat", messages=[{"role": "user", "content": "FAIL"}], stream=stream
        )
    assert err.value.code == "pipeline_error"
    assert "thinker" in err.value.message
    assert "secret" not in err.value.message and LIBRARY_DETAIL not in str(err.value.body)


def test_a_stream_failing_midway_ends_without_done(server, client):
    body = {"model": "fake-chat", "messages": [{"role": "user", "content": "FAIL LATE"}]}
    lines = []
    url = server.url + "/v1/chat/completions"
    with (
        pytest.raises(httpx.RemoteProtocolError),  # cut: no last chunk of the encoding
        httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response,
    ):
        assert response.status_code == 200  # the headers went out with the first words
        lines.extend(response.iter_lines())
    events = sse_events("\n".join(lines))
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["code"] == "pipeline_error"
    words = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert words == ["", "You", " said:"]  # the role, and the words made before the failure
    assert "secret" not in "".join(lines)
    with pytest.raises(openai.APIError):  # the client raises on the error event
        list(
            client.chat.completions.create(
                model="fake-chat", messages=[{"role": "user", "content": "FAIL LATE"}], stream=True
            )
        )


# ---- the client leaves


def test_leaving_mid_stream_aborts_the_request(server, client):
    def disconnects() -> float:
        return value(
            samples(server.metrics()),
            "omni_request_failures_total",
            endpoint="chat",
            model="fake-chat",
            reason="client_disconnected",
        )

    before = disconnects()
    stream = client.chat.completions.create(
        model="fake-chat", messages=[{"role": "user", "content": "SLOW 300"}], stream=True
    )
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()  # 30 s of words left to make
    deadline = time.monotonic() + 20
    while disconnects() != before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert disconnects() == before + 1
    assert "aborted: client disconnected" in server.log()
    in_flight = value(samples(server.metrics()), "omni_requests_in_flight", model="fake-chat")
    assert in_flight == 0
    # the thinker is free: the next request is answered at once
    completion = client.chat.completions.create(model="fake-chat", messages=HELLO)
    assert completion.choices[0].message.content == ANSWER


def test_models_list_the_chat_models_with_their_voices(client):
    models = {m.id: m for m in client.models.list()}
    assert models["fake-chat"].tasks == ["chat"]
    assert models["fake-omni"].tasks == ["chat"]
    assert models["fake-omni"].voices == ["joe"]
    assert models["fake-chat"].voices == []
