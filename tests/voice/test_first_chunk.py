"""A short first chunk: the first sentence's audio cut in two at a word gap (the frontend picks
the gap, the acoustic stage decodes the whole sentence's latents in two windows), the same audio
as the whole sentence; and idle cores for first chunks."""

from __future__ import annotations

import numpy as np
import pytest

from omni_bench.inprocess import load_stage
from omni_server.backend import Request

pytestmark = pytest.mark.timeout(300)

LONG = "The kettle clicked off just as the rain began to tap against the kitchen window."
CLAUSE = "Our train was delayed, so we shared a sandwich on the cold platform."


@pytest.fixture(scope="module")
def frontend_module(voice):
    """The frontend's module (first_piece lives there), from the loaded stage."""
    import sys

    return sys.modules[type(voice.frontend).__module__]


@pytest.fixture(scope="module")
def acoustic_module(voice):
    import sys

    return sys.modules[type(voice.acoustic).__module__]


def words(phonemes: list[str]) -> int:
    return len("".join(phonemes).split())


def test_the_first_piece_is_the_first_clause_or_the_target_words(voice, frontend_module):
    cut = frontend_module.first_piece
    [long] = voice.frontend.sentences("joe", LONG)
    head, rest = cut(long, 5)
    assert words(head) == 5 and [*head, " ", *rest] == long
    [clause] = voice.frontend.sentences("joe", CLAUSE)
    head, rest = cut(clause, 5)
    assert "".join(head).endswith(",") and words(head) == 4  # "Our train was delayed,"
    assert cut(clause, 1) == cut(long, 1) is None or words(cut(long, 1)[0]) >= 2
    [short] = voice.frontend.sentences("joe", "Hello there, my friend.")
    assert cut(short, 2) is None  # fewer than 3 words would be left after the cut
    assert cut(long, 0) is None
    far = voice.frontend.sentences("joe", "One two three four five six seven eight nine, ten.")[0]
    assert words(cut(far, 3)[0]) == 3  # the clause end lies beyond 2 x target: cut at words


def test_only_the_first_sentence_is_cut_and_noise_keys_follow_the_sentences(voice, frontend_module):
    chunks = list(voice.frontend_chunks(voice.request(f"{LONG} {LONG}", seed=1)))
    assert [c["sentence"] for c in chunks] == [0, 1]
    assert [c["chunk"] for c in chunks] == [0, 1]
    first, second = chunks
    assert second["cut"] is None and np.array_equal(first["phoneme_ids"], second["phoneme_ids"])
    # the cut is the space after the first piece: the ids before it are the piece's (less EOS)
    id_map = voice.frontend.voices["joe"].id_map
    [phonemes] = voice.frontend.sentences("joe", LONG)
    head, _ = frontend_module.first_piece(phonemes, voice.frontend.first_chunk_words)
    head_ids = frontend_module.phonemes_to_ids(head, id_map)
    cut = first["cut"]
    assert list(first["phoneme_ids"][:cut]) == head_ids[:-1]
    assert [int(first["phoneme_ids"][cut])] == id_map[" "]
    # the acoustic stage sends the first sentence as two chunks, the others whole
    assert [c["sentence"] for c in voice.sentences(voice.request(f"{LONG} {LONG}", seed=1))] == [
        0,
        0,
        1,
    ]


def test_no_cut_with_first_chunk_words_zero(voice, plan):
    whole = load_stage(plan, "text_frontend", parameters={"first_chunk_words": 0})
    chunks = list(whole.generate(Request("r", voice.request(LONG))))
    assert [c["sentence"] for c in chunks] == [0] and chunks[0]["cut"] is None


@pytest.fixture(scope="module")
def uncut(plan):
    """The frontend with first_chunk_words = 0: every sentence whole."""
    return load_stage(plan, "text_frontend", parameters={"first_chunk_words": 0})


@pytest.mark.parametrize("text", [LONG, CLAUSE])
def test_the_cut_sentence_is_the_whole_sentences_audio(voice, uncut, text):
    """Same seed: the two chunks of the cut sentence are the audio of the sentence synthesized
    whole, up to a gain per chunk (the first chunk is normalized to its own peak when it leaves;
    a louder rest eases down to its own over its first 20 ms) and rounding at the cut: the words
    either side of the cut keep the whole sentence's prosody."""
    head, rest, *_ = (c["audio"] for c in voice.sentences(voice.request(text, seed=3)))
    sentences = uncut.generate(Request("r", voice.request(text, seed=3)))
    [whole, *_] = (c["audio"] for c in voice.acoustic.generate(Request("a", {}, _stream=sentences)))
    assert len(head) + len(rest) == len(whole)
    assert 0.2 * len(whole) < len(head) < 0.7 * len(whole)  # a first chunk, not the sentence
    ramp = int(0.02 * voice.acoustic.voices["joe"].sample_rate)
    for part, reference in [(head, whole[: len(head)]), (rest[ramp:], whole[len(head) + ramp :])]:
        gain = float(np.dot(part, reference) / np.dot(reference, reference))
        assert 0.7 < gain < 1.5
        assert np.abs(part - gain * reference).max() < 0.01
    around = slice(len(head) - 200, len(head) + 200)
    steps = np.abs(np.diff(np.concatenate([head, rest])[around]))
    assert steps.max() < 0.05 + 1.5 * np.abs(np.diff(whole[around])).max()  # no jump at the join


