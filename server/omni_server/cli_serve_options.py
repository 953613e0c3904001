"""The serve command's HTTP options (`omni-server` and `omni-server ray` share them): the door,
per-request bounds, timeouts, each flag's default the ServeOptions default it sets
(cli.py turns the parsed flags into ServeOptions)."""

from __future__ import annotations

import argparse
import os

from omni_server.serve.options import ServeOptions

API_KEY_ENV = "OMNI_SERVER_API_KEY"


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    """The HTTP layer's options (docs/serving.md): the door, per-request bounds, timeouts."""
    d = ServeOptions()
    door = parser.add_argument_group("access")
    door.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every API route (default: ${API_KEY_ENV}; "
        "prefer the variable: a command line is visible to every local user)",
    )
    door.add_argument(
        "--metrics-open",
        action="store_true",
        help="serve /metrics without the API key (for a scraper that cannot send one)",
    )
    door.add_argument(
        "--allowed-origins",
        default="",
        metavar="LIST",
        help="comma-separated web origins (https://app.example) that may call the API from a "
        "browser, or '*'; none by default (no CORS headers)",
    )
    door.add_argument(
        "--allowed-hosts",
        default="",
        metavar="LIST",
        help="comma-separated Host names to accept besides the loopback ones; bound to "
        "loopback, any other name is refused (DNS rebinding)",
    )
    control = parser.add_argument_group("model control (docs/serving.md#model-control)")
    control.add_argument(
        "--model-control-mode",
        choices=("none", "explicit", "poll"),
        default="none",
        help="none: serve every model for the server's life (default); explicit: load the "
        "--load-model models, then load / reload / unload on POST /v2/repository/models/"
        "NAME/load|unload (on a non-loopback --host only with --api-key); poll: reload what "
        "changed in the repository every --repository-poll-secs (for development)",
    )
    control.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="explicit mode: a model to load at start (repeatable; '*' alone: every model; "
        "none by default)",
    )
    control.add_argument(
        "--repository-poll-secs",
        type=float,
        default=15.0,
        metavar="S",
        help="poll mode: seconds between scans of the repository (15)",
    )
    control.add_argument(
        "--disable-repository-api",
        action="store_true",
        help="leave out the /v2/repository/ routes (index, load, unload)",
    )
    bounds = parser.add_argument_group("bounds (per request, per model)")
    bounds.add_argument(
        "--max-input-chars",
        type=int,
        default=d.max_input_chars,
        metavar="N",
        help=f"speech input characters after NFKC ({d.max_input_chars})",
    )
    bounds.add_argument(
        "--max-audio-seconds",
        type=float,
        default=d.max_audio_seconds,
        metavar="S",
        help=f"estimated audio of one speech request ({d.max_audio_seconds:g})",
    )
    bounds.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        metavar="N",
        help=f"request body size ({d.max_body_bytes})",
    )
    bounds.add_argument(
        "--max-in-flight",
        type=int,
        default=d.max_in_flight,
        metavar="N",
        help=f"requests in the pipeline per model ({d.max_in_flight})",
    )
    bounds.add_argument(
        "--max-queued",
        type=int,
        default=d.max_queued,
        metavar="N",
        help=f"requests waiting for a place per model; more get 429 ({d.max_queued})",
    )
    bounds.add_argument(
        "--queue-timeout",
        type=float,
        default=d.queue_timeout_s,
        metavar="S",
        help=f"longest wait for a place before 429 ({d.queue_timeout_s:g})",
    )
    live = parser.add_argument_group("realtime and speech input streams (per server, per session)")
    live.add_argument(
        "--max-realtime-sessions",
        type=int,
        default=d.max_realtime_sessions,
        metavar="N",
        help="realtime sessions open at once; more are refused with 429 "
        f"({d.max_realtime_sessions})",
    )
    live.add_argument(
        "--max-speech-stream-sessions",
        type=int,
        default=d.max_speech_stream_sessions,
        metavar="N",
        help="speech input streams (/v1/audio/speech/stream-input) open at once; more are "
        f"refused with 429 ({d.max_speech_stream_sessions})",
    )
    live.add_argument(
        "--max-realtime-item-chars",
        type=int,
        default=d.max_realtime_item_chars,
        metavar="N",
        help=f"characters of one conversation item ({d.max_realtime_item_chars})",
    )
    live.add_argument(
        "--max-realtime-conversation-chars",
        type=int,
        default=d.max_realtime_conversation_chars,
        metavar="N",
        help=f"characters of a session's whole conversation ({d.max_realtime_conversation_chars})",
    )
    times = parser.add_argument_group("connections")
    times.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout_s,
        metavar="S",
        help=f"to send a request's headers ({d.header_timeout_s:g})",
    )
    times.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout_s,
        metavar="S",
        help=f"to send a request's body ({d.body_timeout_s:g})",
    )
    times.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        metavar="S",
        help=f"an idle keep-alive connection is closed after ({d.idle_timeout_s:g})",
    )
    times.add_argument(
        "--write-timeout",
        type=float,
        default=d.write_timeout_s,
        metavar="S",
        help=f"a client that reads nothing of its response for this long is dropped "
        f"({d.write_timeout_s:g})",
    )
    times.add_argument(
        "--shutdown-grace",
        type=float,
        default=d.shutdown_grace_s,
        metavar="S",
        help=f"in-flight requests' time to finish after SIGTERM ({d.shutdown_grace_s:g})",
    )

    times.add_argument(
        "--start-timeout",
        type=float,
        default=d.start_timeout_s,
        metavar="S",
        help="the stage processes' time to be ready, at start, after a restart and on a model "
        f"control load, before that start fails ({d.start_timeout_s:g})",
    )
    times.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=d.heartbeat_timeout_s,
        metavar="S",
        help="a ready stage process silent this long (no heartbeat: stopped, or a call holding "
        f"the GIL) is killed and restarted; 0: never ({d.heartbeat_timeout_s:g})",
    )

    voices = parser.add_argument_group("custom voices (docs/voices.md)")
    voices.add_argument(
        "--data-dir",
        metavar="DIR",
        default=None,
        help="where POST /v1/audio/voices keeps custom voices (created 0700; refused if "
        "another user owns it or may enter it); default $XDG_STATE_HOME/omni-server, else "
        "~/.local/state/omni-server",
    )
    voices.add_argument(
        "--max-custom-voices",
        type=int,
        default=d.max_custom_voices,
        metavar="N",
        help=f"custom voices kept at most ({d.max_custom_voices})",
    )
