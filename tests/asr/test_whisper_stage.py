"""The recognizer stage's parameters: the beam it decodes with, and what it refuses."""

from __future__ import annotations

import pytest

from omni_bench.inprocess import load_stage
from omni_server.audio import whisper
from omni_server.backend import StageConfigError


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
