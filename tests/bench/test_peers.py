"""The peers run for real: Piper's own Flask server as a child process, and the voice in-process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from omni_bench.metrics import playback_underrun, ttfa
from omni_bench.peers import InProcessTarget, PiperHttpTarget, make_peer
from tests.helpers.proc import alive

REPOSITORY = Path(__file__).resolve().parents[2] / "repository"
TWO_SENTENCES = "The lighthouse keeper kept a log. Every passing ship was written down."


@pytest.mark.slow  # starts Piper's Flask server
@pytest.mark.timeout(180)
def test_piper_http_serves_the_voice_and_stops_cleanly():
    async def scenario():
        target = PiperHttpTarget()
        await target.start()
        pid = target.server.pid
        try:
            results = await asyncio.gather(*(target.synthesize(TWO_SENTENCES) for _ in range(3)))
        finally:
            await target.close()
        return pid, results

    pid, results = asyncio.run(scenario())
    for timing, clip in results:
        assert timing.ok, timing.error
        assert clip.sample_rate == 22_050  # Piper's server returns the voice's own WAV
        assert 2.0 < clip.seconds < 10.0
        assert timing.audio_seconds == clip.seconds
        assert 0 < ttfa(timing) <= timing.end - timing.start
    assert pid is not None and not alive(pid), "piper.http_server still running after close()"


@pytest.mark.slow  # loads the voice
@pytest.mark.timeout(120)
def test_in_process_voice_streams_the_repository_stages_per_sentence():
    async def scenario():
        target = InProcessTarget(REPOSITORY, max_workers=2, response_format="pcm", stream=True)
        await target.start()
        try:
            return await target.synthesize(TWO_SENTENCES)
        finally:
            await target.close()

    timing, clip = asyncio.run(scenario())
    assert timing.ok
    assert len(timing.chunks) >= 2  # one per sentence, then the resampler's tail
    assert timing.chunks[0].at < timing.chunks[1].at
    assert clip.sample_rate == 24_000
    assert timing.nbytes == len(clip.samples) * 2
    assert playback_underrun(timing) == 0.0  # the voice runs far faster than real time
    assert 0.5 < abs(clip.samples).max() <= 1.0  # peak-normalized, not silence


def test_unknown_peer_is_rejected_by_name():
    with pytest.raises(ValueError, match="in-process, piper-http"):
        make_peer(
            "espeak", repository=REPOSITORY, max_concurrency=4, response_format="pcm", stream=True
        )
