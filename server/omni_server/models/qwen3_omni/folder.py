"""The checkpoint folder a Qwen3-Omni repository's [parameters] names (`checkpoint`), checked
once by every stage that reads it (examples/qwen3-omni/): a folder, config.json's model_type
`qwen3_omni_moe`, a tokenizer. A wrong one stops the start with one line naming it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MODEL_TYPE = "qwen3_omni_moe"


class CheckpointFolderError(ValueError):
    """The repository's checkpoint parameter names no Qwen3-Omni checkpoint folder."""


def checkpoint_folder(parameters: Mapping[str, Any]) -> Path:
    value = parameters.get("checkpoint")
    if not isinstance(value, str) or not value:
        raise CheckpointFolderError(
            "parameters.checkpoint is not set: serve with --parameters.checkpoint DIR (a "
            "Qwen3-Omni checkpoint folder, e.g. one omni-bench random-checkpoint wrote)"
        )
    folder = Path(value).expanduser().resolve()
    if not folder.is_dir():
        raise CheckpointFolderError(f"checkpoint {folder}: no such folder")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointFolderError(f"checkpoint {folder}: no readable config.json: {err}") from err
    found = config.get("model_type") if isinstance(config, dict) else None
    if found != MODEL_TYPE:
        raise CheckpointFolderError(
            f"checkpoint {folder}: config.json's model_type is {found!r}; this pipeline "
            f"serves {MODEL_TYPE!r}"
        )
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointFolderError(f"checkpoint {folder}: no tokenizer.json")
    return folder
