"""Fixtures for the ASR stages' tests: the embedded repository's plan, speech made by its voice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omni_bench import asr_audio
from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.plan import Plan

REPOSITORY = Path(__file__).resolve().parents[2] / "repository"
TEXTS = [
    "Please leave the blue folder on the desk by the door.",
    "The library closes early on Fridays during the summer.",
    "A small boat drifted past the harbor lights without a sound.",
    "Turn left at the bakery and walk two blocks toward the river.",
]


@pytest.fixture(scope="session")
def plan() -> Plan:
    return compile_repository(REPOSITORY)


@pytest.fixture(scope="session")
def clips() -> list[np.ndarray]:
    """Each of TEXTS spoken by the embedded voice, 16 kHz."""
    voice = asr_audio.VoiceSynth()
    return [voice.say(t) for t in TEXTS]


@pytest.fixture(scope="session")
def paused(clips) -> asr_audio.Speech:
    """The clips joined by 0.8-1.6 s of silence: four utterances with known places."""
    return asr_audio.join_with_pauses(clips, TEXTS, pause_s=(0.8, 1.6), seed=3)
