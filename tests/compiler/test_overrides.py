"""Dotted command-line overrides: typed by the schema, errors name the path and the type."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.overrides import Override, parse_tokens
from omni_server.compiler.plan import SchedulerKind
from tests.helpers.repo import make_repo, toml


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(
        tmp_path / "repo",
        stages={
            "frontend": toml("""
                backend = "F"
                next = "synth"
                [parameters]
                lang = "en"
            """),
            "synth": toml("""
                backend = "S"
                next = "encoder"
                gpu = 0
            """),
            "encoder": toml("""
                backend = "E"
                terminal = true
            """),
        },
        repository=toml("""
            [models.tts]
            entry = "frontend"
            tasks = ["speech"]
            voices = ["joe", "amy"]
        """),
    )


def test_parse_tokens_both_forms() -> None:
    assert parse_tokens(["--stages.a.process", "p", "--server.mps=auto"]) == [
        Override("stages.a.process", "p"),
        Override("server.mps", "auto"),
    ]
    assert parse_tokens(["--stages.a.gpu", "-1"]) == [Override("stages.a.gpu", "-1")]


@pytest.mark.parametrize(
    ("tokens", "fragment"),
    [
        (["stages.a.process", "p"], "unexpected argument 'stages.a.process'"),
        (["--verbose"], "unexpected argument '--verbose'"),
        (["--stages.a.process"], "has no value"),
    ],
)
def test_parse_tokens_rejects(tokens: list[str], fragment: str) -> None:
    with pytest.raises(RepositoryError, match=fragment) as info:
        parse_tokens(tokens)
    assert info.value.file == "command line"


@pytest.mark.parametrize(
    ("tokens", "check"),
    [
        (["--stages.synth.process", "pipeline"], lambda p: p.stages["synth"].process == "pipeline"),
        (["--stages.synth.gpu", "3"], lambda p: p.stages["synth"].gpu == (3,)),
        (
            ["--stages.synth.gpu", "1,2", "--stages.synth.tp_size", "2"],
            lambda p: p.stages["synth"].gpu == (1, 2) and p.processes["synth"].tp_size == 2,
        ),
        (
            ["--stages.synth.gpu", "[1, 2]", "--stages.synth.tp_size", "2"],
            lambda p: len(p.instances_of("synth")) == 2,
        ),
        (
            ["--stages.encoder.max_batch_size", "8", "--stages.encoder.scheduler.kind", "batch"],
            lambda p: (
                p.stages["encoder"].scheduler.max_batch_size == 8
                and p.stages["encoder"].scheduler.kind is SchedulerKind.BATCH
            ),
        ),
        (
            [
                "--stages.frontend.sampling.temperature",
                "0",
                "--stages.frontend.sampling.top_k",
                "9",
            ],
            lambda p: (
                p.stages["frontend"].sampling.temperature == 0.0
                and p.models["tts"].sampling.top_k == 9  # the entry's defaults are the model's
            ),
        ),
        (
            ["--stages.encoder.max_total_tokens", "4096"],
            lambda p: p.stages["encoder"].engine.max_total_tokens == 4096,
        ),
        (
            ["--stages.frontend.parameters.rate", "22050", "--stages.frontend.parameters.x.y", "a"],
            lambda p: (
                p.stages["frontend"].parameters["rate"] == 22050
                and p.stages["frontend"].parameters["lang"] == "en"
                and p.stages["frontend"].parameters["x"]["y"] == "a"
            ),
        ),
        (
            ["--stages.frontend.parameters.speeds", "[1.0, 1.5]"],
            lambda p: p.stages["frontend"].parameters["speeds"] == (1.0, 1.5),
        ),
        (
            ["--processes.frontend.num_replicas", "2"],
            lambda p: (
                [i.name for i in p.instances_of("frontend")] == ["frontend@r0", "frontend@r1"]
            ),
        ),
        (
            [
                "--processes.synth.num_replicas",
                "2",
                "--stages.synth.gpu_memory_fraction",
                "0.4",
                "--processes.synth.replica_devices",
                "0,0",
            ],
            lambda p: [i.devices["synth"] for i in p.instances_of("synth")] == [0, 0],
        ),
        (
            ["--processes.frontend.num_replicas", "2", "--processes.frontend.binding=least_loaded"],
            lambda p: p.processes["frontend"].binding == "least_loaded",
        ),
        (["--server.mps", "auto"], lambda p: p.server.mps == "auto"),
        (
            ["--stages.frontend.next", '["synth", "encoder"]'],
            lambda p: p.stages["frontend"].next == ("synth", "encoder"),
        ),
        (
            ["--stages.frontend.next", "synth,encoder", "--stages.frontend.route", "pick"],
            lambda p: p.stages["frontend"].route == "pick",
        ),
        (["--server.gpu_memory_limit", "0.8"], lambda p: p.server.gpu_memory_limit == 0.8),
        (["--models.tts.aliases", "tts-1,tts-1-hd"], lambda p: p.model("tts-1-hd").id == "tts"),
        (
            ["--models.tts.voice_aliases.alloy", "amy", "--models.tts.default_voice", "joe"],
            lambda p: p.models["tts"].voice_aliases == {"alloy": "amy"},
        ),
        (
            ["--stages.encoder.terminal", "false", "--stages.encoder.next", "extra"],
            None,  # rejected below: 'extra' is no stage; here only that the values parse
        ),
        (
            ["--stages.synth.process", "a", "--stages.synth.process", "b"],
            lambda p: p.stages["synth"].process == "b",  # the later override wins
        ),
    ],
)
def test_accepted_overrides(repo: Path, tokens: list[str], check) -> None:
    if check is None:
        with pytest.raises(RepositoryError, match="no stage 'extra'"):
            compile_repository(repo, tokens)
        return
    assert check(compile_repository(repo, tokens))


@pytest.mark.parametrize(
    ("tokens", "field", "fragment"),
    [
        (
            ["--stages.synth.tp_size", "two"],
            "stages.synth.tp_size",
            "expected an integer >= 1, got 'two'",
        ),
        (
            ["--stages.synth.gpu", "x"],
            "stages.synth.gpu",
            "expected an integer or a list of integers",
        ),
        (["--stages.synth.terminal", "yes"], "stages.synth.terminal", "expected true or false"),
        (["--stages.synth.gpu_memory_fraction", "2"], "stages.synth.gpu_memory_fraction", "(0, 1]"),
        (
            ["--stages.synth.colour", "red"],
            "stages.synth.colour",
            "unknown stage field; valid: backend",
        ),
        (["--stages.ghost.process", "p"], "stages.ghost.process", "unknown stage 'ghost'"),
        (
            ["--stages.synth.scheduler.kind", "fast"],
            "stages.synth.scheduler.kind",
            '"single", "batch"',
        ),
        (
            ["--stages.synth.scheduler.size", "1"],
            "stages.synth.scheduler.size",
            "unknown field 'size'",
        ),
        (["--server.gpu_memory_limit", "nan"], "server.gpu_memory_limit", "(0, 1]"),
        (
            ["--stages.frontend.sampling.min_p", "2"],
            "stages.frontend.sampling.min_p",
            "expected a number in [0, 1], got 2.0",
        ),
        (["--stages.synth.max_queue_delay_ms", "inf"], "stages.synth.max_queue_delay_ms", ">= 0"),
        (["--server.threads", "2"], "server.threads", "unknown field 'threads'; valid: mps"),
        (["--server.weight_share", "true"], "server.weight_share", 'one of "off", "on"'),
        (["--processes.synth.num_replicas", "0"], "processes.synth.num_replicas", ">= 1"),
        (
            ["--processes.synth.replica_devices", "a,b"],
            "processes.synth.replica_devices",
            "list of integers",
        ),
        (
            ["--processes.synth.binding", "least-loaded"],
            "processes.synth.binding",
            'expected one of "round_robin", "least_loaded", got "least-loaded"',
        ),
        (["--models.tts.tasks.x", "1"], "models.tts.tasks.x", "expected --models.<id>.<field>"),
        (["--engine.x", "1"], "engine.x", "valid roots: stages, processes, models, server"),
        (["--stages.synth", "1"], "stages.synth", "expected --stages.<name>.<field>"),
    ],
)
def test_rejected_overrides(repo: Path, tokens: list[str], field: str, fragment: str) -> None:
    with pytest.raises(RepositoryError) as info:
        compile_repository(repo, tokens)
    assert info.value.file == "command line"
    assert info.value.field == field
    assert fragment in str(info.value)


def test_override_breaking_a_rule_names_the_rule(repo: Path) -> None:
    """An override passes the same rules as a file value."""
    with pytest.raises(RepositoryError, match="must say where each goes") as info:
        compile_repository(repo, ["--processes.synth.num_replicas", "2"])
    assert info.value.field == "processes.synth.replica_devices"


def test_a_rule_broken_by_two_overrides_names_both(repo: Path) -> None:
    """Overrides move the encoder onto synth's GPU with a fraction: now synth, untouched,
    lacks one. The error is about a field no override set, so it names the overrides."""
    tokens = ["--stages.encoder.gpu", "0", "--stages.encoder.gpu_memory_fraction", "0.5"]
    with pytest.raises(RepositoryError) as err:
        compile_repository(repo, tokens)
    message = str(err.value)
    assert "stage 'synth'" in message and "gpu_memory_fraction" in message
    assert message.endswith(
        "(with the command-line overrides --stages.encoder.gpu, "
        "--stages.encoder.gpu_memory_fraction)"
    )
