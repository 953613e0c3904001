"""Event names and ids of the Realtime protocol, in its GA and beta generations.

The server speaks GA by default; a client that sends `OpenAI-Beta: realtime=v1` when it
connects (as beta clients do) gets the beta names. Client events are accepted under either
generation's names, whatever the session speaks.
"""

from __future__ import annotations

import itertools
import secrets

# GA server event name -> its beta name (only those that differ)
BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}

# content part types: GA item content name -> beta name. The beta names also type the `part`
# of `response.content_part.added` / `.done` in both generations: GA's reference and client
# (`openai.types.realtime.ResponseContentPartAddedEvent`) allow only "audio" / "text" there,
# while a GA item's content keeps "output_audio" / "output_text".
BETA_PARTS = {"output_audio": "audio", "output_text": "text"}

MAX_EVENT_BYTES = 16 << 20  # one client event (an append of ~5 min of PCM16 at 24 kHz)


class Ids:
    """Ids in OpenAI's shapes (`event_...`, `item_...`, `resp_...`), unique per session."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(4)
        self._counter = itertools.count(1)

    def new(self, kind: str) -> str:
        return f"{kind}_{self._prefix}{next(self._counter):06d}"


class ProtocolError(Exception):
    """A client event the session refuses: an `error` event naming it; the session goes on."""

    def __init__(
        self,
        message: str,
        *,
        code: str = "invalid_value",
        param: str | None = None,
        event_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.event_id = event_id

    def event(self) -> dict[str, object]:
        return {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "code": self.code,
                "message": self.message,
                "param": self.param,
                "event_id": self.event_id,
            },
        }
