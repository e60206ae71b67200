"""The admin page in a real headless browser (Debian chromium + chromedriver via selenium):
log in, see the model, change a setting, see it applied to the next request and in the live
view, see a bad value refused, and find the change persisted after a reload.

scripts/setup.sh --dev installs chromium and chromium-driver (apt) and selenium (pip); without
them this test is skipped with that hint. The browser runs with networking features off and a
fresh profile: this machine has no internet, and nothing may leak between runs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from quickdraft.config import SpeculativeConfig
from quickdraft.engine import Engine, ServedModel
from quickdraft.loading import load
from quickdraft.server import ServerConfig, create_app
from quickdraft.server.main import BackgroundServer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ADMIN = "browser-admin-token"

webdriver = pytest.importorskip("selenium.webdriver", reason="scripts/setup.sh --dev installs it")
if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    pytest.skip(
        "chromium / chromedriver missing: scripts/setup.sh --dev installs them",
        allow_module_level=True,
    )
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def settings_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("browser") / "settings.json"


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, settings_path: Path) -> Iterator[BackgroundServer]:
    lm = load(str(tiny_model_dir), "fp32", progress=False)
    engine = Engine({"tiny": ServedModel(lm, SpeculativeConfig(adaptive=False))})
    engine.start()
    config = ServerConfig(admin_token=ADMIN, settings_path=settings_path)
    with BackgroundServer(create_app(engine, config)) as server:
        yield server
    engine.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    profile = tempfile.mkdtemp(prefix="quickdraft-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait(driver: WebDriver, cond: Callable[[WebDriver], Any], what: str) -> Any:
    # a liveness bound for the page to react (it polls once a second), not a speed claim
    return WebDriverWait(driver, 20, poll_frequency=0.1).until(cond, message=what)


def text(driver: WebDriver, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def next_request_spec(srv: BackgroundServer) -> dict[str, Any]:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    r = c.completions.create(
        model="tiny",
        prompt="abcabcabcabc",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    spec: dict[str, Any] = r.model_extra["speculative"]  # type: ignore[index]
    return spec


def test_admin_browser_change_setting_applies_to_next_request(
    srv: BackgroundServer, browser: WebDriver, settings_path: Path
) -> None:
    d = browser
    d.get(srv.url + "/admin")
    assert d.find_element(By.ID, "app").is_displayed() is False

    # a wrong token is refused with the server's message
    d.find_element(By.ID, "token").send_keys("wrong")
    d.find_element(By.ID, "unlock").click()
    wait(d, lambda d: "invalid admin token" in text(d, "#login-error"), "login error shown")

    token = d.find_element(By.ID, "token")
    token.clear()
    token.send_keys(ADMIN)
    d.find_element(By.ID, "unlock").click()
    model = 'section.model[data-model="tiny"]'
    wait(d, lambda d: d.find_element(By.CSS_SELECTOR, model).is_displayed(), "model card")
    assert text(d, f"{model} .active") == "speculation off"
    assert text(d, f"{model} .device") == "runs on cpu"
    assert not d.find_element(By.CSS_SELECTOR, f"{model} .enabled").is_selected()

    assert next_request_spec(srv)["method"] == "none"
    wait(d, lambda d: text(d, f"{model} .requests") == "1", "live request count")

    # change: speculation on, n-gram, k = 3
    d.find_element(By.CSS_SELECTOR, f"{model} .enabled").click()
    Select(d.find_element(By.CSS_SELECTOR, f"{model} .method")).select_by_value("ngram")
    k = d.find_element(By.CSS_SELECTOR, f"{model} .k")
    k.clear()
    k.send_keys("3")
    d.find_element(By.CSS_SELECTOR, f"{model} .apply").click()
    wait(d, lambda d: text(d, f"{model} .status") == "saved", "apply confirmed")
    assert text(d, f"{model} .active") == "ngram, k <= 3, fixed k"

    spec = next_request_spec(srv)
    assert spec["method"] == "ngram" and spec["drafted"] > 0
    assert len(spec["accepted_per_position"]) <= 3
    saved = json.loads(settings_path.read_text())["models"]["tiny"]
    assert saved == {"enabled": True, "method": "ngram", "draft_model": None, "num_draft_tokens": 3}

    # the live view picks the request up: count, acceptance, histogram bars (k + 1 of them)
    wait(d, lambda d: text(d, f"{model} .requests") == "2", "live count after the change")
    wait(d, lambda d: text(d, f"{model} .acceptance-rate").endswith("%"), "acceptance shown")
    bars = d.find_elements(By.CSS_SELECTOR, f"{model} .hist .bar")
    assert len(bars) == 4  # 0..3 accepted draft tokens
    assert sum(int(b.get_attribute("data-count") or 0) for b in bars) > 0

    # a bad value is refused, shown, and changes nothing
    k.clear()
    k.send_keys("0")
    d.find_element(By.CSS_SELECTOR, f"{model} .apply").click()
    wait(
        d,
        lambda d: (
            "error"
            in (d.find_element(By.CSS_SELECTOR, f"{model} .status").get_attribute("class") or "")
        ),
        "error shown",
    )
    assert "num_draft_tokens" in text(d, f"{model} .status")
    assert json.loads(settings_path.read_text())["models"]["tiny"] == saved
    assert next_request_spec(srv)["method"] == "ngram"

    # reload: the token is remembered in this tab, and the form shows the saved settings
    d.refresh()
    wait(d, lambda d: d.find_element(By.CSS_SELECTOR, model).is_displayed(), "card after reload")
    assert d.find_element(By.CSS_SELECTOR, f"{model} .enabled").is_selected()
    assert d.find_element(By.CSS_SELECTOR, f"{model} .k").get_attribute("value") == "3"
    method = Select(d.find_element(By.CSS_SELECTOR, f"{model} .method"))
    assert method.first_selected_option.get_attribute("value") == "ngram"
