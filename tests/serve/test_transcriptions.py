"""`POST /v1/audio/transcriptions` on the real server, through the official `openai` client.

The audio is the embedded voice's own speech (the speech endpoint of the same server), so every
transcript is scored against the text that was spoken. Bad input goes through the client where
it can send it, and through raw HTTP where it cannot (no file, oversize, a client that leaves).
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import socket
import time

import aiohttp
import av
import httpx2 as httpx
import numpy as np
import openai
import pytest
from openai import OpenAI
from openai.types.audio import TranscriptionTextDeltaEvent, TranscriptionTextDoneEvent

from omni_bench.wer import word_error_rate
from omni_server.audio import decode
from omni_server.audio.wav import wav_header
from tests.serve.speech_texts import MANY_SENTENCES, ONE_SENTENCE, THREE_SENTENCES

pytestmark = pytest.mark.timeout(300)

MAX_WER = 0.15
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
CUE_TIME = r"(\d\d):(\d\d):(\d\d)[.,](\d\d\d)"


def _wav(samples: np.ndarray, rate: int) -> bytes:
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    return wav_header(rate, data_bytes=len(pcm)) + pcm


@pytest.fixture(scope="module")
def spoken(client: OpenAI) -> dict[str, bytes]:
    """Speech of the test texts, made by this server's voice: wav and mp3 files."""
    files = {}
    for name, text, fmt in (
        ("three.wav", THREE_SENTENCES, "wav"),
        ("three.mp3", THREE_SENTENCES, "mp3"),
        ("three.flac", THREE_SENTENCES, "flac"),
        ("three.opus", THREE_SENTENCES, "opus"),
        ("many.wav", MANY_SENTENCES, "wav"),
        ("one.wav", ONE_SENTENCE, "wav"),
    ):
        speech = client.audio.speech.create(
            model="tts-1", voice="alloy", input=text, response_format=fmt, extra_body={"seed": 1}
        )
        files[name] = speech.content
    return files


def _cue_seconds(match: tuple[str, ...]) -> float:
    h, m, s, ms = (int(x) for x in match)
    return h * 3600 + m * 60 + s + ms / 1000


def _cues(body: str) -> list[tuple[float, float, str]]:
    """(start, end, text) of every cue of an SRT or WebVTT body."""
    cues = []
    for block in re.split(r"\n\s*\n", body.strip()):
        lines = block.strip().splitlines()
        for i, line in enumerate(lines):
            times = re.findall(CUE_TIME, line)
            if "-->" in line and len(times) == 2:
                cues.append(
                    (_cue_seconds(times[0]), _cue_seconds(times[1]), " ".join(lines[i + 1 :]))
                )
    return cues


@pytest.mark.parametrize("response_format", RESPONSE_FORMATS)
def test_every_response_format_transcribes_the_voice(client, spoken, response_format):
    result = client.audio.transcriptions.create(
        model="whisper-1",
        file=("three.wav", spoken["three.wav"], "audio/wav"),
        response_format=response_format,
    )
    if response_format == "json":
        text = result.text
        assert result.usage.type == "duration" and result.usage.seconds >= 5
    elif response_format == "verbose_json":
        text = result.text
        assert result.language == "english"
        assert 5 < result.duration < 30
        assert result.segments, "verbose_json lists segments by default"
        ends = [s.end for s in result.segments]
        assert all(s.start < s.end <= result.duration + 0.05 for s in result.segments)
        assert ends == sorted(ends)
        assert " ".join(s.text.strip() for s in result.segments) == text
    elif response_format == "text":
        assert isinstance(result, str) and result.endswith("\n")
        text = result
    else:
        assert isinstance(result, str)
        if response_format == "vtt":
            assert result.startswith("WEBVTT")
        cues = _cues(result)
        assert cues, result
        assert all(a < b for a, b, _ in cues)
        assert [a for a, _, _ in cues] == sorted(a for a, _, _ in cues)
        text = " ".join(t for _, _, t in cues)
    wer = word_error_rate([THREE_SENTENCES], [text])
    assert wer <= MAX_WER, f"WER {wer:.2f}: {text!r}"


