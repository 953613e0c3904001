"""The voice on streamed text (the omni model's shape: a thinker streams its answer into the
text frontend): any split of a text gives the whole text's sentences and the same audio."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from omni_bench.inprocess import InProcessVoice
from omni_bench.speech import DEFAULT_DATASET, load_dataset
from omni_server.backend import Request
from omni_server.compiler.compiler import compile_repository
from omni_server.contracts import SpeechOptions, speech_payload
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(300)

SPEECH = SpeechOptions("joe", speed=1.0, seed=11, response_format="pcm", stream=True)
TEXTS = [
    "The quick brown fox jumps over the lazy dog. Then it ran away into the woods.",
    "Dr. Smith paid $42.50 on Jan. 3rd, etc. Is that right? Yes! It is 3.5 times more.",
    "Apples, pears, etc. and then we left. \u201cHello,\u201d she said \u2014 softly.",
    'I said "yes." Then, after a pause: no, not today; maybe tomorrow... or never.',
    ", ".join(["the rain kept falling over the quiet little town by the river"] * 8) + ". Done.",
]


def pieces(text: str, cuts: list[int]) -> list[dict]:
    """The thinker's chunks for `text` cut at `cuts`: the first carries the speech options."""
    bounds = [0, *cuts, len(text)]
    chunks: list[dict] = [{"text": text[a:b]} for a, b in itertools.pairwise(bounds)]
    chunks[0]["speech"] = SPEECH
    return chunks


def streamed(voice: InProcessVoice, chunks: list[dict]) -> list[dict]:
    return list(voice.frontend.generate(Request("r", {}, _stream=iter(chunks))))


def whole(voice: InProcessVoice, text: str) -> list[dict]:
    return list(voice.frontend_chunks(speech_payload(text, SPEECH)))


def same_sentences(got: list[dict], expected: list[dict]) -> None:
    assert [c["phonemes"] for c in got] == [c["phonemes"] for c in expected]
    for a, b in zip(got, expected, strict=True):
        assert np.array_equal(a["phoneme_ids"], b["phoneme_ids"])
        assert (a["sentence"], a["chunk"], a["speech"]) == (
            b["sentence"],
            b["chunk"],
            b["speech"],
        )


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_any_split_gives_the_whole_texts_sentences(voice, text):
    expected = whole(voice, text)
    assert len(expected) >= 2
    rng = random.Random(text)
    splits = {
        "one piece": [],
        "every character": list(range(1, len(text))),
        "mid-word tokens": sorted(rng.sample(range(1, len(text)), len(text) // 4)),
        "few random": sorted(rng.sample(range(1, len(text)), 5)),
    }
    for cuts in splits.values():
        same_sentences(streamed(voice, pieces(text, cuts)), expected)


def test_the_benchmark_dataset_streams_into_its_own_sentences(voice):
    """Every text of omni-bench's dataset (numbers, times, abbreviations, acronyms, paragraphs),
    streamed in random pieces of 1-6 characters as tokens come, gives its whole-text chunks."""
    rng = random.Random(17)
    for text in load_dataset(DEFAULT_DATASET):
        cuts, at = [], 0
        while (at := at + rng.randint(1, 6)) < len(text):
            cuts.append(at)
        same_sentences(streamed(voice, pieces(text, cuts)), whole(voice, text))


def test_streamed_sentences_give_the_same_audio(voice):
    text = TEXTS[0]
    cuts = list(range(3, len(text), 4))  # 4-character pieces: every word cut somewhere
    audio = voice.acoustic.generate(
        Request("a", {}, _stream=iter(streamed(voice, pieces(text, cuts))))
    )
    reference = voice.sentences(voice.request(text, seed=SPEECH.seed))
    got, expected = [c["audio"] for c in audio], [c["audio"] for c in reference]
    assert len(got) == len(expected) == 3  # two sentences, the first cut in two
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, expected, strict=True))


def test_a_sentence_leaves_as_soon_as_the_next_one_starts(voice):
    """The frontend yields sentence 1 once text after it has started, before the stream ends."""
    text = "Hello there, my friend. How are you today?"
    chunks = pieces(text, [6, 15, 22, 24, 26, 30])  # ... "friend." | " " | "Ho" | ...
    consumed: list[int] = []

    def stream() -> Iterator[dict]:
        for index, chunk in enumerate(chunks):
            consumed.append(index)
            yield chunk

    frontend = voice.frontend.generate(Request("r", {}, _stream=stream()))
    first = next(frontend)
    assert first["sentence"] == 0 and first["phonemes"].endswith(".")
    assert consumed[-1] == 4  # "Ho": the next sentence's first letter, nothing later
    assert [c["sentence"] for c in frontend] == [1]


