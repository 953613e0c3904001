"""The `omni-server` command line.

    omni-server --repo DIR [--host H] [--port P] [serve options] [overrides...]
                                                                     serve the repository
    omni-server config resolve --repo DIR [--show config|topology] [--format toml|json]
                [overrides...]                                       print what would run
    omni-server ray --repo DIR [--address ADDR] [--host H] [--port P]
                [--num-replicas N | --autoscale MIN:MAX] [serve options] [overrides...]
                                                     serve it on a Ray cluster (Ray Serve)
    omni-server --version                                            print the version

Overrides are dotted paths into the repository's files (`--stages.tts.max_batch_size 8`),
typed by the schema; see docs/repository.md. Every invalid repository ends with exit code 2
and one line on stderr naming the file, stage and field.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from omni_server.cli_help import ENDPOINTS_HELP, OVERRIDES_HELP, add_version
from omni_server.cli_serve_options import API_KEY_ENV, add_serve_options
from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import Plan
from omni_server.compiler.render import config_json, config_toml, topology_text
from omni_server.gpu.devices import discover
from omni_server.serve.access import loopback_hosts
from omni_server.serve.options import ServeOptions
from omni_server.serve.voice_store import DataDirError, default_data_dir, prepare_dir

EXIT_INVALID = 2


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-server",
        usage="%(prog)s --repo DIR [--host HOST] [--port PORT] [options] [overrides ...]\n"
        "       %(prog)s config resolve --help   (print what would run)\n"
        "       %(prog)s ray --help              (serve on a Ray cluster)\n"
        "       %(prog)s --version",
        description="Serve a model repository over an OpenAI-compatible HTTP and WebSocket API\n"
        "(the endpoints below), running the pipeline its stage folders declare. Logs\n"
        "'omni-server ready on ...' once every stage has started; SIGINT / SIGTERM stop it\n"
        "(exit 0). Invalid repositories exit with code 2 and one line naming the file, stage\n"
        "and field; a port that cannot be bound or a pipeline that fails to start exits 1.",
        epilog=ENDPOINTS_HELP + "\n" + OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--repo", required=True, metavar="DIR", help="the repository folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (8000)")
    add_version(parser)
    add_serve_options(parser)
    return parser


def _serve_options(opts: argparse.Namespace) -> ServeOptions:
    """ServeOptions from the parsed flags; a bad value exits 2 with the flag's name."""
    hosts = _list(opts.allowed_hosts)
    try:
        return ServeOptions(
            api_key=opts.api_key,
            repository_api=not opts.disable_repository_api,
            metrics_need_key=not opts.metrics_open,
            allowed_origins=tuple(_list(opts.allowed_origins)),
            allowed_hosts=frozenset(h.lower() for h in hosts) if hosts else None,
            max_body_bytes=opts.max_body_bytes,
            max_input_chars=opts.max_input_chars,
            max_audio_seconds=opts.max_audio_seconds,
            max_in_flight=opts.max_in_flight,
            max_queued=opts.max_queued,
            queue_timeout_s=opts.queue_timeout,
            max_realtime_sessions=opts.max_realtime_sessions,
            max_speech_stream_sessions=opts.max_speech_stream_sessions,
            max_realtime_item_chars=opts.max_realtime_item_chars,
            max_realtime_conversation_chars=opts.max_realtime_conversation_chars,
            header_timeout_s=opts.header_timeout,
            body_timeout_s=opts.body_timeout,
            idle_timeout_s=opts.idle_timeout,
            write_timeout_s=opts.write_timeout,
            shutdown_grace_s=opts.shutdown_grace,
            start_timeout_s=opts.start_timeout,
            heartbeat_timeout_s=opts.heartbeat_timeout,
            data_dir=prepare_dir(opts.data_dir or default_data_dir()),
            max_custom_voices=opts.max_custom_voices,
        )
    except (ValueError, DataDirError) as e:
        _serve_parser().error(str(e))
        raise  # unreachable: error() exits


def _list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _ray_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-server ray",
        usage="%(prog)s --repo DIR [--address ADDR] [--host HOST] [--port PORT]\n"
        "       [--num-replicas N | --autoscale MIN:MAX] [options] [overrides ...]",
        description="Serve a model repository on a Ray cluster through Ray Serve: every Serve\n"
        "replica runs one whole pipeline (the stage processes the repository declares, with\n"
        "the CPUs and GPUs its plan needs), Serve's HTTP proxy on HOST:PORT serves the same\n"
        "API as omni-server. Connects to the cluster at --address, or starts a local one.\n"
        "Logs 'omni-server ready on ...' once every replica is up; SIGINT / SIGTERM stop it\n"
        "(exit 0). Invalid repositories or options exit 2; a failed deployment exits 1.\n"
        "Needs the ray extra: pip install 'omni-server[ray]'. See docs/scaling.md.",
        epilog=ENDPOINTS_HELP + "\n" + OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--repo", required=True, metavar="DIR", help="the repository folder")
    parser.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster: 'auto' (the one this machine belongs to), HOST:PORT of its head, "
        "or ray://HOST:10001; default: RAY_ADDRESS, else a new local cluster",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address Serve's proxy binds (127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port Serve's proxy binds (8000)")
    scaling = parser.add_mutually_exclusive_group()
    scaling.add_argument(
        "--num-replicas", type=int, default=1, metavar="N", help="pipeline replicas (1)"
    )
    scaling.add_argument(
        "--autoscale",
        metavar="MIN:MAX",
        help="autoscale between MIN and MAX replicas on ongoing requests, aiming at "
        "--max-in-flight per replica",
    )
    add_serve_options(parser)
    return parser


