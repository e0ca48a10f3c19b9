"""Playwright drives Debian's chromium against a running app.py: generate, click a token and read its
decomposition (the sum equals the logit), suppress a prototype, regenerate and see the side-by-side change and
why it changed; search a label, open the card, see evidence; click the map; follow a deep link.
Screenshots go to test-artifacts/ (ignored by git). Needs `apt-get install -y chromium`; without it this FAILS.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from test_app_support import CHANGED_RGB, ROOT, changing_prototype, running_app, shared_assets

from app import handlers
from app.core import GenerationSettings, Studio

pytestmark = pytest.mark.slow  # servers and browsers: not in the fast tier

ARTIFACTS = ROOT / "test-artifacts"
PROMPT = "the cat sat on the"
TIMEOUT = 60_000


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    studio = Studio.load(model, db)
    changing = changing_prototype(studio, GenerationSettings(PROMPT, max_new_tokens=12))
    ARTIFACTS.mkdir(exist_ok=True)
    with running_app(model, db) as url:
        yield {"url": url, "studio": studio, "changing": changing}


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"app-{name}.png"), full_page=True)


def new_page(browser, url: str, width: int = 1500, height: int = 1000):
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(TIMEOUT)
    page.goto(url)
    page.wait_for_selector("#proto-id")  # always visible, whichever tab a deep link opens
    return page


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input").first
    box.fill(str(value))
    box.press("Tab")


def test_generate_explain_suppress_and_compare(browser, app):
    page = new_page(browser, app["url"])
    page.fill("#prompt textarea", PROMPT)
    page.locator("input[aria-label='number input for Max new tokens']").fill("12")
    page.locator("input[aria-label='number input for Max new tokens']").press("Tab")
    page.click("#generate")
    tokens = page.locator("#original .textfield .token")
    page.wait_for_function("document.querySelectorAll('#original .textfield .token').length == 12")
    shot(page, "1-generated")

    tokens.nth(2).click()
    page.wait_for_function("document.querySelector('#token-summary').innerText.includes('Token 2')")
    page.wait_for_selector("#decomposition .js-plotly-plot")
    summary = page.inner_text("#token-summary")
    total, logit = (float(x) for x in re.search(r"= ([-\d.]+); the model's logit is ([-\d.]+)", summary).groups())
    assert abs(total - logit) <= 1e-3 * max(1, abs(logit)), summary
    page.wait_for_function("document.querySelector('#card').innerText.includes('#')")
    shot(page, "2-token-decomposition")

    set_number(page, "proto-id", app["changing"])
    page.click("#suppress")
    page.wait_for_function("document.querySelector('#iv-status').innerText.includes('added')")
    assert f"#{app['changing']}" in page.inner_text("#interventions")
    page.click("#generate")
    page.wait_for_function("document.querySelectorAll('#intervened .textfield .token').length == 12")
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('changed')")
    changed = page.locator(f"#intervened .textfield .token[style*='{CHANGED_RGB}']")
    assert changed.count() >= 1
    assert page.locator("#original .textfield .token").count() == 12  # the original stays beside it
    shot(page, "3-side-by-side")

    changed.first.click()
    page.wait_for_function("document.querySelector('#token-summary').innerText.includes('Why it changed')")
    summary = page.inner_text("#token-summary")
    assert f"#{app['changing']}" in summary, summary
    shot(page, "4-why-changed")
    page.close()


def test_an_untouched_prototype_box_is_empty_and_suppress_asks_for_an_id(browser, app):
    """Gradio draws an empty Number as 0: the page empties the id box as it loads, so Suppress pressed before
    anything is picked asks for an id instead of switching off prototype 0; an id typed at once stays typed."""
    page = new_page(browser, app["url"])
    page.wait_for_function("document.querySelector('#proto-id input').value === ''")
    page.click("#suppress")
    page.wait_for_function("document.querySelector('#iv-status').innerText.includes('\u26a0')")
    assert "prototype id is missing" in page.inner_text("#iv-status")
    assert "#0" not in page.inner_text("#interventions")
    page.close()
    page = new_page(browser, app["url"])
    page.fill("#proto-id input", "4")  # as soon as the box is there, before the page's load events answer
    page.locator("#proto-id input").press("Tab")
    page.get_by_role("tab", name="Prototypes").click()  # its table is filled by the same page load
    page.wait_for_function("document.querySelector('#search-status')?.innerText.includes('prototype(s)')")
    assert page.input_value("#proto-id input") == "4"
    page.close()


def test_search_card_evidence_map_and_deep_link(browser, app):
    studio = app["studio"]
    label = studio.label(3)[0]
    word = max(re.findall(r"[a-z]+", label), key=len)
    page = new_page(browser, app["url"])
    page.get_by_role("tab", name="Prototypes").click()
    # the page's own load event fills the table first; searching before it lands races with it
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('prototype(s)')")
    page.fill("#search-box textarea, #search-box input", word)
    page.click("#search")
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('whose label contains')")
    status = page.inner_text("#search-status")
    assert not status.startswith("0 ") and "⚠️" not in status, status
    assert word in page.inner_text("#table").lower()
    shot(page, "5-search")
    page.locator("#table [data-testid='cell-0-0']").click()
    page.wait_for_function("document.querySelector('#card').innerText.includes('label score')")
    card = page.inner_text("#card")
    assert word in card.lower()
    evidence = page.locator("#evidence .prism-evidence")
    assert evidence.count() >= 1
    assert page.locator("#evidence span[style*='outline']").count() >= 1  # the token is highlighted
    assert "activation" in page.inner_text("#evidence")
    shot(page, "5-card-evidence")

    # the map: a click on a point opens that point's card
    page.wait_for_selector("#prototype-map .js-plotly-plot .point")
    point = page.locator("#prototype-map .js-plotly-plot .point").nth(5)
    point.scroll_into_view_if_needed()
    box = point.bounding_box()
    before = page.inner_text("#card")
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_function("(b) => document.querySelector('#card').innerText !== b", arg=before)
    assert "label score" in page.inner_text("#card")
    shot(page, "6-map")
    page.close()

    page = new_page(browser, app["url"] + "/?prototype=7")
    page.wait_for_function("document.querySelector('#card').innerText.includes('#7')")
    shot(page, "7-deep-link")
    page.close()


def test_bad_input_in_the_browser(browser, app):
    page = new_page(browser, app["url"])
    page.fill("#prompt textarea", "   ")
    page.click("#generate")
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('empty')")
    set_number(page, "proto-id", 4242)
    page.click("#open-card")
    page.wait_for_function("document.querySelector('#card').innerText.includes('no prototype 4242')")
    page.get_by_role("tab", name="Prototypes").click()
    page.fill("#search-box textarea, #search-box input", "'; DROP TABLE labels; --")
    page.click("#search")
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('0 prototype(s) whose')")
    page.fill("#search-box textarea, #search-box input", "")
    page.click("#search")
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('24 prototype')")
    shot(page, "8-bad-input")
    page.close()


def test_semantic_search_order_count_sort_and_map_marks(browser, app):
    studio = app["studio"]
    from precompute.search import label_text

    pid = max(range(studio.n_prototypes), key=lambda p: len(studio.label(p)[0]))
    label, category = studio.label(pid)
    own = label_text(category, label, studio.need_db().card(pid).topic)  # what the search job embedded
    page = new_page(browser, app["url"])
    page.get_by_role("tab", name="Prototypes").click()
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('prototype(s)')")
    page.get_by_label("semantic").first.check()
    page.fill("#search-box textarea, #search-box input", own)
    page.click("#search")
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('similarity >=')")
    status = page.inner_text("#search-status")
    n = int(status.split()[0])
    rows, _ = handlers.search(studio, own, "semantic", "all", "relevance")
    assert n == len(rows) >= 1 and "sorted by relevance" in status
    first = page.locator("#table [data-testid='cell-0-0']").inner_text()
    assert int(first) == pid  # the best match first, not the most active
    assert float(page.locator("#table [data-testid='cell-0-6']").inner_text()) > 0.99  # the similarity is shown
    # the map rings the results
    page.wait_for_function(f"document.querySelector('#prototype-map').innerText.includes('search results ({n})')")
    shot(page, "9-semantic-search")

    # another sort applies at once, without pressing Search
    page.locator("#order input").click()
    page.get_by_role("option", name="prototype id").click()
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('sorted by prototype id')")
    ids = [int(page.locator(f"#table [data-testid='cell-{i}-0']").inner_text()) for i in range(min(n, 5))]
    assert ids == sorted(r[0] for r in rows)[: len(ids)]

    # the open card is starred on the map
    page.locator("#table [data-testid='cell-0-0']").click()
    page.wait_for_function("document.querySelector('#card').innerText.includes('label score')")
    opened = int(page.locator("#proto-id input").first.input_value())
    page.wait_for_function(f"document.querySelector('#prototype-map').innerText.includes('#{opened} (open card)')")
    # the numeric columns are on screen at 1280 px
    page.set_viewport_size({"width": 1280, "height": 900})
    page.wait_for_timeout(500)
    cell = page.locator("#table [data-testid='cell-0-6']").bounding_box()
    table = page.locator("#table").bounding_box()
    assert cell and cell["x"] + cell["width"] <= table["x"] + table["width"] + 1
    shot(page, "10-sorted-and-starred")
    page.close()


@pytest.fixture
def busy_cores():
    """Two processes that keep both cores busy for the length of a test."""
    spin = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    yield
    for proc in procs:
        proc.kill()
        proc.wait()


# the new run is streaming and has written at least n tokens, or the page has already drawn its end (a loaded
# browser can skip the intermediate updates of a fast run)
STREAMING = """(n) => {
    const status = document.querySelector('#gen-status').innerText;
    const m = status.match(/Generating… (\\d+) original/);
    return (m !== null && Number(m[1]) >= n) || (status.length > 0 && !status.includes('Generating'));
}"""
SETTLED = """() => {
    const status = document.querySelector('#gen-status').innerText;
    const n = document.querySelectorAll('#original .textfield .token').length;
    return status.includes('Stopped') || (status.includes('Generated') && n === 128);
}"""
COUNT_AND_STOP = """() => {
    const n = document.querySelectorAll('#original .textfield .token').length;
    document.querySelector('#stop').click();
    return n;
}"""


@pytest.mark.parametrize("width", [1024, 1280])
def test_stop_leaves_at_most_one_more_token_under_load(browser, app, busy_cores, width):
    page = new_page(browser, app["url"], width, 800)
    page.fill("#prompt textarea", PROMPT)
    set_number(page, "max-new", 128)
    stopped = 0
    for press in range(10):
        # another seed each press: a Generate with the settings of a text already written to its end reuses that
        # text at once (no run to stop, and its 'Generating' status too brief to wait for)
        set_number(page, "seed", press + 1)
        page.click("#generate")
        # Generate's click first replaces the last run's status (outside the queue); a refusal (e.g. the page's
        # share of the model spent) would replace it next, and fails here with its message rather than a timeout
        page.wait_for_function("""() => { const s = document.querySelector('#gen-status').innerText;
            return s.includes('Generating') || s.includes('⚠️'); }""")
        assert "⚠️" not in page.inner_text("#gen-status"), (press, page.inner_text("#gen-status"))
        # Stop at a different point of each run, while the new text streams in
        page.wait_for_function(STREAMING, arg=1 + 2 * press)
        shown = page.evaluate(COUNT_AND_STOP)
        # the run ends: stopped by the generation itself or, when the page lagged behind a run that had already
        # written everything, cut by Stop's own answer and the run's last update (RunControl.late_stop). Such a page
        # still draws the updates already on their way, "Generated 128" among them, before the cut lands: wait for
        # the state the page settles in ('Stopped', or the whole text that the page had already shown), then check
        # it; if it never comes, the assertions below say what the page shows
        try:
            page.wait_for_function(SETTLED, timeout=30_000)
        except PlaywrightTimeout:
            pass
        page.wait_for_timeout(300)  # nothing more arrives after the last update
        final = page.locator("#original .textfield .token").count()
        status = page.inner_text("#gen-status")
        assert shown <= final <= shown + 1 or shown == final == 128, (press, shown, final, status)
        assert f"Stopped after {final} original" in status or final == 128, (press, status)
        stopped += f"Stopped after {final} original" in status
    assert stopped >= 5  # most presses landed on a run that was still writing
