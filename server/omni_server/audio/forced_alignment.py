"""Word timing for a voice that has none of its own: the produced audio forced-aligned to the
text that produced it, with the bundled Whisper tiny.en, while the audio streams.

Why Whisper's forced alignment: the text is known, so the aligner does not transcribe and
then hope the words match; it hands Whisper the text's own tokens and reads, from the
cross-attention of its alignment heads (CTranslate2's `align`, the pass faster-whisper times
words with), when each token is heard (dynamic time warping, 20 ms steps). Every word of the
text gets a time, in order, whatever Whisper would have heard. A CTC aligner would need a
wav2vec2-style model that no PyPI package ships (nothing is downloaded from a hub), and
Whisper's transcribe-then-match measured no closer on the embedded voice (docs/models.md).

Streaming (`StreamAligner`): the audio is cut into segments at pauses, each at least
`min_segment_s` long (at most `max_segment_s`: then cut at its quietest 20 ms). Which words a
segment speaks is not known in advance, so a segment is recognized first (greedy, on the same
encoder output) and its hypothesis matched against the text's next words
(`align_text.covered_words`); those words are then forced-aligned to it. At the end, the
words left are forced-aligned to the audio left. A segment's words are therefore known once
the pause after it has been produced, plus one encoder pass (over Whisper's whole 30 s window:
most of the cost), one greedy decode and one alignment pass (docs/models.md measures them).

Times are seconds from the utterance's first sample at the rate the audio is pushed in
(after speed and resampling: the listener's time).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_server.audio.align_text import (
    Word,
    covered_words,
    monotonic,
    normalized,
    spoken_words,
    timing_of,
)
from omni_server.audio.resample import StreamResampler
from omni_server.audio.whisper import WHISPER_RATE, load_whisper
from omni_server.contracts import SpeechTiming

FRAME = WHISPER_RATE // 50  # 20 ms: the pause detector's frame, Whisper's alignment step
MAX_WINDOW_S = 30.0  # Whisper hears 30 s at most
MAX_DECODE_TOKENS = 224  # Whisper's own bound for one window's text


@dataclass(frozen=True)
class Segmenting:
    """Where the stream is cut for alignment (see the module docstring)."""

    min_segment_s: float = 2.0  # a cut needs this much audio before it
    max_segment_s: float = 10.0  # past this without a pause: cut at the quietest frame
    min_pause_s: float = 0.15  # a pause: this long under silence_db
    silence_db: float = -35.0  # below the loudest 20 ms heard so far

    def __post_init__(self) -> None:
        if not 0 < self.min_segment_s < self.max_segment_s <= MAX_WINDOW_S:
            raise ValueError(
                f"need 0 < min_segment_s < max_segment_s <= {MAX_WINDOW_S:g}; got "
                f"{self.min_segment_s!r}, {self.max_segment_s!r}"
            )
        if not 0 < self.min_pause_s < self.min_segment_s:
            raise ValueError(
                f"min_pause_s must lie in (0, min_segment_s); got {self.min_pause_s!r}"
            )
        if not self.silence_db < 0:
            raise ValueError(f"silence_db must be below 0; got {self.silence_db!r}")


class WhisperAligner:
    """Whisper tiny.en for alignment: encode a segment once, recognize it, force-align text.

    It keeps no per-utterance state (a StreamAligner does), so one serves every stream of a
    stage; calls from up to `workers` threads run at once (the word_timing stage's pool).
    A segment costs one encoder pass over Whisper's whole 30 s window (most of the cost,
    whatever the segment's length), one greedy decode and one alignment pass."""

    def __init__(self, model: Any | None = None, *, cpu_threads: int = 1, workers: int = 1) -> None:
        from faster_whisper.tokenizer import Tokenizer  # heavy: only where an aligner is made

        if model is None:
            model = load_whisper(cpu_threads=cpu_threads, workers=workers)
        self.model = model
        self.tokenizer = Tokenizer(
            self.model.hf_tokenizer, self.model.model.is_multilingual, task="transcribe",
            language="en",
        )  # fmt: skip

    def encode(self, audio: np.ndarray) -> tuple[Any, int]:
        """16 kHz mono float32 (at most 30 s) -> (the encoder's output, its feature frames)."""
        from faster_whisper.audio import pad_or_trim

        features = self.model.feature_extractor(audio.astype(np.float32, copy=False))
        frames = min(int(features.shape[-1]), int(MAX_WINDOW_S * 100))
        return self.model.encode(pad_or_trim(features)), frames

    def recognize(self, encoded: tuple[Any, int]) -> list[str]:
        """The words Whisper hears (greedy, no timestamps), normalized."""
        prompt = [*self.tokenizer.sot_sequence, self.tokenizer.no_timestamps]
        result = self.model.model.generate(
            encoded[0], [prompt], beam_size=1, max_length=MAX_DECODE_TOKENS,
            suppress_blank=True, suppress_tokens=[-1],
        )[0]  # fmt: skip
        tokens = [t for t in result.sequences_ids[0] if t < self.tokenizer.eot]
        words = (normalized(w) for w in self.tokenizer.decode(tokens).split())
        return [w for w in words if w]

    def force(
        self, encoded: tuple[Any, int], text: str, words: Sequence[Word]
    ) -> list[tuple[float, float]]:
        """Each of `words` (consecutive words of `text`) timed in the encoded segment, in
        seconds from its start: the text's tokens aligned by Whisper, each word taking the
        time of the tokens that spell it."""
        if not words:
            return []
        begin = words[0].char_start
        piece = " " + text[begin : words[-1].char_end]
        tokens = self.tokenizer.encode(piece)
        alignment = self.model.find_alignment(self.tokenizer, [tokens], *encoded)[0]
        spelled = "".join(a["word"] for a in alignment)
        if spelled != piece:  # a token that splits a character: time the words evenly
            return _evenly(words, encoded[1] / 100)
        times: list[tuple[float, float] | None] = [None] * len(words)
        cursor, index = begin - 1, 0  # the piece starts one space before the first word
        for part in alignment:
            start, end = cursor, cursor + len(part["word"])
            cursor = end
            while index < len(words) and words[index].char_end <= start:
                index += 1
            for w in range(index, len(words)):
                if words[w].char_start >= end:
                    break
                if part["word"].strip() and words[w].char_end > start:
                    t0, t1 = float(part["start"]), float(part["end"])
                    held = times[w]
                    times[w] = (t0, t1) if held is None else (min(held[0], t0), max(held[1], t1))
        return _filled(times)


def _evenly(words: Sequence[Word], seconds: float) -> list[tuple[float, float]]:
    """Words spread over `seconds` in proportion to their length (the fallback)."""
    lengths = np.cumsum([0] + [len(w.text) for w in words], dtype=np.float64)
    edges = lengths / lengths[-1] * seconds
    return [(float(edges[i]), float(edges[i + 1])) for i in range(len(words))]


def _filled(times: Sequence[tuple[float, float] | None]) -> list[tuple[float, float]]:
    """A word no token timed (cannot happen with a lossless tokenizer, but never None):
    a zero-length time at the end of the word before it."""
    out: list[tuple[float, float]] = []
    last = 0.0
    for held in times:
        start, end = held if held is not None else (last, last)
        out.append((start, end))
        last = end
    return out


class StreamAligner:
    """One utterance's word timing as its audio streams in (see the module docstring).

    `push(samples)` after each chunk of audio, `finish()` once at its end; each returns the
    timing of the words it could place (None when it placed none yet). The timings returned,
    joined, cover the text from its first character to its last, and every word of it in
    order with non-decreasing starts."""

    def __init__(
        self, aligner: WhisperAligner, text: str, rate: int, segmenting: Segmenting | None = None
    ) -> None:
        self.aligner, self.text = aligner, text
        self.segmenting = segmenting or Segmenting()
        self.words = spoken_words(text)
        self.resampler = StreamResampler(rate, WHISPER_RATE)
        self.buffer = np.zeros(0, np.float32)  # 16 kHz audio not aligned yet
        self.offset_s = 0.0  # where buffer[0] lies in the utterance
        self.next_word = 0  # the first word not timed yet
        self.next_char = 0  # the first character of the text not in a timing yet
        self.loudest = 0.0  # the loudest frame's RMS so far (the silence threshold's reference)
        self.last_end_s = 0.0  # the end of the last word timed
        self.align_seconds = 0.0  # compute spent aligning (the latency it adds, logged)
        self.segments = 0

    def push(self, samples: np.ndarray) -> SpeechTiming | None:
        if self.next_word >= len(self.words):  # every word timed: the rest is not needed
            return None
        self.buffer = np.concatenate([self.buffer, self.resampler.push(samples)])
        timings = []
        while self.next_word < len(self.words) and (cut := self._cut()) is not None:
            timing = self._segment(cut)
            if timing is not None:
                timings.append(timing)
        return SpeechTiming.joined(timings) if timings else None

    def finish(self) -> SpeechTiming | None:
        """The words left, aligned to the audio left, and the text to its end."""
        words = self.words[self.next_word :]
        if words:
            self.buffer = np.concatenate([self.buffer, self.resampler.flush()])
        times: list[tuple[float, float]] = []
        if words and len(self.buffer) >= FRAME:
            times = self._aligned(self.buffer[: int(MAX_WINDOW_S * WHISPER_RATE)], words)
        elif words:
            times = [(self.last_end_s, self.last_end_s)] * len(words)
        if self.next_char >= len(self.text):
            return None
        timing = timing_of(self.text, words, times, (self.next_char, len(self.text)))
        self.next_word, self.next_char = len(self.words), len(self.text)
        return timing

    def _segment(self, cut: int) -> SpeechTiming | None:
        """Align buffer[:cut]: recognize it, take the words it speaks, time them."""
        began = time.perf_counter()
        audio, self.buffer = self.buffer[:cut], self.buffer[cut:]
        offset, self.offset_s = self.offset_s, self.offset_s + cut / WHISPER_RATE
        encoded = self.aligner.encode(audio)
        rest = self.words[self.next_word :]
        heard = self.aligner.recognize(encoded)
        reference = [normalized(w.text) for w in rest[: 2 * len(heard) + 8]]
        count = covered_words(reference, heard)
        if count == 0:  # no speech heard: the segment holds none of the text
            self.align_seconds += time.perf_counter() - began
            return None
        words = rest[:count]
        times = self._place(self.aligner.force(encoded, self.text, words), offset, audio)
        self.next_word += count
        end_char = (
            self.words[self.next_word].char_start
            if self.next_word < len(self.words)
            else len(self.text)
        )
        timing = timing_of(self.text, words, times, (self.next_char, end_char))
        self.next_char = end_char
        self.segments += 1
        self.align_seconds += time.perf_counter() - began
        return timing

    def _aligned(self, audio: np.ndarray, words: Sequence[Word]) -> list[tuple[float, float]]:
        began = time.perf_counter()
        encoded = self.aligner.encode(audio)
        times = self._place(self.aligner.force(encoded, self.text, words), self.offset_s, audio)
        self.align_seconds += time.perf_counter() - began
        return times

    def _place(
        self, times: Sequence[tuple[float, float]], offset: float, audio: np.ndarray
    ) -> list[tuple[float, float]]:
        """Segment times -> utterance times: each start moved past the silence it lies in,
        inside the segment, after the words before."""
        limit = len(audio) / WHISPER_RATE
        onsets = self._onsets(monotonic(times, limit), audio)
        placed = [(offset + s, offset + e) for s, e in monotonic(onsets, limit)]
        if placed:
            self.last_end_s = placed[-1][1]
        return placed

    def _onsets(
        self, times: Sequence[tuple[float, float]], audio: np.ndarray
    ) -> list[tuple[float, float]]:
        """Each word's start moved to the first 10 ms of sound at or after it, inside the
        word. Whisper's alignment runs a word after a pause from inside the pause (its
        attention spreads over the silence before a sound): on the tuning texts the median
        start error went 67 -> 55 ms, the 95th percentile 228 -> 195 ms (docs/models.md)."""
        hop = WHISPER_RATE // 100
        frames = len(audio) // hop
        if frames == 0:
            return list(times)
        rms = np.sqrt(np.mean(audio[: frames * hop].reshape(frames, hop) ** 2, axis=1))
        loudest = max(self.loudest, float(rms.max()))
        sound = rms > loudest * 10 ** (self.segmenting.silence_db / 20)
        out = []
        for start, end in times:
            f, last = int(start * 100), min(int(end * 100), frames)
            while f < last and not sound[f]:
                f += 1
            out.append((max(start, f / 100) if f < last else start, end))
        return out

    def _cut(self) -> int | None:
        """Where to cut the buffer (in samples), or None: not yet.

        The same audio is cut at the same places however it is chunked: frames are read in
        order, each judged against the loudest frame up to itself, and a pause is cut half
        `min_pause_s` into it (a pause still growing at the buffer's end cuts where a whole
        one would)."""
        seg = self.segmenting
        frames = len(self.buffer) // FRAME
        if frames == 0:
            return None
        rms = np.sqrt(np.mean(self.buffer[: frames * FRAME].reshape(frames, FRAME) ** 2, axis=1))
        level = np.maximum.accumulate(np.maximum(rms, self.loudest))  # [frames]
        silent = rms <= level * 10 ** (seg.silence_db / 20)
        first = int(seg.min_segment_s * 50)  # the earliest frame a cut may fall on
        pause = max(1, int(seg.min_pause_s * 50))
        run = 0
        for f in range(frames):
            run = run + 1 if silent[f] else 0
            at = f - run + 1 + pause // 2  # half min_pause_s into the pause
            if run >= pause and at >= first:
                return self._consumed(level, at)
        longest = int(seg.max_segment_s * 50)
        if frames < longest:
            return None
        search = int(0.6 * longest)  # the quietest frame of the window's last 40 %
        return self._consumed(level, search + int(np.argmin(rms[search:longest])))

    def _consumed(self, level: np.ndarray, frame: int) -> int:
        """The cut at `frame`, in samples; the loudest level heard up to it is kept."""
        self.loudest = float(level[frame - 1]) if frame > 0 else self.loudest
        return frame * FRAME
