"""No single request's work takes the thinker down (issue 27, items 1 and 3), on the real
SmolLM2 thinker in real stage processes.

- A prompt that takes seconds to tokenize does not stop the process's heartbeat (the tokenizer
  releases the GIL; `heartbeat_timeout_s` here is shorter than the tokenizing), and one too long
  for the context whatever its tokens (the probe's 15 MB) is refused before any tokenizing.
- The thinker's `timeout_s` ends a long answer as `max_tokens` would: `finish_reason: "length"`,
  through HTTP chat with the official client, whole and streamed; the process lives on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from omni_server.compiler.compiler import compile_repository
from omni_server.contracts import ChatInput, Message, Sampling
from omni_server.pipeline import PipelineError
from omni_server.pipeline.supervision import SupervisionPolicy
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running
from tests.helpers.server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

THINKER = Path(__file__).resolve().parents[2] / "repository" / "thinker"
INSTANCE = "thinker@r0"
LONG_ANSWER = "Count from 1 to 1000, one number a line."


def _repo(root: Path, timeout_s: float | None = None) -> Path:
    stage = (THINKER / "stage.toml").read_text().replace('stream_to = ["text_frontend"]\n', "")
    if timeout_s is not None:
        stage = stage.replace("timeout_s = 120\n", f"timeout_s = {timeout_s}\n")
        assert f"timeout_s = {timeout_s}" in stage
    models = toml("""
        [models.chat]
        entry = "thinker"
        tasks = ["chat"]
    """)
    return make_repo(root, {"thinker": stage}, models, {"thinker": THINKER / "model.py"})


def _inputs(text: str, **sampling) -> dict:
    """The thinker's typed inputs, as the chat endpoint builds them."""
    return ChatInput((Message("user", text),), Sampling(max_tokens=16, **sampling)).payload()


async def test_a_prompt_that_takes_seconds_to_tokenize_leaves_the_heartbeat_beating(tmp_path):
    plan = compile_repository(_repo(tmp_path / "repo"))
    # silent for 1.5 s: frozen. Tokenizing the prompt below takes longer than that on any
    # machine here (about 0.6 M characters: seconds), so a tokenizer holding the GIL the whole
    # time would get the process killed, and every request after it would fail.
    policy = SupervisionPolicy(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5)
    async with running(plan, supervision=policy) as runtime:
        pids = runtime.processes()
        chars_a_token = 81  # SmolLM2's longest token; the thinker's bound is 8192 x this
        sentence = "The quick brown fox jumps over the lazy dog 12345. "
        near_the_bound = sentence * ((8192 * chars_a_token - 200) // len(sentence))
        with pytest.raises(PipelineError) as tokenized:
            await _result(runtime, _inputs(near_the_bound))
        with pytest.raises(PipelineError) as unread:  # the probe's 15 MB: refused unread
            await _result(runtime, _inputs("x" * 15_000_000))
        answer = await _result(runtime, _inputs("What is the capital of France?", temperature=0))
        assert runtime.restarts[INSTANCE] == 0 and runtime.processes() == pids
    # both are the caller's fault: over the 8192-token context (the first once tokenized)
    for err in (tokenized.value, unread.value):
        assert err.code == "invalid_request" and err.error_code == "context_length_exceeded"
    assert "tokens" in tokenized.value.message and "characters" in unread.value.message
    assert "Paris" in answer["text"]


async def _result(runtime, inputs: dict) -> dict:
    handle = runtime.submit(runtime.plan.models["chat"], inputs)
    async for _ in handle:
        pass
    return await handle.result()


@pytest.fixture(scope="module")
def timed_server(tmp_path_factory):
    """A server whose thinker bounds a request at 3 s (an answer of 1000 numbers takes
    minutes here)."""
    root = tmp_path_factory.mktemp("thinker-timeout")
    repo = _repo(root / "repo", timeout_s=3)
    with ServerProcess.start(repo, root / "server.log") as server:
        yield server


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_reaches_the_thinkers_timeout_ends_with_length(timed_server, stream):
    client = OpenAI(base_url=timed_server.url + "/v1", api_key="unused", max_retries=0)
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": LONG_ANSWER}],
        "max_tokens": 4000,
        "temperature": 0,
    }
    if stream:
        chunks = list(
            client.chat.completions.create(
                **body, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        completion = client.chat.completions.create(**body)
        text, finish = completion.choices[0].message.content, completion.choices[0].finish_reason
        usage = completion.usage
    assert finish == "length"
    # cut by the time, not by max_tokens; what was written so far is the answer (on a busy
    # machine 3 s may hold only a few tokens)
    assert usage is not None and usage.completion_tokens < 4000
    assert text is not None and (text.strip() or usage.completion_tokens <= 1)
    # not a killed process: the thinker serves on, and says so in its log
    again = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
    )
    assert again.choices[0].finish_reason in ("stop", "length")
    log = timed_server.log()
    assert "frozen" not in log and "past timeout_s" not in log and "restart" not in log.lower()
