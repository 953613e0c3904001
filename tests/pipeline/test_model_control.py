"""ModelControl over real stage processes: a shared stage reloads once and every model using it
follows; an unchanged group is not touched; a version that cannot start changes nothing.

The stages are the level voice stand-in (tests/fixtures/level_voice.py): its audio carries its
`level` parameter, so every answer says which version made it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from omni_server.pipeline import ControlError, ControlMode, ModelControl, PipelineError
from tests.fixtures import FIXTURES
from tests.helpers.proc import alive
from tests.helpers.repo import make_repo, toml

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # several stage processes each

THINKER = "thinker"  # stands for the embedded thinker: three models share it


def _stage(level: int, extra: str = "") -> str:
    return (
        toml(f"""
        backend = "LevelVoice"
        terminal = true
        [scheduler]
        kind = "stream"
        [parameters]
        level = {level}
        chunks = 3
        pause_s = 0.01
        """)
        + extra
    )


def _repo(root: Path) -> Path:
    return make_repo(
        root,
        stages={THINKER: _stage(100), "asr": _stage(7)},
        repository=toml("""
            [models.chat]
            entry = "thinker"
            tasks = ["chat"]
            [models.omni]
            entry = "thinker"
            tasks = ["chat"]
            [models.realtime]
            entry = "thinker"
            tasks = ["realtime"]
            [models.whisper]
            entry = "asr"
            tasks = ["transcription"]
            """),
        models={THINKER: FIXTURES / "level_voice.py", "asr": FIXTURES / "level_voice.py"},
    )


async def _level(control: ModelControl, model: str) -> int:
    async with control.submit(control.plan.models[model], {"text": "hi"}) as handle:
        audio = b"".join([chunk["audio"] async for chunk in handle])
        await handle.result()
    levels = set(np.frombuffer(audio, dtype="<i2").tolist())
    assert len(levels) == 1, f"one stream, one version: {levels}"
    return levels.pop()


async def _drained(control: ModelControl, names: set[str]) -> None:
    for _ in range(400):
        if not any("~g" in n for n in control.processes()) and set(control.processes()) == names:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"old generations still running: {control.processes()}")


async def test_a_shared_stage_reloads_once_and_every_model_follows(tmp_path):
    root = _repo(tmp_path / "repo")
    control = ModelControl(root, mode=ControlMode.EXPLICIT, load=["*"])
    await control.start()
    try:
        before = control.processes()
        versions = control.generations()
        assert {versions[m] for m in ("chat", "omni", "realtime")} == {versions["chat"]}
        assert versions["whisper"] != versions["chat"]
        assert [await _level(control, m) for m in ("chat", "omni", "realtime")] == [100] * 3

        (root / THINKER / "stage.toml").write_text(_stage(200))
        await control.load("omni")  # through any of the three: the group reloads as one

        after = control.generations()
        new = after["chat"]
        assert new != versions["chat"]
        assert after["omni"] == after["realtime"] == new  # all three follow the one restart
        assert after["whisper"] == versions["whisper"]  # untouched: it shares nothing
        assert [await _level(control, m) for m in ("chat", "omni", "realtime")] == [200] * 3
        await _drained(control, {"thinker@r0", "asr@r0"})
        now = control.processes()
        assert now["asr@r0"] == before["asr@r0"]  # the same process, never restarted
        assert now["thinker@r0"] != before["thinker@r0"]
        assert not alive(before["thinker@r0"])
        index = {e["name"]: e for e in control.index()}
        assert {index[m]["version"] for m in ("chat", "omni", "realtime")} == {str(new)}
        assert all(e["state"] == "READY" and e["reason"] == "" for e in index.values())
    finally:
        await control.stop()
    assert not control.processes()
    assert not alive(before["asr@r0"])


async def test_a_version_whose_initialize_raises_leaves_the_old_one_serving(tmp_path):
    root = _repo(tmp_path / "repo")
    control = ModelControl(root, mode=ControlMode.EXPLICIT, load=["chat"])
    await control.start()
    try:
        assert set(control.plan.models) == {"chat"}  # explicit: only the named model
        assert set(control.processes()) == {"thinker@r0"}
        pid = control.processes()["thinker@r0"]
        (root / THINKER / "stage.toml").write_text(_stage(300, "fail_initialize = true\n"))
        with pytest.raises(ControlError) as failed:
            await control.load("chat")
        assert failed.value.status == 500
        assert "fail_initialize" in failed.value.message
        index = {e["name"]: e for e in control.index()}
        assert index["chat"]["state"] == "READY"
        assert "failed to start" in index["chat"]["reason"]
        assert "fail_initialize" in index["chat"]["reason"]
        assert index["whisper"]["state"] == "UNAVAILABLE"
        assert index["whisper"]["reason"] == "not loaded"
        assert await _level(control, "chat") == 100  # the old version serves on
        assert control.processes() == {"thinker@r0": pid}  # the failed version left nothing

        (root / THINKER / "stage.toml").write_text("level = ")  # not TOML
        with pytest.raises(ControlError) as broken:
            await control.load("chat")
        assert broken.value.status == 400
        assert "stage.toml" in broken.value.message
        assert "stage.toml" in {e["name"]: e for e in control.index()}["chat"]["reason"]
        assert await _level(control, "chat") == 100

        chat = control.plan.models["chat"]
        await control.unload("chat")
        assert not control.plan.models
        assert not control.processes()
        assert not alive(pid)
        with pytest.raises(PipelineError, match="not loaded"):
            control.submit(chat, {"text": "x"})
    finally:
        await control.stop()
