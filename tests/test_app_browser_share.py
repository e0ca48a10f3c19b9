"""The explanation view in Debian's chromium against a running app.py on the tiny model: the panel never describes a
token of an earlier text, a line break is one chip and indices stay aligned, no special token is shown, a copied
link opened in a fresh browser gives the same two texts and the same explained token, an exported interventions
file imported in a fresh browser gives the same texts, and a damaged link is refused with a message.
Screenshots go to test-artifacts/."""

from __future__ import annotations

import pytest
from test_app_browser import new_page, set_number, shot
from test_app_support import changing_prototype, running_app, shared_assets

from app import handlers
from app.core import GenerationSettings, Studio

pytestmark = pytest.mark.slow  # servers and browsers: not in the fast tier

PROMPT = "the cat sat on the"
TOKENS = 12


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    studio = Studio.load(model, db)
    changing = changing_prototype(studio, GenerationSettings(PROMPT, max_new_tokens=TOKENS), "reroute")
    # a sampled continuation with a line break in its first half (the tiny tokenizer has a '\n' token)
    newline = next((seed, i) for seed in range(200) for i, step in enumerate(studio.generate(
        GenerationSettings(PROMPT, 24, temperature=1.5, seed=seed)).steps[:12]) if "\n" in step.text)
    with running_app(model, db) as url:
        yield {"url": url, "studio": studio, "changing": changing, "newline": newline}


def chips(page, elem_id: str) -> list[str]:
    return page.locator(f"#{elem_id} .textfield .token").all_inner_texts()


def generate(page, n: int, run: str = "original") -> None:
    """Press Generate and wait until this run's text is complete. Generate first clears the panel and sets the
    status to 'Generating…' in one step, so once the panel is cleared a 'Generated' status is this run's (the
    callers have a token explained before they generate again)."""
    page.click("#generate")
    done = "intervened token(s)." if run == "intervened" else "original token(s)."
    page.wait_for_function("(d) => { const s = document.querySelector('#gen-status').innerText; "
                           "return document.querySelector('#token-summary').innerText.includes('new text') && "
                           "s.includes('Generated ') && s.includes(d); }", arg=done)
    page.wait_for_function(f"document.querySelectorAll('#{run} .textfield .token').length == {n}")


def test_the_panel_follows_the_text_newlines_keep_indices_and_no_special_token(browser, app):
    seed, at = app["newline"]
    page = new_page(browser, app["url"])
    page.fill("#prompt textarea", PROMPT)
    set_number(page, "max-new", 24)
    set_number(page, "temperature", 1.5)
    set_number(page, "seed", seed)
    generate(page, 24)
    tokens = chips(page, "original")
    # the token shows the mark, and the page breaks the line after it (Gradio draws the break as its own element)
    assert tokens[at].endswith(handlers.NEWLINE.rstrip("\n")) and not any("<|" in t for t in tokens)
    assert page.locator("#original .textfield .line-break").count() >= 1
    # the chip right after the line break is token at+1, explained as such
    page.locator("#original .textfield .token").nth(at + 1).click()
    page.wait_for_function(f"document.querySelector('#token-summary').innerText.includes('Token {at + 1}:')")
    expected = app["studio"].generate(GenerationSettings(PROMPT, 24, temperature=1.5, seed=seed)).steps[at + 1]
    assert repr(expected.text) in page.inner_text("#token-summary")
    page.wait_for_selector("#decomposition .js-plotly-plot")
    shot(page, "share-1-newline")

    # a new text: the panel and the training-data panel no longer describe the old token
    page.fill("#prompt textarea", "a dog ran to the")
    set_number(page, "temperature", 0)
    generate(page, 24)
    summary = page.inner_text("#token-summary")
    assert f"Token {at + 1}" not in summary and "Click a token of the new text" in summary
    assert page.locator("#decomposition .js-plotly-plot .waterfall").count() == 0
    assert "Find the training data" in page.inner_text("#attribution-panel")
    shot(page, "share-2-cleared")
    page.close()


