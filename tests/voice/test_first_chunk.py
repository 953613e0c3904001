"""A short first chunk (the first sentence cut at a natural boundary), smooth joins,
and idle cores for first chunks."""

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


def test_only_the_first_sentence_is_cut_and_noise_keys_follow_the_chunks(voice):
    chunks = list(voice.frontend_chunks(voice.request(f"{LONG} {LONG}", seed=1)))
    assert [c["sentence"] for c in chunks] == [0, 0, 1]
    assert [c["chunk"] for c in chunks] == [0, 1, 2]
    assert [(c["joins_previous"], c["joins_next"]) for c in chunks] == [
        (False, True),
        (True, False),
        (False, False),
    ]
    assert len(chunks[0]["phoneme_ids"]) < len(chunks[2]["phoneme_ids"]) / 2


def test_no_cut_with_first_chunk_words_zero(voice, plan):
    whole = load_stage(plan, "text_frontend", parameters={"first_chunk_words": 0})
    chunks = list(whole.generate(Request("r", voice.request(LONG))))
    assert [c["sentence"] for c in chunks] == [0] and not chunks[0]["joins_next"]


def test_joins_have_no_click_and_a_short_pause(voice):
    """The samples either side of a join are near zero (fades; VITS edges are quiet anyway),
    and the silence across the join is a pause, not a sentence break."""
    [head, rest, *_] = voice.sentences(voice.request(LONG, seed=3))
    a, b = head["audio"], rest["audio"]
    assert abs(float(a[-1])) < 1e-3 and abs(float(b[0])) < 1e-3
    rate = head["sample_rate"]
    silent_end = len(a) - 1 - int(np.flatnonzero(np.abs(a) >= 0.01)[-1])
    silent_start = int(np.flatnonzero(np.abs(b) >= 0.01)[0])
    gap_s = (silent_end + silent_start) / rate
    assert 0.03 < gap_s < 0.1, gap_s  # whole sentences end with ~130-175 ms of silence
    steps = np.abs(np.diff(np.concatenate([a[-200:], b[:200]])))
    assert steps.max() < 0.05  # no jump at the join


def test_tighten_join_keeps_sound_and_fades_cut_edges(acoustic_module):
    rate = 22050
    tone = np.sin(np.arange(rate // 10) * 0.3).astype(np.float32)  # 100 ms of sound
    audio = np.concatenate([np.zeros(rate // 5, np.float32), tone, np.zeros(rate // 5, np.float32)])
    out = acoustic_module.tighten_join(audio, rate, before_s=0.04, after_s=0.02)
    assert len(out) == pytest.approx(len(tone) + 0.06 * rate, abs=2)
    assert out[0] == 0.0 and abs(out[-1]) < 1e-6
    untouched = acoustic_module.tighten_join(audio, rate, before_s=0.0, after_s=0.0)
    assert np.array_equal(untouched, audio)


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
