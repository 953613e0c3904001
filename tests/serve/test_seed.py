"""A request `seed` gives bit-identical audio on every run and in every process topology."""

from __future__ import annotations

import pytest
from openai import OpenAI

from omni_server.compiler.compiler import compile_repository
from tests.helpers.server import EMBEDDED_REPO, VOICE_ONLY, ServerProcess
from tests.serve.speech_texts import ONE_SENTENCE, THREE_SENTENCES

pytestmark = pytest.mark.timeout(300)


def speak(client: OpenAI, seed: int | None, response_format: str = "wav") -> bytes:
    extra = {} if seed is None else {"seed": seed}
    return client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input=THREE_SENTENCES,
        response_format=response_format,
        extra_body=extra,
    ).content


def test_same_seed_same_bytes(client: OpenAI):
    first, second = speak(client, 1234), speak(client, 1234)
    assert first == second
    assert speak(client, 1235) != first


def test_without_seed_audio_varies(client: OpenAI):
    # the voice samples noise (two RandomNormalLike nodes): unseeded runs differ, as it intends
    takes = {
        client.audio.speech.create(
            model="tts-1", voice="alloy", input=ONE_SENTENCE, response_format="pcm"
        ).content
        for _ in range(3)
    }
    assert len(takes) > 1


def other_topology() -> list[str]:
    """Overrides giving the embedded repository a process layout unlike its default one.

    Stages sharing a process are split out, each into a process of its own; the first stage
    of each shared process stays, so processes the repository configures keep a stage.
    Without shared processes, every stage joins the first stage's process instead.
    """
    plan = compile_repository(EMBEDDED_REPO)
    layout = {}
    for process in plan.processes.values():
        layout |= {stage: stage for stage in process.stages[1:]}
    if not layout:
        first = next(iter(plan.processes.values())).name
        layout = {stage: first for stage in plan.stages}
    args = []
    for stage, process in layout.items():
        args += [f"--stages.{stage}.process", process]
    return args


def stream_pcm(client: OpenAI, seed: int) -> bytes:
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=THREE_SENTENCES,
        response_format="pcm",
        stream_format="audio",
        extra_body={"seed": seed},
    ) as response:
        return b"".join(response.iter_bytes())


def test_same_seed_same_bytes_in_another_topology(client: OpenAI, tmp_path):
    streamed_default, whole_default = stream_pcm(client, 99), speak(client, 99, "flac")
    # only the voice loaded: the rest of the repository plays no part in its bytes
    with ServerProcess.start(
        EMBEDDED_REPO, tmp_path / "server.log", *other_topology(), *VOICE_ONLY
    ) as other:
        status, health = other.get_json("/health")
        assert status == 200 and health["ready"]
        with OpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0) as other_client:
            streamed_other = stream_pcm(other_client, 99)
            whole_other = speak(other_client, 99, "flac")
    assert streamed_other == streamed_default
    assert whole_other == whole_default
