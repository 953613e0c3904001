"""EngineConfig (omni_server/engine_config.py) is the one declaration of the `[engine]` table:
the compiler checks a stage file with its checks and messages (naming file, stage and field,
before any process starts), overrides are typed by it, and docs/engine.md's table is its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.schema import ENGINE_FIELDS
from omni_server.engine import EngineConfig
from omni_server.engine_config import EngineConfigError, docs_table, table_fields
from tests.helpers.repo import make_repo

DOCS = Path(__file__).resolve().parents[2] / "docs" / "engine.md"

MODELS = '[models.chat]\nentry = "thinker"\ntasks = ["chat"]\n'


def _repo(tmp_path: Path, engine: str) -> Path:
    stage = f'backend = "Thinker"\nterminal = true\n[engine]\n{engine}\n'
    return make_repo(tmp_path / "repo", stages={"thinker": stage}, repository=MODELS)


def test_the_docs_table_is_engine_configs() -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert "\n".join(docs_table()) in text


def test_the_compilers_engine_fields_are_engine_configs() -> None:
    names = [f.name for f in table_fields()]
    assert list(ENGINE_FIELDS) == names
    assert "device" not in names and "gpu_memory_fraction" not in names  # the stage's own
    assert ENGINE_FIELDS["decode_attention"].choices == ("auto", "paged", "gather")


@pytest.mark.parametrize(
    ("engine", "field", "message"),
    [
        ("max_batch_size = 0", "engine.max_batch_size", "must be a positive integer, got 0"),
        ('decode_attention = "flash"', "engine.decode_attention", "must be one of"),
        ('cuda_graphs = "yes"', "engine.cuda_graphs", "must be true or false"),
        # across fields: found by the compiler now, not when the stage's engine starts
        ("max_step_tokens = 8\nmax_batch_size = 8", "engine.max_step_tokens", "must exceed"),
    ],
)
def test_a_stage_file_gets_engine_configs_message(
    tmp_path: Path, engine: str, field: str, message: str
) -> None:
    with pytest.raises(RepositoryError) as info:
        compile_repository(_repo(tmp_path, engine))
    err = info.value
    assert err.stage == "thinker" and err.field == field, err
    assert err.file is not None and err.file.endswith("stage.toml")
    assert message in str(err)
    # the engine says the same of the same table
    table = dict(line.replace('"', "").split(" = ") for line in engine.splitlines())
    typed = {k: int(v) if v.isdigit() else v for k, v in table.items()}
    with pytest.raises(EngineConfigError) as engine_err:
        EngineConfig.from_table(typed)
    assert f"engine.{engine_err.value.field}" == field
    assert message in str(engine_err.value)


def test_every_engine_field_is_accepted_by_the_compiler(tmp_path: Path) -> None:
    """decode_attention, attention_keys_per_token, max_prefill_beside_decodes were the
    engine's but not the compiler's: one declaration, one set of fields."""
    engine = 'decode_attention = "gather"\nattention_keys_per_token = 64\n'
    plan = compile_repository(_repo(tmp_path, engine + "max_prefill_beside_decodes = 16"))
    settings = plan.stages["thinker"].engine
    assert settings is not None and settings.settings["decode_attention"] == "gather"
