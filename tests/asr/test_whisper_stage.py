"""The recognizer stage: its parameters (the beam it decodes with, what it refuses) and its
continuous batching (requests sharing calls, each with its own result and errors)."""

from __future__ import annotations

import numpy as np
import pytest

from omni_bench.inprocess import load_stage
from omni_bench.wer import word_error_rate
from omni_server.audio import vad, whisper
from omni_server.backend import Request, StageConfigError, StepOutput
from omni_server.contracts import AsrOptions

from .conftest import TEXTS


@pytest.mark.parametrize("beam", [0, -1, 17, 2.5, "5", True])
def test_a_bad_beam_size_names_the_file_and_the_field(plan, beam):
    with pytest.raises(StageConfigError) as refused:
        load_stage(plan, "asr_whisper", parameters={"beam_size": beam})
    message = str(refused.value)
    assert "asr_whisper/stage.toml" in message
    assert "parameters.beam_size must be an integer in [1, 16]" in message
    assert repr(beam) in message


@pytest.mark.slow  # loads Whisper
def test_the_stage_decodes_with_the_beam_its_descriptor_names(plan):
    assert plan.stages["asr_whisper"].parameters["beam_size"] == whisper.SERVED_BEAM_SIZE
    assert load_stage(plan, "asr_whisper").recognizer.beam_size == whisper.SERVED_BEAM_SIZE
    greedy = load_stage(plan, "asr_whisper", parameters={"beam_size": 1})
    assert greedy.recognizer.beam_size == 1


def _request(name: str, audio, **options) -> Request:
    windows = vad.pack_windows(vad.segment_speech(audio))
    inputs = {"audio": audio, "duration": audio.size / 16000, "windows": windows}
    return Request(id=name, inputs={**inputs, "options": AsrOptions(**options)})


def _run(stage, requests: list[Request]) -> dict[str, list[StepOutput]]:
    """Play the ar scheduler: add them all, step until each has finished or failed."""
    for request in requests:
        stage.add(request)
    outputs: dict[str, list[StepOutput]] = {r.id: [] for r in requests}
    ended: set[str] = set()
    for _ in range(200):
        for output in stage.step():
            assert output.request.id not in ended  # nothing after a request's end
            outputs[output.request.id].append(output)
            if output.finished or output.error is not None:
                ended.add(output.request.id)
        if len(ended) == len(requests):
            return outputs
    raise AssertionError(f"not finished after 200 steps: {set(outputs) - ended}")


@pytest.mark.slow  # loads Whisper
def test_concurrent_requests_share_calls_and_each_hears_its_own_clip(plan, clips, paused):
    stage = load_stage(plan, "asr_whisper")
    calls: list[int] = []  # requests in each call
    decode = stage.recognizer.decode

    def counted(batch):
        calls.append(len({id(w.owner) for w in batch}))
        return decode(batch)

    stage.recognizer.decode = counted
    requests = [_request("a", clips[0]), _request("b", clips[1]), _request("c", paused.samples)]
    outputs = _run(stage, requests)
    assert calls[0] == 3  # the first call held one window of each request
    texts = {"a": TEXTS[0], "b": TEXTS[1], "c": " ".join(TEXTS)}
    for name, got in outputs.items():
        assert got[0].chunk == {
            "language": "en",
            "duration": pytest.approx(next(r for r in requests if r.id == name).inputs["duration"]),
        }
        assert got[-1].finished and all(o.error is None for o in got)
        heard = " ".join(s["text"] for o in got[1:] if o.chunk for s in o.chunk["segments"])
        assert word_error_rate([texts[name]], [heard]) <= 0.1, (name, heard)
        starts = [s["start"] for o in got[1:] if o.chunk for s in o.chunk["segments"]]
        assert starts == sorted(starts)


@pytest.mark.slow  # loads Whisper
def test_a_failing_request_fails_alone(plan, clips):
    """A call that raises fails the request whose windows made it fail; the others in the same
    call are decoded again without it and finish."""
    stage = load_stage(plan, "asr_whisper")
    decode = stage.recognizer.decode

    def broken_on_bad(batch):
        if any(w.owner.options.words for w in batch):  # "bad": the one asking for words
            raise RuntimeError("this clip breaks the decoder")
        return decode(batch)

    stage.recognizer.decode = broken_on_bad
    outputs = _run(
        stage,
        [
            _request("good", clips[0]),
            _request("bad", clips[1], words=True),
            _request("also", clips[2]),
        ],
    )
    errors = [o.error for o in outputs["bad"] if o.error is not None]
    assert [e.args for e in errors] == [("this clip breaks the decoder",)]
    for name in ("good", "also"):
        assert outputs[name][-1].finished and all(o.error is None for o in outputs[name])
        assert any(o.chunk and o.chunk.get("segments") for o in outputs[name])


@pytest.mark.slow  # loads Whisper
def test_silence_finishes_with_its_header_and_no_segment(plan):
    stage = load_stage(plan, "asr_whisper")
    outputs = _run(stage, [_request("quiet", np.zeros(32000, np.float32))])["quiet"]
    assert outputs[0].chunk == {"language": "en", "duration": 2.0}
    assert outputs[-1].finished and not any(o.chunk and "segments" in o.chunk for o in outputs)
