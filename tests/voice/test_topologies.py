"""Seeded audio through the real runtime equals the in-process voice, whatever the topology."""

from __future__ import annotations

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.partition import groups, subplan
from omni_server.contracts import SpeechOptions, speech_payload
from omni_server.pipeline.runtime import Runtime

pytestmark = pytest.mark.slow  # the real voice through runtime processes

TEXT = "Every topology speaks alike. The seed fixes every noise value."

TOPOLOGIES = {
    "default: voice x 2 replicas": [],
    "acoustic in its own process": [
        "--stages.acoustic.process", "acoustic", "--processes.voice.num_replicas", "1",
    ],
}  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overrides", TOPOLOGIES.values(), ids=TOPOLOGIES.keys())
async def test_seeded_audio_is_identical_through_the_runtime(voice, repository, overrides):
    expected = voice.speak(TEXT, response_format="pcm", stream=True, seed=5).body
    # the voice's part of the repository only (as `--load-model piper-joe` serves it): Whisper's
    # and SmolLM2's processes would take most of the start and play no part in the audio
    whole = compile_repository(repository, overrides)
    [(models, stages)] = groups(whole, ["piper-joe"])
    plan = subplan(whole, models, stages)
    assert set(plan.models) == {"piper-joe"}
    runtime = Runtime(plan)
    await runtime.start()
    try:
        for _ in range(2):  # two requests in turn: ties alternate, so both replicas serve
            speech = SpeechOptions("joe", seed=5, response_format="pcm", stream=True)
            handle = runtime.submit(plan.models["piper-joe"], speech_payload(TEXT, speech))
            chunks = [chunk["audio"] async for chunk in handle]
            result = await handle.result()
            assert len(chunks) >= 2  # one per sentence, streamed
            assert b"".join(chunks) == expected
            assert result["sentences"] == 2 and result["sample_rate"] == 24000
    finally:
        await runtime.stop()
