"""The `omni-client` command as a user runs it: a subprocess against a real omni-server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omni_client import OmniClient
from omni_server.audio.decode import container_name, decode
from tests.clients.texts import SENTENCES

pytestmark = pytest.mark.timeout(300)


def omni_client(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "omni_client", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
    )


def one_error_line(result: subprocess.CompletedProcess[bytes]) -> str:
    """The CLI's failure contract: exactly one line on stderr, and no traceback."""
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got: {lines}"
    assert lines[0].startswith("omni-client: error: ")
    return lines[0]


def test_speak_writes_the_format_of_the_extension(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "hello.wav"
    result = omni_client(
        "speak", "Hello from the command line.", "-o", str(out), "--url", server_url
    )
    assert result.returncode == 0, result.stderr
    assert container_name(out.read_bytes()) == "wav"
    assert decode(out.read_bytes()).seconds > 0.5


def test_format_flag_overrides_the_extension(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "clip.bin"
    result = omni_client(
        "--url", server_url, "speak", "Explicit format.", "--format", "flac", "-o", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert container_name(out.read_bytes()) == "flac"


def test_stream_writes_the_same_pcm_as_a_whole_request(server_url: str) -> None:
    result = omni_client("speak", "--stream", SENTENCES, "--seed", "9", "--url", server_url)
    assert result.returncode == 0, result.stderr
    with OmniClient(server_url) as client:
        whole = client.speech(SENTENCES, format="pcm", seed=9)
    assert len(result.stdout) > 24000 * 2  # more than a second of s16 audio
    assert result.stdout == whole


def test_words_are_printed_as_they_play(server_url: str, tmp_path: Path) -> None:
    """`--words`: each word at its start (seconds from the first audio), paced as it plays;
    the audio to -o as WAV, or, with --stream, PCM to stdout and the words to stderr."""
    text = "Hello there, my good friend."
    out = tmp_path / "hello.wav"
    result = omni_client(
        "speak", "--words", text, "-o", str(out), "--seed", "2", "--url", server_url
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert [line.split()[1] for line in lines] == ["Hello", "there", "my", "good", "friend"]
    starts = [float(line.split()[0]) for line in lines]
    assert starts == sorted(starts) and starts[-1] < decode(out.read_bytes()).seconds
    streamed = omni_client("speak", "--words", "--stream", text, "--seed", "2", "--url", server_url)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stderr.decode().splitlines() == lines
    assert len(streamed.stdout) > 24000  # PCM16 at 24 kHz: over half a second


def test_text_from_stdin_to_stdout(server_url: str) -> None:
    result = omni_client(
        "speak", "-", "--format", "wav", "--url", server_url, stdin=b"Read from standard input."
    )
    assert result.returncode == 0, result.stderr
    assert decode(result.stdout).seconds > 0.5


def test_batch_writes_every_line(server_url: str, tmp_path: Path) -> None:
    lines = tmp_path / "lines.txt"
    lines.write_text("First line.\nSecond line.\n\nFourth line, after a blank.\nFifth.\n")
    out_dir = tmp_path / "clips"
    result = omni_client(
        "speak", "--file", str(lines), "--out-dir", str(out_dir), "--concurrency", "2",
        "--url", server_url,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["0001.wav", "0002.wav", "0004.wav", "0005.wav"]
    for path in out_dir.iterdir():
        assert decode(path.read_bytes()).seconds > 0.2, path
    assert "4/4" in result.stderr.decode(), "the progress bar reached the end"


def test_models_and_health(server_url: str) -> None:
    models = omni_client("models", "--url", server_url)
    assert models.returncode == 0, models.stderr
    with OmniClient(server_url) as client:
        assert models.stdout.decode().split() == [m["id"] for m in client.models()]
    health = omni_client("health", "--url", server_url)
    assert health.returncode == 0, health.stderr
    assert health.stdout.strip().startswith(b"{")


# -- failures: one line, the documented exit status ----------------------------------------------


def test_rejected_request_exits_2(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "never.wav"
    result = omni_client(
        "speak", "Hi.", "--voice", "no-such-voice", "-o", str(out), "--url", server_url
    )
    assert result.returncode == 2
    assert "no-such-voice" in one_error_line(result)
    assert not out.exists()


def test_batch_with_rejected_lines_exits_2(server_url: str, tmp_path: Path) -> None:
    lines = tmp_path / "lines.txt"
    lines.write_text("One.\nTwo.\n")
    result = omni_client(
        "speak", "--file", str(lines), "--out-dir", str(tmp_path / "out"), "--quiet",
        "--voice", "no-such-voice", "--url", server_url,
    )  # fmt: skip
    assert result.returncode == 2
    stderr = result.stderr.decode().strip().splitlines()
    assert sorted(line.split(":")[1] for line in stderr[:2]) == [" line 1", " line 2"]
    assert all("no-such-voice" in line for line in stderr[:2])
    assert stderr[2:] == ["omni-client: error: 2 of 2 lines failed (see above)"]
    assert "Traceback" not in result.stderr.decode()


def test_unreachable_server_exits_1(unreachable_url: str, tmp_path: Path) -> None:
    result = omni_client("speak", "Hi.", "-o", str(tmp_path / "x.wav"), "--url", unreachable_url)
    assert result.returncode == 1
    assert "cannot connect" in one_error_line(result)
    health = omni_client("health", "--url", unreachable_url)
    assert health.returncode == 1
    one_error_line(health)
    lines = tmp_path / "lines.txt"
    lines.write_text("One.\nTwo.\nThree.\n")
    batch = omni_client(
        "speak", "--file", str(lines), "--out-dir", str(tmp_path / "out"), "--quiet",
        "--url", unreachable_url,
    )  # fmt: skip
    assert batch.returncode == 1, "losing the server stops the batch"
    assert "cannot connect" in one_error_line(batch)


@pytest.mark.parametrize(
    "args",
    [
        ["speak"],  # no text
        ["speak", "Hi.", "--file", "lines.txt", "--out-dir", "x"],  # both
        ["speak", "--file", "lines.txt"],  # no --out-dir
        ["speak", "Hi.", "--stream", "-o", "x.wav"],
        ["speak", "Hi.", "--speed", "fast"],
        ["nonsense"],
        ["models", "--url", "localhost:8000"],  # no scheme
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    result = omni_client(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr.decode()
    assert result.stderr.decode().strip().splitlines()[-1].startswith("omni-client")


def test_unknown_extension_exits_2(server_url: str, tmp_path: Path) -> None:
    result = omni_client("speak", "Hi.", "-o", str(tmp_path / "x.xyz"), "--url", server_url)
    assert result.returncode == 2
    assert "x.xyz" in one_error_line(result)
