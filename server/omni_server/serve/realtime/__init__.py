"""`GET /v1/realtime`: OpenAI's Realtime protocol over a WebSocket (docs/realtime.md).

A session hears the caller (server VAD turn detection on the appended audio), transcribes each
committed turn with the repository's transcription model, answers with its realtime model (the
thinker streaming into the voice), and stops answering when the caller speaks over it.
"""

from omni_server.serve.realtime.session import realtime

__all__ = ["realtime"]
