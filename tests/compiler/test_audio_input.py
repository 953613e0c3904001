"""`[models.<id>] audio_input`: how a model hears audio in (transcribed, or natively by its
entry), checked by the compiler and shown by `config resolve` where it is not the default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.render import config_json
from tests.helpers.repo import make_repo, toml

STAGES = {"thinker": toml('backend = "Thinker"\nterminal = true\n')}


def _repo(root: Path, model: str) -> Path:
    return make_repo(root, STAGES, toml('[models.omni]\nentry = "thinker"\n') + model)


def test_a_model_transcribes_unless_it_says_it_hears_audio(tmp_path: Path) -> None:
    plan = compile_repository(_repo(tmp_path / "a", 'tasks = ["chat"]\n'))
    assert plan.models["omni"].audio_input == "transcribe"
    assert not plan.models["omni"].hears_audio
    assert "audio_input" not in json.loads(config_json(plan))["models"]["omni"]


def test_a_native_model_reaches_the_plan_and_config_resolve(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "a", 'tasks = ["chat", "realtime"]\naudio_input = "native"\n')
    plan = compile_repository(repo)
    assert plan.models["omni"].hears_audio
    assert json.loads(config_json(plan))["models"]["omni"]["audio_input"] == "native"
    # the command line overrides it as any model field
    plan = compile_repository(repo, ["--models.omni.audio_input", "transcribe"])
    assert not plan.models["omni"].hears_audio


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        ('tasks = ["chat"]\naudio_input = "ears"\n', 'one of "transcribe", "native"'),
        ('tasks = ["speech"]\naudio_input = "native"\n', "only through chat or realtime"),
    ],
)
def test_a_bad_audio_input_names_file_model_and_field(
    tmp_path: Path, model: str, fragment: str
) -> None:
    with pytest.raises(RepositoryError) as info:
        compile_repository(_repo(tmp_path / "a", model))
    err = info.value
    assert err.file is not None and err.file.endswith("repository.toml")
    assert err.field == "models.omni.audio_input"
    assert fragment in str(err) and "models.omni.audio_input" in str(err)
