"""A user turn's transcript: the repository's transcription model hears the turn's clip, and
the item's `transcript` and the `conversation.item.input_audio_transcription.*` events follow.

For a cascade the transcript is the thinker's input (a response waits for it); for a model that
hears audio itself it is the client's record, made beside the response.
"""

from __future__ import annotations

from omni_server.compiler.plan import ModelSpec
from omni_server.contracts import AsrOptions
from omni_server.pipeline import PipelineError
from omni_server.serve.errors import ApiError
from omni_server.serve.pipeline_call import admitted, submitted
from omni_server.serve.realtime.config import SessionConfig
from omni_server.serve.realtime.conversation import Item
from omni_server.serve.realtime.events import ServerEvents
from omni_server.serve.state import ServerState


async def transcribe(
    state: ServerState,
    asr: ModelSpec,
    events: ServerEvents,
    config: SessionConfig,
    item: Item,
    clip: bytes,
    seconds: float,
    index: int = 0,
) -> None:
    """Write the transcript of `clip` (a WAV of `seconds`) into the item's part `index` (its
    `input_audio` part), under
    one admission place of the transcription model (it may wait in that model's queue: nothing
    else of the session waits on it but a cascade's response). The events go out while the
    session's `config.transcription` is on when the transcript (or the failure) comes."""
    try:
        async with (
            admitted(state, asr),
            submitted(state, asr, AsrOptions().payload(clip)) as handle,
        ):
            result = await handle.result()
    except (PipelineError, ApiError) as err:  # ApiError: not ready, or no place came
        if config.transcription:
            await events.send(
                {
                    "type": "conversation.item.input_audio_transcription.failed",
                    "item_id": item.id,
                    "content_index": index,
                    "error": {"type": "transcription_error", "message": err.message},
                }
            )
        return
    text = str(result.get("text", "")).strip() if isinstance(result, dict) else ""
    item.content[index]["transcript"] = text
    if config.transcription:
        common = {"item_id": item.id, "content_index": index}
        await events.send(
            {"type": "conversation.item.input_audio_transcription.delta", **common, "delta": text}
        )
        await events.send(
            {
                "type": "conversation.item.input_audio_transcription.completed",
                **common,
                "transcript": text,
                "usage": {"type": "duration", "seconds": round(seconds, 3)},
            }
        )
