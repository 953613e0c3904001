"""Fixtures for the embedded voice tests: the real repository's stages, loaded in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_bench.inprocess import InProcessVoice
from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.plan import Plan

REPOSITORY = Path(__file__).resolve().parents[2] / "repository"


@pytest.fixture(scope="session")
def repository() -> Path:
    return REPOSITORY


@pytest.fixture(scope="session")
def plan() -> Plan:
    return compile_repository(REPOSITORY)


@pytest.fixture(scope="session")
def voice() -> InProcessVoice:
    return InProcessVoice(REPOSITORY)


@pytest.fixture(scope="session")
def whisper():
    from omni_server.audio.whisper import Recognizer, load_whisper

    return Recognizer(load_whisper())
