"""What an operator may set about the HTTP layer: the door, the bounds, the timeouts.

One frozen value, built by the command line (`omni-server --api-key ...`, server.py) or by an
embedder calling `create_app(runtime, options=ServeOptions(...))`; docs/serving.md lists each
field with its flag and default.
"""

from __future__ import annotations

from dataclasses import dataclass

# Speech bodies are small (4096 characters of input, JSON-escaped at worst 12 bytes each); the
# limit leaves room for `instructions` and extension fields and rejects anything bigger with 413.
MAX_BODY_BYTES = 1 << 20
MAX_INPUT_CHARS = 4096  # OpenAI's limit, counted after NFKC normalization here
# The slowest script measured reads about 4.3 characters a second (U+FDFA expands to 18 Arabic
# characters; 100 of them gave 417 s), English prose about 15. An input's audio is estimated at
# 4 characters a second (divided by `speed`): never less than what the voice makes, so the
# bound below is a bound. 1024 s lets the longest input through at speed 1.
ESTIMATE_CHARS_PER_SECOND = 4.0
MAX_AUDIO_SECONDS = MAX_INPUT_CHARS / ESTIMATE_CHARS_PER_SECOND


@dataclass(frozen=True)
class ServeOptions:
    # the door
    api_key: str | None = None  # Bearer key for every API route; None: no authentication
    metrics_need_key: bool = True  # /metrics behind the key too (when there is one)
    allowed_origins: tuple[str, ...] = ()  # CORS: exact origins, or "*"; () sends no CORS headers
    # Host header names accepted when bound to loopback (DNS rebinding); None: any Host
    allowed_hosts: frozenset[str] | None = None
    # POST /v2/repository/...: Triton's model repository API (serve/repository_api.py)
    repository_api: bool = True
    # work per request
    max_body_bytes: int = MAX_BODY_BYTES
    max_input_chars: int = MAX_INPUT_CHARS
    max_audio_seconds: float = MAX_AUDIO_SECONDS
    # admission, per served model: requests in the pipeline, and requests waiting for a place
    max_in_flight: int = 8
    max_queued: int = 32
    queue_timeout_s: float = 30.0  # a queued request that gets no place by then is a 429
    # connections
    header_timeout_s: float = 10.0  # from a connection's first byte of a request to its blank line
    body_timeout_s: float = 30.0  # to read a whole request body
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request in progress
    write_timeout_s: float = 30.0  # one write of a streamed response to a client not reading
    shutdown_grace_s: float = 5.0  # in-flight requests' time to finish after a stop signal

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_input_chars", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1; got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be 0 or more; got {self.max_queued}")
        for name in (
            "max_audio_seconds",
            "queue_timeout_s",
            "header_timeout_s",
            "body_timeout_s",
            "idle_timeout_s",
            "write_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be 0 or more; got {self.shutdown_grace_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; leave it out to serve without authentication")
