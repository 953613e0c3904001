"""Read a repository folder into raw TOML tables (no validation beyond "it is TOML")."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_server.compiler.errors import RepositoryError

REPOSITORY_FILE = "repository.toml"
STAGE_FILE = "stage.toml"
# Stage and process names appear in dotted override paths and instance names (`x@r0`).
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")


@dataclass
class RawStage:
    name: str
    directory: Path  # resolved
    file: Path  # the stage.toml, as the user named the folder (for messages)
    data: dict[str, Any]


@dataclass
class RawRepository:
    root: Path  # resolved
    file: Path  # the repository.toml, as the user named the folder (for messages)
    data: dict[str, Any]
    stages: dict[str, RawStage] = field(default_factory=dict)


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise RepositoryError("file not found", file=path) from None
    except tomllib.TOMLDecodeError as e:
        raise RepositoryError(f"not valid TOML: {e}", file=path) from None
    except (OSError, UnicodeDecodeError) as e:
        raise RepositoryError(f"cannot read: {e}", file=path) from None


def load_repository(path: str | Path) -> RawRepository:
    """Read repository.toml and every stage folder (a folder holding a stage.toml)."""
    shown = Path(path)
    root = shown.resolve()
    if not root.is_dir():
        raise RepositoryError("repository folder not found", file=shown)
    repo_file = shown / REPOSITORY_FILE
    if not repo_file.is_file():
        raise RepositoryError(
            f"missing {REPOSITORY_FILE}: every repository declares its served models there",
            file=repo_file,
        )
    raw = RawRepository(root=root, file=repo_file, data=read_toml(repo_file))
    # Hidden folders (.git, editor backups) are never stages.
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for directory in folders:
        stage_file = shown / directory.name / STAGE_FILE
        if not (directory / STAGE_FILE).is_file():
            continue
        name = directory.name
        if not NAME.match(name):
            raise RepositoryError(
                "a stage folder name may hold only letters, digits, '_' and '-'",
                file=stage_file,
                stage=name,
            )
        raw.stages[name] = RawStage(name, directory, stage_file, read_toml(stage_file))
    if not raw.stages:
        raise RepositoryError(
            f"no stages: a stage is a sub-folder holding a {STAGE_FILE}", file=shown
        )
    return raw
