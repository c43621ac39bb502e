"""The chat page (``/``) driven in headless Chromium against a live loopback server: a streamed reply, the
live stats panel, and the Stop button. Saves a screenshot in the test's tmp directory; with
LLAMAPACK_UPDATE_SCREENSHOT=1 it replaces the committed ``tests/screenshots/chat_page.png``.

Needs Debian's ``chromium`` and ``chromium-driver`` (scripts/test.sh installs them when missing); without them
this test fails."""
from __future__ import annotations

import llama_cpp  # noqa: F401 - before numpy (see docs/hook.md: static C++ runtime)

import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from test_server import NAME, llm, model_path, raw, serve  # noqa: F401 - fixtures reused

SCREENSHOT = Path(__file__).resolve().parent / "screenshots" / "chat_page.png"
INSTALL = "apt-get update && apt-get install -y chromium chromium-driver"
CHROMEDRIVER = "/usr/bin/chromedriver"


@contextmanager
def chromium_driver(profile: Path):
    """Headless Chromium through Debian's chromedriver; a test failure (not a skip) when either is missing."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver") or (
        CHROMEDRIVER if os.path.exists(CHROMEDRIVER) else None)
    if not chromium or not chromedriver:
        pytest.fail(f"chromium and chromedriver are needed for the chat page test; as root: {INSTALL}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is needed for the chat page test: pip install -e '.[test]'")
    os.environ["SE_OFFLINE"] = "true"  # never let Selenium Manager download a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1000,640"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def test_chat_page_streams_shows_stats_and_stops(serve, tmp_path):
    with chromium_driver(tmp_path / "profile") as browser:
        drive(serve(), browser, tmp_path)


def drive(base: str, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    browser.get(base + "/")
    assert browser.title == "llamapack chat"
    text = lambda css: [e.text for e in browser.find_elements(By.CSS_SELECTOR, css)]  # noqa: E731
    assistant = lambda: browser.execute_script(  # noqa: E731 - textContent: also while scrolled out of view
        "const a = document.querySelectorAll('.msg.assistant'); return a.length ? a[a.length - 1].textContent : null")
    stat = lambda i: browser.find_element(By.ID, i).text  # noqa: E731
    # the whole panel in one script call: the fields of one poll (field by field, a poll landing in between
    # paired the in-flight poll's bytes/token with the next poll's tok/s)
    panel = lambda: browser.execute_script(  # noqa: E731
        "return Object.fromEntries(['model', 'hit', 'bpt', 'tps', 'busy'].map((i) => [i, "
        "document.getElementById(i).textContent]))")

    # the panel is filled from /stats right away, before any request: no last request to show yet
    first = wait_for(lambda: (lambda p: p["model"] == NAME and p["busy"] == "idle" and p)(panel()), 10,
                     "the first /stats poll")
    assert (first["hit"], first["bpt"], first["tps"]) == ("n/a", "–", "–"), first

    # 1. a message: the reply streams in (several lengths seen), then the page is ready again
    browser.find_element(By.ID, "max").clear()
    browser.find_element(By.ID, "max").send_keys("120")
    browser.find_element(By.ID, "input").send_keys("Hello there, tiny model")
    browser.find_element(By.ID, "send").click()
    lengths = []
    deadline = time.monotonic() + 30
    while True:
        reply = assistant()
        if reply:
            lengths.append(len(reply))
        if browser.find_element(By.ID, "send").is_enabled() and lengths:
            break
        assert time.monotonic() < deadline, "the first reply did not finish"
        time.sleep(0.02)
    assert text(".msg.user") == ["Hello there, tiny model"]
    assert text(".error") == []
    grown = sorted(set(lengths))
    assert len(grown) >= 2 and lengths == sorted(lengths), f"the reply did not stream: lengths {lengths}"
    first_reply = assistant()
    assert len(first_reply) > 20 and browser.find_element(By.ID, "input").get_attribute("value") == ""

    # 2. the stats panel shows the finished request's numbers (polled once a second), those of /stats
    shown = wait_for(lambda: (lambda p: p["busy"] == "idle" and p["tps"] != "–" and p)(panel()), 10,
                     "the stats panel to show the first request's numbers")
    stats = raw(base, "/stats")[1]
    last = stats["last_request"]
    assert stats["total"]["n_requests"] == 1 and not stats["busy"]
    # a cold cache: the first request reads experts (and its 16 slots hold a quarter of the 64 experts)
    assert last["read_bytes"] > 0 and last["read_bytes_per_token"] > 1 << 20 and last["decode_tok_s"] > 0
    hit, bpt, tps = shown["hit"], shown["bpt"], shown["tps"]
    assert re.fullmatch(r"\d+\.\d %", hit) and re.fullmatch(r"\d+\.\d\d MiB", bpt) and re.fullmatch(r"\d+\.\d", tps)
    assert abs(float(hit[:-2]) - 100 * stats["pack"]["hit_rate"]) <= 0.05 + 1e-9, (shown, stats["pack"])
    assert abs(float(bpt[:-4]) - last["read_bytes_per_token"] / (1 << 20)) <= 0.005 + 1e-9, (shown, last)
    assert abs(float(tps) - last["decode_tok_s"]) <= 0.05 + 1e-9, (shown, last)

    # 3. a longer reply, stopped midway: the server stops generating and the text stops growing
    browser.find_element(By.ID, "max").clear()
    browser.find_element(By.ID, "max").send_keys("350")
    browser.find_element(By.ID, "input").send_keys("Tell me a long story")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2 and len(assistant() or "") > 10,
             30, "the second reply to start")
    wait_for(lambda: stat("busy") == "generating", 5, "the panel to show the server generating")
    stop = browser.find_element(By.ID, "stop")
    assert stop.is_enabled() and not browser.find_element(By.ID, "send").is_enabled()
    stop.click()
    stats = wait_for(lambda: (lambda s: s["total"]["n_requests"] == 2 and not s["busy"] and s)(raw(base, "/stats")[1]),
                     20, "the server to stop generating after Stop")
    assert 0 < stats["last_request"]["n_generated"] < 350, stats["last_request"]  # stopped early, not run out
    wait_for(lambda: browser.find_element(By.ID, "send").is_enabled(), 5, "Send to be enabled again")
    assert not stop.is_enabled()
    stopped = assistant()
    time.sleep(1.5)
    assert assistant() == stopped, "the reply kept growing after Stop"
    assert text(".user.msg") == ["Hello there, tiny model", "Tell me a long story"] and text(".error") == []
    wait_for(lambda: stat("busy") == "idle", 5, "the panel to show the server idle")

    # the chart of hit rate and tok/s over time has been drawn from several polls
    assert int(browser.find_element(By.ID, "chart").get_attribute("data-points")) >= 3
    shot = SCREENSHOT if os.environ.get("LLAMAPACK_UPDATE_SCREENSHOT") == "1" else tmp_path / SCREENSHOT.name
    shot.parent.mkdir(exist_ok=True)
    browser.save_screenshot(str(shot))
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG") and 5_000 < len(png) < 500_000
