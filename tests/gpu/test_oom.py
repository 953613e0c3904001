"""Out of GPU memory inside a stage fails that request (500, naming the stage), never the process.

The stages run in real stage processes (the runtime's), their backends in tests/fixtures/
oom_stages.py. On the CPU the out-of-memory error is SIMULATED (the backend raises
torch.OutOfMemoryError itself: a CPU cannot run out of CUDA memory); the GPU tests make a real
one, an allocation past the cap that the stage's gpu_memory_fraction puts on its allocator.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.plan import Plan
from omni_server.pipeline import PipelineError, Runtime
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running
from tests.helpers.server import ServerProcess, failed_start_line

pytestmark = pytest.mark.timeout(180)

SPEECH_MODEL = """\
[models.m]
entry = "s"
tasks = ["speech"]
"""


def _plan(root: Path, backend: str, kind: str | None = None, placement: str = "") -> Plan:
    stage = f'backend = "model.py:{backend}"\nterminal = true\n{placement}'
    if kind:
        stage += toml(f"""
            [scheduler]
            kind = "{kind}"
        """)
    make_repo(root, {"s": stage}, SPEECH_MODEL, {"s": FIXTURES / "oom_stages.py"})
    return compile_repository(root)


async def _fails_out_of_memory(runtime: Runtime, inputs: dict) -> PipelineError:
    with pytest.raises(PipelineError) as caught:
        await runtime.submit(runtime.plan.models["m"], inputs).result()
    error = caught.value
    assert error.code == "stage_failed" and error.stage == "s"
    assert error.error_code == "out_of_gpu_memory"
    assert error.message.startswith("stage s: ") and "out of GPU memory" in error.message
    return error


@pytest.mark.parametrize(
    ("backend", "kind"), [("OomSingle", None), ("OomStream", "stream"), ("OomAR", "ar")]
)
async def test_simulated_oom_fails_the_request_and_the_process_serves_on(tmp_path, backend, kind):
    plan = _plan(tmp_path, backend, kind)
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        (pid,) = runtime.processes().values()
        first = await runtime.submit(model, {}).result()
        assert first["pid"] == pid
        error = await _fails_out_of_memory(runtime, {"alloc_gib": 2.0})
        assert "tried to allocate 2.00 GiB on GPU 0" in error.message
        after = await runtime.submit(model, {}).result()
        assert after["pid"] == pid  # the same process: it was not restarted
        assert runtime.processes() == {"s@r0": pid}


async def test_an_ar_step_out_of_memory_fails_its_requests_and_frees_them(tmp_path):
    plan = _plan(tmp_path, "OomAR", "ar")
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        long = runtime.submit(model, {"steps": 10_000, "step_s": 0.01}, "long")
        await anext(aiter(long))  # its first step's chunk: it is in the backend's batch now
        failing = runtime.submit(model, {"alloc_gib": 2.0}, "failing")
        for handle in (long, failing):  # the step failed: every request it may have run fails
            with pytest.raises(PipelineError, match="out of GPU memory"):
                await handle.result()
        after = await runtime.submit(model, {"steps": 3}).result()
    assert sorted(after["aborted"]) == ["failing", "long"]  # both aborted: their state freed


async def test_a_stage_that_runs_out_of_memory_while_it_initializes_is_a_one_line_start_error(
    tmp_path,
):
    plan = _plan(
        tmp_path,
        "OomAtStart",
        None,
        toml("""
            [parameters]
            alloc_gib = 2.0
        """),
    )
    runtime = Runtime(plan)
    with pytest.raises(PipelineError) as caught:
        await runtime.start()
    assert caught.value.message == (
        "stage s: initialize() ran out of GPU memory: tried to allocate 2.00 GiB on GPU 0"
    )


def test_the_server_exits_1_with_that_line(tmp_path):
    _plan(
        tmp_path / "repo",
        "OomAtStart",
        None,
        toml("""
            [parameters]
            alloc_gib = 2.0
        """),
    )
    assert failed_start_line(tmp_path / "repo").endswith(
        "stage s: initialize() ran out of GPU memory: tried to allocate 2.00 GiB on GPU 0"
    )


@pytest.mark.slow  # a real server process
def test_chat_out_of_memory_is_a_500_naming_the_stage_and_the_next_succeeds(tmp_path):
    stage = toml("""
        backend = "model.py:OomChat"
        process = "thinker"
        terminal = true
    """)
    stage += toml("""
        [scheduler]
        kind = "ar"
    """)
    models = toml("""
        [models.chat]
        entry = "thinker"
        tasks = ["chat"]
    """)
    repo = make_repo(
        tmp_path / "repo", {"thinker": stage}, models, {"thinker": FIXTURES / "oom_stages.py"}
    )
    openai = pytest.importorskip("openai")  # not on the GPU machines
    with (
        ServerProcess.start(repo, tmp_path / "server.log") as server,
        openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
        ) as client,
    ):

        def ask(text: str) -> str:
            answer = client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": text}]
            )
            return answer.choices[0].message.content or ""

        pid = ask("hello").split()[1]
        with pytest.raises(openai.InternalServerError) as caught:
            ask("OOM")
        assert caught.value.status_code == 500
        message = caught.value.message
        assert "thinker" in message and "out of GPU memory" in message
        assert ask("hello again") == f"ok {pid}"  # served by the same process


# ---- on a GPU: a real out-of-memory error, past the stage's cap --------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("backend", "kind"), [("OomSingle", None), ("OomAR", "ar")])
async def test_the_fraction_caps_the_stage_and_a_real_oom_fails_only_its_request(
    tmp_path, backend, kind
):
    plan = _plan(
        tmp_path,
        backend,
        kind,
        toml("""
            gpu = 0
            gpu_memory_fraction = 0.05
        """),
    )
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        (pid,) = runtime.processes().values()
        small = await runtime.submit(model, {"alloc_gib": 1.0}).result()  # within 5%
        total_gib = small["total"] / (1 << 30)
        over = 0.1 * total_gib  # twice the cap, far below what the device has free
        assert small["free"] / (1 << 30) > 2 * over
        await _fails_out_of_memory(runtime, {"alloc_gib": over})
        after = await runtime.submit(model, {"alloc_gib": 1.0}).result()
        assert after["pid"] == pid
        # the cap is real: the device had room, the stage's allocator had not
        assert after["free"] / (1 << 30) > 2 * over
        assert after["reserved"] <= 0.05 * after["total"]


@pytest.mark.gpu
async def test_a_budget_the_device_cannot_give_is_a_one_line_start_error(tmp_path):
    torch = pytest.importorskip("torch")
    free = torch.cuda.mem_get_info(0)[0]
    hog = torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda:0")  # another process's
    try:
        plan = _plan(
            tmp_path,
            "OomSingle",
            None,
            toml("""
                gpu = 0
                gpu_memory_fraction = 0.5
            """),
        )
        runtime = Runtime(plan)
        with pytest.raises(PipelineError) as caught:
            await runtime.start()
        message = caught.value.message
        assert message.startswith("stage s: gpu_memory_fraction 0.5 of cuda:0 is ")
        assert "GiB, but only " in message and message.endswith(" GiB is free")
        assert "\n" not in message
    finally:
        del hog
        torch.cuda.empty_cache()
