"""Issue 38 in the browser, at 1024 and 1280 px (Chromium against a running app.py on the tiny model): the texts sit
above the fold at 1280x800 and side by side at 1024, as text (tokens touch, their spaces are theirs); the contrast of
two tokens adds up to their logit gap, which the model's own forward pass gives; an injected prototype changes the
first token's logit by exactly its slice, activation x (W p)[token]; a bar of a chart opens its prototype's card; a
link on screen is cleared when the interventions change; charts follow the dark theme.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_app_support import ROOT, running_app, shared_assets

from app.core import GenerationSettings, Studio
from prism import Interventions

pytestmark = pytest.mark.slow  # servers and browsers: not in the fast tier

ARTIFACTS = ROOT / "test-artifacts"
PROMPT = "the cat sat on the"
TIMEOUT = 60_000
WIDTHS = [1024, 1280]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    ARTIFACTS.mkdir(exist_ok=True)
    with running_app(model, db) as url:
        yield {"url": url, "studio": Studio.load(model, db)}


def open_page(browser, url: str, width: int, height: int = 800, dark: bool = False):
    page = browser.new_page(viewport={"width": width, "height": height}, color_scheme="dark" if dark else "light")
    page.set_default_timeout(TIMEOUT)
    page.goto(url + ("/?__theme=dark" if dark else ""))
    page.wait_for_selector("#proto-id")
    return page


def generate(page, prompt: str = PROMPT, tokens: int | None = None) -> None:
    page.fill("#prompt textarea", prompt)
    if tokens is not None:
        box = page.locator("#max-new input[type=number]").first
        box.fill(str(tokens))
        box.press("Tab")
    page.click("#generate")
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('Generated')")


def explain(page, index: int, run: str = "original") -> str:
    page.locator(f"#{run} .textfield .token").nth(index).click()
    page.wait_for_function(f"document.querySelector('#token-summary').innerText.includes('Token {index}:')")
    page.wait_for_selector("#decomposition .js-plotly-plot")
    return page.inner_text("#token-summary")


def chart(page, elem_id: str) -> list[dict]:
    """The traces a chart on the page draws (plotly keeps them on its graph div)."""
    return page.evaluate(f"""() => document.querySelector('#{elem_id} .js-plotly-plot').data.map(t =>
        ({{x: Array.from(t.x || []), y: Array.from(t.y || []), customdata: Array.from(t.customdata || []),
          type: t.type}}))""")


@torch.no_grad()
def first_logits(studio: Studio) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own logits for the first generated token (no interventions), and the prompt's ids."""
    gen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=1))
    ids = gen.input_ids(0)
    return studio.model(ids).logits[0, -1], ids


@pytest.mark.parametrize("width", WIDTHS)
def test_the_texts_are_text_above_the_fold_and_side_by_side(browser, app, width):
    page = open_page(browser, app["url"], width, 800 if width == 1280 else 768)
    generate(page)  # the page's own default length
    page.wait_for_function("document.querySelectorAll('#original .textfield .token').length >= 8")
    page.screenshot(path=str(ARTIFACTS / f"explain-fold-{width}.png"))
    boxes = page.evaluate("""() => ['#original .textfield', '#intervened', '#prism-legend', '#generate']
        .map(s => { const r = document.querySelector(s).getBoundingClientRect();
                    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right}; })""")
    original, intervened, legend, button = boxes
    assert page.evaluate("window.scrollY") == 0
    if width == 1280:  # the fold: the whole original text and the legend show without scrolling
        assert original["bottom"] <= 800 and legend["bottom"] <= 800, boxes
    assert intervened["top"] < page.viewport_size["height"], boxes
    # side by side, not stacked
    assert abs(intervened["top"] - original["top"]) < 40 and intervened["left"] >= original["right"] - 1, boxes
    assert button["top"] < original["top"]
    # text, not pills: tokens are inline, and two tokens on one line touch (their spaces are their own)
    spans = page.evaluate("""() => Array.from(document.querySelectorAll('#original .textfield .token .text'))
        .map(t => { const r = t.getBoundingClientRect(); return {text: t.textContent, top: r.top, left: r.left,
                                                                   right: r.right, lines: t.getClientRects().length};
        })""")
    # (a token that wraps, its space at one line's end and its word on the next, is two boxes: left out)
    same_line = [(a, b) for a, b in zip(spans, spans[1:])
                 if abs(a["top"] - b["top"]) < 2 and a["text"] and a["lines"] == b["lines"] == 1]
    assert same_line and all(abs(b["left"] - a["right"]) <= 1.0 for a, b in same_line), [
        (a, b) for a, b in same_line if abs(b["left"] - a["right"]) > 1.0]
    want = app["studio"].generate(GenerationSettings(PROMPT, max_new_tokens=len(spans))).text
    assert "".join(s["text"] for s in spans) == want.replace("\n", "⏎")
    page.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_contrast_adds_up_to_the_logit_gap_and_a_bar_opens_its_card(browser, app, width):
    studio = app["studio"]
    logits, _ = first_logits(studio)
    first, second = (int(i) for i in logits.topk(2).indices)
    other = studio.decode(second)
    page = open_page(browser, app["url"], width)
    generate(page, tokens=4)
    explain(page, 0)
    page.fill("#contrast-token textarea", other)
    page.click("#contrast")
    page.wait_for_function("document.querySelector('#contrast-summary').innerText.includes('logit gap')")
    page.wait_for_selector("#contrast-plot .js-plotly-plot")
    page.screenshot(path=str(ARTIFACTS / f"explain-contrast-{width}.png"), full_page=True)
    md = page.inner_text("#contrast-summary")
    gap = float(re.search(r"logit gap ([-+\d.]+)", md).group(1))
    want = float(logits[first] - logits[second])
    assert gap == pytest.approx(want, abs=1e-3), md
    parts = chart(page, "contrast-plot")[0]["x"]
    assert sum(parts) == pytest.approx(want, abs=1e-4 * max(1.0, abs(want)))  # the bars add up to the gap exactly
    # a prototype's bar in the decomposition opens its card (the residual and the sum do not)
    bars = chart(page, "decomposition")[0]
    pid = next(int(c) for c in bars["customdata"] if c is not None and c >= 0)
    page.evaluate("""(pid) => { const gd = document.querySelector('#decomposition .js-plotly-plot');
        const i = Array.from(gd.data[0].customdata).indexOf(pid);
        gd.emit('plotly_click', {points: [{customdata: pid, pointNumber: i}]}); }""", pid)
    page.wait_for_function(f"document.querySelector('#card').innerText.includes('#{pid}')")
    assert page.input_value("#proto-id input") == str(pid)
    page.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_injection_changes_the_logit_by_exactly_the_injected_slice(browser, app, width):
    studio = app["studio"]
    logits, ids = first_logits(studio)
    active = set(studio.model(ids).prototype_ids[0, -1].tolist())
    pid = next(p for p in range(studio.n_prototypes) if p not in active)  # not active where the text starts
    value = 3.0
    page = open_page(browser, app["url"], width)
    for elem_id, number in (("proto-id", pid), ("inject-value", value)):
        box = page.locator(f"#{elem_id} input").first
        box.fill(str(number))
        box.press("Tab")  # the change reaches the server before the click reads it
    page.click("#inject")
    page.wait_for_function("document.querySelector('#iv-status').innerText.trim().length > 0")
    page.wait_for_function("document.querySelector('#iv-status').innerText.includes('added')", timeout=10_000)
    generate(page, tokens=3)
    page.wait_for_function("document.querySelectorAll('#intervened .textfield .token').length == 3")
    summary = explain(page, 0, "intervened")
    logit = float(re.search(r"the model's logit is ([-\d.]+)", summary).group(1))
    # the token the intervened text starts with (a wrong one would not meet the logit below)
    chosen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=1),
                             Interventions(inject={pid: value})).steps[0].token_id
    injected = value * float(studio.model.lm_head.weight[chosen] @ studio.model.prototypes.weight[pid])
    assert logit - float(logits[chosen]) == pytest.approx(injected, abs=2e-3), summary
    bars = chart(page, "decomposition")[0]
    shown = [x for x, c in zip(bars["x"], bars["customdata"]) if c == pid]
    assert shown and shown[0] == pytest.approx(injected, abs=1e-4 * max(1.0, abs(injected)))
    page.close()


