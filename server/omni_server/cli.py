"""The `omni-server` command line.

    omni-server --repo DIR [--host H] [--port P] [overrides...]      serve the repository
    omni-server config resolve --repo DIR [--show config|topology] [--format toml|json]
                [overrides...]                                       print what would run

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

from omni_server.repository.compiler import compile_repository
from omni_server.repository.errors import RepositoryError
from omni_server.repository.plan import Plan
from omni_server.repository.render import config_json, config_toml, topology_text

EXIT_INVALID = 2

OVERRIDES_HELP = """\
overrides:
  --stages.<stage>.<field> VALUE       a stage.toml field (process, gpu, next, ...)
  --stages.<stage>.max_batch_size N    [scheduler] fields (also --stages.<stage>.scheduler.<f>)
  --stages.<stage>.max_total_tokens N  [engine] fields (also --stages.<stage>.engine.<f>)
  --stages.<stage>.parameters.<key> V  free-form [parameters] (V read as a TOML value)
  --processes.<name>.<field> VALUE     num_replicas, replica_devices
  --models.<id>.<field> VALUE          entry, tasks, aliases, voices, default_voice, ...
  --server.<field> VALUE               mps, weight_share, gpu_memory_limit
  Also --path=VALUE. Lists: comma-separated (1,2) or JSON ([1, 2]); booleans: true / false.
"""


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-server",
        usage="%(prog)s --repo DIR [--host HOST] [--port PORT] [overrides ...]\n"
        "       %(prog)s config resolve --help",
        description="Serve a model repository over an OpenAI-compatible HTTP API (speech:\n"
        "POST /v1/audio/speech; GET /v1/models, /health, /metrics, / the playground),\n"
        "running the pipeline its stage folders declare. Logs 'omni-server ready on ...'\n"
        "once every stage has started; SIGINT / SIGTERM stop it (exit 0). Invalid\n"
        "repositories exit with code 2 and one line naming the file, stage and field; a port\n"
        "that cannot be bound or a pipeline that fails to start exits 1.",
        epilog=OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--repo", required=True, metavar="DIR", help="the repository folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (8000)")
    return parser


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
    plan = compile_repository(opts.repo, overrides)
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
    plan = compile_repository(opts.repo, overrides)
    return _start_server(plan, opts.host, opts.port)


def _start_server(plan: Plan, host: str, port: int) -> int:
    try:
        server = importlib.import_module("omni_server.server")
    except ModuleNotFoundError as e:
        if e.name != "omni_server.server":
            raise  # a missing dependency of the server, not a missing server
        print("omni-server: serving is not built yet", file=sys.stderr)
        return EXIT_INVALID
    result = server.serve(plan, host=host, port=port)
    return int(result or 0)
