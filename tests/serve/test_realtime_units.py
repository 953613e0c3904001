"""The realtime session's pure parts: G.711 codecs, formats, session.update in both shapes, the
conversation's insert / truncate / context."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from omni_server.serve.realtime import audio
from omni_server.serve.realtime.config import SessionConfig
from omni_server.serve.realtime.conversation import Conversation, Item, item_from_client
from omni_server.serve.realtime.protocol import ProtocolError

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    audioop = pytest.importorskip("audioop")  # the reference G.711 (gone in Python 3.13)


def test_g711_encodes_and_decodes_every_value_as_the_reference_does():
    linear = np.arange(-32768, 32768, dtype=np.int32)
    pcm = linear.astype("<i2").tobytes()
    assert audio.ulaw_encode(linear).tobytes() == audioop.lin2ulaw(pcm, 2)
    assert audio.alaw_encode(linear).tobytes() == audioop.lin2alaw(pcm, 2)
    codes = bytes(range(256))
    for fmt, reference in ((audio.PCMU, audioop.ulaw2lin), (audio.PCMA, audioop.alaw2lin)):
        decoded = np.round(audio.decode(codes, fmt) * 32768).astype("<i2").tobytes()
        assert decoded == reference(codes, 2)


def test_formats_in_both_generations_and_clear_errors():
    assert audio.parse_format("pcm16") is audio.PCM16
    assert audio.parse_format({"type": "audio/pcm", "rate": 24000}) is audio.PCM16
    assert audio.parse_format("g711_alaw") is audio.PCMA
    assert audio.parse_format({"type": "audio/pcmu"}) is audio.PCMU
    with pytest.raises(ValueError, match="24000 Hz here"):
        audio.parse_format({"type": "audio/pcm", "rate": 16000})
    with pytest.raises(ValueError, match="expected"):
        audio.parse_format("mp3")
    with pytest.raises(ValueError, match="odd number of bytes"):
        audio.decode(b"\x00\x01\x02", audio.PCM16)


def test_session_update_takes_ga_and_beta_shapes_and_is_all_or_nothing():
    config = SessionConfig(model="m", voice="joe")
    config.update(
        {
            "type": "realtime",
            "output_modalities": ["text"],
            "audio": {
                "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                "output": {"voice": "joe", "speed": 1.5},
            },
        },
        ("joe",),
    )
    assert config.output_modalities == ["text"] and config.input_format is audio.PCMU
    assert config.turn_detection is None and config.speed == 1.5
    config.update(
        {
            "modalities": ["text", "audio"],
            "input_audio_format": "pcm16",
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 300},
        },
        ("joe",),
    )
    assert config.output_modalities == ["audio"] and config.input_format is audio.PCM16
    assert config.turn_detection is not None and config.turn_detection.silence_duration_ms == 300
    before = config.ga("s")
    with pytest.raises(ProtocolError) as err:
        config.update({"instructions": "x", "voice": "nobody"}, ("joe",))
    assert err.value.param == "session.voice"
    assert config.ga("s") == before  # nothing of the refused update applied


def test_session_seed_is_our_extension_validated_and_not_echoed():
    config = SessionConfig(model="m", voice="joe")
    config.update({"type": "realtime", "seed": 7}, ("joe",))
    assert config.seed == 7
    assert "seed" not in config.ga("s") and "seed" not in config.beta("s")  # OpenAI's shape
    for bad in (-1, 1.5, True, "7", 2**63):
        with pytest.raises(ProtocolError) as err:
            config.update({"seed": bad, "instructions": "x"}, ("joe",))
        assert err.value.param == "session.seed"
    assert config.seed == 7 and config.instructions != "x"  # a refused update changes nothing
    config.update({"seed": None}, ("joe",))
    assert config.seed is None


def test_conversation_inserts_truncates_and_builds_the_context():
    conversation = Conversation(max_item_chars=1000, max_chars=10_000)
    first = item_from_client(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        "a",
    )
    answer = Item(
        id="b",
        role="assistant",
        content=[{"type": "output_audio", "transcript": "Hello there, friend."}],
    )
    answer.audio_ms = 2000
    assert conversation.add(first) is None
    assert conversation.add(answer) == "a"
    assert (
        conversation.add(
            Item(id="c", role="system", content=[{"type": "input_text", "text": "Be brief."}]), "a"
        )
        == "a"
    )
    conversation.truncate("b", 0, 1000)
    assert answer.content[0]["transcript"] == "Hello ther"  # half the audio: half the text
    assert conversation.messages("Rules.") == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Hello ther"},
    ]
    with pytest.raises(ProtocolError, match="audio_end_ms"):
        conversation.truncate("b", 0, 5000)
    with pytest.raises(ProtocolError) as err:
        conversation.delete("nope")
    assert err.value.code == "item_not_found"


def _text_item(item_id: str, text: str, role: str = "user") -> Item:
    return item_from_client(
        {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]},
        item_id,
    )


def test_conversation_refuses_client_items_over_its_bounds():
    conversation = Conversation(max_item_chars=100, max_chars=250)
    with pytest.raises(ProtocolError) as err:
        conversation.add_from_client(_text_item("big", "x" * 101))
    assert err.value.code == "item_too_large" and "--max-realtime-item-chars" in err.value.message
    assert conversation.items == []  # refused whole
    for name in ("a", "b"):
        conversation.add_from_client(_text_item(name, "y" * 100))
    with pytest.raises(ProtocolError) as err:
        conversation.add_from_client(_text_item("c", "z" * 51))  # 251 > 250
    assert err.value.code == "conversation_too_large"
    assert [i.id for i in conversation.items] == ["a", "b"]
    conversation.add_from_client(_text_item("c", "z" * 50))  # exactly the bound
    assert conversation.chars() == 250


def test_session_items_make_room_by_dropping_the_oldest():
    conversation = Conversation(max_item_chars=100, max_chars=250)
    for name in ("a", "b"):
        conversation.add_from_client(_text_item(name, "y" * 100))
    answer = Item(id="r", role="assistant", content=[{"type": "output_text", "text": "w" * 120}])
    assert conversation.add(answer) == "b"
    assert [i.id for i in conversation.items] == ["b", "r"]  # "a" went: 220 <= 250
    assert conversation.chars() == 220
