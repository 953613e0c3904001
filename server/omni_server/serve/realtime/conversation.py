"""A session's conversation: ordered items (user / assistant / system messages) that become the
thinker's context on every response.

Bounded three ways (docs/realtime.md#bounds): at most MAX_ITEMS items, one client item at most
`max_item_chars` characters and the whole conversation at most `max_chars`. A client's item over
either bound is refused (an `error` event naming the bound, the conversation unchanged); the
session's own items (a turn's transcript, an answer: bounded by 120 s of audio and
`max_output_tokens`) make room by dropping the oldest items, as the item count does.

For a model that hears audio itself, a spoken user turn keeps its clip (`Item.clip`, a 16 kHz
WAV) and the model hears it on every later response. Clips are bounded apart from text: the
newest MAX_HEARD_TURNS turns within MAX_HEARD_BYTES keep theirs; an older turn is read as its
transcript (when the repository transcribes) or, without one, leaves the model's context.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

from omni_server.audio.resample import resample
from omni_server.contracts import AudioPart, WordTiming
from omni_server.serve.realtime import audio
from omni_server.serve.realtime.audio import AudioFormat
from omni_server.serve.realtime.input_audio import (
    MAX_BUFFER_S,
    MIN_COMMIT_SAMPLES,
    VAD_RATE,
    wav,
)
from omni_server.serve.realtime.protocol import BETA_PARTS, ProtocolError

ROLES = ("user", "assistant", "system")
INPUT_PARTS = ("input_text", "input_audio")
MAX_ITEMS = 512  # a session's history is bounded; the oldest items go first
# Spoken turns a model that hears audio keeps hearing: the newest 8 turns, at most 8 MiB of
# 16 kHz PCM16 WAV (about 4.4 minutes; one turn is at most 120 s, 3.8 MB). An omni model's
# audio encoder costs prompt tokens for every clip on every response (Qwen3-Omni: 12.5 per
# second), so a long session's early turns are better read as text than heard again.
MAX_HEARD_TURNS = 8
MAX_HEARD_BYTES = 8 << 20


@dataclass
class Item:
    id: str
    role: str
    content: list[dict[str, Any]] = field(default_factory=list)  # GA content parts
    status: str = "completed"
    audio_ms: float = 0.0  # assistant audio sent so far (truncate cuts the transcript with it)
    # when each spoken word of an assistant item plays (the voice's timing; empty for a voice
    # that times nothing): truncate cuts the transcript after the word playing at its time
    words: list[WordTiming] = field(default_factory=list)
    # a spoken user turn, as a model that hears audio hears it (16 kHz mono PCM16 WAV); None
    # for other items, other models, and turns past the clip bound (never shown to the client)
    clip: bytes | None = None

    def text(self) -> str:
        return "".join(
            str(part.get("text") or part.get("transcript") or "") for part in self.content
        )

    def chars(self) -> int:
        return sum(
            len(str(part.get("text") or "")) + len(str(part.get("transcript") or ""))
            for part in self.content
        )

    def ga(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": self.status,
            "content": [dict(part) for part in self.content],
        }

    def beta(self) -> dict[str, Any]:
        item = self.ga()
        for part in item["content"]:
            part["type"] = BETA_PARTS.get(part["type"], part["type"])
        return item


class Conversation:
    def __init__(self, *, max_item_chars: int, max_chars: int) -> None:
        self.items: list[Item] = []
        self.max_item_chars = max_item_chars
        self.max_chars = max_chars

    def chars(self) -> int:
        """Characters of every item's text (what the thinker would read, and what it holds)."""
        return sum(item.chars() for item in self.items)

    def clip_bytes(self) -> int:
        """Bytes of the spoken turns' clips held (at most MAX_HEARD_BYTES)."""
        return sum(len(item.clip) for item in self.items if item.clip is not None)

    def add_from_client(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """A `conversation.item.create`: refused whole when over a bound (nothing changes)."""
        size = item.chars()
        if size > self.max_item_chars:
            raise ProtocolError(
                f"the item has {size} characters; an item may have at most "
                f"{self.max_item_chars} (--max-realtime-item-chars)",
                code="item_too_large",
                param="item.content",
            )
        total = self.chars() + size
        if total > self.max_chars:
            raise ProtocolError(
                f"the conversation would hold {total} characters; it may hold at most "
                f"{self.max_chars} (--max-realtime-conversation-chars): delete items first "
                "(conversation.item.delete)",
                code="conversation_too_large",
                param="item.content",
            )
        return self.add(item, previous_item_id)

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` (at the end when None); returns the id before it.
        The oldest other items go while the conversation is over a bound."""
        if previous_item_id is None:
            index = len(self.items)
        else:
            index = self._index(previous_item_id, "previous_item_id") + 1
        self.items.insert(index, item)
        total = self.chars()
        while len(self.items) > 1 and (len(self.items) > MAX_ITEMS or total > self.max_chars):
            oldest = 1 if self.items[0] is item else 0
            total -= self.items[oldest].chars()
            del self.items[oldest]
        self._bound_clips()
        position = self.items.index(item)
        return self.items[position - 1].id if position > 0 else None

    def get(self, item_id: str, param: str = "item_id") -> Item:
        return self.items[self._index(item_id, param)]

    def delete(self, item_id: str) -> None:
        del self.items[self._index(item_id, "item_id")]

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        """Cut an assistant item's audio at `audio_end_ms`: its transcript keeps the share of
        its text that was heard (the listener never heard the rest)."""
        item = self.get(item_id)
        if item.role != "assistant":
            raise ProtocolError("only assistant audio can be truncated", param="item_id")
        if not 0 <= content_index < len(item.content):
            raise ProtocolError(f"no content part {content_index}", param="content_index")
        if audio_end_ms < 0 or audio_end_ms > item.audio_ms + 1:
            raise ProtocolError(
                f"audio_end_ms must be in [0, {int(item.audio_ms)}] (the audio sent)",
                param="audio_end_ms",
            )
        part = item.content[content_index]
        text = str(part.get("transcript") or "")
        heard = heard_transcript(text, item.words, audio_end_ms)
        if heard is None:  # no word timings: the share of the text that the audio's share is
            keep = round(len(text) * audio_end_ms / item.audio_ms) if item.audio_ms else 0
            heard = text[:keep]
        part["transcript"] = heard
        item.words = [w for w in item.words if w.start_s * 1000 < audio_end_ms]
        item.audio_ms = float(audio_end_ms)

    def messages(self, instructions: str) -> list[dict[str, Any]]:
        """The thinker's context: the instructions, then every item with text, or with a clip
        (content `(AudioPart,)`: the model hears the turn, its transcript is the client's)."""
        out: list[dict[str, Any]] = (
            [{"role": "system", "content": instructions}] if instructions else []
        )
        for item in self.items:
            text = item.text().strip()
            if item.clip is not None:
                out.append({"role": item.role, "content": _heard_parts(item, item.clip)})
            elif text:
                out.append({"role": item.role, "content": text})
        return out

    def _bound_clips(self) -> None:
        """Keep the clips of the newest MAX_HEARD_TURNS spoken turns within MAX_HEARD_BYTES
        (the newest clip always: one turn is under the byte bound)."""
        kept = held = 0
        full = False  # once a clip is past the bound, every older one is too
        for item in reversed(self.items):
            if item.clip is None:
                continue
            full = full or (
                kept > 0 and (kept == MAX_HEARD_TURNS or held + len(item.clip) > MAX_HEARD_BYTES)
            )
            if full:
                item.clip = None
                continue
            kept += 1
            held += len(item.clip)

    def _index(self, item_id: str, param: str) -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise ProtocolError(
            f"no item {item_id!r} in the conversation", code="item_not_found", param=param
        )


def _heard_parts(item: Item, clip: bytes) -> tuple[str | AudioPart, ...]:
    """An item with a clip as a model that hears it reads it: its parts in order, the audio
    part as the clip (its transcript is the client's), text parts as their text."""
    heard = AudioPart(clip, "wav")
    return tuple(
        heard if part["type"] == "input_audio" else str(part.get("text") or "")
        for part in item.content
    )


def item_from_client(raw: Any, item_id: str, hears: AudioFormat | None = None) -> Item:
    """A conversation.item.create's item: a message with text content. `hears`: the session's
    input format, for a model that hears audio itself, whose user items may also hold one
    `{"type": "input_audio", "audio": base64, "transcript"?}` part (decoded here, at 16 kHz
    as a committed turn is: call it off the event loop). Other audio comes from the buffer."""
    if not isinstance(raw, dict) or raw.get("type", "message") != "message":
        raise ProtocolError('item must be {"type": "message", "role", "content"}', param="item")
    role = raw.get("role")
    if role not in ROLES:
        raise ProtocolError(f"item.role must be one of {', '.join(ROLES)}", param="item.role")
    content = raw.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError("item.content must be a non-empty list", param="item.content")
    parts: list[dict[str, Any]] = []
    clip = None
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        where = f"item.content[{i}]"
        if kind in ("input_text", "output_text", "text") and isinstance(text, str):
            out_kind = "input_text" if role != "assistant" else "output_text"
            parts.append({"type": out_kind, "text": text})
        elif kind == "input_audio" and hears is not None and role == "user":
            assert isinstance(part, dict)
            if clip is not None:
                raise ProtocolError("a user item holds at most one input_audio part", param=where)
            clip = _heard_clip(part.get("audio"), hears, f"{where}.audio")
            transcript = part.get("transcript")
            if transcript is not None and not isinstance(transcript, str):
                raise ProtocolError("transcript must be a string", param=f"{where}.transcript")
            parts.append({"type": "input_audio", "transcript": transcript})
        else:
            audio = "input_audio parts ({type, audio}) of user items or " if hears else ""
            raise ProtocolError(
                "content parts must be text parts ({type: input_text | output_text, text}); "
                f"send audio as {audio}with input_audio_buffer.append",
                param=where,
            )
    return Item(id=item_id, role=role, content=parts, clip=clip)


def _heard_clip(raw: Any, fmt: AudioFormat, param: str) -> bytes:
    """A client item's audio (base64 in the session's input format) as a committed turn's
    clip: a 16 kHz WAV of 100 ms .. MAX_BUFFER_S."""
    try:
        if not isinstance(raw, str):
            raise ValueError("not a string")
        samples = audio.decode(base64.b64decode(raw, validate=True), fmt)
    except (binascii.Error, ValueError) as err:
        raise ProtocolError(
            f"audio is not base64 {fmt.type}: {err}", code="invalid_audio", param=param
        ) from None
    heard = resample(samples, fmt.rate, VAD_RATE)
    if not MIN_COMMIT_SAMPLES <= heard.size <= MAX_BUFFER_S * VAD_RATE:
        raise ProtocolError(
            f"audio must last 0.1 to {MAX_BUFFER_S:g} s; got {heard.size / VAD_RATE:.3f} s",
            code="invalid_audio",
            param=param,
        )
    return wav(heard)


def heard_transcript(text: str, words: list[WordTiming], audio_end_ms: float) -> str | None:
    """`text` up to the end of the word playing at `audio_end_ms` (or the last word before,
    in a pause), with the punctuation after it; None without word timings.

    The spoken words are the voice's (its text normalized: "$5" spoken "5 dollars"): each is
    found in the transcript after the one before it; a word the transcript does not hold
    leaves the cut at the last one found."""
    if not words:
        return None
    cursor = cut = 0
    for word in words:
        if word.start_s * 1000 >= audio_end_ms:
            break
        found = text.find(word.text, cursor)
        if found < 0:
            continue
        cursor = cut = found + len(word.text)
    while cut < len(text) and not text[cut].isspace() and not text[cut].isalnum():
        cut += 1  # "world," keeps its comma
    return text[:cut]
