"""Issue 38 in the browser, at 1024 and 1280 px (Chromium against a running app.py on the tiny model): the texts sit
above the fold at 1280x800 and side by side at 1024, as text (tokens touch, their spaces are theirs); the contrast of
two tokens adds up to their logit gap, which the model's own forward pass gives; an injected prototype changes the
first token's logit by exactly its slice, activation x (W p)[token]; a prompt token clicked is explained, its
slices adding up to the logit the model gave it; a bar of a chart opens its prototype's card; a
link on screen is cleared when the interventions change; charts follow the dark theme.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_app_support import CHANGED_RGB, ROOT, changing_prototype, running_app, shared_assets

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


def intervene(page, button: str, pid: int) -> None:
    """Type a prototype id, press an intervention's button (suppress, scale, ...) and wait until the list shows it."""
    page.fill("#proto-id input", str(pid))
    page.locator("#proto-id input").press("Tab")  # the change reaches the server before the click reads it
    page.click(f"#{button}")
    # the handler's answer: the list shows the id, or the status refuses (then show the refusal, not a timeout)
    page.wait_for_function(f"document.querySelector('#interventions').innerText.includes('#{pid}') || "
                           "document.querySelector('#iv-status').innerText.includes('\u26a0')")
    assert f"#{pid}" in page.inner_text("#interventions"), page.inner_text("#iv-status")


def explain(page, index: int, run: str = "original") -> str:
    page.locator(f"#{run} .textfield .token").nth(index).click()
    page.wait_for_function(f"document.querySelector('#token-summary').innerText.includes('Token {index}:')")
    page.wait_for_selector("#decomposition .js-plotly-plot")
    return page.inner_text("#token-summary")


def chart(page, elem_id: str) -> list[dict]:
    """The traces a chart on the page draws (plotly keeps them on its graph div)."""
    return page.evaluate(f"""() => document.querySelector('#{elem_id} .js-plotly-plot').data.map(t =>
        ({{x: Array.from(t.x || []), y: Array.from(t.y || []), customdata: Array.from(t.customdata || []),
          hovertext: Array.from(t.hovertext || []), type: t.type}}))""")


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
def test_a_prompt_token_click_explains_it_and_its_slices_add_up_to_the_models_logit(browser, app, width):
    studio = app["studio"]
    ids = studio.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = studio.model(torch.tensor([ids])).logits[0]  # the plain model over the prompt alone
    page = open_page(browser, app["url"], width)
    generate(page, tokens=3)
    page.click("#prompt-panel button, #prompt-panel .label-wrap")  # the accordion opens
    page.wait_for_function(f"document.querySelectorAll('#prompt-tokens .textfield .token').length == {len(ids)}")
    texts = page.evaluate("""() => Array.from(document.querySelectorAll('#prompt-tokens .textfield .token .text'))
        .map(t => t.textContent)""")
    assert "".join(texts) == PROMPT  # the prompt as text, token by token, its spaces its own
    index = len(ids) - 1
    page.locator("#prompt-tokens .textfield .token").nth(index).click()
    page.wait_for_function(f"document.querySelector('#token-summary').innerText.includes('Prompt token {index}:')")
    page.wait_for_selector("#decomposition .js-plotly-plot")
    page.screenshot(path=str(ARTIFACTS / f"explain-prompt-{width}.png"), full_page=True)
    want = float(logits[index - 1, ids[index]])
    md = page.inner_text("#token-summary")
    assert float(re.search(r"the model's logit is ([-\d.]+)", md).group(1)) == pytest.approx(want, abs=1e-3), md
    bars = chart(page, "decomposition")[0]["x"]
    assert sum(bars[:-1]) == pytest.approx(bars[-1], abs=1e-4) and bars[-1] == pytest.approx(want, abs=1e-3)
    assert page.locator("#run input[value=prompt]").is_checked()
    # the probability beside the logit is the softmax of the model's own logits there
    p = float(re.search(r"the model's logit is [-\d.]+ \(.*?\), probability (\d[\d.e+-]*\d)", md).group(1))
    assert p == pytest.approx(float(logits[index - 1].softmax(-1)[ids[index]]), rel=0.02, abs=6e-4), md
    # the first prompt token has nothing before it: a message, not an explanation
    page.locator("#prompt-tokens .textfield .token").nth(0).click()
    page.wait_for_function("document.querySelector('#token-summary').innerText.includes('is the first')")
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
    # Gradio's own "processing" overlay sits inside #iv-status while the click waits in the queue (under a loaded
    # CI machine for longer than 10 s): wait for the handler's answer, whichever it is, and show it if it refused
    page.wait_for_function("['added', '\u26a0'].some(s => document.querySelector('#iv-status').innerText.includes(s))")
    assert "added" in page.inner_text("#iv-status"), page.inner_text("#iv-status")
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
    # every bar's label whole on hover, however long (the axis may shorten it)
    labelled = [(c, h) for c, h in zip(bars["customdata"], bars["hovertext"]) if isinstance(c, int) and c >= 0]
    assert labelled and all(f"#{c} {studio.label(c)[0]}" in h.replace("<br>", "\n") for c, h in labelled), labelled
    page.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_a_link_is_cleared_when_the_interventions_change_and_dark_charts(browser, app, width):
    page = open_page(browser, app["url"], width, dark=True)
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
    page.screenshot(path=str(ARTIFACTS / f"explain-dark-{width}.png"), full_page=True)
    colours = page.evaluate("""() => { const svg = document.querySelector('#decomposition .main-svg');
        const title = document.querySelector('#decomposition .gtitle');
        return {paper: getComputedStyle(svg).backgroundColor, title: getComputedStyle(title).fill}; }""")
    assert colours["paper"] in ("rgba(0, 0, 0, 0)", "transparent"), colours
    light = [int(v) for v in re.findall(r"\d+", colours["title"])[:3]]
    assert min(light) >= 180, colours  # light text on the dark page
    page.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_a_card_shows_three_bands_opens_a_linked_card_and_tries_a_text(browser, app, width):
    studio = app["studio"]
    from precompute import query

    with_links = [p for p in range(studio.n_prototypes) if studio.db.run(query.siblings, p)]
    pid = with_links[0]
    page = open_page(browser, app["url"], width)
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


