"""`omni-server config resolve` and the serve entry's refusal of invalid repositories."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

import omni_server
from omni_server.cli import main
from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.render import config_dict
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
                weights = { name = "x", sizes = [1, 2] }
            """),
            "synth": toml("""
                backend = "S"
                next = "encoder"
                stream_to = "encoder"
                gpu = 0
                gpu_memory_fraction = 0.3
                [scheduler]
                kind = "stream"
            """),
            "encoder": toml("""
                backend = "E"
                terminal = true
                [scheduler]
                kind = "batch"
                max_batch_size = 4
                max_queue_delay_ms = 2.5
            """),
        },
        repository=toml("""
            [models.tts]
            entry = "frontend"
            tasks = ["speech"]
            voices = ["joe"]
            default_voice = "joe"
            [models.tts.voice_aliases]
            alloy = "joe"
        """),
    )


def test_resolve_prints_config_and_topology(repo: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "resolve", "--repo", str(repo)]) == 0
    out = capsys.readouterr().out
    config_text, topology = out.split("# processes", 1)
    assert tomllib.loads(config_text) == config_dict(compile_repository(repo))
    assert "frontend : frontend" in topology
    assert "synth@r0    -> GPU 0" in topology
    assert "encoder@r0  -> CPU" in topology


def test_resolve_json_round_trips(repo: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(["config", "resolve", "--repo", str(repo), "--show", "config", "--format", "json"])
        == 0
    )
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["stages"]["encoder"]["scheduler"] == {
        "kind": "batch",
        "max_batch_size": 4,
        "max_queue_delay_ms": 2.5,
    }
    assert resolved["stages"]["frontend"]["parameters"]["weights"] == {"name": "x", "sizes": [1, 2]}
    assert resolved["stages"]["synth"]["process"] == "synth"
    assert resolved["models"]["tts"]["voice_aliases"] == {"alloy": "joe"}


