"""The chat page of ``racer serve`` in a real headless browser: Debian's Chromium
driven by Selenium (its own chromedriver from the same Debian packages, so nothing is
downloaded). Loads ``/``, sends a prompt, waits for the answer, compares it with the
API's answer and checks that tinted runs are there; saves a screenshot
(``$RACER_SCREENSHOT`` names where a copy goes, as for the README's)."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from racer import DEFAULT_MODEL
from test_serve import _post, start_server

KEY = "page-key"

PROMPT = ("Write a Python class Stack with push, pop, peek and is_empty methods, then a Queue class with the "
          "same methods built on two stacks.")
TOKENS = 160


def _browser_parts() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or ("/usr/lib/chromium/chromedriver"
                                              if os.path.exists("/usr/lib/chromium/chromedriver") else None)
    missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if not path]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        message = f"the page test needs {', '.join(missing)}: run `make browser` (Debian's chromium, chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs them: a missing browser there is a broken set-up
        pytest.skip(message)
    return chromium, driver


@pytest.fixture(scope="module")
def page_server(real):
    process, base = start_server("--api-key", KEY)
    yield base
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)


def test_the_page_streams_the_apis_answer_tinted_by_source(page_server, tmp_path):
    chromium, driver_path = _browser_parts()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    expected = _post(page_server, "/v1/chat/completions", {
        "model": DEFAULT_MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
        "temperature": 0, "racer": True}, key=KEY).json()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,800"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        browser.get(page_server + "/")
        wait = WebDriverWait(browser, 120)
        wait.until(lambda b: DEFAULT_MODEL in b.find_element(By.ID, "model").text)
        tokens = browser.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys(str(TOKENS))
        # The server wants its API key: the page offers a field for it, and a message sent
        # without it is refused and handed back, not lost.
        key = browser.find_element(By.ID, "api-key")
        assert key.is_displayed()
        browser.find_element(By.ID, "prompt").send_keys(PROMPT)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda b: b.find_element(By.ID, "error").is_displayed())
        assert "API key" in browser.find_element(By.ID, "error").text
        assert browser.find_element(By.ID, "prompt").get_attribute("value") == PROMPT
        assert not browser.find_elements(By.CSS_SELECTOR, ".turn")
        key.send_keys(KEY)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".assistant[data-done='true']"))
        assert browser.execute_script("return sessionStorage.getItem('racer-api-key')") == KEY
        answer = browser.execute_script(
            "return Array.from(document.querySelectorAll('.assistant span[class^=src-]'))"
            ".map(s => s.textContent).join('')")
        assert answer == expected["choices"][0]["message"]["content"]
        counts = browser.execute_script(
            "const n = s => document.querySelectorAll('.assistant .src-' + s).length;"
            "return {retrieval: n('retrieval'), logits: n('logits'), both: n('both'), none: n('none')};")
        assert counts["none"] > 0 and counts["retrieval"] + counts["logits"] + counts["both"] > 0, counts
        count = int(browser.find_element(By.ID, "count").text)
        assert count == expected["usage"]["completion_tokens"]
        # The page's own figures agree with each other: one point a verification step, and
        # MAT = tokens / (prefill + steps). (Its tree sizes are its own request's: the
        # server's drafter memory and the measured budget make them differ from the first.)
        steps = int(browser.find_element(By.ID, "spark").get_attribute("data-steps"))
        points = browser.find_element(By.CSS_SELECTOR, "#spark polyline").get_attribute("points").split()
        assert steps > 1 and len(points) == steps
        assert float(browser.find_element(By.ID, "mat").text) == pytest.approx(count / (1 + steps), abs=0.006)
        assert not browser.find_element(By.ID, "error").is_displayed()
        shot = tmp_path / "chat-page.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get("RACER_SCREENSHOT"):
            shutil.copy(shot, os.environ["RACER_SCREENSHOT"])
    finally:
        browser.quit()
