"""The typed contracts between stages (omni_server/contracts.py): each field checked where it is
declared, the defaults resolved once, and a contract that crosses processes checked again when
it is decoded (the real codec of the rings)."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from omni_server.compiler.plan import SamplingSpec
from omni_server.contracts import (
    AsrOptions,
    ChatInput,
    Message,
    Sampling,
    SpeechOptions,
    SpeechTiming,
    VoiceReference,
    WordTiming,
    seed_of,
    speech_payload,
    with_seed,
)
from omni_server.wire.codec import decode, encode

CLIP = VoiceReference("voice_ab", "/data/voice_ab.wav", "hello there", 24000, "en")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"voice": ""}, "voice must be a voice's name"),
        ({"speed": 5.0}, "speed must lie in 0.25..4.0"),
        ({"speed": float("nan")}, "speed must lie in"),
        ({"response_format": "ogg"}, "response_format must be one of"),
        ({"response_format": "opus", "sample_rate": 22050}, "opus supports sample rates"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"seed": True}, "seed must be an integer"),
        ({"stream": 1}, "stream must be true or false"),
        ({"temperature": 3.0}, "temperature must lie in 0..2"),
        ({"reference": CLIP}, "a reference names its voice"),
    ],
)
def test_speech_options_refuse_what_no_voice_can_speak(fields, message):
    with pytest.raises(ValueError, match=message):
        SpeechOptions(**{"voice": "joe", **fields})


def test_speech_options_defaults_are_declared_once():
    options = SpeechOptions("joe")
    assert (options.response_format, options.stream, options.speed) == ("mp3", True, 1.0)
    assert (options.seed, options.sample_rate, options.reference) == (None, None, None)
    assert speech_payload("Hi.", options) == {"text": "Hi.", "speech": options}


def test_sampling_resolves_the_request_then_the_model_then_openai():
    model = SamplingSpec(temperature=0.2, max_tokens=512)
    assert Sampling.resolve(model) == Sampling(max_tokens=512, temperature=0.2)
    asked = Sampling.resolve(model, temperature=0.0, top_k=5, max_tokens=3, stop=("@@",))
    assert (asked.temperature, asked.top_k, asked.max_tokens) == (0.0, 5, 3)
    assert (asked.top_p, asked.min_p, asked.stop) == (1.0, 0.0, ("@@",))  # OpenAI's
    assert Sampling.resolve() == Sampling()  # no model default: OpenAI's, max_tokens None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ChatInput(()), "messages must be a non-empty tuple"),
        (lambda: ChatInput(({"role": "user", "content": "x"},)), r"messages\[0\] must be a"),
        (lambda: Message("tool", "x"), "role must be one of system, user, assistant"),
        (lambda: Sampling(max_tokens=0), "max_tokens must be a positive integer"),
        (lambda: Sampling(top_p=1.5), "top_p and min_p lie in 0..1"),
        (lambda: Sampling(stop=["x"]), "stop must be a tuple"),
        (lambda: AsrOptions(temperature=2.0), "temperature must lie in 0..1"),
    ],
)
def test_chat_and_asr_contracts_refuse_bad_fields(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_payload_without_its_contract_is_named():
    with pytest.raises(TypeError, match=r"payload\['chat'\] must be an .*ChatInput; found dict"):
        ChatInput.of({"chat": {"messages": []}})
    assert AsrOptions.of(AsrOptions().payload(b"RIFF")) == AsrOptions()


def test_contracts_cross_processes_through_the_codec():
    speech = SpeechOptions("voice_ab", response_format="pcm", seed=3, reference=CLIP)
    chat = ChatInput((Message("user", "hi"),), Sampling(max_tokens=4, stop=("x",)), speech)
    header, buffers = encode(chat.payload())
    got = ChatInput.of(decode(header, buffers))
    assert got == chat and got is not chat
    assert isinstance(got.speech, SpeechOptions) and got.speech.reference == CLIP


def test_decoding_checks_a_contract_again():
    """What a stage reads from shared memory is checked as the server's value was: a contract
    whose bytes say speed 9 (written by a bug, or another process of this user) fails to decode."""
    good = SpeechOptions("joe")
    bad = replace(good)
    object.__setattr__(bad, "speed", 9.0)  # what a corrupted record would carry
    header, buffers = encode({"speech": bad})
    with pytest.raises(ValueError, match="speed must lie in"):
        decode(header, buffers)
    assert pickle.loads(pickle.dumps(good)) == good


def test_the_seed_is_read_and_set_where_the_contract_keeps_it():
    chat = ChatInput((Message("user", "hi"),)).payload()
    assert seed_of(chat) is None
    seeded = with_seed(chat, 42)
    assert seed_of(seeded) == 42 and ChatInput.of(seeded).sampling.seed == 42
    assert seed_of(chat) is None  # the original is untouched
    assert seed_of(with_seed({"prompt": [1]}, 7)) == 7  # a plain payload: its own "seed"


def test_to_dict_is_plain_json():
    chat = ChatInput((Message("user", "hi"),), Sampling(stop=("a",)))
    assert chat.to_dict() == {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": None,
        "stop": ["a"],
        "speech": None,
    }


def test_the_docs_example_runs():
    """docs/backends.md shows the contracts with an example: it runs as shown."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "backends.md").read_text()
    section = doc.split("## What the server hands a pipeline: typed contracts", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/backends.md", "exec"), {})


def _hello_timing() -> SpeechTiming:
    # "hi you": "hi" plays 0.10..0.30 s, the space takes the gap, "you" 0.35..0.60 s
    return SpeechTiming(
        characters=tuple("hi you"),
        character_start_times_seconds=(0.1, 0.2, 0.3, 0.35, 0.43, 0.52),
        character_end_times_seconds=(0.2, 0.3, 0.35, 0.43, 0.52, 0.6),
        words=(WordTiming("hi", 0.1, 0.3, 0, 2), WordTiming("you", 0.35, 0.6, 3, 6)),
    )


def test_speech_timing_crosses_processes_and_is_checked_again():
    timing = _hello_timing()
    header, buffers = encode({SpeechTiming.KEY: timing})
    assert SpeechTiming.of(decode(header, buffers)) == timing
    with pytest.raises(ValueError, match="words\\[0\\] 'ho' must be the characters"):
        replace(timing, words=(WordTiming("ho", 0.1, 0.3, 0, 2),))  # not the text's span
    forged = _hello_timing()
    object.__setattr__(forged, "characters", tuple("ho you"))  # bypasses the check, as bytes may
    with pytest.raises(ValueError, match="words\\[0\\] 'hi' must be the characters"):
        pickle.loads(pickle.dumps(forged))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: WordTiming("hi", 0.3, 0.1, 0, 2), "0 <= start_s <= end_s"),
        (lambda: WordTiming("hi", 0.1, 0.3, 0, 3), "must span its text"),
        (lambda: SpeechTiming(("a",), (0.0,), ()), "tuples of 1 numbers"),
        (lambda: SpeechTiming(("ab",), (0.0,), (0.1,)), "single characters"),
        (lambda: SpeechTiming(("a",), (0.2,), (0.1,)), "0 <= start <= end"),
    ],
)
def test_timing_contracts_refuse_bad_fields(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_speech_timings_shift_and_join_with_words_reindexed():
    first = _hello_timing()
    second = first.shifted(1.0)
    assert second.words[1].start_s == pytest.approx(1.35)
    assert first.shifted(-0.2).start_s == 0.0  # never before the audio
    both = SpeechTiming.joined([first, second])
    assert both.text == "hi youhi you"
    assert [(w.text, w.char_start) for w in both.words] == [
        ("hi", 0),
        ("you", 3),
        ("hi", 6),
        ("you", 9),
    ]
    assert both.character_start_times_seconds[6] == pytest.approx(1.1)