def test_streamed_text_with_nothing_speakable_gives_one_empty_chunk(voice):
    [chunk] = streamed(voice, pieces("... ...", [2, 4]))
    assert chunk["sentence"] is None and len(chunk["phoneme_ids"]) == 0
    assert chunk["speech"] is SPEECH  # the encoding rides on: pcm, the default rate, streamed
    [audio] = voice.acoustic.generate(Request("a", {}, _stream=iter([chunk])))
    assert len(audio["audio"]) == 0


def test_a_text_only_request_is_not_spoken(voice):
    """No "speech" (the omni model asked for text only): the voice says nothing, the encoder
    ends with no bytes and a result of no audio."""
    for first in ({"text": "Hello there. "}, {"text": "Hello there. ", "speech": None}):
        assert streamed(voice, [first, {"text": "How are you?"}]) == []
    sentences = voice.acoustic.generate(Request("a", {}, _stream=iter([])))
    encoder = voice.encoder.generate(Request("e", {}, _stream=sentences))
    with pytest.raises(StopIteration) as end:
        next(encoder)
    assert end.value.value == {
        "sample_rate": None,
        "audio_seconds": 0.0,
        "format": None,
        "sentences": 0,
    }


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        (lambda: [], "the text stream ended before its first chunk"),
        (
            lambda: [{"text": "Hi.", "speech": "joe"}],
            r"payload\['speech'\] must be an omni_server.contracts.SpeechOptions; found str",
        ),
        # the contract's own check: refused where the options are built
        (lambda: [{"text": "Hi.", "speech": replace(SPEECH, speed=9.0)}], "speed must lie in"),
        (lambda: [{"text": "Hi.", "speech": replace(SPEECH, voice="alloy")}], "unknown voice"),
        (lambda: [{"text": 5, "speech": SPEECH}], "text must be a string"),
    ],
)
def test_bad_streamed_text_fails_with_a_clear_message(voice, chunks, message):
    with pytest.raises(ValueError, match=message):
        streamed(voice, chunks())


def stage_toml(repository, name: str, process: str | None = None) -> str:
    text = (repository / name / "stage.toml").read_text()
    return text if process is None else text.replace('process = "voice"', f'process = "{process}"')


@pytest.mark.slow  # a runtime with the voice in processes
@pytest.mark.parametrize("voice_replicas", [1, 2])
async def test_a_thinker_streaming_into_the_voice_gives_the_speech_models_audio(
    voice, repository, tmp_path, voice_replicas
):
    """A fake thinker in its own process streams text, cut mid-word, into the real voice stages
    (text over the ring); the audio is the speech model's for the same text and seed."""
    text = TEXTS[1]
    stages = {
        "thinker": toml("""
            backend = "model.py:TextStreamer"
            process = "thinker"
            stream_to = ["text_frontend"]
            [scheduler]
            kind = "stream"
        """),
        **{
            name: stage_toml(repository, name)
            for name in ("text_frontend", "acoustic", "audio_encoder")
        },
    }
    models = {
        "thinker": FIXTURES / "text_streamer.py",
        **{
            name: repository / name / "model.py"
            for name in ("text_frontend", "acoustic", "audio_encoder")
        },
    }
    root = make_repo(
        tmp_path,
        stages,
        toml(f"""
            [processes.voice]
            num_replicas = {voice_replicas}
            [models.speech]
            entry = "text_frontend"
            tasks = ["speech"]
            voices = ["joe"]
            [models.omni]
            entry = "thinker"
            tasks = ["chat"]
            voices = ["joe"]
        """),
        models,
    )
    plan = compile_repository(root)
    expected = voice.speak(text, response_format="pcm", stream=True, seed=SPEECH.seed).body
    cuts = sorted(random.Random(7).sample(range(1, len(text)), 20))
    async with running(plan) as runtime:
        for _ in range(voice_replicas):  # with two replicas, both serve in turn
            handle = runtime.submit(
                plan.models["omni"], {"text": text, "cuts": cuts, "speech": SPEECH}
            )
            chunks = [c["audio"] async for c in handle]
            result = await handle.result()
            assert len(chunks) >= 2 and b"".join(chunks) == expected
            assert result["sentences"] == 4 and result["sample_rate"] == 24000
            handle = runtime.submit(plan.models["speech"], speech_payload(text, SPEECH))
            assert b"".join([c["audio"] async for c in handle]) == expected
            await handle.result()
        # a text-only request of the omni model: the voice stays silent, the request completes
        handle = runtime.submit(plan.models["omni"], {"text": text, "cuts": cuts, "speech": None})
        assert [c async for c in handle] == []
        assert (await handle.result())["sentences"] == 0
