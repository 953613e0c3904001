"""Higgs Audio v2's audio tokenizer for the stages of examples/higgs-audio-v2: the checkpoint
folder checked at start, the tokenizer loaded from it (our own torch code,
audio/higgs_tokenizer: its encoder turns a reference clip into codes, its decoder codes into
24 kHz audio), the delay pattern undone as frames stream in, and decode windows cut so that
audio decoded a chunk at a time equals the audio of decoding every code at once
(docs/models.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omni_server.audio import higgs_tokenizer
from omni_server.audio.higgs_tokenizer import HiggsAudioTokenizer

MODEL_TYPE = "higgs_audio_v2"
SAMPLE_RATE = 24000  # the tokenizer's rate: a frame is hop_length (960) samples, 25 a second
AUDIO_TOKENIZER_DIR = "audio_tokenizer"  # where omni-bench random-checkpoint writes it


class HiggsCheckpointError(ValueError):
    """A checkpoint folder this pipeline cannot serve; the message names the folder and what is
    missing or wrong, in one line."""


@dataclass(frozen=True)
class HiggsCheckpoint:
    folder: Path  # the model: config.json, safetensors, tokenizer, chat template
    audio_tokenizer: Path  # the audio tokenizer: config.json + model.safetensors


def open_checkpoint(parameters: Any) -> HiggsCheckpoint:
    """The folders named by a repository's [parameters] (`checkpoint`, and `audio_tokenizer`
    where it is not `checkpoint/audio_tokenizer`), checked for what every stage reads."""
    value = parameters.get("checkpoint")
    if not isinstance(value, str) or not value:
        raise HiggsCheckpointError(
            "parameters.checkpoint is not set: serve with --parameters.checkpoint DIR (a "
            "Higgs Audio v2 checkpoint folder, e.g. one omni-bench random-checkpoint wrote)"
        )
    folder = Path(value).expanduser().resolve()
    if not folder.is_dir():
        raise HiggsCheckpointError(f"checkpoint {folder}: no such folder")
    config = _json(folder, "config.json")
    if config.get("model_type") != MODEL_TYPE:
        raise HiggsCheckpointError(
            f"checkpoint {folder}: config.json's model_type is {config.get('model_type')!r}; "
            f"this pipeline serves {MODEL_TYPE!r}"
        )
    for name in ("tokenizer.json",):
        if not (folder / name).is_file():
            raise HiggsCheckpointError(f"checkpoint {folder}: no {name}")
    audio = _audio_tokenizer_folder(folder, parameters.get("audio_tokenizer"))
    if _json(audio, "config.json").get("model_type") != "higgs_audio_v2_tokenizer":
        raise HiggsCheckpointError(
            f"audio tokenizer {audio}: config.json is no higgs_audio_v2_tokenizer (set "
            "--parameters.audio_tokenizer DIR to its folder)"
        )
    if not (audio / "model.safetensors").is_file():
        raise HiggsCheckpointError(f"audio tokenizer {audio}: no model.safetensors")
    return HiggsCheckpoint(folder, audio)


def _audio_tokenizer_folder(folder: Path, given: Any) -> Path:
    """The parameter, else the folder processor_config.json names (where it is one), else
    checkpoint/audio_tokenizer (the published model names a hub repository there instead)."""
    if isinstance(given, str) and given:
        return Path(given).expanduser().resolve()
    named = None
    if (folder / "processor_config.json").is_file():
        settings = _json(folder, "processor_config.json").get("audio_tokenizer")
        if isinstance(settings, dict):
            named = settings.get("audio_tokenizer_name_or_path")
    if isinstance(named, str) and Path(named).is_dir():
        return Path(named).resolve()
    return folder / AUDIO_TOKENIZER_DIR


def _json(folder: Path, name: str) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        raise HiggsCheckpointError(f"{folder}: no {name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise HiggsCheckpointError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise HiggsCheckpointError(f"{path}: not a JSON object")
    return data


def load_audio_tokenizer(checkpoint: HiggsCheckpoint, device: str) -> HiggsAudioTokenizer:
    """The audio tokenizer of `checkpoint`, in eval mode on `device` (float32)."""
    try:
        codec = higgs_tokenizer.load(checkpoint.audio_tokenizer, device)
    except higgs_tokenizer.TokenizerFolderError as err:
        raise HiggsCheckpointError(str(err)) from err
    if codec.config.sample_rate != SAMPLE_RATE:
        raise HiggsCheckpointError(
            f"audio tokenizer {checkpoint.audio_tokenizer}: sample_rate "
            f"{codec.config.sample_rate}, expected {SAMPLE_RATE}"
        )
    return codec


def delayed(codes: np.ndarray, bos: int, eos: int) -> list[list[int]]:
    """A clip's codes [n, K] as the prompt carries them: BOS and EOS around them and the delay
    pattern (codebook k shifted k frames later): n + K + 1 frames of K codes, as the reference
    processor's build_delay_pattern makes them."""
    n, k = codes.shape
    out = np.full((n + 2 + k - 1, k), eos, dtype=np.int64)
    for j in range(k):
        out[: j + 1, j] = bos
        out[j + 1 : j + 1 + n, j] = codes[:, j]
    frames: list[list[int]] = out.tolist()
    return frames


