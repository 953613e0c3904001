"""`POST /v1/chat/completions` on the embedded repository: the real thinker (SmolLM2-135M on the
engine) behind the real server, through the official `openai` client.

The server is the session's (tests/serve/conftest.py). Greedy decoding (temperature 0) makes the
answers deterministic, so a streamed answer must equal the whole one token for token.
"""

from __future__ import annotations

import base64
import re

import openai
import pytest
from openai import OpenAI

from omni_bench.wer import word_error_rate
from omni_server.audio import decode
from tests.helpers.metrics import samples, value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smol-chat"
OMNI = "smol-omni"  # the thinker followed by the voice
# Whisper tiny.en hearing the voice speak a short answer: one slip in six words ("France is" ->
# "Francis") is 0.33; silence or the wrong words score near 1.
MAX_WER = 0.5
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 24}


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z']+", text)


def test_a_greedy_answer_is_english(client: OpenAI):
    completion = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    answer = completion.choices[0].message.content
    assert completion.model == MODEL
    words = _words(answer)
    assert len(words) >= 3, answer
    # English prose: letters, spaces and punctuation of the ASCII range, and common words
    assert sum(c.isascii() for c in answer) / len(answer) > 0.95, answer
    common = {"the", "is", "of", "a", "and", "in", "paris", "capital", "france"}
    assert common & {w.lower() for w in words}, answer
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_the_default_answer_names_paris(client: OpenAI):
    """No sampling field, as OpenAI's quickstart asks: the thinker's [sampling] (temperature 0.2,
    top_p 0.9, max_tokens 512) applies. Sampled, so seeded: about 2 seeds in 5 begin "L'Étoile"
    and ramble in French (docs/serving.md#sampling-defaults); seeds 1, 3 and 4 answer Paris,
    while at OpenAI's temperature 1 they ramble (seed 1 naming Paris in passing)."""
    (listed,) = [m for m in client.models.list().data if m.id == MODEL]
    assert listed.sampling == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 512}
    for seed in (1, 3, 4):
        completion = client.chat.completions.create(model=MODEL, messages=QUESTION, seed=seed)
        answer = completion.choices[0].message.content
        assert "Paris" in answer, (seed, answer)
        assert completion.choices[0].finish_reason == "stop", (seed, answer)


def test_streamed_equals_whole_at_temperature_0(client: OpenAI):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    *body, usage_chunk = chunks
    streamed = "".join(c.choices[0].delta.content or "" for c in body)
    assert streamed == whole.choices[0].message.content
    assert len([c for c in body if c.choices[0].delta.content]) > 1  # token by token
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage_chunk.choices == []
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()


def test_usage_counts_the_prompt_and_the_answer(client: OpenAI):
    short = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    follow_up = [
        *QUESTION,
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And the capital of Spain?"},
    ]
    longer = client.chat.completions.create(model=MODEL, messages=follow_up, **GREEDY)
    cut = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_completion_tokens=3
    )
    assert short.usage.prompt_tokens > len(_words(QUESTION[0]["content"]))
    # two more turns of eight words add at least those tokens (and their role markers)
    assert longer.usage.prompt_tokens >= short.usage.prompt_tokens + 8 + 4
    assert cut.usage.prompt_tokens == short.usage.prompt_tokens
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 3
    assert 0 < short.usage.completion_tokens <= GREEDY["max_tokens"]
    for c in (short, longer, cut):
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_context_window_is_a_400(client: OpenAI, stream):
    # about 10000 tokens: over the thinker's 8192-token budget, under the 1 MiB body limit
    flood = [{"role": "user", "content": "hello " * 10_000}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=flood, stream=stream, max_tokens=8)
    assert err.value.code == "context_length_exceeded"
    assert err.value.param == "messages"
    # the thinker is still serving
    completion = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    assert completion.choices[0].message.content


# ---- audio out: the thinker's words spoken by the voice (smol-omni)


@pytest.fixture(scope="module")
def omni(client: OpenAI) -> str:
    if OMNI not in {m.id for m in client.models.list()}:
        pytest.skip(f"the embedded repository has no {OMNI} model yet")
    return OMNI


def _audio_seconds(server) -> float:
    return value(samples(server.metrics()), "omni_audio_seconds_total", model=OMNI)


def test_a_spoken_answer_is_the_text_answer_and_as_long_as_reported(server, client, omni):
    text = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY)
    before = _audio_seconds(server)
    completion = client.chat.completions.create(
        model=omni,
        messages=QUESTION,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
        seed=1,
        **GREEDY,
    )
    reported = _audio_seconds(server) - before
    message = completion.choices[0].message
    assert message.content is None
    # the same thinker, greedy: the omni model says what the chat model writes
    assert message.audio.transcript == text.choices[0].message.content
    assert completion.usage.model_dump() == text.usage.model_dump()
    wav = base64.b64decode(message.audio.data)
    clip = decode(wav, "wav")
    assert clip.sample_rate == 24000  # OpenAI's, resampled from the 22.05 kHz voice
    assert clip.samples.size / clip.sample_rate == pytest.approx(reported, abs=0.002)
    assert reported > 0.5
    heard = client.audio.transcriptions.create(
        model="whisper-1", file=("answer.wav", wav, "audio/wav")
    )
    assert word_error_rate([message.audio.transcript], [heard.text]) <= MAX_WER, heard.text


def test_a_streamed_spoken_answer_is_pcm16_as_long_as_reported(server, client, omni):
    before = _audio_seconds(server)
    chunks = list(
        client.chat.completions.create(
            model=omni,
            messages=QUESTION,
            modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "pcm16"},
            stream=True,
            seed=1,
            **GREEDY,
        )
    )
    reported = _audio_seconds(server) - before
    audios = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    transcript = "".join(a.transcript or "" for a in audios)
    pcm = b"".join(base64.b64decode(a.data) for a in audios if a.data)
    assert transcript.strip()
    assert len([a for a in audios if a.data]) > 1  # sentence by sentence, not one file
    assert len(pcm) / 2 / 24000 == pytest.approx(reported, abs=0.002)
    assert reported > 0.5
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
