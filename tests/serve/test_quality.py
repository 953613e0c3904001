"""Served audio is intelligible: the bundled Whisper tiny.en transcribes it back to its text."""

from __future__ import annotations

import pytest
from openai import OpenAI

from omni_bench.first_chunk_wer import HELD_OUT
from omni_bench.speech import load_dataset
from omni_bench.wer import word_error_rate
from omni_server.audio import decode
from omni_server.audio.whisper import Recognizer, load_whisper

pytestmark = pytest.mark.timeout(300)

# Plain sentences (normalize_text equates spelled-out numbers and digits; none are needed here).
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you get home tonight.",
    "The weather will be sunny and warm for the rest of the week.",
    "She sells sea shells by the sea shore.",
]


@pytest.mark.parametrize(("response_format", "stream_format"), [("mp3", None), ("pcm", "audio")])
def test_served_speech_transcribes_with_low_wer(
    client: OpenAI, response_format: str, stream_format: str | None
):
    whisper = Recognizer(load_whisper())
    hypotheses = []
    for sentence in SENTENCES:
        # None: the whole response (`"stream": false`); "audio": streamed as it is synthesized
        extra = {} if stream_format is None else {"stream_format": stream_format}
        with client.audio.speech.with_streaming_response.create(
            model="tts-1",
            voice="alloy",
            input=sentence,
            response_format=response_format,
            extra_body={"seed": 11, **({"stream": False} if stream_format is None else {})},
            **extra,
        ) as response:
            body = response.read()
        hypotheses.append(whisper.transcribe(*decode(body, response_format)))
    wer = word_error_rate(SENTENCES, hypotheses)
    assert wer < 0.15, f"WER {wer:.2f}: {list(zip(SENTENCES, hypotheses, strict=True))}"


def test_served_first_chunks_keep_held_out_sentences_intelligible(client: OpenAI):
    """The embedded voice cuts each request's first sentence for a sooner first audio chunk
    (text_frontend `first_chunk_words`); on sentences never used to tune the voice, the
    served, streamed speech still transcribes back (the cut once cost words at the join:
    "a pale" -> "at pale", "hung new curtains" -> "hun new curtin"). WER over the first 8
    held-out texts (one sentence each, all of them cut)."""
    texts = load_dataset(HELD_OUT)[:8]
    whisper = Recognizer(load_whisper())
    hypotheses = []
    for seed, text in enumerate(texts):
        with client.audio.speech.with_streaming_response.create(
            model="tts-1",
            voice="alloy",
            input=text,
            response_format="pcm",
            stream_format="audio",
            extra_body={"seed": seed},
        ) as response:
            body = response.read()
        hypotheses.append(whisper.transcribe(*decode(body, "pcm")))
    wer = word_error_rate(texts, hypotheses)
    assert wer < 0.08, f"WER {wer:.3f}: {list(zip(texts, hypotheses, strict=True))}"