@dataclass
class Undelay:
    """Generated frames (delay pattern, as the engine emits them) -> code columns [K] as each
    becomes whole: the reference's `batch_decode` (generation starts after the all-BOS frame,
    ends before the all-EOS frame; codebook k of column j is frame j + k's; codes clipped to the
    real range) done one frame at a time."""

    num_codebooks: int
    bos: int
    eos: int
    frames: list[list[int]] = field(default_factory=list)  # after the all-BOS frame
    ended: bool = False  # the all-EOS frame came (later frames are ignored)
    started: bool = False

    def push(self, frame: list[int]) -> None:
        if self.ended:
            return
        if all(c == self.bos for c in frame):
            self.started, self.frames = True, []  # the reference starts at the last one
            return
        if all(c == self.eos for c in frame):
            self.ended = True
            return
        self.frames.append(frame)

    def columns(self) -> int:
        """How many code columns are whole now."""
        return max(0, len(self.frames) - self.num_codebooks + 1)

    def codes(self, start: int, stop: int) -> np.ndarray:
        """Columns [start, stop) as [K, stop - start], clipped to codes 0 .. bos - 1."""
        k = self.num_codebooks
        out = np.empty((k, stop - start), dtype=np.int64)
        for j in range(k):
            out[j] = [self.frames[i + j][j] for i in range(start, stop)]
        return np.clip(out, 0, self.bos - 1)


@dataclass(frozen=True)
class Window:
    """Decode columns [start, stop) and keep the audio of columns [keep, keep + count)."""

    start: int
    stop: int
    keep: int
    count: int


def next_window(
    done: int,
    available: int,
    final: bool,
    *,
    chunk: int,
    context: int,
    lookahead: int,
    span: int = 0,
) -> Window | None:
    """The next chunk of a stream that has emitted `done` columns and holds `available`: `chunk`
    columns once `lookahead` more are there (the decoder's right context), decoded with up to
    `context` columns before (its left context); at the end whatever is left, with at least
    `context` columns before it and more, up to a window of `span` columns, where there are
    (more left context changes nothing the receptive field sees; a fixed length lets the last
    window reuse the steady window's CUDA graph). A stream that ended with more than a chunk and
    its lookahead left (its decode fell behind) still goes a chunk at a time, so that its windows
    keep the lengths the graphs were captured for. None: not yet."""
    if final and available < done + chunk + lookahead:
        if available <= done:
            return None
        start = max(0, min(done - context, available - span))
        return Window(start, available, done, available - done)
    if available < done + chunk + lookahead:
        return None
    return Window(max(0, done - context), done + chunk + lookahead, done, chunk)