def test_a_cut_outside_the_sentence_fails_the_request(voice):
    chunk = {**next(voice.frontend_chunks(voice.request(LONG, seed=1))), "cut": 10**6}
    with pytest.raises(ValueError, match="cut must lie in 1"):
        list(voice.acoustic.generate(Request("a", {}, _stream=iter([chunk]))))


def test_decoding_in_windows_with_context_matches_decoding_all_frames(voice, acoustic_module):
    """The invariant CutSentence rests on: the decoder (flow + HiFi-GAN) on frames
    [0, cut + CONTEXT_FRAMES) and [cut - CONTEXT_FRAMES, end) gives, on each side of the cut,
    the samples decoding every frame at once gives."""
    joe = voice.acoustic.voices["joe"]
    model = joe.model
    assert model.splittable and model.duration_output is not None
    ids = next(voice.frontend_chunks(voice.request(CLAUSE)))["phoneme_ids"]
    feeds = {
        "input": np.asarray(ids, np.int64).reshape(1, -1),
        "input_lengths": np.array([len(ids)], np.int64),
        "scales": np.array([joe.noise_scale, joe.length_scale, joe.noise_w], np.float32),
    }
    latents = model.latents(feeds, np.random.default_rng(4))
    assert latents.durations is not None and latents.durations.sum() == latents.frames
    everything = model.decode(latents, 0, latents.frames).reshape(-1)
    hop = len(everything) // latents.frames
    margin = acoustic_module.CONTEXT_FRAMES
    cut = latents.frames // 2
    left = model.decode(latents, 0, cut + margin).reshape(-1)[: cut * hop]
    right = model.decode(latents, cut - margin, latents.frames).reshape(-1)[margin * hop :]
    assert np.abs(np.concatenate([left, right]) - everything).max() < 1e-3
    # and the whole graph, run as one call, is these segments
    assert np.array_equal(model(feeds, np.random.default_rng(4)).reshape(-1), everything)


def test_seeded_first_chunks_stay_on_one_thread_whatever_the_load(voice, acoustic_module):
    """Two onnxruntime threads round some sentences differently (this one: LONG), so a seeded
    request never takes the idle cores: its bytes do not depend on the machine's load."""
    joe = voice.acoustic.voices["joe"]
    assert joe.wide is not None  # the repository asks for idle_core_threads = 2
    ids = next(voice.frontend_chunks(voice.request(LONG)))["phoneme_ids"]
    one = joe.synthesize(ids, speed=1.0, rng=np.random.default_rng(5))
    wide = joe.synthesize(ids, speed=1.0, rng=np.random.default_rng(5), wide=True)
    assert len(one) == len(wide) and np.allclose(one, wide, atol=1e-3)
    idle = voice.acoustic.cores
    assert idle is not None
    busy = acoustic_module.IdleCores(idle.directory)
    seeded = [c["audio"].tobytes() for c in voice.sentences(voice.request(LONG, seed=8))]
    with busy.hold(busy.count):  # every core taken: no step can go wide now
        held = [c["audio"].tobytes() for c in voice.sentences(voice.request(LONG, seed=8))]
    assert seeded == held


def test_idle_core_tokens_are_exclusive_and_released(acoustic_module, tmp_path):
    cores = acoustic_module.IdleCores(tmp_path / "cores")
    other = acoustic_module.IdleCores(tmp_path / "cores")  # another replica: its own files
    with cores.hold(1) as one:
        assert one == 1
        with other.hold(cores.count) as rest:
            assert rest == cores.count - 1  # the core in use is not free
    with other.hold(cores.count) as everything:
        assert everything == cores.count  # released when the step ended


def test_idle_core_tokens_refuse_a_directory_others_can_write(acoustic_module, tmp_path):
    shared = tmp_path / "cores"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="not a directory private to this user"):
        acoustic_module.IdleCores(shared)
