"""The `omni-client` command line: speak (to a file, stdout, a PCM stream, a batch), transcribe
(whole, or streamed as it is heard), talk (one spoken turn over the realtime WebSocket),
models (and the model repository API: index, load, unload), health.

Exit status: 0 success; 1 the server failed or could not be reached (HTTP 5xx, connection
refused or broken, timeout); 2 the command or request was wrong (bad arguments, HTTP 4xx such
as an unknown voice, an unreadable input file or unwritable output); 130 interrupted.
Every error is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import sys
import time
import wave
from pathlib import Path
from typing import Any

from omni_client import protocol
from omni_client.async_client import AsyncOmniClient
from omni_client.batch import read_lines, synthesize_lines
from omni_client.errors import APIError, OmniError, OmniUsageError
from omni_client.sync_client import OmniClient

PROG = "omni-client"
EXIT_SERVER = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def version() -> str:
    """The installed distribution's version (omni-server ships the clients)."""
    try:
        return importlib.metadata.version("omni-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


class CommandError(Exception):
    """A one-line failure of the command, with its exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a usage line on bad arguments
    try:
        return args.run(args)
    except CommandError as e:
        return _fail(str(e), e.status)
    except APIError as e:
        where = f" (param: {e.param})" if e.param else ""
        return _fail(f"{e}{where}", EXIT_USAGE if e.is_client_error else EXIT_SERVER)
    except OmniUsageError as e:
        return _fail(str(e), EXIT_USAGE)
    except OmniError as e:  # connection refused / broken, timeout, a non-JSON answer
        return _fail(str(e), EXIT_SERVER)
    except OSError as e:  # local files: unreadable input, unwritable output
        return _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e), EXIT_USAGE)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)


def build_parser() -> argparse.ArgumentParser:
    # connection options are accepted before or after the subcommand
    connection = argparse.ArgumentParser(add_help=False)
    group = connection.add_argument_group("server")
    group.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help=f"server base URL (default: ${protocol.URL_ENV} or {protocol.DEFAULT_URL})",
    )
    group.add_argument(
        "--api-key",
        default=argparse.SUPPRESS,
        help=f"sent as 'Authorization: Bearer KEY' (default: ${protocol.API_KEY_ENV})",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=argparse.SUPPRESS,
        help="seconds to wait to connect and between received bytes "
        f"(default: {protocol.DEFAULT_TIMEOUT_S:g})",
    )

    parser = argparse.ArgumentParser(
        prog=PROG,
        parents=[connection],
        description="Client for omni-server's OpenAI-compatible API: speech (to a file, stdout,\n"
        "a raw PCM stream, a batch), text piped in as it is written and spoken sentence by\n"
        "sentence (the stream-input WebSocket), transcription (whole or streamed), one spoken\n"
        "turn over the realtime WebSocket, the served models and the model repository API\n"
        "(index, load, unload), and health. Chat has no command here: use the openai client\n"
        "or the playground (docs/clients.md).",
        epilog="exit status: 0 ok, 1 server or connection error, 2 usage or rejected request",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    speak = commands.add_parser(
        "speak",
        parents=[connection],
        help="synthesize speech",
        description="Synthesize TEXT into a file, stdout, a raw PCM stream, or a batch of files.",
        epilog='examples:\n  omni-client speak "Hello." -o hello.wav\n'
        '  omni-client speak --stream "Hello." | aplay -f S16_LE -r 24000 -c 1\n'
        "  omni-client speak --file lines.txt --out-dir clips/ --concurrency 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    speak.add_argument("text", nargs="?", help="the text to speak ('-' reads stdin)")
    speak.add_argument("-o", "--output", help="output file ('-' for stdout)")
    speak.add_argument(
        "--format",
        choices=protocol.FORMATS,
        help="default: from -o's extension; mp3 to stdout; wav for --file",
    )
    speak.add_argument(
        "--stream",
        action="store_true",
        help="write raw s16le mono PCM to stdout as it is synthesized",
    )
    speak.add_argument(
        "--words",
        action="store_true",
        help="print each word as it plays (its start in seconds, then the word; to stderr "
        "with --stream); with -o FILE the audio goes there as WAV",
    )
    speak.add_argument("--file", type=Path, help="batch: one clip per non-blank line of FILE")
    speak.add_argument("--out-dir", type=Path, help="batch: folder for the clips (NNNN.FORMAT)")
    speak.add_argument(
        "--concurrency", type=_positive_int, default=4, help="batch: requests in flight (4)"
    )
    speak.add_argument("--quiet", action="store_true", help="batch: no progress bar")
    speak.add_argument(
        "--model", default=protocol.DEFAULT_MODEL, help=f"({protocol.DEFAULT_MODEL})"
    )
    speak.add_argument(
        "--voice",
        default=protocol.DEFAULT_VOICE,
        help=f"a voice or OpenAI voice name (default: {protocol.DEFAULT_VOICE})",
    )
    speak.add_argument("--speed", type=float, help="0.25 to 4.0 (server default 1.0)")
    speak.add_argument("--seed", type=int, help="same seed, same text: bit-identical audio")
    speak.add_argument("--instructions", help="style instructions, for models that take them")
    speak.add_argument("--sample-rate", type=int, help="output sample rate in Hz")
    speak.set_defaults(run=run_speak, parser=speak)

    transcribe = commands.add_parser(
        "transcribe",
        parents=[connection],
        help="transcribe an audio file",
        description="Transcribe FILE (any format the server decodes: wav, mp3, flac, ogg, ...).",
        epilog="examples:\n  omni-client transcribe meeting.wav\n"
        "  omni-client transcribe talk.mp3 --format srt -o talk.srt\n"
        "  omni-client transcribe --stream talk.wav",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    transcribe.add_argument("file", help="the audio file ('-' reads stdin)")
    transcribe.add_argument(
        "--format",
        choices=protocol.TRANSCRIPT_FORMATS,
        default="text",
        help="text (default), json, verbose_json (segments, words), srt or vtt subtitles",
    )
    transcribe.add_argument(
        "--stream",
        action="store_true",
        help="print the text as it is recognized (--format text only)",
    )
    transcribe.add_argument("-o", "--output", help="write the transcript to a file")
    transcribe.add_argument(
        "--model",
        default=protocol.DEFAULT_TRANSCRIPTION_MODEL,
        help=f"({protocol.DEFAULT_TRANSCRIPTION_MODEL})",
    )
    transcribe.add_argument("--language", help="the spoken language, ISO-639-1 (e.g. en)")
    transcribe.add_argument("--prompt", help="text the speech continues, or words to expect")
    transcribe.add_argument("--temperature", type=float, help="0 (default) to 1")
    transcribe.add_argument(
        "--timestamps",
        action="append",
        choices=protocol.GRANULARITIES,
        help="verbose_json: timestamps per segment and/or word (repeatable)",
    )
    transcribe.set_defaults(run=run_transcribe, parser=transcribe)

    talk = commands.add_parser(
        "talk",
        parents=[connection],
        help="one spoken turn over the realtime WebSocket",
        description="Send a spoken question (a WAV file) to a realtime model and hear the "
        "answer; transcripts go to stderr as they arrive.",
        epilog="examples:\n  omni-client talk --file question.wav -o answer.wav\n"
        "  omni-client talk --file question.wav --stream | aplay -f S16_LE -r 24000 -c 1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    talk.add_argument("--file", required=True, help="the question, a 16-bit PCM WAV file")
    talk.add_argument("-o", "--output", help="write the answer as a WAV file")
    talk.add_argument(
        "--stream", action="store_true", help="write the answer's raw PCM16 (24 kHz) to stdout"
    )
    talk.add_argument("--model", default="smol-realtime", help="(smol-realtime)")
    talk.add_argument("--instructions", help="the session's instructions for the answer")
    talk.set_defaults(run=run_talk, parser=talk)

    stream = commands.add_parser(
        "speak-stream",
        parents=[connection],
        help="speak text as it is piped in (the speech input stream WebSocket)",
        description="Read text from stdin (or --file) as it arrives, e.g. a language model's "
        "tokens, and speak each sentence as soon as it is complete; the audio (PCM16 mono) "
        "goes raw to stdout, or to a WAV file with -o.",
        epilog="examples:\n  llm 'tell me a story' | omni-client speak-stream | aplay -f S16_LE "
        "-r 24000 -c 1\n  omni-client speak-stream --file story.txt -o story.wav",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stream.add_argument("--file", help="read the text from this file instead of stdin")
    stream.add_argument("-o", "--output", help="write the audio as a WAV file")
    stream.add_argument("--model", default=protocol.DEFAULT_MODEL, help="(%(default)s)")
    stream.add_argument("--voice", default=protocol.DEFAULT_VOICE, help="(%(default)s)")
    stream.add_argument(
        "--sample-rate", type=int, default=24_000, help="PCM16 sample rate (%(default)s)"
    )
    stream.add_argument("--seed", type=int, help="same seed, same text: bit-identical audio")
    stream.set_defaults(run=run_speak_stream, parser=stream)

    models = commands.add_parser(
        "models",
        parents=[connection],
        help="list the served models; the repository index; load, reload, unload",
        description="List the served models (GET /v1/models), or use the server's model\n"
        "repository API (Triton's; load and unload need --model-control-mode explicit):\n"
        "  omni-client models --index [--ready]        every model and its state\n"
        "  omni-client models --load NAME [--config JSON]   load or reload (atomic swap)\n"
        "  omni-client models --unload NAME [--unload-dependents]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    models.add_argument("--json", action="store_true", help="print the full model objects")
    control = models.add_mutually_exclusive_group()
    control.add_argument(
        "--index", action="store_true", help="print the repository index: name state version"
    )
    control.add_argument("--load", metavar="NAME", help="load or reload this model")
    control.add_argument("--unload", metavar="NAME", help="unload this model (it drains first)")
    models.add_argument("--ready", action="store_true", help="--index: only READY models")
    models.add_argument(
        "--config",
        metavar="JSON",
        help="--load: repository fields for this load, e.g. '{\"stages.acoustic.parameters."
        "length_scale\": 1.2}'",
    )
    models.add_argument(
        "--unload-dependents",
        action="store_true",
        help="--unload: also every model sharing a stage with it",
    )
    models.set_defaults(run=run_models, parser=models)

    health = commands.add_parser(
        "health", parents=[connection], help="print the server's health; exit 1 if not ready"
    )
    health.set_defaults(run=run_health, parser=health)
    return parser


# -- commands ----------------------------------------------------------------------------------


def run_speak(args: argparse.Namespace) -> int:
    _check_speak_args(args, args.parser)
    options = _speech_options(args)
    if args.file is not None:
        return _speak_batch(args, options)
    text = sys.stdin.read() if args.text == "-" else args.text
    with _client(args) as client:
        if args.words:
            return _speak_words(client.stream_words(text, **options), args)
        if args.stream:
            return _write_stream(client.stream_pcm(text, **options))
        to_stdout = args.output in (None, "-")
        if to_stdout and sys.stdout.isatty():
            raise CommandError(
                "refusing to write audio to a terminal: give -o FILE, pipe the output, "
                "or use --stream",
                EXIT_USAGE,
            )
        format = args.format or ("mp3" if to_stdout else protocol.format_for_path(args.output))
        audio = client.speech(text, format=format, **options)
    if to_stdout:
        sys.stdout.buffer.write(audio)
        sys.stdout.buffer.flush()
    else:
        Path(args.output).write_bytes(audio)
    return 0


def run_transcribe(args: argparse.Namespace) -> int:
    if args.stream and args.format != "text":
        args.parser.error("--stream prints the text as it comes; drop --format")
    audio = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    filename = "stdin" if args.file == "-" else Path(args.file).name
    options = {
        "model": args.model,
        "language": args.language,
        "prompt": args.prompt,
        "temperature": args.temperature,
        "filename": filename,
    }
    with _client(args) as client:
        if args.stream:
            return _print_transcript_stream(client.stream_transcription(audio, **options), args)
        transcript = client.transcribe(
            audio, response_format=args.format, timestamp_granularities=args.timestamps, **options
        )
    if isinstance(transcript, dict):
        text = json.dumps(transcript, indent=2, ensure_ascii=False) + "\n"
    else:
        text = transcript if transcript.endswith("\n") else transcript + "\n"
    _write_text(text, args.output)
    return 0


def _print_transcript_stream(events: Any, args: argparse.Namespace) -> int:
    """Deltas to stdout as they arrive; with -o, the done event's whole text to the file."""
    for event in events:
        if event["type"] == protocol.TRANSCRIPT_DELTA and args.output is None:
            sys.stdout.write(event["delta"])
            sys.stdout.flush()
        elif event["type"] == protocol.TRANSCRIPT_DONE:
            if args.output is None:
                sys.stdout.write("\n")
            else:
                _write_text(event["text"] + "\n", args.output)
    return 0


def _write_text(text: str, output: str | None) -> None:
    if output in (None, "-"):
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(output).write_text(text, encoding="utf-8")


def run_models(args: argparse.Namespace) -> int:
    if args.config is not None and args.load is None:
        args.parser.error("--config goes with --load")
    if args.unload_dependents and args.unload is None:
        args.parser.error("--unload-dependents goes with --unload")
    if args.ready and not args.index:
        args.parser.error("--ready goes with --index")
    if args.index or args.load or args.unload:
        return _run_control(args)
    with _client(args) as client:
        models = client.models()
    if args.json:
        print(json.dumps(models, indent=2))
    else:
        for model in models:
            print(model["id"])
    return 0


def _run_control(args: argparse.Namespace) -> int:
    config = None
    if args.config is not None:
        try:
            config = json.loads(args.config)
        except json.JSONDecodeError as e:
            args.parser.error(f"--config is not JSON: {e.msg}")
        if not isinstance(config, dict):
            args.parser.error("--config must be a JSON object of field -> value")
    with _client(args) as client:
        if args.load:
            client.load_model(args.load, config)
            print(f"{args.load}: loaded")
        elif args.unload:
            client.unload_model(args.unload, unload_dependents=args.unload_dependents)
            print(f"{args.unload}: unloaded")
        else:
            index = client.repository_index(ready=args.ready)
            if args.json:
                print(json.dumps(index, indent=2))
            for entry in [] if args.json else index:
                version = entry.get("version", "-")
                reason = f"  {entry['reason']}" if entry.get("reason") else ""
                print(f"{entry['name']}\t{entry['state']}\t{version}{reason}")
    return 0


def run_health(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(client.health()))
    return 0


# -- helpers -----------------------------------------------------------------------------------


def _check_speak_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if (args.text is None) == (args.file is None):
        parser.error("give either TEXT or --file FILE")
    if args.file is not None:
        if args.out_dir is None:
            parser.error("--file needs --out-dir DIR")
        if args.output is not None or args.stream:
            parser.error("--file writes into --out-dir; drop -o / --stream")
    elif args.out_dir is not None:
        parser.error("--out-dir is for batches (--file)")
    if args.stream and (args.output is not None or args.format not in (None, "pcm")):
        parser.error("--stream always writes raw PCM to stdout; drop -o / --format")
    if args.words and (args.file is not None or args.format not in (None, "wav")):
        parser.error("--words speaks one TEXT as PCM (-o FILE: WAV); drop --file / --format")


def _speech_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "voice": args.voice,
        "speed": args.speed,
        "seed": args.seed,
        "instructions": args.instructions,
        "sample_rate": args.sample_rate,
    }


