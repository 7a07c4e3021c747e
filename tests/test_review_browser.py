"""The review app in a real browser: Debian's headless Chromium driven by Selenium through Debian's chromium-driver
(nothing is downloaded). A reviewer clicks from the flags to an evaluation, to a differing case, to the compare
page; no console error and no Content-Security-Policy violation on the way; a tampered ledger's badge is red.
Screenshots are kept as test artifacts in test-artifacts/review/ (readme.png is the README's, docs/images/review.png)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from review_ledger import review
from test_review import made, tamper  # noqa: F401  (fixture)
from trust import keys  # noqa: F401  (fixture)

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "review"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:  # make test installs both: missing ones fail, never skip
        pytest.fail("chromium and chromium-driver are needed: 'make test' installs them (apt-get install chromium chromium-driver)")
    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1600"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    b = webdriver.Chrome(service=Service(driver), options=options)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        yield b
    finally:
        b.quit()


def problems(browser) -> list[str]:
    """What the console said since the last call that a reviewer must never see: errors and CSP violations."""
    return [e["message"] for e in browser.get_log("browser")
            if e["level"] in ("SEVERE", "ERROR") or "Content Security Policy" in e["message"]]


def test_a_reviewer_clicks_from_the_flags_to_a_case_to_the_compare_page(made, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    ws, ids = made
    seen = []
    with review(ws) as url:
        browser.get(url + "/flags")
        assert "ledger verifies" in browser.find_element(By.ID, "integrity").text
        browser.save_screenshot(str(ARTIFACTS / "1-flags.png"))
        seen += problems(browser)
        browser.find_element(By.LINK_TEXT, "Evaluations").click()
        browser.find_element(By.LINK_TEXT, str(ids["fail"])).click()
        assert browser.current_url == f"{url}/evaluations/{ids['fail']}"
        browser.find_element(By.PARTIAL_LINK_TEXT, "differs (").click()
        rows = browser.find_elements(By.CSS_SELECTOR, "table.cases tbody tr.differs a")
        assert rows, "no differing case listed"
        browser.save_screenshot(str(ARTIFACTS / "2-evaluation.png"))
        browser.set_window_size(1280, 900)  # the README's picture, docs/images/review.png: the top of a FAIL's page
        browser.save_screenshot(str(ARTIFACTS / "readme.png"))
        browser.set_window_size(1280, 1600)
        seen += problems(browser)
        rows[-1].click()
        position = browser.find_element(By.CSS_SELECTOR, "strong.position").text
        assert position.isdigit() and browser.find_elements(By.CSS_SELECTOR, "svg polyline")
        browser.save_screenshot(str(ARTIFACTS / "3-case.png"))
        seen += problems(browser)
        browser.find_element(By.CSS_SELECTOR, "a.compare").click()
        assert browser.current_url == f"{url}/compare/{ids['pass']}/{ids['fail']}"
        assert "(changed)" in browser.find_element(By.TAG_NAME, "main").text
        browser.save_screenshot(str(ARTIFACTS / "4-compare.png"))
        seen += problems(browser)
        browser.get(url + f"/evaluations/{ids['pass']}")  # the calibration's detection curve and the signed flip
        browser.save_screenshot(str(ARTIFACTS / "5-calibrated.png"))
        seen += problems(browser)
    assert seen == []


def test_a_tampered_ledger_shows_red_in_the_browser(made, browser, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    ws = tmp_path / "ws"
    shutil.copytree(made[0], ws)
    tamper(ws / "ledger" / "evidence.db")
    with review(ws) as url:
        for path in ("/flags", "/evaluations", f"/evaluations/{made[1]['fail']}"):
            browser.get(url + path)
            badge = browser.find_element(By.ID, "integrity")
            assert "LEDGER DOES NOT VERIFY" in badge.text and "bad" in badge.get_attribute("class")
            assert badge.value_of_css_property("background-color") == "rgba(207, 34, 46, 1)"  # the stylesheet loaded
        browser.save_screenshot(str(ARTIFACTS / "6-tampered.png"))
        assert problems(browser) == []


def test_the_problem_finder_sees_a_csp_violation(made, browser, tmp_path):  # noqa: F811
    """The check above can fail: a page with an inline script (which the CSP forbids) is reported."""
    with review(made[0]) as url:
        browser.get(url + "/flags")
        browser.execute_script("var s = document.createElement('script'); s.textContent = '1'; document.body.appendChild(s);")
        assert any("Content Security Policy" in p for p in problems(browser))
