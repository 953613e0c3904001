"""What an operator may set about the HTTP layer: the door, the bounds, the timeouts.

One frozen value, built by the command line (`omni-server --api-key ...`, server.py) or by an
embedder calling `create_app(runtime, options=ServeOptions(...))`; docs/serving.md lists each
field with its flag and default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omni_server.pipeline.supervision import HEARTBEAT_INTERVAL_S, SupervisionPolicy

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
# Realtime (docs/realtime.md#bounds). A session holds at most its conversation's characters
# (UCS-4 at worst: 4 bytes each) and 120 s of uncommitted audio (float32 at 16 kHz, 7.5 MiB), so
# the defaults bound it at about 8.5 MiB, and all sessions together at 16 times that. An item
# over 32768 characters cannot fit the embedded thinker's 8192-token context anyway (about 4
# characters a token in English); the conversation keeps 8 such items.
MAX_REALTIME_SESSIONS = 16
# The speech input stream (docs/stream_input.md): a session holds a socket and little else, but
# each speaks through its model's admission places; 32 open at once is what the default
# admission (8 in the pipeline, 32 waiting) can serve when all speak together.
MAX_SPEECH_STREAM_SESSIONS = 32
MAX_REALTIME_ITEM_CHARS = 32_768
MAX_REALTIME_CONVERSATION_CHARS = 262_144


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
    # realtime: sessions open at once (more are refused with 429 before the upgrade), one
    # conversation item's characters, and a whole conversation's
    max_realtime_sessions: int = MAX_REALTIME_SESSIONS
    max_realtime_item_chars: int = MAX_REALTIME_ITEM_CHARS
    max_realtime_conversation_chars: int = MAX_REALTIME_CONVERSATION_CHARS
    # the speech input stream: sessions open at once (more are refused with 429 before the
    # upgrade)
    max_speech_stream_sessions: int = MAX_SPEECH_STREAM_SESSIONS
    # connections
    header_timeout_s: float = 10.0  # from a connection's first byte of a request to its blank line
    body_timeout_s: float = 30.0  # to read a whole request body
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request in progress
    write_timeout_s: float = 30.0  # one write of a streamed response to a client not reading
    shutdown_grace_s: float = 5.0  # in-flight requests' time to finish after a stop signal
    # the pipeline: how long its stage processes may take to be ready (at start, on a restart,
    # on a model control load) before the start fails
    start_timeout_s: float = 300.0
    # a ready stage process silent (no heartbeat) this long is frozen: killed and restarted
    # (0: never); beats come every HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = 6.0
    # custom voices (docs/voices.md): where they are kept (None: nowhere, POST refuses) and
    # how many at most
    data_dir: Path | None = None
    max_custom_voices: int = 64

    def supervision(self) -> SupervisionPolicy:
        """The runtime's supervision policy with this server's heartbeat bound."""
        return SupervisionPolicy(heartbeat_timeout_s=self.heartbeat_timeout_s)

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_input_chars",
            "max_in_flight",
            "max_realtime_sessions",
            "max_realtime_item_chars",
            "max_realtime_conversation_chars",
            "max_speech_stream_sessions",
            "max_custom_voices",
        ):
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
            "start_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")
        if self.max_realtime_item_chars > self.max_realtime_conversation_chars:
            raise ValueError(
                "max_realtime_item_chars must not exceed max_realtime_conversation_chars; got "
                f"{self.max_realtime_item_chars} > {self.max_realtime_conversation_chars}"
            )
        if self.heartbeat_timeout_s != 0 and not self.heartbeat_timeout_s > HEARTBEAT_INTERVAL_S:
            raise ValueError(
                "heartbeat_timeout_s must be 0 (never) or more than the "
                f"{HEARTBEAT_INTERVAL_S:g} s between heartbeats; got {self.heartbeat_timeout_s:g}"
            )
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be 0 or more; got {self.shutdown_grace_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; leave it out to serve without authentication")
