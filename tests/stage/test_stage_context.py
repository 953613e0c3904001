"""What a backend learns of the served models (`StageContext.models`): the models whose requests
visit its stage, as the server resolved them, command-line overrides included, in the stage's
own process (real stage processes: the context is built where the backend runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_server.compiler import compile_repository
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

# each stage adds what it was told about the models to the payload it hands on
SEEN = """\
from omni_server.backend import StageBackend


class Seen(StageBackend):
    def initialize(self, context):
        self.stage = context.stage
        self.models = {
            m.id: {"voices": list(m.voices), "default": m.default_voice}
            for m in context.models.values()
        }

    def execute(self, requests):
        return [{**r.inputs, self.stage: self.models} for r in requests]
"""

STAGES = {
    "front": toml("""
        backend = "model.py:Seen"
        next = "voice"
        """),
    "voice": toml("""
        backend = "model.py:Seen"
        terminal = true
        process = "speaker"
        """),
}
MODELS = toml("""
    [models.talk]
    entry = "front"
    tasks = ["speech"]
    voices = ["a", "b"]
    default_voice = "a"

    [models.direct]
    entry = "voice"
    tasks = ["speech"]
    voices = ["z"]
    """)


async def test_a_stage_sees_the_models_through_it_with_overrides(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo", STAGES, MODELS, {"front": SEEN, "voice": SEEN})
    plan = compile_repository(repo, ["--models.talk.voices", "a,b,c"])
    assert plan.process_of("front").name != plan.process_of("voice").name
    async with running(plan) as runtime:
        seen = await runtime.submit(plan.models["talk"], {}).result()
    talk = {"voices": ["a", "b", "c"], "default": "a"}
    assert seen["front"] == {"talk": talk}  # `direct` never visits it
    assert seen["voice"] == {"talk": talk, "direct": {"voices": ["z"], "default": None}}
