"""The HTML report in a real browser: Debian's headless Chromium, driven by selenium.

Opens the report of an example pair, fails on any console error (a script
error, a blocked fetch: the page's Content-Security-Policy forbids every
network load), counts the SVG pictures and tensor entries, types into the
search box and checks that the visible entries shrink to the matching ones,
and saves a screenshot (to the test's tmp dir; set LAYOUTLANG_SCREENSHOTS=DIR
to keep a copy).

Needs `chromium` and `chromium-driver` (Debian packages; .ci/run installs them
when it runs as root) and the `selenium` dev dependency. Without them the test
skips on a developer's machine, but FAILS when LAYOUTLANG_REQUIRE_BROWSER=1
(.ci/run sets it): CI must not stay green without ever opening the report.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from layoutlang.compiler import compile_plan
from layoutlang.report.html_page import render_html, tensor_groups

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
PAIRS = {
    "llama3_8b": ("examples/llama3_8b_train.layout", "examples/llama3_8b_infer.layout", "layers.3.self_attn.k_proj"),
    "deepseek_v3": ("examples/deepseek_v3_moe.layout", "examples/deepseek_v3_infer.layout", "layers.7.mlp.gate.weight"),
}
PNG = b"\x89PNG\r\n\x1a\n"
REQUIRE = os.environ.get("LAYOUTLANG_REQUIRE_BROWSER", "") not in ("", "0")


def _missing(reason: str):
    """Skip, or fail where the browser is required (CI)."""
    if REQUIRE:
        pytest.fail(f"LAYOUTLANG_REQUIRE_BROWSER is set but {reason}", pytrace=False)
    pytest.skip(reason)


def _driver(profile: Path):
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        _missing(f"headless Chromium is not installed ({CHROMIUM}, {CHROMEDRIVER}): "
                 "apt-get install chromium chromium-driver (.ci/run does it as root)")
    try:
        from selenium import webdriver
    except ImportError:
        _missing("selenium is not installed; it is a dev dependency: pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--window-size=1400,1800"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(90)
    driver.set_script_timeout(30)
    return driver


def _visible(driver) -> list[str]:
    """The keys text of every tensor entry not hidden by the search."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('article.group'))"
        ".filter(g => !g.hidden && g.offsetParent !== null)"
        ".map(g => Array.from(g.querySelectorAll('.key')).map(e => e.textContent).join('\\n'))")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(PAIRS))
def test_report_in_chromium(name, tmp_path):
    src, dst, query = PAIRS[name]
    plan = compile_plan(ROOT / src, ROOT / dst)
    groups = [g for p in tensor_groups(plan) for g in p.groups]
    page = tmp_path / "plan.html"
    page.write_text(render_html(plan), "utf-8")
    driver = _driver(tmp_path / "profile")
    try:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
        from selenium.webdriver.support.ui import WebDriverWait

        driver.get(page.as_uri())
        WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.readyState") == "complete")
        counts = driver.execute_script(
            "return {svg: document.querySelectorAll('svg').length,"
            " pictures: document.querySelectorAll('svg.tensor').length,"
            " heat: document.querySelectorAll('svg.heatmap rect').length,"
            " blocks: document.querySelectorAll('svg.tensor rect[data-logical]').length,"
            " groups: document.querySelectorAll('article.group').length,"
            " sources: document.querySelectorAll('#sources .src').length}")
        drawn = sum(1 for g in groups if g.pictures)
        assert counts["groups"] == len(groups)
        assert counts["pictures"] == 2 * drawn  # source and destination per drawn group
        assert counts["svg"] >= counts["pictures"] + 4  # + defs, heatmap (+ legend), two bar charts
        assert counts["heat"] > 1 and counts["blocks"] >= counts["pictures"]
        assert counts["sources"] == 2
        assert len(_visible(driver)) == len(groups)

        box = driver.find_element(By.ID, "tensor-search")
        box.send_keys(query)
        WebDriverWait(driver, 10).until(lambda d: len(_visible(d)) < len(groups))
        shown = _visible(driver)
        expected = [g for g in groups if any(query in k for k in g.keys)]
        assert 0 < len(shown) == len(expected)
        assert all(query in text for text in shown)
        count = driver.find_element(By.ID, "tensor-count").text
        assert count == f"{len(expected)} of {len(groups)} groups"
        driver.save_screenshot(str(tmp_path / "search.png"))

        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.DELETE)
        WebDriverWait(driver, 10).until(lambda d: len(_visible(d)) == len(groups))

        driver.execute_script("window.scrollTo(0, 0)")
        shot = tmp_path / "report.png"
        driver.save_screenshot(str(shot))
        assert shot.read_bytes().startswith(PNG) and shot.stat().st_size > 10_000
        first = driver.find_element(By.CSS_SELECTOR, "article.group svg.tensor")
        first.screenshot(str(tmp_path / "picture.png"))
        keep = os.environ.get("LAYOUTLANG_SCREENSHOTS")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for png in tmp_path.glob("*.png"):
                shutil.copy(png, Path(keep) / f"{name}-{png.name}")

        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert not errors, errors
    finally:
        driver.quit()
