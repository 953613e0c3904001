"""The benchmark's audio making: noise at the stated SNR, clips placed where the spans say."""

from __future__ import annotations

import numpy as np
import pytest

from omni_bench import asr_audio


def test_noise_is_added_at_the_stated_snr():
    rng = np.random.default_rng(0)
    speech = (0.2 * np.sin(np.arange(32000) / 7)).astype(np.float32)
    for snr in (0.0, 10.0, 20.0):
        noisy = asr_audio.add_noise(speech, snr, seed=int(rng.integers(100)))
        noise = noisy - speech
        measured = 10 * np.log10(np.mean(speech**2) / np.mean(noise**2))
        assert measured == pytest.approx(snr, abs=0.3)


def test_pauses_put_each_clip_where_its_span_says():
    clips = [np.full(1000 * (i + 1), 0.5, np.float32) for i in range(3)]
    joined = asr_audio.join_with_pauses(clips, ["a", "b", "c"], pause_s=(0.2, 0.4), seed=1)
    assert joined.text == "a b c"
    for (start, end), clip in zip(joined.spans, clips, strict=True):
        np.testing.assert_array_equal(joined.samples[start:end], clip)
        assert joined.samples[start - 1] == 0.0  # a pause before every clip
    gaps = [b[0] - a[1] for a, b in zip(joined.spans, joined.spans[1:], strict=False)]
    assert all(0.2 * 16000 <= g <= 0.4 * 16000 for g in gaps)


def test_an_upload_wav_round_trips():
    samples = (0.5 * np.sin(np.arange(16000) / 5)).astype(np.float32)
    decoded = asr_audio.decode_file(asr_audio.to_wav(samples))
    np.testing.assert_allclose(decoded, samples, atol=1e-4)