def test_word_timestamps_in_verbose_json(client, spoken):
    result = client.audio.transcriptions.create(
        model="whisper-tiny-en",
        file=("three.mp3", spoken["three.mp3"], "audio/mpeg"),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    words = result.words
    assert words and result.segments
    assert len(words) >= 0.8 * len(THREE_SENTENCES.split())
    starts = [w.start for w in words]
    assert starts == sorted(starts)
    assert all(w.start <= w.end <= result.duration + 0.05 for w in words)
    assert word_error_rate([THREE_SENTENCES], [" ".join(w.word for w in words)]) <= MAX_WER


def test_word_granularity_alone_leaves_out_segments(client, spoken):
    result = client.audio.transcriptions.create(
        model="whisper-1",
        file=("three.wav", spoken["three.wav"]),
        response_format="verbose_json",
        timestamp_granularities=["word"],
    )
    assert result.words
    assert getattr(result, "segments", None) is None


def test_stream_sends_deltas_as_segments_finish_then_done(client, spoken):
    # ~80 s of speech: more than one Whisper window, so more than one delta
    stream = client.audio.transcriptions.create(
        model="gpt-4o-transcribe", file=("many.wav", spoken["many.wav"]), stream=True
    )
    deltas, done = [], []
    for event in stream:
        if event.type == "transcript.text.delta":
            assert not done, "a delta came after transcript.text.done"
            TranscriptionTextDeltaEvent.model_validate(event.to_dict())
            deltas.append(event.delta)
        elif event.type == "transcript.text.done":
            done.append(event)
    assert len(done) == 1
    assert len(deltas) >= 2, deltas
    assert "".join(deltas) == done[0].text
    # the client builds events without validating them: validate against its strict types
    # (its done event allows token usage only, so a duration usage would fail here)
    assert TranscriptionTextDoneEvent.model_validate(done[0].to_dict()).usage is None
    wer = word_error_rate([MANY_SENTENCES], [done[0].text])
    assert wer <= MAX_WER, f"WER {wer:.2f}"


def test_stream_of_silence_is_only_done(client):
    silence = _wav(np.zeros(3 * 16000, np.float32), 16000)
    events = list(
        client.audio.transcriptions.create(model="whisper-1", file=("s.wav", silence), stream=True)
    )
    assert [e.type for e in events] == ["transcript.text.done"]
    assert TranscriptionTextDoneEvent.model_validate(events[0].to_dict()).text == ""


def test_silence_is_an_empty_transcript(client):
    rng = np.random.default_rng(0)
    hiss = (rng.standard_normal(4 * 22050) * 1e-4).astype(np.float32)  # near silence, 22.05 kHz
    result = client.audio.transcriptions.create(
        model="whisper-1", file=("quiet.wav", _wav(hiss, 22050)), response_format="verbose_json"
    )
    assert result.text == "" and result.segments == []
    assert result.duration == pytest.approx(4.0, abs=0.01)


def test_prompt_and_temperature_are_accepted(client, spoken):
    result = client.audio.transcriptions.create(
        model="whisper-1",
        file=("one.wav", spoken["one.wav"]),
        prompt="A pangram, read aloud.",
        temperature=0.0,
        language="en",
        chunking_strategy="auto",  # OpenAI's: the pipeline segments by its own VAD
    )
    assert word_error_rate([ONE_SENTENCE], [result.text]) <= MAX_WER


def test_logprobs_are_whispers_tokens_of_the_text(client, spoken):
    file = ("one.wav", spoken["one.wav"])
    result = client.audio.transcriptions.create(model="whisper-1", file=file, include=["logprobs"])
    assert result.logprobs and "".join(t.token for t in result.logprobs).strip() == result.text
    assert all(
        t.logprob <= 0 and bytes(int(b) for b in t.bytes) == t.token.encode()
        for t in result.logprobs
    )
    assert sum(t.logprob for t in result.logprobs) / len(result.logprobs) > -1.0  # confident
    events = list(
        client.audio.transcriptions.create(
            model="whisper-1", file=file, include=["logprobs"], stream=True
        )
    )
    done = events[-1]
    assert isinstance(done, TranscriptionTextDoneEvent)
    assert [t.token for t in done.logprobs] == [t.token for t in result.logprobs]
    deltas = [e for e in events if isinstance(e, TranscriptionTextDeltaEvent)]
    assert [t.token for e in deltas for t in e.logprobs] == [t.token for t in done.logprobs]
    assert client.audio.transcriptions.create(model="whisper-1", file=file).logprobs is None


@pytest.mark.parametrize(
    ("options", "param", "code"),
    [
        ({"chunking_strategy": "sometimes"}, "chunking_strategy", "invalid_value"),
        (
            {"chunking_strategy": {"type": "server_vad", "silence_duration_ms": 300}},
            "chunking_strategy",
            "unsupported_value",
        ),
        ({"include": ["logprobs"], "response_format": "verbose_json"}, "include", None),
        ({"temperature": 1.5}, "temperature", "decimal_above_max_value"),
    ],
    ids=["chunking-sometimes", "server-vad", "logprobs-verbose", "temperature"],
)
def test_bad_options_are_refused_naming_the_field(client, spoken, options, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(
            model="whisper-1", file=("one.wav", spoken["one.wav"]), **options
        )
    error = info.value.body
    assert error["param"] == param and (code is None or error["code"] == code), error
    assert param in error["message"]


def test_unknown_fields_are_refused_as_openai_refuses_them(client, spoken):
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(
            model="whisper-1", file=("one.wav", spoken["one.wav"]), extra_body={"diarize": True}
        )
    error = info.value.body
    assert error["message"] == "Unrecognized request argument supplied: diarize"
    assert (error["param"], error["code"]) == (None, None)


def test_another_language_is_refused_naming_english(client, spoken):
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(
            model="whisper-1", file=("three.wav", spoken["three.wav"]), language="fr"
        )
    error = info.value.body
    assert error["param"] == "language" and error["code"] == "unsupported_language"
    assert "English" in error["message"] and "'fr'" in error["message"]


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("notes.txt", b"this is a text file, not audio\n" * 40),
        ("empty.wav", b""),
        ("noise.bin", np.random.default_rng(1).bytes(20_000)),
    ],
)
def test_a_file_that_is_not_audio_is_a_400(client, name, data):
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model="whisper-1", file=(name, data))
    assert info.value.body["code"] == "invalid_audio"
    assert info.value.body["param"] == "file"


