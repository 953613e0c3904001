"""Audio helpers for stage authors: encoding, streaming WAV, resampling, decoding, speech in.

encode     AudioEncoder: float32 mono blocks -> the next bytes of an mp3|opus|aac|flac|wav|pcm
           body, progressively (streamed responses) or as one seekable file
wav        RIFF/WAVE headers, including the streaming header whose sizes are 0xFFFFFFFF
resample   one-shot and streaming resampling with soxr
decode     bytes of any of those formats -> float32 samples (tests, benchmarks, quality checks)
vad        voice activity: Silero / webrtcvad detectors, the utterance tracker, Whisper windows
whisper    the bundled Whisper tiny.en (faster-whisper): the recognizer of the ASR stage and of
           the tools' WER judge (normalization and WER live in omni_bench.wer)
"""

from omni_server.audio.decode import decode
from omni_server.audio.encode import (
    CONTENT_TYPES,
    DEFAULT_SAMPLE_RATES,
    FORMATS,
    AudioEncoder,
    check_sample_rate,
    default_sample_rate,
)
from omni_server.audio.resample import StreamResampler, resample
from omni_server.audio.wav import STREAMING_SIZE, wav_header

__all__ = [
    "CONTENT_TYPES",
    "DEFAULT_SAMPLE_RATES",
    "FORMATS",
    "STREAMING_SIZE",
    "AudioEncoder",
    "StreamResampler",
    "check_sample_rate",
    "decode",
    "default_sample_rate",
    "resample",
    "wav_header",
]
