"""The text frontend: normalization, sentence splitting and phonemization with espeak-ng."""

from __future__ import annotations

import numpy as np
import pytest

from omni_bench.inprocess import load_stage
from omni_server.backend import InvalidRequest, Request, StageConfigError
from omni_server.contracts import SpeechOptions, speech_payload

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def frontend(plan):
    """One chunk per whole sentence (the first-chunk cut is tested in test_first_chunk.py)."""
    return load_stage(plan, "text_frontend", parameters={"first_chunk_words": 0})


def speech(text: str, voice: str = "joe", **options) -> dict:
    """The speech entry's inputs: `text` and the typed options (checked as they are built)."""
    return speech_payload(text, SpeechOptions(voice, **options))


def chunks(frontend, inputs: dict) -> list[dict]:
    return list(frontend.generate(Request("r", inputs)))


def phonemes(frontend, text: str) -> list[str]:
    return [c["phonemes"] for c in chunks(frontend, speech(text))]


def test_numbers_are_read_as_words(frontend):
    [digits] = phonemes(frontend, "I have 42 apples.")
    [words] = phonemes(frontend, "I have forty two apples.")
    assert digits == words


def test_abbreviations_do_not_end_the_sentence(frontend):
    said = phonemes(frontend, "Dr. Smith met Mr. Jones on Jan. 3rd.")
    assert len(said) == 1, said
    assert said == phonemes(frontend, "Doctor Smith met Mister Jones on January third.")


def test_etc_keeps_its_sentence_end_only_where_it_has_one(frontend):
    assert len(phonemes(frontend, "Apples, pears, etc. Then we left.")) == 2
    assert len(phonemes(frontend, "Apples, pears, etc. and then we left.")) == 1


def test_currency_is_spelled_out(frontend):
    [said] = phonemes(frontend, "It costs $42.50.")
    assert said == phonemes(frontend, "It costs forty two dollars and fifty cents.")[0]


def test_sentences_are_split_and_typographic_punctuation_normalized(frontend):
    said = phonemes(frontend, "\u201cHello,\u201d she said \u2014 softly. Are you there? Yes!")
    assert len(said) == 3
    assert said[1].endswith("?") and said[2].endswith("!")


def test_phoneme_ids_follow_the_voice_id_map(frontend):
    [sentence] = chunks(frontend, speech("Hi."))
    ids = sentence["phoneme_ids"]
    assert ids.dtype == np.int64
    # BOS, then every phoneme followed by PAD (0), then EOS
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 2 * len(sentence["phonemes"]) + 3
    assert np.all(ids[1:-1:2] == 0)


def test_long_sentence_is_cut_at_clause_and_word_boundaries(frontend, plan):
    uncut = load_stage(
        plan, "text_frontend", parameters={"max_sentence_phonemes": 10**6, "first_chunk_words": 0}
    )
    clause = "the rain kept falling over the quiet little town by the river"
    text = ", ".join([clause] * 12) + "."  # one sentence of ~700 phonemes
    said = phonemes(frontend, text)
    assert len(said) > 1
    assert all(len(s) <= frontend.max_sentence_phonemes for s in said)
    assert len(phonemes(uncut, text)) == 1
    assert "".join(said).replace(" ", "") == phonemes(uncut, text)[0].replace(" ", "")
    words_only = phonemes(frontend, " ".join([clause] * 12))  # no punctuation at all
    assert len(words_only) > 1 and all(len(s) <= frontend.max_sentence_phonemes for s in words_only)


def test_request_options_pass_through(frontend):
    options = SpeechOptions(
        "joe", speed=1.5, seed=7, response_format="pcm", stream=True, sample_rate=16000
    )
    [chunk] = chunks(frontend, speech_payload("Hi.", options))
    assert chunk["speech"] is options  # every chunk carries the request's options on, as sent
    assert (chunk["sentence"], chunk["chunk"]) == (0, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text": "  "}, "text must be a non-empty string"),
        ({"voice": "alloy"}, "unknown voice 'alloy'; valid: joe"),
        # the contract's own checks: refused where the options are built, before any stage
        ({"speed": 5.0}, "speed must lie in 0.25..4.0"),
        ({"response_format": "ogg"}, "response_format must be one of"),
        ({"response_format": "opus", "sample_rate": 22050}, "opus supports sample rates"),
        ({"seed": "7"}, "seed must be an integer"),
    ],
)
def test_bad_request_fails_with_a_clear_message(frontend, change, message):
    good = {"text": "Hello.", "voice": "joe"}
    with pytest.raises(ValueError) as failed:
        chunks(frontend, speech(**{**good, **change}))
    assert message in str(failed.value)
    if "text" in change:  # the stage's checks name the request
        assert "bad speech request" in str(failed.value)
    if "voice" in change:  # a voice gone since the server checked it: the caller's (a 400)
        assert isinstance(failed.value, InvalidRequest)
        assert (failed.value.code, failed.value.param) == ("voice_not_found", "voice")
    assert len(chunks(frontend, speech(**good))) == 1


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_text_espeak_cannot_encode_is_the_callers_fault(frontend, streamed):
    """Issue 42 item 1: a lone surrogate (which the server's edges refuse first) is an
    InvalidRequest naming the text, a 400, not espeak-ng's UnicodeEncodeError (a 500)."""
    text = "Hello \ud800 there. "
    if streamed:
        first = {"text": text, SpeechOptions.KEY: SpeechOptions("joe")}
        request = Request("r", {}, _stream=iter([first]))
    else:
        request = Request("r", speech(text))
    with pytest.raises(InvalidRequest) as refused:
        list(frontend.generate(request))
    assert refused.value.code == "invalid_value"
    assert refused.value.param == ("text" if streamed else "input")
    assert "unpaired UTF-16 surrogate (U+D800)" in refused.value.message


def test_config_error_says_what_was_required_and_found(plan):
    with pytest.raises(StageConfigError, match=r"parameters.voices must be a table.*found 'joe'"):
        load_stage(plan, "text_frontend", parameters={"voices": "joe"})
    with pytest.raises(StageConfigError, match=r"parameters.voices.joe: package 'no_such_voice'"):
        load_stage(plan, "text_frontend", parameters={"voices": {"joe": "no_such_voice"}})