DAMAGED = [
    # (file, how): a container that declares its length (flac's STREAMINFO) tells a cut file
    # from a short one; any format fails on garbage
    ("three.flac", "cut in half"),
    ("three.opus", "header only"),
    ("three.mp3", "header only"),
    ("three.mp3", "zeroed in the middle"),
]


def _damaged(data: bytes, how: str) -> bytes:
    third = len(data) // 3
    if how == "cut in half":
        return data[: len(data) // 2]
    if how == "header only":
        return data[:200]
    return data[:third] + bytes(2000) + data[third + 2000 :]


@pytest.mark.parametrize(("name", "how"), DAMAGED)
def test_truncated_and_corrupt_files_are_400s(client, spoken, name, how):
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(
            model="whisper-1", file=(name, _damaged(spoken[name], how))
        )
    assert info.value.body["code"] == "invalid_audio"
    assert info.value.body["param"] == "file"


def _silent_flac(seconds: float) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="flac") as container:
        stream = container.add_stream("flac", rate=16000, layout="mono")
        block = np.zeros((1, 16000 * 10), np.int16)
        for _ in range(int(seconds // 10)):
            frame = av.AudioFrame.from_ndarray(block, format="s16", layout="mono")
            frame.sample_rate = 16000
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def test_a_long_silent_flac_is_heard_whole(client):
    """Issue 27.9 scaled: 15 minutes of silence (a small upload, 58 MB decoded) is legal and
    transcribes to nothing; the bounds it lives under are tests/asr/test_decode.py's."""
    flac = _silent_flac(900)
    assert len(flac) < 1_000_000
    result = client.audio.transcriptions.create(
        model="whisper-1", file=("long.flac", flac), response_format="verbose_json"
    )
    assert result.duration == pytest.approx(900, abs=0.5) and result.text == ""


def test_a_truncated_opus_is_a_400_not_a_partial_transcript(client, spoken):
    """Issue 27.6: an Ogg/Opus cut anywhere (here at a page boundary, every page whole) ends
    without its end-of-stream page."""
    opus = spoken["three.opus"]
    pages = [i for i in range(len(opus)) if opus.startswith(b"OggS", i)]
    for cut in (pages[len(pages) // 2], len(opus) * 2 // 3):
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.transcriptions.create(model="whisper-1", file=("a.opus", opus[:cut]))
        assert (
            info.value.body["code"] == "invalid_audio" and "truncated" in info.value.body["message"]
        )


def test_an_mp3_cut_at_a_frame_is_a_shorter_mp3(client, spoken):
    """MP3 is a bare run of frames with no declared length (this encoder writes none), as Ogg
    is of pages: half a file is a valid, shorter file, and is heard as such."""
    mp3 = spoken["three.mp3"]
    whole = client.audio.transcriptions.create(
        model="whisper-1", file=("a.mp3", mp3), response_format="verbose_json"
    )
    half = client.audio.transcriptions.create(
        model="whisper-1", file=("a.mp3", mp3[: len(mp3) // 2]), response_format="verbose_json"
    )
    assert half.duration == pytest.approx(whole.duration / 2, rel=0.1)
    assert 0 < len(half.text.split()) < len(whole.text.split())


def test_bad_fields_are_400s_naming_the_field(client, spoken):
    file = ("three.wav", spoken["three.wav"])
    cases = [
        ({"response_format": "diarized_json"}, "response_format"),
        ({"temperature": 3.0}, "temperature"),
        ({"timestamp_granularities": ["word"]}, "timestamp_granularities"),  # json format
        ({"include": ["speakers"]}, "include"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.transcriptions.create(model="whisper-1", file=file, **fields)
        assert info.value.body["param"] == param, fields


def test_unknown_model_and_speech_model_are_refused(client, spoken):
    file = ("three.wav", spoken["three.wav"])
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="whisper-large", file=file)
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model="tts-1", file=file)
    assert info.value.body["code"] == "unsupported_task"


def test_missing_file_is_missing_required_parameter(server):
    response = httpx.post(
        server.url + "/v1/audio/transcriptions", files={"model": (None, "whisper-1")}, timeout=30
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "missing_required_parameter" and error["param"] == "file"


def test_a_json_body_is_refused(server):
    response = httpx.post(
        server.url + "/v1/audio/transcriptions", json={"model": "whisper-1"}, timeout=30
    )
    assert response.status_code == 400
    assert "multipart/form-data" in response.json()["error"]["message"]


def test_oversize_upload_is_413_before_the_body_is_read(server):
    """A declared length over 25 MB is refused at once: the server answers while the client has
    sent only the headers and a little of the body."""
    host, port = "127.0.0.1", server.port
    boundary = "xyz"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    length = 30 * 1024 * 1024
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(
            (
                f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                f"Content-Length: {length}\r\n\r\n"
            ).encode()
            + head
        )
        reply = sock.recv(65536).decode(errors="replace")
    status, _, rest = reply.partition("\r\n")
    assert " 413 " in status, reply[:500]
    body = json.loads(rest.split("\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large"


def test_chunked_upload_over_25_mb_is_413(server):
    def body():
        yield (
            b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.wav"\r\n\r\n'
        )
        block = bytes(1024 * 1024)
        for _ in range(27):
            yield block
        yield b"\r\n--b--\r\n"

    try:
        response = httpx.post(
            server.url + "/v1/audio/transcriptions",
            content=body(),
            headers={"Content-Type": "multipart/form-data; boundary=b"},
            timeout=60,
        )
    except httpx.TransportError:
        pytest.fail("the server dropped the connection instead of answering 413")
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def _failures(server, reason: str) -> float:
    pattern = (
        r'omni_request_failures_total\{endpoint="transcription",model="[^"]*",'
        rf'reason="{reason}"\}} ([0-9.e+]+)'
    )
    return sum(float(v) for v in re.findall(pattern, server.metrics()))


def test_client_leaving_mid_upload_counts_as_a_disconnect(server):
    before = _failures(server, "client_disconnected")
    boundary = "q"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            (
                "POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
                f"Content-Length: {5 * 1024 * 1024}\r\n\r\n"
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
                'filename="a.wav"\r\n\r\n'
            ).encode()
            + bytes(200_000)
        )
        time.sleep(0.3)  # let the server start reading the part before the client vanishes
    deadline = time.monotonic() + 20
    while _failures(server, "client_disconnected") <= before:
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.1)


def test_transcription_metrics_count_requests(server, client, spoken):
    client.audio.transcriptions.create(model="whisper-1", file=("t.wav", spoken["three.wav"]))
    text = server.metrics()
    assert re.search(
        r'omni_requests_total\{endpoint="transcription",model="whisper-tiny-en",status="200"\} '
        r"[1-9]",
        text,
    )


def test_models_list_the_asr_model_with_its_aliases(server):
    status, body = server.get_json("/v1/models/whisper-1")
    assert status == 200
    assert body["id"] == "whisper-tiny-en"
    assert body["tasks"] == ["transcription"]
    assert {"whisper-1", "gpt-4o-transcribe"} <= set(body["aliases"])


def test_served_speech_decodes_to_what_was_uploaded(spoken):
    """The fixture's files are real audio of plausible length (guards the tests above)."""
    samples, rate = decode(spoken["three.wav"], "wav")
    assert 5 < samples.size / rate < 30
    assert io.BytesIO(spoken["three.mp3"]).getbuffer().nbytes > 1000


# ---- the upload's bounds, on the app with a stand-in pipeline (no server process, no Whisper)


async def test_a_slow_upload_gets_408(app_client):
    client = await app_client(body_timeout_s=0.3)

    async def trickle():
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
        await asyncio.sleep(5)  # the rest never comes in time
        yield b"\r\n--b--\r\n"

    response = await client.post(
        "/v1/audio/transcriptions",
        data=trickle(),
        headers={"Content-Type": "multipart/form-data; boundary=b"},
    )
    assert response.status == 408
    assert (await response.json())["error"]["code"] == "request_timeout"


@pytest.mark.parametrize(
    ("content_type", "body", "code"),
    [
        ("multipart/form-data; boundary=b", b"no boundary anywhere", "invalid_request"),
        ("multipart/form-data", b"--b\r\n\r\n", "invalid_request"),  # no boundary parameter
        ("text/plain", b"hello", "invalid_request"),
    ],
    ids=["no-parts", "no-boundary", "not-multipart"],
)
async def test_malformed_forms_are_400s(app_client, content_type, body, code):
    client = await app_client()
    response = await client.post(
        "/v1/audio/transcriptions", data=body, headers={"Content-Type": content_type}
    )
    assert response.status == 400
    assert (await response.json())["error"]["code"] in (code, "missing_required_parameter")


async def test_a_model_that_does_not_transcribe_is_refused_after_the_form(app_client):
    client = await app_client()
    form = aiohttp.FormData()
    form.add_field("model", "quiet")  # the stand-in speech model
    form.add_field("file", b"RIFF", filename="a.wav")
    response = await client.post("/v1/audio/transcriptions", data=form)
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "unsupported_task"