def test_a_copied_link_restores_the_same_texts_in_a_fresh_browser(browser, app):
    page = new_page(browser, app["url"])
    page.fill("#prompt textarea", PROMPT)
    set_number(page, "max-new", TOKENS)
    set_number(page, "temperature", 0.9)
    set_number(page, "seed", 5)
    set_number(page, "proto-id", app["changing"])
    page.click("#suppress")
    page.wait_for_function("document.querySelector('#iv-status').innerText.includes('added')")
    generate(page, TOKENS, "intervened")
    page.locator("#intervened .textfield .token").nth(3).click()
    page.wait_for_function("document.querySelector('#token-summary').innerText.includes('Token 3:')")
    texts = chips(page, "original"), chips(page, "intervened")
    summary = page.inner_text("#token-summary")
    page.click("#copy-link")
    page.wait_for_function("(() => { const box = document.querySelector('#link input, #link textarea'); "
                           "return box !== null && box.value.includes('state='); })()")
    link = page.locator("#link input, #link textarea").first.input_value()
    assert link.startswith(app["url"].rstrip("/") + "/?state=")
    page.close()

    fresh = browser.new_context(viewport={"width": 1400, "height": 1000})  # nothing shared but the link
    other = fresh.new_page()
    other.set_default_timeout(60_000)
    other.goto(link)
    other.wait_for_selector("#proto-id")  # the page is built (checks below read its elements)
    other.wait_for_function(f"document.querySelectorAll('#intervened .textfield .token').length == {TOKENS}")
    other.wait_for_function("document.querySelector('#token-summary').innerText.includes('Token 3:')")
    assert (chips(other, "original"), chips(other, "intervened")) == texts
    assert other.inner_text("#token-summary").split("\n")[0] == summary.split("\n")[0]
    assert f"#{app['changing']}" in other.inner_text("#interventions")
    assert other.locator("#prompt textarea").input_value() == PROMPT
    shot(other, "share-3-link-restored")

    # a damaged link: a clear message, nothing applied, nothing generated
    other.goto(link[:-3] + "zzz")
    other.wait_for_selector("#gen-status")
    other.wait_for_function("document.querySelector('#gen-status').innerText.includes('cannot be used')")
    assert "changed or cut off" in other.inner_text("#gen-status")
    assert other.locator("#prompt textarea").input_value() != PROMPT and chips(other, "original") == []
    assert f"#{app['changing']}" not in other.inner_text("#interventions")
    fresh.close()


def test_exported_interventions_imported_in_a_fresh_browser_give_the_same_texts(browser, app, tmp_path):
    page = new_page(browser, app["url"])
    page.fill("#prompt textarea", PROMPT)
    set_number(page, "max-new", TOKENS)
    set_number(page, "proto-id", app["changing"])
    page.click("#suppress")
    page.wait_for_function("document.querySelector('#iv-status').innerText.includes('added')")
    page.click("#suppress-mode label:has-text('remove the slice')")
    page.wait_for_function("document.querySelector('#iv-status').innerText.includes('remove the slice')")
    generate(page, TOKENS, "intervened")
    texts = chips(page, "original"), chips(page, "intervened")
    page.click("#export-iv")
    page.wait_for_selector("#export-file a")
    with page.expect_download() as download:
        page.locator("#export-file a").first.click()
    path = tmp_path / "interventions.json"
    download.value.save_as(path)
    page.close()

    fresh = browser.new_context(viewport={"width": 1400, "height": 1000})
    other = fresh.new_page()
    other.set_default_timeout(60_000)
    other.goto(app["url"])
    other.wait_for_selector("#proto-id")
    with other.expect_file_chooser() as chooser:
        other.click("#import-iv")
    chooser.value.set_files(str(path))
    other.wait_for_function("document.querySelector('#iv-status').innerText.includes('imported 1')")
    assert other.locator("#suppress-mode input[value='zero']").is_checked()
    other.fill("#prompt textarea", PROMPT)
    set_number(other, "max-new", TOKENS)
    generate(other, TOKENS, "intervened")
    assert (chips(other, "original"), chips(other, "intervened")) == texts
    shot(other, "share-4-imported")
    fresh.close()


def test_link_export_and_import_endpoints(app):
    """The same over HTTP (gradio_client): one client's exported interventions, imported by another, give the same
    intervened text; /link returns a URL that restores the state; /export_table returns the CSV."""
    import json

    import gradio_client

    client = gradio_client.Client(app["url"], verbose=False)
    client.predict(app["changing"], api_name="/suppress")
    *_, result = client.predict(PROMPT, TOKENS, 0, 1, 0, api_name="/generate")
    *_, token = client.predict("intervened", 2, api_name="/decompose")
    url, status = client.predict(PROMPT, TOKENS, 0, 1, 0, "intervened", token, api_name="/link")
    assert url.startswith(app["url"].rstrip("/") + "/?state=") and "⚠️" not in status
    from app import share

    link = share.decode_link(app["studio"], url.split("state=")[1])
    assert link.selected == ("intervened", 2) and link.session.interventions().suppress == {app["changing"]}
    path, _ = client.predict(api_name="/export_interventions")
    assert json.loads(open(path).read())["items"][0]["prototype_ids"] == [app["changing"]]
    generation, _ = client.predict(api_name="/export_generation")
    exported = json.loads(open(generation).read())["runs"]["intervened"]["tokens"]
    assert [t["chosen"]["token_id"] for t in exported] == [t["token_id"] for t in result["intervened"]["tokens"]]

    other = gradio_client.Client(app["url"], verbose=False)
    _, status, mode = other.predict(gradio_client.handle_file(path), api_name="/import_interventions")
    assert "imported 1" in status and mode == "reroute"
    *_, again = other.predict(PROMPT, TOKENS, 0, 1, 0, api_name="/generate")
    assert again["intervened"]["text"] == result["intervened"]["text"]
    table, _ = other.predict(api_name="/export_table")
    assert open(table).read().startswith("prototype_id,")