def run_talk(args: argparse.Namespace) -> int:
    from omni_client.talk import read_wav, talk, wav_bytes

    if args.stream and args.output:
        raise CommandError("--stream writes to stdout; drop -o, or --stream", EXIT_USAGE)
    pcm = read_wav(Path(args.file).read_bytes())

    def on_event(kind: str, text: str) -> None:
        if kind == "heard":
            print(f"you: {text}", file=sys.stderr)
            print("answer: ", end="", file=sys.stderr, flush=True)
        else:
            print(text, end="", file=sys.stderr, flush=True)

    def on_audio(data: bytes) -> None:
        if args.stream:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    connection = _connection(args)
    turn = asyncio.run(
        talk(
            pcm,
            base_url=connection["base_url"] or os.environ.get(protocol.URL_ENV),
            api_key=connection["api_key"] or os.environ.get(protocol.API_KEY_ENV),
            model=args.model,
            instructions=args.instructions,
            timeout=connection["timeout"],
            on_event=on_event,
            on_audio=on_audio,
        )
    )
    print(file=sys.stderr)
    if args.output:
        Path(args.output).write_bytes(wav_bytes(bytes(turn.audio)))
    if turn.status != "completed":
        raise CommandError(f"the answer ended {turn.status}", EXIT_SERVER)
    return 0