def test_a_link_is_cleared_when_the_interventions_change_and_dark_charts(browser, app):
    page = open_page(browser, app["url"], 1280, dark=True)
    generate(page, tokens=4)
    page.click("#copy-link")
    page.wait_for_function("document.querySelector('#link textarea, #link input') && "
                           "(document.querySelector('#link textarea, #link input').value || '').includes('http')")
    page.fill("#proto-id input", "1")
    page.locator("#proto-id input").press("Tab")
    page.click("#suppress")
    page.wait_for_function("document.querySelector('#share-status').innerText.includes('earlier state')")
    assert not page.locator("#link").is_visible()
    explain(page, 0)
    page.screenshot(path=str(ARTIFACTS / "explain-dark.png"), full_page=True)
    colours = page.evaluate("""() => { const svg = document.querySelector('#decomposition .main-svg');
        const title = document.querySelector('#decomposition .gtitle');
        return {paper: getComputedStyle(svg).backgroundColor, title: getComputedStyle(title).fill}; }""")
    assert colours["paper"] in ("rgba(0, 0, 0, 0)", "transparent"), colours
    light = [int(v) for v in re.findall(r"\d+", colours["title"])[:3]]
    assert min(light) >= 180, colours  # light text on the dark page
    page.close()


def test_a_card_shows_three_bands_opens_a_linked_card_and_tries_a_text(browser, app):
    studio = app["studio"]
    from precompute import query

    with_links = [p for p in range(studio.n_prototypes) if studio.db.run(query.siblings, p)]
    pid = with_links[0]
    page = open_page(browser, app["url"], 1024)
    page.fill("#proto-id input", str(pid))
    page.click("#open-card")
    page.wait_for_function(f"document.querySelector('#card').innerText.includes('#{pid} ')")
    page.wait_for_function("document.querySelector('#evidence').innerText.includes('Low')")
    text = page.inner_text("#evidence")
    assert "Top" in text and "Middle" in text
    # a sibling's link opens its card in place (no page load: the text box keeps what was typed)
    page.fill("#prompt textarea", "kept")
    link = page.locator("#card a[href^='#prototype-']").first
    target = int(link.get_attribute("href").split("-")[-1])
    link.click()
    page.wait_for_function(f"document.querySelector('#card').innerText.startsWith('#{target} ')")
    assert page.input_value("#proto-id input") == str(target)
    assert page.input_value("#prompt textarea") == "kept"
    # try it on your text: the shading's values are the prototype's activations, from the model here
    page.click("#try-panel button, #try-panel .label-wrap")
    page.fill("#try-text textarea", PROMPT)
    page.click("#try-run")
    page.wait_for_selector("#try-result .prism-try-token")
    shown = [float(v) for v in page.eval_on_selector_all(
        "#try-result .prism-try-token", "els => els.map(e => e.dataset.activation)")]
    _, want = studio.activations_on(PROMPT, target)
    assert shown == pytest.approx(want, abs=1e-5)
    page.close()
