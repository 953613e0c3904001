"""repository.toml's [parameters]: free-form, every stage's backend sees them
(`context.repository_parameters`), `--parameters.<key>` overrides them like any field."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.render import config_toml
from tests.helpers.repo import make_repo, toml

STAGES = {
    "only": toml("""
    backend = "B"
    terminal = true
""")
}
MODEL = toml("""
    [models.m]
    entry = "only"
    tasks = ["speech"]
""")


def repo(tmp_path: Path, extra: str = "") -> Path:
    return make_repo(tmp_path / "repo", stages=STAGES, repository=extra + MODEL)


def test_the_table_is_read_overridden_and_printed(tmp_path: Path) -> None:
    root = repo(
        tmp_path,
        toml("""
        [parameters]
        checkpoint = "/models/a"
        [parameters.codec]
        rate = 24000
    """),
    )
    plan = compile_repository(root)
    assert plan.parameters == {"checkpoint": "/models/a", "codec": {"rate": 24000}}
    plan = compile_repository(
        root, ["--parameters.checkpoint", "/models/b", "--parameters.codec.rate", "16000"]
    )
    assert plan.parameters["checkpoint"] == "/models/b"
    assert plan.parameters["codec"]["rate"] == 16000
    text = config_toml(plan)
    assert '[parameters]\ncheckpoint = "/models/b"' in text
    assert "[parameters.codec]\nrate = 16000" in text


def test_absent_is_empty_and_an_override_creates_it(tmp_path: Path) -> None:
    root = repo(tmp_path)
    assert compile_repository(root).parameters == {}
    assert "[parameters]" not in config_toml(compile_repository(root))
    plan = compile_repository(root, ["--parameters.checkpoint=/x"])
    assert plan.parameters == {"checkpoint": "/x"}


def test_not_a_table_or_no_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match=r"parameters.*expected a table"):
        compile_repository(repo(tmp_path, "parameters = 3\n"))
    with pytest.raises(RepositoryError, match=r"unexpected argument .--parameters."):
        compile_repository(repo(tmp_path / "b"), ["--parameters", "x"])
