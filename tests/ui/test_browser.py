"""A real browser on the real app: Debian's Chromium driven by Playwright.

Only what a browser alone shows is tested here (pages render without an exception box, Plotly draws,
a slider moved with the keyboard changes the chart); logic is tested faster with AppTest.
Screenshots of every page go to artifacts/screenshots/ (git-ignored).
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from bench.bench_classroom import serve
from ui.lessons import LESSONS

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
SHOTS = ROOT / "artifacts" / "screenshots"
# generous: a page's first render on 2 busy cores (torch imports, Plotly) can take tens of seconds
WAIT_MS = 90_000
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason="needs Debian's Chromium: sudo apt-get install -y chromium"),
]


@contextlib.contextmanager
def _streamlit_server():
    try:
        with serve() as (url, _proc):
            yield url
    except RuntimeError as e:  # it did not start: say what it printed
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def server():
    with _streamlit_server() as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="shardlab-chromium-")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 3200})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


def _open(browser, url: str):
    page = browser.new_page()
    page.goto(url)
    page.wait_for_selector('[data-testid="stApp"]', timeout=WAIT_MS)
    # Streamlit shows a running indicator while the script runs; wait until the page settles.
    page.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=WAIT_MS)
    page.wait_for_timeout(500)
    return page


def _assert_no_exception(page, where: str):
    boxes = page.locator('[data-testid="stException"]')
    assert boxes.count() == 0, f"{where}: {boxes.first.inner_text()}"


PAGES = [("home", "")] + [(lesson.url_path, lesson.url_path) for lesson in LESSONS]
# The lessons whose tables are app_pages.text_table's: every table in view (not in a closed expander) must fit an
# 800-px window (the lesson 466 px beside the sidebar). A data grid keeps each column as wide as its text, and
# there their last columns had run out of sight behind a sideways scroll. Checked on the rendered page resized to
# 800 px, which finds what a page opened at 800 px does (the hardware page's calibration grid over by 756 px
# either way, the collectives page's by 300 px: both by design) without opening the page a second time.
TABLES_AT_800 = {"data-parallel", "pipeline", "context-parallel", "expert-parallel", "mamba"}
# each table and how far its content runs past its box
_OVERFLOWING_TABLES = """() => [...document.querySelectorAll('[data-testid=stTable], [data-testid=stDataFrame]')]
  .filter(el => !el.closest('details:not([open])'))
  .map(el => { const box = el.querySelector('.dvn-scroller') || el.querySelector('table')?.parentElement || el;
               return [el.innerText.split('\\n')[0], box.scrollWidth - box.clientWidth]; })
  .filter(([, over]) => over > 2)"""


@pytest.mark.parametrize(("name", "path"), PAGES, ids=[p[0] for p in PAGES])
def test_every_page_renders(server, browser, name, path):
    page = _open(browser, f"{server}/{path}")
    try:
        _assert_no_exception(page, name)
        assert page.locator("h1").first.inner_text().strip()
        if path:  # lessons draw Plotly charts
            page.wait_for_selector(".js-plotly-plot .main-svg", timeout=WAIT_MS)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
        if path in TABLES_AT_800:
            page.wait_for_selector('[data-testid="stTable"], [data-testid="stDataFrame"]', timeout=WAIT_MS)
            page.set_viewport_size({"width": 800, "height": 1200})
            page.wait_for_timeout(500)
            assert page.evaluate(_OVERFLOWING_TABLES) == [], f"{name}: a table runs past an 800-px window"
    finally:
        page.close()


def _trace_points(page) -> str:
    return page.locator(".js-plotly-plot .scatterlayer").first.inner_html()


def test_batch_slider_moves_the_operating_point(server, browser):
    page = _open(browser, f"{server}/hardware")
    try:
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=WAIT_MS)
        before_plot = _trace_points(page)
        verdict = page.get_by_test_id("stMetric").filter(has_text="Bound by")
        assert "memory" in verdict.inner_text()
        slider = page.get_by_role("slider", name="Tokens in the batch (B)")
        slider.focus()
        for _ in range(5):  # 128 -> 4096 tokens
            page.keyboard.press("ArrowRight")
        page.wait_for_function(
            "() => [...document.querySelectorAll('[data-testid=stMetric]')]"
            ".some(m => m.innerText.includes('Bound by') && m.innerText.includes('compute'))", timeout=WAIT_MS)
        page.wait_for_timeout(500)
        _assert_no_exception(page, "hardware after slider")
        assert _trace_points(page) != before_plot
        assert "tokens=4096" in page.url
        # the chips compared are in the link too: a chip added here is there when the link is opened again
        picker = page.get_by_test_id("stMultiSelect").first.locator("input").first
        picker.click()
        picker.fill("MI300X")
        page.keyboard.press("Enter")
        page.wait_for_function("() => location.search.includes('MI300X')", timeout=WAIT_MS)
        page.goto(page.url)
        page.get_by_test_id("stMultiSelect").first.get_by_text("MI300X").wait_for(timeout=WAIT_MS)
    finally:
        page.close()


def test_bad_link_shows_a_message_not_a_traceback(server, browser):
    page = _open(browser, f"{server}/hardware?chip=h900&dp=-1")
    try:
        _assert_no_exception(page, "bad link")
        page.get_by_test_id("stSidebar").get_by_text("Unknown chip h900 in the link").wait_for(timeout=WAIT_MS)
        page.get_by_test_id("stSidebar").get_by_text("Mesh size dp=-1").wait_for(timeout=WAIT_MS)
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=WAIT_MS)
    finally:
        page.close()


def test_shared_link_is_the_first_request_of_a_fresh_server(browser):
    # A teacher's link opens a lesson directly; the first session of a new server must route it through
    # app.py's navigation (a folder named pages/ beside app.py would switch Streamlit to its old
    # directory-based routing for that request).
    with _streamlit_server() as url:
        page = _open(browser, f"{url}/hardware?chip=tpu-v5p&tokens=512")
        try:
            _assert_no_exception(page, "deep link")
            page.locator("h1").get_by_text("Hardware & roofline").wait_for(timeout=WAIT_MS)
            page.get_by_test_id("stSidebar").get_by_text("chips of TPU v5p").wait_for(timeout=WAIT_MS)
        finally:
            page.close()


@pytest.mark.multiprocess
def test_collectives_ring_plays_and_the_live_sweep_runs(server, browser):
    # Plotly runs the animation frames in the browser, and the sweep starts real worker processes from
    # the server: neither shows up in AppTest.
    page = _open(browser, f"{server}/collectives?collective=All-gather&ring_n=3")
    try:
        page.wait_for_selector(".js-plotly-plot .main-svg", timeout=WAIT_MS)
        ring = page.locator(".js-plotly-plot").first
        assert "Start:" in ring.locator(".gtitle").text_content()
        ring.locator(".updatemenu-button").first.click()  # Play
        page.wait_for_function(
            "() => document.querySelector('.js-plotly-plot .gtitle').textContent.includes('step 2/2')",
            timeout=WAIT_MS)
        page.get_by_role("button", name="Run the sweep").click()
        page.wait_for_timeout(1500)
        # a widget moved while the sweep runs reruns the page: the sweep is followed again, not lost
        page.get_by_test_id("stRadio").filter(has_text="Ranks").get_by_text("3", exact=True).click()
        page.get_by_text("α (latency per step)").wait_for(timeout=120_000)
        _assert_no_exception(page, "collectives after the sweep")
        assert page.locator('[data-testid="stAlert"]').filter(has_text="failed").count() == 0
        assert page.locator(".js-plotly-plot").count() == 3
    finally:
        page.close()


@pytest.mark.multiprocess
def test_live_panel_draws_the_prediction_beside_the_run(server, browser):
    # the measured step and its prediction, animated in the browser: what AppTest cannot show
    page = _open(browser, f"{server}/data-parallel")
    try:
        page.get_by_role("button", name="Run on this machine").click()
        page.get_by_text("Prediction error").first.wait_for(timeout=180_000)
        _assert_no_exception(page, "data-parallel after the live run")
        titles = page.locator(".js-plotly-plot .gtitle")
        page.wait_for_function(
            "() => [...document.querySelectorAll('.js-plotly-plot .gtitle')].some(t => t.textContent"
            ".startsWith('Measured: step'))", timeout=WAIT_MS)
        texts = [titles.nth(i).text_content() for i in range(titles.count())]
        predicted = next(i for i, t in enumerate(texts) if t.startswith("Predicted by the planner"))
        assert any(t.startswith("Measured: step") for t in texts)
        chart = page.locator(".js-plotly-plot").filter(has_text="Predicted by the planner").first
        before = chart.locator(".slider-container").inner_html()
        chart.locator(".updatemenu-button").first.click()  # Play
        page.wait_for_timeout(1500)
        assert chart.locator(".slider-container").inner_html() != before, texts[predicted]
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "live-panel.png"), full_page=True)
    finally:
        page.close()


@pytest.mark.multiprocess
def test_the_labs_default_experiment_runs_in_the_browser(server, browser):
    page = _open(browser, f"{server}/lab")
    try:
        page.get_by_role("button", name="Run this experiment").click()
        page.get_by_text("matches the single-process reference").first.wait_for(timeout=180_000)
        _assert_no_exception(page, "the lab after its default run")
        page.get_by_text("This session's runs").first.wait_for(timeout=WAIT_MS)
        # each drawn a moment after the heading above it (a count right after the heading had read 0 grids once)
        page.locator('[data-testid="stTable"]').first.wait_for(state="attached", timeout=WAIT_MS)  # lanes, folded
        page.locator('[data-testid="stDataFrame"]').first.wait_for(state="attached", timeout=WAIT_MS)  # the runs
        assert page.get_by_role("button", name="Stop this run").count() == 0  # gone once the run ended
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "lab.png"), full_page=True)
    finally:
        page.close()
