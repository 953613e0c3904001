"""`POST /v1/chat/completions` on the embedded repository: the real thinker (SmolLM2-135M on the
engine) behind the real server, through the official `openai` client.

The server is the session's (tests/serve/conftest.py). Greedy decoding (temperature 0) makes the
answers deterministic, so a streamed answer must equal the whole one token for token.
"""

from __future__ import annotations

import re

import openai
import pytest
from openai import OpenAI

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smol-chat"
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
