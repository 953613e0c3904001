"""The one error a repository can raise: it names the file, the stage and the field."""

from __future__ import annotations

from pathlib import Path


class RepositoryError(ValueError):
    """An invalid repository, or an invalid command-line override of one.

    `file` is the file the mistake lives in (or "command line" for an override), `stage` the
    stage it concerns (None for repository-wide fields) and `field` the dotted field path
    (None when the whole file is wrong). `str(error)` is one line naming all three and saying
    what would be valid; the CLI prints it as is.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | Path | None = None,
        stage: str | None = None,
        field: str | None = None,
    ) -> None:
        self.file = str(file) if file is not None else None
        self.stage = stage
        self.field = field
        self.reason = message
        where = [self.file] if self.file else []
        if stage is not None:
            where.append(f"stage '{stage}'")
        if field is not None:
            where.append(f"field '{field}'")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)
