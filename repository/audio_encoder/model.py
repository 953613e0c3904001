"""Audio encoder stage (terminal): sentence audio -> the response body, as bytes to send.

It reads everything from the chunks the acoustic stage streams to it (audio, native rate, and
the request's `speech` options: format, sample rate, stream), so it can start on the first
sentence while later ones are still being synthesized; its `next` payload (the acoustic
stage's totals) is not needed.

Per chunk: resample to the output rate with soxr (a stream resampler, so sentence joins have no
seams), encode with PyAV, yield {"audio": bytes} when the encoder produced any, with the
`contracts.SpeechTiming` of the words the acoustic stage timed since the last bytes ("timing";
seconds from the first sample, so resampling leaves them as they are). A streamed
request gets bytes after every sentence (wav: the 0xFFFFFFFF header first; pcm: raw s16le);
a non-streamed one gets the whole file in one chunk at the end (wav with true sizes). A stream
with no chunk at all (a text-only request of an omni model: the frontend said nothing) ends with
no bytes and a result of no audio (`format` None).
"""

from __future__ import annotations

from collections.abc import Generator

from omni_server.audio.encode import AudioEncoder, default_sample_rate
from omni_server.audio.resample import StreamResampler
from omni_server.backend import Payload, Request, StageBackend
from omni_server.contracts import SpeechOptions, SpeechTiming


class AudioEncoderStage(StageBackend):
    def generate(self, request: Request) -> Generator[Payload, None, Payload]:
        encoder: AudioEncoder | None = None
        sentences = 0
        timings: list[SpeechTiming] = []  # the words of audio not yet sent, in order
        try:
            for chunk in request.stream():
                request.check_aborted()
                if encoder is None:
                    speech = SpeechOptions.of(chunk)
                    fmt = speech.response_format
                    rate = speech.sample_rate or default_sample_rate(fmt, chunk["sample_rate"])
                    resampler = StreamResampler(int(chunk["sample_rate"]), rate)
                    encoder = AudioEncoder(fmt, rate, streaming=speech.stream)
                if chunk["sentence"] is not None:  # None: a chunk of no sentence (no audio)
                    sentences = max(sentences, int(chunk["sentence"]) + 1)
                timing = chunk.get(SpeechTiming.KEY)
                if isinstance(timing, SpeechTiming):
                    timings.append(timing)
                data = encoder.encode(resampler.push(chunk["audio"]))
                if data:
                    yield _with_timing(data, timings)
            if encoder is None:  # a request the voice does not speak (omni, text only)
                return {"sample_rate": None, "audio_seconds": 0.0, "format": None, "sentences": 0}
            tail = encoder.encode(resampler.flush()) + encoder.finish()
            if tail or timings:
                yield _with_timing(tail, timings)
            return {
                "sample_rate": encoder.sample_rate,
                "audio_seconds": encoder.samples / encoder.sample_rate,
                "format": encoder.format,
                "sentences": sentences,
            }
        finally:
            if encoder is not None:
                encoder.close()


def _with_timing(data: bytes, timings: list[SpeechTiming]) -> Payload:
    """A chunk of body bytes with the timing of the words whose audio went into the encoder
    since the last chunk (the encoder may hold samples back: a word's timing may come a chunk
    before its last bytes, never after them). Empties `timings`."""
    chunk: Payload = {"audio": data}
    if timings:
        chunk[SpeechTiming.KEY] = SpeechTiming.joined(timings)
        timings.clear()
    return chunk
