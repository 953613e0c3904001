"""What `omni-server --help` says besides its options: the endpoints it serves, the dotted
overrides every command takes, and `--version`. Kept true to the code by
tests/compiler/test_cli.py (every route the app serves is named here)."""

from __future__ import annotations

import argparse

from omni_server import __version__

OVERRIDES_HELP = """\
overrides:
  --stages.<stage>.<field> VALUE       a stage.toml field (process, device, gpu, next, ...);
                                       --stages.<stage>.device cpu|gpu|auto moves a stage
  --stages.<stage>.max_batch_size N    [scheduler] fields (also --stages.<stage>.scheduler.<f>)
  --stages.<stage>.max_total_tokens N  [engine] fields (also --stages.<stage>.engine.<f>)
  --stages.<stage>.parameters.<key> V  free-form [parameters] (V read as a TOML value)
  --processes.<name>.<field> VALUE     num_replicas, replica_devices, binding
  --models.<id>.<field> VALUE          entry, tasks, aliases, voices, default_voice, ...
  --server.<field> VALUE               mps, weight_share, gpu_memory_limit, stage_timeout_s
  --parameters.<key> VALUE             repository.toml's [parameters], which every stage
                                       sees (a checkpoint path, ...)
  Also --path=VALUE. Lists: comma-separated (1,2) or JSON ([1, 2]); booleans: true / false.
  Every field: docs/repository.md.
"""

ENDPOINTS_HELP = """endpoints (docs/serving.md), as each model's tasks in repository.toml allow:
  POST /v1/audio/speech                  text to speech (OpenAI's; whole or streamed)
  POST /v1/audio/transcriptions          speech to text (OpenAI's multipart form)
  POST /v1/chat/completions              chat, text or text and audio out, audio in
  GET  /v1/realtime                      WebSocket: OpenAI's realtime voice sessions
  GET  /v1/audio/speech/stream-input     WebSocket: text in as it is written, audio out
  GET  /v1/text-to-speech/{voice_id}/stream-input
                                         the same, on ElevenLabs' path and conventions
  GET|POST /v1/audio/voices, DELETE /v1/audio/voices/{id}
                                         the models' voices; custom voices (cloning models)
  GET  /v1/models, /v1/models/{id}       the served models
  GET  /health, /health/live, /health/ready, /metrics (Prometheus), /openapi.json,
       / (the browser playground)
  POST /v2/repository/...                Triton's model repository API (load, unload)
"""


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