def _ray(args: list[str]) -> int:
    parser = _ray_parser()
    opts, overrides = parser.parse_known_args(args)
    options = _serve_options(opts)
    compile_repository(opts.repo, overrides)  # every repository error before Ray starts
    try:
        command = importlib.import_module("omni_server.cluster.command")
        resources = importlib.import_module("omni_server.cluster.resources")
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("ray"):
            raise
        print("omni-server ray needs Ray Serve: pip install 'omni-server[ray]'", file=sys.stderr)
        return EXIT_INVALID
    try:
        if opts.autoscale is not None:
            scaling = resources.Scaling.parse_autoscale(opts.autoscale)
        elif opts.num_replicas < 1:
            raise ValueError(f"--num-replicas must be at least 1; got {opts.num_replicas}")
        else:
            scaling = resources.Scaling(num_replicas=opts.num_replicas)
    except ValueError as e:
        parser.error(str(e))
    result = command.run(
        opts.repo, overrides, options, scaling, address=opts.address, host=opts.host, port=opts.port
    )
    return int(result)


def _resolve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-server config resolve",
        usage="%(prog)s --repo DIR [--show {config,topology}] [--format {toml,json}]\n"
        "       [overrides ...]",
        description="Compile the repository (with overrides) and print the resolved config\n"
        "and the process topology (processes, OS processes and their devices, GPUs).\n"
        "Starts nothing. Invalid repositories exit with code 2 and one line naming the file,\n"
        "stage and field.",
        epilog=OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--repo", required=True, metavar="DIR", help="the repository folder")
    parser.add_argument(
        "--show",
        choices=("config", "topology"),
        help="print only the resolved config or only the topology (default: both)",
    )
    parser.add_argument(
        "--format", choices=("toml", "json"), default="toml", help="config format (toml)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] == ["config"]:
            if args[1:2] != ["resolve"]:
                print(
                    "usage: omni-server config resolve --repo DIR [...]; "
                    "see omni-server config resolve --help",
                    file=sys.stderr,
                )
                return EXIT_INVALID
            return _resolve(args[2:])
        if args[:1] == ["ray"]:
            return _ray(args[1:])
        return _serve(args)
    except RepositoryError as e:
        print(f"omni-server: {e}", file=sys.stderr)
        return EXIT_INVALID
    except BrokenPipeError:
        # `config resolve | head`: the reader left; not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _resolve(args: list[str]) -> int:
    opts, overrides = _resolve_parser().parse_known_args(args)
    plan = compile_repository(opts.repo, overrides, discover(os.environ).facts())
    if opts.show in (None, "config"):
        print(config_json(plan) if opts.format == "json" else config_toml(plan), end="")
        if opts.format == "json":
            print()
    if opts.show is None:
        print()
    if opts.show in (None, "topology"):
        print(topology_text(plan), end="")
    return 0


def _serve(args: list[str]) -> int:
    opts, overrides = _serve_parser().parse_known_args(args)
    options = _serve_options(opts)
    _check_control(opts)
    _check_control_access(opts, options)
    # the machine is asked once: the plan is compiled for it (device = "auto") and the runtime
    # places stages on it
    machine = discover(os.environ)
    plan = compile_repository(opts.repo, overrides, machine.facts())
    for name in opts.load_model:
        if name != "*" and plan.model(name) is None:
            raise RepositoryError(
                f"no model '{name}' in the repository; models: {', '.join(plan.models)}",
                file=plan.repository / "repository.toml",
                field="--load-model",
            )
    control = {
        "model_control": opts.model_control_mode,
        "load_models": tuple(opts.load_model),
        "poll_s": opts.repository_poll_secs,
        "overrides": tuple(overrides),
        "machine": machine,
    }
    return _start_server(plan, opts.host, opts.port, options, control)


def _check_control(opts: argparse.Namespace) -> None:
    """The model control flags agree (as Triton's); exit 2 naming the flag otherwise."""
    parser = _serve_parser()
    if opts.load_model and opts.model_control_mode != "explicit":
        parser.error("--load-model needs --model-control-mode explicit")
    if "*" in opts.load_model and len(opts.load_model) > 1:
        parser.error("--load-model '*' loads every model and must be the only --load-model")
    if not opts.repository_poll_secs > 0:
        parser.error(f"--repository-poll-secs must be above 0; got {opts.repository_poll_secs:g}")


def _check_control_access(opts: argparse.Namespace, options: ServeOptions) -> None:
    """Who may load and unload models: with an API key, whoever holds it; without one, only
    this host's users, so explicit mode on a non-loopback address without a key exits 2 (a
    load forks processes and replaces what serves: not for anyone who can reach the port)."""
    exposed = opts.model_control_mode == "explicit" and options.repository_api
    if exposed and options.api_key is None and loopback_hosts(opts.host) is None:
        _serve_parser().error(
            f"--model-control-mode explicit on --host {opts.host} (not a loopback address) "
            "would let anyone who reaches the port load and unload models: set an API key "
            f"(--api-key or ${API_KEY_ENV}), bind a loopback address, or add "
            "--disable-repository-api"
        )


def _start_server(
    plan: Plan, host: str, port: int, options: ServeOptions, control: dict[str, Any]
) -> int:
    try:
        server = importlib.import_module("omni_server.server")
    except ModuleNotFoundError as e:
        if e.name != "omni_server.server":
            raise  # a missing dependency of the server, not a missing server
        print("omni-server: serving is not built yet", file=sys.stderr)
        return EXIT_INVALID
    result = server.serve(plan, host=host, port=port, options=options, **control)
    return int(result or 0)
