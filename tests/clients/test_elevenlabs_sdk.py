"""ElevenLabs' own Python SDK (`elevenlabs` on PyPI) on the text-in WebSocket, with its defaults.

`client.text_to_speech.convert_realtime(voice_id, text=...)` connects to ElevenLabs' path
`/v1/text-to-speech/{voice_id}/stream-input`, asks for its default `mp3_44100_128`, sends its own
opening message and text chunks, and reads `message` from an error. It always builds a `wss://`
URL, so the server sits behind a TLS proxy here (tests/helpers/tls_proxy.py), as it would behind
an operator's reverse proxy. The real voice is heard by the server's own Whisper; the error and
the key run on the stand-in voice in-process (tests/serve/inline.py).

The SDK has no seed (its query is model_id and output_format only), so the voice's noise differs
run to run: the texts are long enough (17 words) that one misheard word is far from the bound.
"""

from __future__ import annotations

import asyncio
import io
import wave
from urllib.parse import urlparse

import httpx2
import numpy as np
import pytest
from elevenlabs.client import ElevenLabs
from elevenlabs.core.api_error import ApiError as ElevenLabsError

from omni_bench.wer import word_error_rate
from omni_server.audio import decode
from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from omni_server.serve.realtime.audio import PCMU
from omni_server.serve.realtime.audio import decode as decode_g711
from tests.helpers.tls_proxy import TlsProxy, self_signed_certificate
from tests.serve.inline import MODEL, inline_runtime, listening

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKENS = ["The weather ", "is lovely ", "today. ", "Tomorrow ", "it will ", "rain, and "]
TOKENS += ["the wind ", "will blow ", "from the ", "cold north."]
SAID = "".join(TOKENS)
MAX_WER = 0.3  # unseeded: see the module's docstring


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def wss_url(server_url, certificate):
    address = urlparse(server_url)
    with TlsProxy((address.hostname, address.port), *certificate) as proxy:
        yield proxy.url


@pytest.fixture
def trusted(certificate, monkeypatch):
    """The SDK's WebSocket trusts the proxy's certificate (its default SSL context reads this)."""
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))


def _wav(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def _heard(server_url: str, samples: np.ndarray, rate: int) -> str:
    answer = httpx2.post(
        f"{server_url}/v1/audio/transcriptions",
        data={"model": "whisper-1"},
        files={"file": ("said.wav", _wav(samples, rate), "audio/wav")},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["text"]


def test_the_sdk_with_its_defaults_gets_mp3(server_url, wss_url, trusted):
    client = ElevenLabs(api_key="unused", base_url=wss_url)
    audio = b"".join(
        client.text_to_speech.convert_realtime(
            voice_id="alloy", text=iter(TOKENS), model_id="tts-1"
        )
    )
    clip = decode(audio, "mp3")  # one MP3 stream across the sentences
    assert clip.sample_rate == 44_100 and len(clip.samples) > 2 * 44_100
    heard = _heard(server_url, clip.samples, clip.sample_rate)
    assert word_error_rate([SAID], [heard]) <= MAX_WER, heard


@pytest.mark.parametrize("output_format", ["ulaw_8000", "pcm_16000"])
def test_the_sdk_gets_telephony_and_pcm_formats(server_url, wss_url, trusted, output_format):
    client = ElevenLabs(api_key="unused", base_url=wss_url)
    audio = b"".join(
        client.text_to_speech.convert_realtime(
            voice_id="joe", text=iter(TOKENS), model_id="tts-1", output_format=output_format
        )
    )
    if output_format == "ulaw_8000":
        samples, rate = decode_g711(audio, PCMU), 8000  # one byte a sample
    else:
        samples, rate = decode(audio, "pcm", pcm_rate=16_000).samples, 16_000
    assert len(samples) > 2 * rate
    heard = _heard(server_url, samples, rate)
    assert word_error_rate([SAID], [heard]) <= MAX_WER, (output_format, heard)


@pytest.fixture
async def stand_in_wss(tmp_path, certificate):
    """The stand-in voice in-process, with an API key, behind the TLS proxy."""
    options = ServeOptions(api_key="sk-eleven")
    async with (
        inline_runtime(tmp_path / "repo") as runtime,
        listening(create_app(runtime, options=options), options) as port,
    ):
        with TlsProxy(("127.0.0.1", port), *certificate) as proxy:
            yield proxy.url


def _speak(url: str, key: str, text: list[str]) -> bytes:
    client = ElevenLabs(api_key=key, base_url=url)
    stream = client.text_to_speech.convert_realtime(
        voice_id="hush", text=iter(text), model_id=MODEL, output_format="pcm_24000"
    )
    return b"".join(stream)


async def test_the_sdk_sends_its_key_and_reads_the_error_message(stand_in_wss, trusted):
    # xi-api-key, the header the SDK sends, is the server's key: the session speaks
    audio = await asyncio.to_thread(_speak, stand_in_wss, "sk-eleven", ["hello there."])
    assert audio == bytes(len(audio)) and len(audio) >= 3 * 480  # the stand-in's silence
    # a stage fails: ElevenLabs' error shape, whose `message` the SDK raises with the close code
    with pytest.raises(ElevenLabsError) as failed:
        await asyncio.to_thread(_speak, stand_in_wss, "sk-eleven", ["fail now."])
    assert failed.value.status_code == 1011
    body = failed.value.body
    assert set(body) == {"message", "error", "code"} and body["code"] == 1011, body
    assert body["error"] == "pipeline_error" and "libfoo" not in body["message"], body
    # a wrong key is refused at the upgrade
    with pytest.raises(Exception, match="401"):
        await asyncio.to_thread(_speak, stand_in_wss, "sk-wrong", ["hello there."])