def test_resolved_config_compiles_back_to_the_same_plan(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The resolved TOML is the format itself: written back as files it gives the same plan."""
    main(
        [
            "config",
            "resolve",
            "--repo",
            str(repo),
            "--show",
            "config",
            "--stages.encoder.max_batch_size",
            "8",
        ]
    )
    resolved = tomllib.loads(capsys.readouterr().out)
    assert resolved["stages"]["encoder"]["scheduler"]["max_batch_size"] == 8
    stages = resolved.pop("stages")
    import tomli_w

    copy = make_repo(
        tmp_path / "copy",
        stages={name: tomli_w.dumps(table) for name, table in stages.items()},
        repository=tomli_w.dumps(resolved),
    )
    again = config_dict(compile_repository(copy))
    assert again["stages"] == stages
    assert again["models"] == resolved["models"]


def test_resolve_topology_only_with_override(repo: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(
        [
            "config",
            "resolve",
            "--repo",
            str(repo),
            "--show",
            "topology",
            "--stages.frontend.process",
            "pipeline",
            "--stages.encoder.process=pipeline",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("# processes")
    assert "pipeline : frontend, encoder" in out
    assert "pipeline@r0 -> CPU" in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--stages.synth.tp_size", "x"], "field 'stages.synth.tp_size': expected an integer"),
        (["--stages.frontend.next", "ghost"], "stage 'frontend', field 'next': no stage 'ghost'"),
        (["--bogus"], "unexpected argument '--bogus'"),
    ],
)
def test_invalid_exits_2_with_one_line(
    repo: Path, argv: list[str], fragment: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["config", "resolve", "--repo", str(repo), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("omni-server: ")
    assert fragment in lines[0]


def test_more_replicas_than_cores_exit_2_naming_the_field(
    repo: Path, capsys: pytest.CaptureFixture
) -> None:
    """Issue 42.2: the command line compiles for this machine's facts (gpu.discover), so a
    process with more replicas than the cores is refused, as through the control route."""
    too_many = len(os.sched_getaffinity(0)) + 1
    argv = ["--processes.encoder.num_replicas", str(too_many)]
    for command in (["config", "resolve"], []):  # resolving and serving refuse it alike
        assert main([*command, "--repo", str(repo), *argv]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "field 'processes.encoder.num_replicas'" in err[0], err
        assert f"{too_many} OS processes" in err[0] and "CPU core" in err[0]


def test_serve_refuses_invalid_repository_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["--repo", str(tmp_path / "missing"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "repository folder not found" in err


def test_config_without_resolve(capsys: pytest.CaptureFixture) -> None:
    assert main(["config"]) == 2
    assert "omni-server config resolve" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_real_command_exit_code_and_no_traceback(tmp_path: Path) -> None:
    """The installed entry point, as a user runs it, on a stage with broken TOML."""
    bad = make_repo(
        tmp_path / "bad",
        stages={
            "tts": toml("""
                backend = "T"
                terminal = true
                next = [
            """)
        },
        repository=toml("""
            [models.m]
            entry = "tts"
            tasks = ["speech"]
        """),
    )
    result = subprocess.run(
        [sys.executable, "-m", "omni_server", "config", "resolve", "--repo", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert "tts/stage.toml" in result.stderr and "not valid TOML" in result.stderr


@pytest.mark.timeout(60)
def test_help_documents_both_commands() -> None:
    serve = subprocess.run(
        [sys.executable, "-m", "omni_server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert serve.returncode == 0
    assert "--repo" in serve.stdout and "config resolve" in serve.stdout
    assert "--stages.<stage>.<field>" in serve.stdout
    resolve = subprocess.run(
        [sys.executable, "-m", "omni_server", "config", "resolve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert resolve.returncode == 0
    assert "--show {config,topology}" in resolve.stdout and "--format {toml,json}" in resolve.stdout


def _routes(repo: Path) -> set[str]:
    """Every path the real app routes, its `{name}` parts written `{}`."""
    from omni_server.serve import create_app

    app = create_app(types.SimpleNamespace(), plan=compile_repository(repo))  # routes only
    return {re.sub(r"\{[^}]*\}", "{}", r.resource.canonical) for r in app.router.routes()}


def test_help_describes_every_endpoint_and_override(repo: Path) -> None:
    """`omni-server --help` names each route the app serves (Triton's /v2/repository/ API as
    one), the ray command, and the override roots and fields docs/repository.md lists."""
    serve = subprocess.run(
        [sys.executable, "-m", "omni_server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert serve.returncode == 0
    text = re.sub(r"\{[^}]*\}", "{}", serve.stdout)
    missing = [
        path
        for path in _routes(repo)
        if path not in text
        and not (path.startswith("/v2/repository/") and "/v2/repository/" in text)
    ]
    assert missing == []
    for named in ("ray --help", "--parameters.<key>", "binding", "stage_timeout_s", "--version"):
        assert named in serve.stdout, named
    for method in ("/v1/audio/speech", "/v1/audio/transcriptions", "/v1/chat/completions"):
        assert f"POST /{method.lstrip('/')}" in serve.stdout


@pytest.mark.parametrize("package", ["omni_server", "omni_client", "omni_bench.cli"])
def test_version_prints_the_package_version(package: str) -> None:
    command = [sys.executable, "-m", package, "--version"]
    if package == "omni_bench.cli":  # no __main__: its console script calls main()
        command = [sys.executable, "-c", "import sys, omni_bench.cli as c; sys.exit(c.main())"]
        command.append("--version")
    run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    name = package.split(".")[0].replace("_", "-")
    assert run.stdout.strip() == f"{name} {importlib.metadata.version('omni-server')}"
    assert importlib.metadata.version("omni-server") == omni_server.__version__


def test_serve_without_server_module(
    repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Until the server room exists, serving says so (simulated: the module made unimportable)."""
    monkeypatch.setitem(sys.modules, "omni_server.server", None)
    assert main(["--repo", str(repo)]) == 2
    assert capsys.readouterr().err == "omni-server: serving is not built yet\n"


def test_serve_hands_the_compiled_plan_to_the_server(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI's half of serving: compile with overrides, then call server.serve(plan, ...).
    The server room is replaced by a recorder here; its own tests run it for real."""
    calls = []
    fake = types.ModuleType("omni_server.server")
    fake.serve = lambda plan, host, port, **_: calls.append((plan, host, port)) or 0
    monkeypatch.setitem(sys.modules, "omni_server.server", fake)
    code = main(["--repo", str(repo), "--port", "8123", "--stages.encoder.max_batch_size", "2"])
    assert code == 0
    (plan, host, port), *_ = calls
    assert (host, port) == ("127.0.0.1", 8123)
    assert plan.stages["encoder"].scheduler.max_batch_size == 2