def run_speak_stream(args: argparse.Namespace) -> int:
    import wave

    from omni_client.speak_stream import speak_stream

    audio = bytearray()

    def on_audio(data: bytes) -> None:
        if args.output:
            audio.extend(data)
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    connection = _connection(args)
    with open(args.file, "rb") if args.file else contextlib.nullcontext(sys.stdin.buffer) as text:
        asyncio.run(
            speak_stream(
                text,
                base_url=connection["base_url"] or os.environ.get(protocol.URL_ENV),
                api_key=connection["api_key"] or os.environ.get(protocol.API_KEY_ENV),
                model=args.model,
                voice=args.voice,
                sample_rate=args.sample_rate,
                seed=args.seed,
                timeout=connection["timeout"],
                on_audio=on_audio,
            )
        )
    if args.output:
        with wave.open(args.output, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(args.sample_rate)
            out.writeframes(bytes(audio))
    return 0


def _connection(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "base_url": getattr(args, "url", None),
        "api_key": getattr(args, "api_key", None),
        "timeout": getattr(args, "timeout", protocol.DEFAULT_TIMEOUT_S),
    }


def _client(args: argparse.Namespace) -> OmniClient:
    return OmniClient(**_connection(args))


def _speak_words(events: Any, args: argparse.Namespace) -> int:
    """Each word printed when it plays: at its start, counted from the first audio's arrival
    (as a player that starts then hears it); the audio to stdout (--stream) or -o FILE."""
    shown = sys.stderr if args.stream else sys.stdout
    pcm = bytearray()
    started: float | None = None
    for event in events:
        if isinstance(event, bytes):
            started = time.monotonic() if started is None else started
            if args.stream:
                sys.stdout.buffer.write(event)
                sys.stdout.buffer.flush()
            else:
                pcm += event
            continue
        wait = event["start"] - (time.monotonic() - (started or time.monotonic()))
        if wait > 0:
            time.sleep(wait)
        shown.write(f"{event['start']:7.2f}  {event['word']}\n")
        shown.flush()
    if args.output not in (None, "-"):
        rate = args.sample_rate or protocol.PCM_SAMPLE_RATE
        with wave.open(args.output, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(rate)
            out.writeframes(bytes(pcm))
    return 0


def _write_stream(chunks: Any) -> int:
    out = sys.stdout.buffer
    try:
        for chunk in chunks:
            out.write(chunk)
            out.flush()  # the player downstream should hear each sentence as soon as it exists
    except BrokenPipeError:
        # the reader went away (e.g. the player was closed); silence the interpreter's final flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise CommandError("output closed before the audio ended", EXIT_SERVER) from None
    return 0


def _speak_batch(args: argparse.Namespace, options: dict[str, Any]) -> int:
    lines = read_lines(args.file)
    if not lines:
        raise CommandError(f"{args.file}: no text lines", EXIT_USAGE)

    async def run() -> Any:
        async with AsyncOmniClient(**_connection(args)) as client:
            return await synthesize_lines(
                client,
                lines,
                args.out_dir,
                format=args.format or "wav",
                concurrency=args.concurrency,
                progress=not args.quiet,
                options=options,
            )

    result = asyncio.run(run())
    if not result.rejected:
        return 0
    server_side = any(not e.is_client_error for _, e in result.rejected)
    raise CommandError(
        f"{len(result.rejected)} of {len(lines)} lines failed (see above)",
        EXIT_SERVER if server_side else EXIT_USAGE,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status
