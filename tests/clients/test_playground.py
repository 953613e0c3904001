"""The playground page at `/`, end to end in headless Chromium against a real omni-server.

Chromium and chromedriver come from Debian (`install_chromium.sh`, run here when missing and
we are root); the test skips only where they cannot be installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_client import OmniClient

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
INSTALL_SCRIPT = Path(__file__).with_name("install_chromium.sh")
CHROMIUM = "chromium"
CHROMEDRIVER = "chromedriver"

# slow: a browser; the first test may install Chromium (apt)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the [test] extra")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


def _browser_paths() -> tuple[str, str] | None:
    chromium, driver = shutil.which(CHROMIUM), shutil.which(CHROMEDRIVER)
    return (chromium, driver) if chromium and driver else None


@pytest.fixture(scope="session")
def chromium_paths() -> tuple[str, str]:
    paths = _browser_paths()
    if paths is None and os.geteuid() == 0 and shutil.which("apt-get"):
        install = subprocess.run(
            ["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=900
        )
        paths = _browser_paths()
        if paths is None:
            pytest.skip(f"Chromium could not be installed: {install.stderr.strip()[-500:]}")
    if paths is None:
        pytest.skip("Chromium is not installed and cannot be here (needs root and apt-get)")
    return paths


@pytest.fixture
def browser(chromium_paths: tuple[str, str]) -> Iterator[webdriver.Chrome]:
    chromium, driver_path = chromium_paths
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",  # running as root (CI) forbids the sandbox
        "--disable-dev-shm-usage",
        "--autoplay-policy=no-user-gesture-required",
        "--window-size=1000,900",
    ):
        options.add_argument(flag)
    # an explicit chromedriver: Selenium Manager would try to download one
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def open_playground(browser, server_url: str) -> None:
    browser.get(f"{server_url}/")
    WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-ready") is not None
    )
    status = browser.find_element(By.ID, "status").text
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true", status


def last_run(browser) -> dict | None:
    return browser.execute_script("return window.playground.lastRun")


def finished(run: dict | None) -> bool:
    """Failed, or every scheduled sample was played by the audio context (`ended` fired)."""
    if run is None:
        return False
    return run["error"] is not None or (
        run["ok"] and run["samplesPlayed"] == run["samplesScheduled"]
    )


@pytest.mark.parametrize("format", ["pcm", "wav", "mp3"])
def test_speak_plays_the_stream(browser, server_url: str, format: str) -> None:
    open_playground(browser, server_url)
    with OmniClient(server_url) as client:
        served = [m["id"] for m in client.models() if "speech" in m.get("tasks", ["speech"])]
    models = [o.text for o in Select(browser.find_element(By.ID, "model")).options]
    assert models == served, "the model picker is filled from /v1/models"
    voices = [o.text for o in Select(browser.find_element(By.ID, "voice")).options]
    assert "alloy" in voices
    Select(browser.find_element(By.ID, "format")).select_by_value(format)
    text = browser.find_element(By.ID, "text")
    text.clear()
    text.send_keys("Hello from the browser. This sentence streams while the next one is made.")
    browser.find_element(By.ID, "speak").click()

    WebDriverWait(browser, 90).until(lambda b: finished(last_run(b)))
    run = last_run(browser)
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"playground-{format}.png"))
    if format == "pcm":
        browser.save_screenshot(str(ARTIFACTS / "playground.png"))

    assert run["error"] is None, run["error"]
    assert run["samplesScheduled"] > 0
    assert run["samplesPlayed"] == run["samplesScheduled"]
    assert run["duration_s"] > 1.0
    assert run["ttfa_ms"] > 0
    assert run["chunks"] >= 1
    if format == "pcm":
        assert run["sampleRate"] == 24000  # the API's raw PCM rate (X-Sample-Rate)
    # the page shows what it measured, in its stable elements
    assert browser.find_element(By.ID, "ttfa").text.endswith(" ms")
    assert float(browser.find_element(By.ID, "duration").text.removesuffix(" s")) > 1.0
    assert browser.find_element(By.ID, "status").text == "done"


def test_server_errors_are_shown(browser, server_url: str) -> None:
    open_playground(browser, server_url)
    browser.execute_script(
        "document.getElementById('voice').add(new Option('no-such-voice', 'no-such-voice'));"
    )
    Select(browser.find_element(By.ID, "voice")).select_by_value("no-such-voice")
    browser.find_element(By.ID, "speak").click()
    WebDriverWait(browser, 30).until(lambda b: (run := last_run(b)) and run["error"])
    status = browser.find_element(By.ID, "status")
    assert "HTTP 400" in status.text and "no-such-voice" in status.text
    assert "error" in status.get_attribute("class")
    assert last_run(browser)["samplesScheduled"] == 0


@pytest.fixture
def talking_browser(chromium_paths, server_url: str, tmp_path: Path) -> Iterator[webdriver.Chrome]:
    """Chromium whose fake microphone plays a question spoken by the embedded voice, then a long
    silence (the fake device loops its file: the silence lets the answer finish uninterrupted)."""
    import wave

    with OmniClient(server_url) as client:
        pcm = client.speech("What is the capital of France?", format="pcm")
    rate = 24_000
    silence = bytes(2 * rate)
    question = tmp_path / "question.wav"
    with wave.open(str(question), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(silence + bytes(pcm) + silence * 20)
    chromium, driver_path = chromium_paths
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--autoplay-policy=no-user-gesture-required",
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={question}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def test_talk_hears_the_microphone_and_answers_aloud(talking_browser, server_url: str) -> None:
    browser = talking_browser
    open_playground(browser, server_url)
    browser.find_element(By.ID, "talk").click()

    def answered(b) -> dict | None:
        run = b.execute_script("return window.playground.lastTalk")
        return run if run and (run["error"] or run["status"]) else None

    run = WebDriverWait(browser, 240).until(answered)
    browser.find_element(By.ID, "hangup").click()
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "playground-talk.png"))
    assert run["error"] is None, run["error"]
    assert run["status"] == "completed"
    assert "capital" in run["heard"].lower() and "france" in run["heard"].lower(), run["heard"]
    assert run["answer"].strip()
    assert run["samplesScheduled"] > 12_000  # over half a second of answer at 24 kHz
    assert run["firstAudioMs"] is not None and run["firstAudioMs"] > 0
    assert browser.find_element(By.ID, "heard").text == run["heard"]
