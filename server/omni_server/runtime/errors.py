"""The one error the runtime raises to its callers (the serving layer)."""

from __future__ import annotations

from typing import Literal

ErrorCode = Literal["stage_failed", "process_died", "aborted", "unavailable"]


class PipelineError(Exception):
    """A request (or the whole pipeline) failed.

    `code` says why: a backend raised ("stage_failed"), a stage process died ("process_died"),
    the request was aborted ("aborted"), or the pipeline cannot take requests ("unavailable").
    `stage` names the stage at fault when there is one.
    """

    def __init__(self, message: str, *, code: ErrorCode, stage: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code: ErrorCode = code
        self.stage = stage

    def __reduce__(self):  # keyword-only arguments need an explicit pickle recipe
        return (_rebuild, (self.message, self.code, self.stage))


def _rebuild(message: str, code: ErrorCode, stage: str | None) -> PipelineError:
    return PipelineError(message, code=code, stage=stage)
