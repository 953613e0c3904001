"""compiler/partition.py: the groups model control loads as one, and their subplans."""

from __future__ import annotations

import os
from pathlib import Path

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.partition import fingerprint, groups, subplan
from omni_server.wire.routes import Routes
from tests.helpers.repo import make_repo, toml

EMBEDDED = Path(__file__).resolve().parents[2] / "repository"
SPEECH = ["piper-joe"]
THINKER_MODELS = ["smol-chat", "smol-omni", "smol-realtime"]


def test_embedded_repository_groups() -> None:
    plan = compile_repository(EMBEDDED)
    found = {models: stages for models, stages in groups(plan, plan.models)}
    speech_and_thinker = frozenset([*SPEECH, *THINKER_MODELS])
    # the omni model joins the thinker to the voice: one group; Whisper shares nothing
    assert set(found) == {speech_and_thinker, frozenset(["whisper-tiny-en"])}
    assert "thinker" in found[speech_and_thinker]
    assert "acoustic" in found[speech_and_thinker]
    assert found[frozenset(["whisper-tiny-en"])] == {
        "asr_decode",
        "asr_segment",
        "asr_whisper",
        "asr_format",
    }


def test_chat_alone_is_the_thinker_alone() -> None:
    plan = compile_repository(EMBEDDED)
    [(models, stages)] = groups(plan, ["smol-chat"])
    assert (models, stages) == (frozenset(["smol-chat"]), frozenset(["thinker"]))
    sub = subplan(plan, models, stages)
    assert list(sub.stages) == ["thinker"]
    assert sub.stages["thinker"].stream_to == ()  # its edge into the voice is dropped
    assert list(sub.processes) == ["thinker"]
    assert [i.name for i in sub.instances] == ["thinker@r0"]
    assert sub.edges == ()
    assert Routes(sub).terminals("smol-chat") == {"thinker"}  # the runtime reads it whole


def test_chat_and_speech_without_omni_are_two_groups() -> None:
    plan = compile_repository(EMBEDDED)
    found = groups(plan, ["smol-chat", "piper-joe"])
    assert sorted(sorted(m) for m, _ in found) == [["piper-joe"], ["smol-chat"]]
    voice = next(s for m, s in found if "piper-joe" in m)
    sub = subplan(plan, frozenset(["piper-joe"]), voice)
    assert [i.name for i in sub.instances] == ["voice@r0", "voice@r1"]
    assert {e.dst for e in sub.edges} == {"acoustic", "audio_encoder"}


def test_a_shared_process_joins_models(tmp_path: Path) -> None:
    stage = 'backend = "B"\nterminal = true\nprocess = "shared"\n'
    root = make_repo(
        tmp_path,
        stages={"a": stage, "b": stage, "c": 'backend = "C"\nterminal = true\n'},
        repository=toml("""
            [models.ma]
            entry = "a"
            tasks = ["speech"]
            [models.mb]
            entry = "b"
            tasks = ["speech"]
            [models.mc]
            entry = "c"
            tasks = ["speech"]
            """),
    )
    plan = compile_repository(root)
    found = {m: s for m, s in groups(plan, plan.models)}
    assert found == {frozenset(["ma", "mb"]): {"a", "b"}, frozenset(["mc"]): {"c"}}


def test_fingerprint_sees_code_edits_only_in_its_stages(tmp_path: Path) -> None:
    root = make_repo(
        tmp_path,
        stages={"a": 'backend = "A"\nterminal = true\n', "b": 'backend = "B"\nterminal = true\n'},
        repository=toml("""
            [models.ma]
            entry = "a"
            tasks = ["speech"]
            [models.mb]
            entry = "b"
            tasks = ["speech"]
            """),
    )
    plan = compile_repository(root)
    a, b = fingerprint(plan, ["a"]), fingerprint(plan, ["b"])
    model_py = root / "a" / "model.py"
    model_py.write_text(model_py.read_text() + "\n# edited\n")
    stat = model_py.stat()
    os.utime(model_py, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert fingerprint(plan, ["a"]) != a
    assert fingerprint(plan, ["b"]) == b
    assert compile_repository(root) == plan  # the plan alone cannot tell: hence the fingerprint
