"""Audio encoder: a voice's reference clip -> its codes (the audio tokenizer's encoder), and the
prompt's token ids.

The clip is read (PyAV), mixed to mono and resampled to 24 kHz (soxr), then encoded by the
audio tokenizer (audio/higgs_tokenizer) as the reference processor encodes it; its codes, with
the stream BOS / EOS around them and the delay pattern, are the prompt's audio frames. The
frames are cached, so a voice's encoder runs once: a custom voice's (POST /v1/audio/voices) by
its id, as its clip never changes under it; a voices/ clip's by path, size and modification
time (an operator may replace the file). The cache holds `max_cached_voices`, least recently
used out first. A custom voice deleted while its request ran has lost its clip: a 400. The
prompt's `<|AUDIO_OUT|>` becomes one frame token a frame (the processor's expansion: n - 7
audio tokens, then 7 delay tokens) and the text is tokenized without added special tokens
(the template writes its own BOS).

In: the preprocessing payload. Out: {"prompt_ids", "audio_codes" (None without a clip),
"sampling", "encoding", "voice"} to the engine.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_server.audio import decode, resample
from omni_server.audio.higgs_codec import (
    SAMPLE_RATE,
    HiggsCheckpointError,
    delayed,
    load_audio_tokenizer,
    open_checkpoint,
)
from omni_server.backend import InvalidRequest, StageBackend, StageConfigError, StageContext
from omni_server.engine import HFTokenizer

log = logging.getLogger("omni_server.examples.higgs.audio_encoder")

AUDIO_OUT = "<|AUDIO_OUT|>"
DELAY_TOKEN = "<|reserved_special_token_6|>"


class AudioEncoder(StageBackend):
    def initialize(self, context: StageContext) -> None:
        try:
            checkpoint = open_checkpoint(context.repository_parameters)
            self.codec = load_audio_tokenizer(checkpoint, context.device)
        except HiggsCheckpointError as err:
            raise StageConfigError(str(err)) from err
        self.device = context.device
        self.tokenizer = HFTokenizer(checkpoint.folder)
        self.num_codebooks = int(self.codec.config.num_quantizers)
        codes = int(self.codec.config.codebook_size)
        self.bos, self.eos = codes, codes + 1  # the model's stream BOS / EOS (config.json)
        self.max_clip_seconds = float(context.parameters.get("max_clip_seconds", 30.0))
        self.max_cached_voices = int(context.parameters.get("max_cached_voices", 128))
        if self.max_cached_voices < 1:
            raise StageConfigError(f"max_cached_voices: {self.max_cached_voices}; at least 1")
        self._cache: OrderedDict[tuple[Any, ...], list[list[int]]] = OrderedDict()
        self._lock = threading.Lock()
        self.encoded = 0  # encoder runs (a voice's first request, or its clip changed)

    def execute(self, requests: list[Any]) -> list[dict[str, Any]]:
        return [self._one(request.inputs) for request in requests]

    def _one(self, inputs: dict[str, Any]) -> dict[str, Any]:
        voice = inputs["voice"]
        text = inputs["prompt_text"]
        frames = None
        if voice["clip"] is not None:
            frames = self.voice_frames(
                Path(voice["clip"]), voice["name"], custom=bool(voice.get("custom"))
            )
            n, k = len(frames), self.num_codebooks
            if text.count(AUDIO_OUT) != 1:
                raise InvalidRequest("the prompt must hold one reference voice", param="voice")
            text = text.replace(AUDIO_OUT, AUDIO_OUT * (n - (k - 1)) + DELAY_TOKEN * (k - 1))
        return {
            "prompt_ids": self.tokenizer.encode(text),
            "audio_codes": frames,
            "sampling": inputs["sampling"],
            "encoding": inputs["encoding"],
            "text": inputs["text"],
            "voice": voice["name"],
        }

    def voice_frames(self, clip: Path, name: str, *, custom: bool) -> list[list[int]]:
        """The clip's prompt frames (BOS, codes, EOS, delay pattern), encoded once per voice."""
        key: tuple[Any, ...]
        if custom:
            key = ("custom", name)
        else:
            stat = clip.stat()
            key = ("clip", str(clip), stat.st_size, stat.st_mtime_ns)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        try:
            codes = self.encode(clip)
        except FileNotFoundError as err:
            if not custom:
                raise  # a voices/ clip gone from the repository: the server's fault
            raise InvalidRequest(
                f"voice {name!r} was deleted while this request ran (its clip is gone)",
                param="voice",
                code="voice_not_found",
            ) from err
        frames = delayed(codes, self.bos, self.eos)
        with self._lock:
            self._cache[key] = frames
            while len(self._cache) > self.max_cached_voices:
                self._cache.popitem(last=False)
            self.encoded += 1
        log.info("audio_encoder: encoded voice %s: %d frames (encoder runs: %d)",
                 name, len(codes), self.encoded)  # fmt: skip
        return frames

    def encode(self, clip: Path) -> np.ndarray:
        """A clip -> its codes [n, K] (the tokenizer's encode at 24 kHz mono)."""
        samples, rate = decode(clip.read_bytes())
        if samples.ndim > 1:
            samples = samples.mean(axis=1)
        if rate != SAMPLE_RATE:
            samples = resample(samples, rate, SAMPLE_RATE)
        seconds = len(samples) / SAMPLE_RATE
        if not 0 < seconds <= self.max_clip_seconds:
            raise InvalidRequest(
                f"reference clip {clip.name}: {seconds:.1f} s; 0 to {self.max_clip_seconds:g} "
                "s are allowed",
                param="voice",
            )
        values = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
        with torch.inference_mode():
            codes = self.codec.encode(values.view(1, 1, -1).to(self.device))
        return codes[0].transpose(0, 1).cpu().numpy()  # type: ignore[no-any-return]
