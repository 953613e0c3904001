"""Custom voices on disk: a reference clip and its transcript per voice, under the server's data
directory, private to the server's user, surviving a restart.

    <data_dir>/                  0700, owned by the server's user (checked at every start)
      voices/                    0700
        voice_<hex>.wav          0600  the reference clip, mono PCM16 at its own rate
        voice_<hex>.json         0600  {id, name, scope, model, language, transcript,
                                        sample_rate, seconds, created_at, consent}

The JSON file is what makes a voice exist: it is written last (after the clip) and removed
first, each by an atomic rename or unlink, so a crash between the two leaves at worst an
orphan clip, never a voice without its clip. Files are created with O_EXCL | O_NOFOLLOW and
mode 0600, and a file the server's user does not own, or any link, is skipped when loading:
another local user can neither read a clip nor plant a voice.

A voice's `scope` is the cloning stage it was made for (docs/voices.md): every model whose
pipeline visits that stage may speak in it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import secrets
import stat
import threading
import time
import wave
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
VOICE_PREFIX = "voice_"


class DataDirError(ValueError):
    """The data directory cannot be used safely (its owner, its mode, not a directory)."""


class StoreFull(Exception):
    """The store holds its limit of voices already."""


class VoiceGone(Exception):
    """The voice was deleted (or never stored): a request naming it cannot be admitted."""


@dataclass(frozen=True)
class StoredVoice:
    id: str
    name: str
    scope: str  # the cloning stage it belongs to
    model: str  # the model it was created with
    language: str | None
    transcript: str
    sample_rate: int
    seconds: float
    created_at: int
    consent: str | None = None  # the consent recording's id the request named (OpenAI's form)


def default_data_dir() -> Path:
    """$XDG_STATE_HOME/omni-server, else ~/.local/state/omni-server (the XDG default)."""
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local/state"
    return base / "omni-server"


def prepare_dir(path: Path) -> Path:
    """Create `path` (and parents) as 0700 if missing; refuse one that is not a directory of
    this user or that other users may enter. Returns the resolved path."""
    path = Path(path).expanduser()
    try:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as err:
        raise DataDirError(f"data directory {path}: {err.strerror or err}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise DataDirError(f"data directory {path} is not a directory (or is a link)")
    if info.st_uid != os.geteuid():
        raise DataDirError(f"data directory {path} belongs to uid {info.st_uid}, not this user")
    if info.st_mode & 0o077:
        raise DataDirError(
            f"data directory {path} has mode {stat.S_IMODE(info.st_mode):o}; other users may "
            f"enter it: chmod 700 {path}"
        )
    return path


class VoiceStore:
    """The custom voices under one data directory, loaded at start, changed by `add`/`delete`.

    Single-writer: one server owns a data directory (two servers sharing one would each see
    only the voices they loaded or made). Methods do file I/O: call them off the event loop
    (asyncio.to_thread) when a clip is large."""

    def __init__(self, data_dir: Path) -> None:
        self.root = prepare_dir(data_dir)
        self.voices_dir = prepare_dir(self.root / "voices")
        self._voices: dict[str, StoredVoice] = {}
        # requests holding a voice's clip (`held`), and the voices deleted while held: their
        # clip goes with the last hold. Invariant: _deleted <= _holds.keys()
        self._holds: dict[str, int] = {}
        self._deleted: set[str] = set()
        self._lock = threading.Lock()  # add() and delete() run on worker threads: a check and
        # the change it guards are one step
        self._load()

    def __len__(self) -> int:
        return len(self._voices)

    def get(self, voice_id: str) -> StoredVoice | None:
        return self._voices.get(voice_id)

    def in_scope(self, scope: str) -> list[StoredVoice]:
        """The voices of one cloning stage, oldest first."""
        return sorted(
            (v for v in self._voices.values() if v.scope == scope), key=lambda v: v.created_at
        )

    def clip_path(self, voice_id: str) -> Path:
        return self.voices_dir / f"{voice_id}.wav"

    def add(
        self,
        *,
        name: str,
        scope: str,
        model: str,
        language: str | None,
        transcript: str,
        samples: np.ndarray,  # [n] float32 mono in [-1, 1]
        sample_rate: int,
        limit: int,
        consent: str | None = None,
    ) -> StoredVoice:
        """Store a new voice; raises StoreFull when `limit` voices are stored already."""
        with self._lock:
            if len(self._voices) >= limit:
                raise StoreFull(f"{len(self._voices)} custom voices are stored (the limit)")
            return self._add(
                name, scope, model, language, transcript, samples, sample_rate, consent
            )

    def _add(
        self,
        name: str,
        scope: str,
        model: str,
        language: str | None,
        transcript: str,
        samples: np.ndarray,
        sample_rate: int,
        consent: str | None,
    ) -> StoredVoice:
        voice = StoredVoice(
            id=VOICE_PREFIX + secrets.token_hex(8),
            name=name,
            scope=scope,
            model=model,
            language=language,
            transcript=transcript,
            sample_rate=sample_rate,
            seconds=round(len(samples) / sample_rate, 3),
            created_at=int(time.time()),
            consent=consent,
        )
        _write_private(self.clip_path(voice.id), _wav_bytes(samples, sample_rate))
        try:
            metadata = json.dumps(asdict(voice), ensure_ascii=False).encode()
            _write_private(self._metadata_path(voice.id), metadata)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                self.clip_path(voice.id).unlink()
            raise
        self._voices[voice.id] = voice
        return voice

    def delete(self, voice_id: str) -> bool:
        """Remove a voice: no request may name it from here on. Its clip stays on disk while
        requests admitted in it still run (`held`), and goes with the last of them."""
        with self._lock:
            if self._voices.pop(voice_id, None) is None:
                return False
            in_use = voice_id in self._holds
            if in_use:
                self._deleted.add(voice_id)
        with contextlib.suppress(FileNotFoundError):
            self._metadata_path(voice_id).unlink()  # first: the voice is gone from here on
        if not in_use:
            self._remove_clip(voice_id)
        return True

    @contextlib.contextmanager
    def held(self, voice_id: str) -> Iterator[None]:
        """Keep the voice's clip on disk for the block: a request admitted in the voice runs
        to its end even if the voice is deleted meanwhile (docs/voices.md). Raises VoiceGone
        when the voice is deleted already. Any thread; cheap (no I/O unless the block ends
        the last hold of a deleted voice)."""
        with self._lock:
            if voice_id not in self._voices:
                raise VoiceGone(voice_id)
            self._holds[voice_id] = self._holds.get(voice_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._holds.pop(voice_id) - 1
                if left:
                    self._holds[voice_id] = left
                last_of_deleted = not left and voice_id in self._deleted
                if last_of_deleted:
                    self._deleted.discard(voice_id)
            if last_of_deleted:
                self._remove_clip(voice_id)

    def holds(self, voice_id: str) -> int:
        """How many requests hold the voice's clip now (for tests and operators)."""
        with self._lock:
            return self._holds.get(voice_id, 0)

    def _remove_clip(self, voice_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.clip_path(voice_id).unlink()

    def _metadata_path(self, voice_id: str) -> Path:
        return self.voices_dir / f"{voice_id}.json"

    def _load(self) -> None:
        for path in sorted(self.voices_dir.glob(f"{VOICE_PREFIX}*.json")):
            try:
                voice = StoredVoice(**json.loads(_read_private(path)))
                if f"{voice.id}.json" != path.name:
                    raise ValueError(f"its id {voice.id!r} is not its file name")
                _read_private(self.clip_path(voice.id), header_only=True)
            except (OSError, ValueError, TypeError) as err:
                log.warning("skipping the stored voice %s: %s", path, err)
                continue
            self._voices[voice.id] = voice
        if self._voices:
            log.info("%d custom voice(s) in %s", len(self._voices), self.voices_dir)


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically: a fresh 0600 file beside it, renamed over it."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise


def _read_private(path: Path, *, header_only: bool = False) -> bytes:
    """A regular file of this user's, not a link (O_NOFOLLOW), as bytes (or its first 44)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError(f"{path} is not a regular file of this user")
        return file.read(44) if header_only else file.read()


def _wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm.tobytes())
    return out.getvalue()
