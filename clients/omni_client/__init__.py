"""Python client for omni-server's OpenAI-compatible audio API (speech and transcription).

    from omni_client import OmniClient

    with OmniClient("http://127.0.0.1:8000") as client:
        client.speech_to_file("hello.wav", "Hello there.")
        for chunk in client.stream_pcm("Streamed as it is synthesized."):
            ...  # s16le mono PCM at 24000 Hz
        print(client.transcribe("hello.wav")["text"])

`AsyncOmniClient` has the same methods as coroutines (`stream_pcm` and `stream_transcription`
are async iterators). Both run on httpx2.
"""

from omni_client.async_client import AsyncOmniClient
from omni_client.errors import (
    APIError,
    OmniConnectionError,
    OmniError,
    OmniTimeoutError,
    OmniUsageError,
)
from omni_client.protocol import (
    DEFAULT_URL,
    FORMATS,
    PCM_SAMPLE_RATE,
    TRANSCRIPT_FORMATS,
    format_for_path,
)
from omni_client.sync_client import OmniClient

__all__ = [
    "DEFAULT_URL",
    "FORMATS",
    "PCM_SAMPLE_RATE",
    "TRANSCRIPT_FORMATS",
    "APIError",
    "AsyncOmniClient",
    "OmniClient",
    "OmniConnectionError",
    "OmniError",
    "OmniTimeoutError",
    "OmniUsageError",
    "format_for_path",
]
