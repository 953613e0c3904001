"""The embedded thinker stage (SmolLM2-135M on the engine) served by the runtime: the real model
in a real stage process, driven through the "ar" scheduler. One runtime serves the module's
tests (its start loads the model; each test's requests are independent of the others')."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio

from omni_server.compiler.compiler import compile_repository
from omni_server.contracts import ChatInput, Message, Sampling, SpeechOptions
from omni_server.pipeline import PipelineError
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.asyncio(loop_scope="module"),  # the module's one runtime lives on its loop
]

THINKER = Path(__file__).resolve().parents[2] / "repository" / "thinker"
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is two plus two?",
    "Say hello.",
]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("thinker-repo")
    stage = (THINKER / "stage.toml").read_text().replace('stream_to = ["text_frontend"]\n', "")
    stage = stage.replace("max_total_tokens = 8192", "max_total_tokens = 2048")
    make_repo(
        root,
        {"thinker": stage},
        toml("""
            [models.chat]
            entry = "thinker"
            tasks = ["chat"]
        """),
        {"thinker": THINKER / "model.py"},
    )
    return compile_repository(root)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(plan):
    async with running(plan) as started:  # stopped and checked for leaks after the module
        yield started


def _inputs(question: str, speech: SpeechOptions | None = None, **sampling) -> dict:
    """The thinker's typed inputs, as the chat endpoint builds them."""
    messages = (Message("user", question),)
    return ChatInput(messages, Sampling(max_tokens=12, **sampling), speech).payload()


async def _answer(runtime, inputs: dict) -> tuple[str, dict]:
    handle = runtime.submit(runtime.plan.models["chat"], inputs)
    text = "".join([chunk["text"] async for chunk in handle])
    return text, await handle.result()


async def test_greedy_answers_are_the_same_alone_and_in_a_batch_and_seeds_repeat(runtime):
    alone = [await _answer(runtime, _inputs(q, temperature=0)) for q in QUESTIONS]
    batched = await asyncio.gather(
        *(_answer(runtime, _inputs(q, temperature=0)) for q in QUESTIONS)
    )
    seeded = [
        await _answer(runtime, _inputs(QUESTIONS[0], temperature=1.0, seed=7)) for _ in range(2)
    ]
    assert alone == list(batched)
    for text, result in alone:
        assert text == result["text"] and text.strip()
        assert result["finish_reason"] in ("stop", "length")
        assert 0 < result["usage"]["completion_tokens"] <= 12
        assert result["usage"]["prompt_tokens"] > 5
    assert "Paris" in alone[0][0]
    assert seeded[0] == seeded[1]


async def test_a_prompt_over_the_context_is_the_callers_fault(runtime):
    with pytest.raises(PipelineError) as err:
        await _answer(runtime, _inputs("word " * 3000))
    text, _ = await _answer(runtime, _inputs(QUESTIONS[2], temperature=0))  # the stage goes on
    assert err.value.code == "invalid_request"
    assert err.value.error_code == "context_length_exceeded" and err.value.param == "messages"
    assert text.strip()


async def test_text_the_tokenizer_cannot_encode_is_the_callers_fault(runtime):
    """Issue 42 item 1: a lone surrogate (the server's edges refuse it first) is refused by the
    thinker in its own process as the caller's fault (a 400 across processes), not the
    tokenizer's TypeError (a 500); the stage goes on."""
    with pytest.raises(PipelineError) as err:
        await _answer(runtime, _inputs("Hello \ud800 there. "))
    assert err.value.code == "invalid_request"
    assert (err.value.error_code, err.value.param) == ("invalid_value", "messages")
    assert "unpaired UTF-16 surrogate (U+D800)" in err.value.message
    text, _ = await _answer(runtime, _inputs(QUESTIONS[2], temperature=0))
    assert text.strip()


async def test_speech_options_ride_the_first_chunk(runtime):
    speech = SpeechOptions("joe", speed=1.0, seed=1, response_format="pcm", stream=True)
    handle = runtime.submit(
        runtime.plan.models["chat"], _inputs(QUESTIONS[3], speech, temperature=0)
    )
    chunks = [chunk async for chunk in handle]
    await handle.result()
    assert chunks[0]["speech"] == speech
    assert all("speech" not in chunk for chunk in chunks[1:])