@pytest.mark.parametrize("width", WIDTHS)
def test_who_pushes_a_token_and_the_glossary(browser, app, width):
    """'pushes token' search: the table lists first the prototype whose signature raises the token most, by the
    model's own weights, (W p_i)[token] for every prototype; the glossary opens on one screen."""
    studio = app["studio"]
    token = studio.tokenizer(" cat", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        values = studio.model.prototypes.weight @ studio.model.lm_head.weight[token]  # (K,)
    page = open_page(browser, app["url"], width)
    page.get_by_role("tab", name="Prototypes").click()
    page.get_by_label("pushes token").check()
    page.fill("#search-box textarea", " cat")
    page.click("#search")
    page.wait_for_function("document.querySelector('#search-status').innerText.includes('raises')")
    first = page.locator("#table [data-testid='cell-0-0']").inner_text()
    assert int(first) == int(values.argmax()), page.inner_text("#search-status")
    shown = float(page.locator("#table [data-testid='cell-0-6']").inner_text())
    assert shown == pytest.approx(float(values.max()), abs=1e-2)  # the slice at activation 1, as listed
    page.get_by_text("What the words mean").click()
    page.wait_for_selector("#glossary table:has-text('residual')")
    glossary = page.locator("#glossary table").first.bounding_box()
    assert glossary is not None and glossary["height"] <= 800  # one screen
    page.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_why_it_changed_is_a_table_and_scaling_an_idle_prototype_says_to_inject(browser, app, width):
    """Suppressing a prototype the text uses changes a token: its 'why it changed' is a table (prototype, role,
    effect) whose last row is the sum of the rows above it. Scaling a prototype the text never selects says so and
    points to Inject."""
    studio = app["studio"]
    settings = GenerationSettings(PROMPT, max_new_tokens=6)
    pid = changing_prototype(studio, settings, "reroute")  # the app's default way of suppressing
    ids = studio.generate(settings).input_ids(0)
    idle = next(p for p in range(studio.n_prototypes) if p not in set(studio.model(ids).prototype_ids[0].flatten()
                                                                            .tolist()))
    page = open_page(browser, app["url"], width)
    intervene(page, "suppress", pid)
    generate(page, tokens=6)
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('changed')")
    page.locator(f"#intervened .textfield .token[style*='{CHANGED_RGB}']").first.click()
    page.wait_for_selector("#token-summary table")
    header = page.locator("#token-summary table th").all_inner_texts()
    assert [h.strip().split(" ")[0] for h in header[:2]] == ["prototype", "role"], header
    cells = [r for r in page.eval_on_selector_all(
        "#token-summary table tbody tr", "rows => rows.map(r => Array.from(r.cells).map(c => c.innerText))")]
    effects = [float(r[-1].replace("\u2212", "-")) for r in cells]
    assert effects[-1] == pytest.approx(sum(effects[:-1]), abs=2e-3 * len(effects)), cells  # the last row: all
    # scaling a prototype no token selects (the suppression cleared first: re-routing brings others in) says it
    # changed nothing there and offers injection
    page.get_by_role("button", name="Clear all").click()
    page.wait_for_function(f"!document.querySelector('#interventions').innerText.includes('#{pid}')")
    intervene(page, "scale", idle)
    generate(page, tokens=6)
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('inject it')")
    assert f"#{idle}" in page.inner_text("#gen-status")
    page.close()
