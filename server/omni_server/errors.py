"""The one error the pipeline raises to its callers (the serving layer): a leaf module."""

from __future__ import annotations

from typing import Literal

# the `error_code` of a request that ran out of GPU memory in a stage (stage/scheduling/oom.py
# raises it; the HTTP layer names it in its 500); the stage serves on
OUT_OF_GPU_MEMORY = "out_of_gpu_memory"

ErrorCode = Literal[
    "stage_failed", "invalid_request", "process_died", "aborted", "unavailable", "timeout"
]


class PipelineError(Exception):
    """A request (or the whole pipeline) failed.

    `code` says why: a backend raised ("stage_failed"), a backend refused the request's input
    (`backend.InvalidRequest`: "invalid_request", with the OpenAI `error_code` and `param` it
    gave), a stage process died ("process_died"), the request was aborted ("aborted"), a stage
    ran past its time ("timeout"), or the pipeline cannot take requests ("unavailable").
    `stage` names the stage at fault when there is one.
    """

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode,
        stage: str | None = None,
        error_code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code: ErrorCode = code
        self.stage = stage
        self.error_code = error_code
        self.param = param

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only arguments need a pickle recipe
        return (_rebuild, (self.message, self.code, self.stage, self.error_code, self.param))


def _rebuild(
    message: str, code: ErrorCode, stage: str | None, error_code: str | None, param: str | None
) -> PipelineError:
    return PipelineError(message, code=code, stage=stage, error_code=error_code, param=param)
