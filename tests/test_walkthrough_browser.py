"""The README's two walkthroughs, driven through the real UI on the shipped default in Debian's chromium: the prompt,
temperature and seed (and for the modern one the clicked token and the prototype) are read from README.md itself, so
the README and this test cannot drift apart.

"Switch the King James register off": markers in the original continuation, a marker's slices adding up to its
logit, fewer markers (on our machine none) after the preset with the default re-routing, "why it changed" naming a
prototype that took a suppressed one's slot, and another text once the session switches to removing the slices.

"A modern email, one prototype switched off": the clicked word is the README's, the prototype it names carries the
largest slice, the training-data panel lists sequences on the same click, and suppressing that one prototype from its
card changes the word, with "why it changed" naming it. The shipped database has no training-data cache (the app
builds one on first start, 3,072 sequences, about 15 minutes), so the module serves a copy with a cache of 256 of the
model's own training sequences, built here by the same job. Screenshots go to test-artifacts/. Slow (builds that
cache, loads SmolLM2 once)."""

from __future__ import annotations

import re
import shutil

import duckdb
import pytest
from test_app_support import CHANGED_RGB, ROOT, running_app

from app import handlers
from app.assets import DEFAULT_MODEL, resolve_db
from app.training_data import Recipe
from precompute.__main__ import main as precompute_main
from precompute.attribution import has_attribution
from precompute.presets import PRESETS

pytestmark = pytest.mark.slow  # servers and browsers: not in the fast tier

ARTIFACTS = ROOT / "test-artifacts"
TIMEOUT = 180_000
MARKERS = PRESETS["kjv-register"].marker_pattern()


def open_with_prompt(browser, app: str, prompt: str):
    """A new page on the app with `prompt` typed in."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(TIMEOUT)
    page.goto(app)
    page.wait_for_selector("#prompt textarea")
    page.fill("#prompt textarea", prompt)
    return page


KJV = "### Walkthrough: switch the King James register off"
MODERN = "### Walkthrough: a modern email, one prototype switched off"


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(title)
    end = text.find("\n### ", start + len(title))
    return text[start: end if end > 0 else len(text)]


def walkthrough_settings(title: str = KJV) -> dict:
    """Prompt, temperature and seed of a README walkthrough's step 1."""
    section = readme_section(title)
    step = re.search(r"type `([^`]+)` as the prompt, Temperature ([\d.]+), Seed (\d+)", section)
    assert step, "README walkthrough step 1 must name the prompt, Temperature and Seed"
    return {"prompt": step.group(1), "temperature": float(step.group(2)), "seed": int(step.group(3))}


def set_number(page, elem_id: str, value) -> None:
    box = page.locator(f"#{elem_id} input[type='number']").first
    box.fill(str(value))
    box.press("Tab")


def tokens(page, elem_id: str) -> list[str]:
    return page.locator(f"#{elem_id} .textfield .token").all_inner_texts()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The shipped model and a copy of its database with a small training-data cache over the model's own training
    corpus (the first start's recipe, app/training_data.Recipe, with 256 sequences in place of 3,072)."""
    ARTIFACTS.mkdir(exist_ok=True)
    db = tmp_path_factory.mktemp("walkthrough") / "default-with-cache.duckdb"
    shutil.copyfile(resolve_db(None, model_given=False), db)
    recipe = Recipe(corpus="default-v3", max_sequences=256)
    precompute_main(["build", "--model", str(DEFAULT_MODEL), "--db", str(db), *recipe.argv()])
    with duckdb.connect(str(db), read_only=True) as con:
        assert has_attribution(con)
    with running_app(DEFAULT_MODEL, db, timeout=600) as url:
        yield url


def test_readme_walkthrough_removes_the_register_and_names_the_replacements(browser, app):
    settings = walkthrough_settings()
    page = open_with_prompt(browser, app, settings["prompt"])
    set_number(page, "temperature", settings["temperature"])
    set_number(page, "seed", settings["seed"])
    page.click("#generate")
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('Generated 24 original')")
    original = "".join(tokens(page, "original"))
    assert len(tokens(page, "original")) == 24  # one chip per token, line breaks included (shown as a mark)
    assert "<|" not in original  # no special token as text
    before = MARKERS.findall(original)
    assert before, f"the README promises King James markers in the original continuation: {original!r}"

    # step 2: click a marker token; its slices add up to its logit
    chips = tokens(page, "original")
    marker = next(i for i, t in enumerate(chips) if MARKERS.fullmatch(t.strip()))
    page.locator("#original .textfield .token").nth(marker).click()
    page.wait_for_function(f"document.querySelector('#token-summary').innerText.includes('{chips[marker].strip()}')")
    summary = page.inner_text("#token-summary")
    total, logit = (float(x) for x in re.search(r"= ([-\d.]+); the model's logit is ([-\d.]+)", summary).groups())
    assert abs(total - logit) <= 1e-3 * max(1, abs(logit)), summary
    page.wait_for_function("document.querySelector('#card').innerText.includes('#')")

    # step 3: the preset, with the default way of switching off (re-routing)
    assert page.locator("#suppress-mode input[value='reroute']").is_checked()
    page.locator("#preset input").click()
    page.get_by_role("option", name=PRESETS["kjv-register"].title).click()
    page.click("#preset-apply")
    page.wait_for_function("document.querySelector('#iv-status').innerText.includes('added')")
    assert PRESETS["kjv-register"].title in page.inner_text("#interventions")

    # step 4: generate again, side by side
    page.click("#generate")
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('24 intervened token(s).')")
    intervened = "".join(tokens(page, "intervened"))
    after = MARKERS.findall(intervened)
    assert len(after) < len(before), (original, intervened)
    assert "".join(tokens(page, "original")) == original  # the original is kept for the comparison
    status = page.inner_text("#gen-status")
    assert re.search(r"slots went to #\d+", status), status
    page.screenshot(path=str(ARTIFACTS / "walkthrough-1-side-by-side.png"), full_page=True)

    # click the first changed token: "why it changed" names a replacing prototype
    first_change = page.locator(f"#intervened .textfield .token[style*='{CHANGED_RGB}']").first
    first_change.click()
    page.wait_for_function("document.querySelector('#token-summary').innerText.includes('Why it changed')")
    summary = page.inner_text("#token-summary")
    assert re.search(r"re-routed to #\d+", summary), summary
    page.screenshot(path=str(ARTIFACTS / "walkthrough-2-why-it-changed.png"), full_page=True)

    # step 5: the other reading of suppression, for this session only
    page.get_by_label("remove the slice").check()
    page.wait_for_function("document.querySelector('#iv-status').innerText.includes('remove the slice')")
    page.click("#generate")
    # the explanation belonged to the previous text: the new generation empties it
    page.wait_for_function("document.querySelector('#token-summary').innerText.includes('new text')")
    page.wait_for_function(
        "(t) => document.querySelector('#gen-status').innerText.includes('24 intervened token(s).') && "
        "Array.from(document.querySelectorAll('#intervened .textfield .token')).map(e => e.innerText).join('') != t",
        arg="".join(tokens(page, "intervened")))
    removed = "".join(tokens(page, "intervened"))
    assert removed != intervened and "".join(tokens(page, "original")) == original
    assert not re.search(r"slots went to #\d+", page.inner_text("#gen-status"))  # nothing is re-routed now
    page.screenshot(path=str(ARTIFACTS / "walkthrough-3-slices-removed.png"), full_page=True)
    page.close()


def test_readme_modern_walkthrough_switches_one_prototype_off(browser, app):
    import gradio_client

    settings = walkthrough_settings(MODERN)
    section = readme_section(MODERN)
    word, index = re.search(r"Click \*([^*]+)\* \(token (\d+)\)", section).groups()
    index = int(index)
    prototype = int(re.search(r"The largest slice, [+\d.]+, is #(\d+)", section).group(1))
    assert f"Type {prototype} into" in section
    replaced = re.search(r"Click \*([^*]+)\* and \"Why it changed\" names #" + str(prototype), section).group(1)

    # the README's claim about the slices, from the same app over its API (its own session)
    client = gradio_client.Client(app, verbose=False)
    client.predict(settings["prompt"], 24, settings["temperature"], 1, settings["seed"], api_name="/generate")
    data = client.predict("original", index, api_name="/decompose")[-1]
    assert data["chosen"]["token"].strip() == word
    largest = max(data["chosen"]["slices"], key=lambda s: s["contribution"])
    assert largest["prototype_id"] == prototype, largest

    # step 1-2: generate, click the word; the slices add up to its logit
    page = open_with_prompt(browser, app, settings["prompt"])
    set_number(page, "temperature", settings["temperature"])
    set_number(page, "seed", settings["seed"])
    page.click("#generate")
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('Generated 24 original')")
    chips = tokens(page, "original")
    assert chips[index].strip() == word, chips
    page.locator("#original .textfield .token").nth(index).click()
    page.wait_for_function(f"document.querySelector('#token-summary').innerText.includes('{word}')")
    summary = page.inner_text("#token-summary")
    total, logit = (float(x) for x in re.search(r"= ([-\d.]+); the model's logit is ([-\d.]+)", summary).groups())
    assert abs(total - logit) <= 1e-3 * max(1, abs(logit)), summary

    # step 3: the training data answers on the same click
    page.wait_for_function(f"document.querySelector('#attribution').innerText.includes('Training data behind token "
                           f"{index}')")
    cards = page.locator("#attribution .prism-attribution")
    assert cards.count() >= 1 and "via the trained layers" in cards.first.inner_text()
    assert page.locator("#attribution span[style*='outline']").count() >= 1
    page.screenshot(path=str(ARTIFACTS / "walkthrough-modern-1-token.png"), full_page=True)

    # step 4: open the prototype's card, suppress it
    page.fill("#proto-id input", str(prototype))
    page.click("#open-card")
    page.wait_for_function(f"document.querySelector('#card').innerText.includes('#{prototype}')")
    page.click("#suppress")
    page.wait_for_function("document.querySelector('#iv-status').innerText.includes('added')")
    assert str(prototype) in page.inner_text("#interventions")

    # step 5: generate again: the word changes, and "why it changed" names the prototype
    original = "".join(tokens(page, "original"))
    page.click("#generate")
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('24 intervened token(s).')")
    after = tokens(page, "intervened")
    assert "".join(tokens(page, "original")) == original
    assert after[index].strip() == replaced and after[:index] == chips[:index], after
    page.locator("#intervened .textfield .token").nth(index).click()
    page.wait_for_function("document.querySelector('#token-summary').innerText.includes('Why it changed')")
    assert f"#{prototype}" in page.inner_text("#token-summary")
    page.screenshot(path=str(ARTIFACTS / "walkthrough-modern-2-why-it-changed.png"), full_page=True)
    page.close()


def test_the_text_streams_and_stop_keeps_what_was_written(browser, app):
    """Tokens appear while the model writes (SmolLM2 on CPU writes a few per second), Stop ends the run and keeps
    them, and a token written before Stop can be explained."""
    settings = walkthrough_settings()
    page = open_with_prompt(browser, app, settings["prompt"])
    set_number(page, "max-new", 200)
    page.click("#generate")
    page.wait_for_function("document.querySelectorAll('#original .textfield .token').length >= 3")
    shown = len(tokens(page, "original"))
    status = page.inner_text("#gen-status")
    assert "Generating" in status and "Generated" not in status, status  # the text is there before the end
    page.click("#stop")
    page.wait_for_function("document.querySelector('#gen-status').innerText.includes('Stopped after')")
    kept = int(re.search(r"Stopped after (\d+) original", page.inner_text("#gen-status")).group(1))
    assert shown <= kept < 200
    # the page shows exactly the tokens the session kept (messages already on their way may still land)
    page.wait_for_function(f"document.querySelectorAll('#original .textfield .token').length == {kept}")
    page.wait_for_timeout(1000)
    assert len(tokens(page, "original")) == kept
    page.locator("#original .textfield .token").nth(kept - 1).click()
    page.wait_for_function(f"document.querySelector('#token-summary').innerText.includes('Token {kept - 1}:')")
    page.screenshot(path=str(ARTIFACTS / "walkthrough-4-stopped.png"), full_page=True)
    page.close()


def test_a_link_carries_a_shipped_controller_by_name(browser, app):
    """The shipped controller switched on over the API, shared as a link: a fresh browser gets the controller back
    (listed with the interventions) and the same two texts."""
    import gradio_client

    client = gradio_client.Client(app, verbose=False)
    _, status, view = client.predict("", None, True, "next_sentence", api_name="/controller")
    assert "⚠️" not in status and view["moved"] > 0
    prompt = walkthrough_settings()["prompt"]
    *_, result = client.predict(prompt, 12, 0, 1, 0, api_name="/generate")
    assert result["first_change"] is not None, "the controller should change this greedy continuation"
    url, _ = client.predict(prompt, 12, 0, 1, 0, "original", None, api_name="/link")
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT)
    page.goto(url)
    page.wait_for_function("document.querySelectorAll('#intervened .textfield .token').length == 12")
    # a token's text shows a line break as its mark (Gradio draws the break itself as an element of its own)
    shown = lambda run: "".join(tokens(page, run)).replace(handlers.NEWLINE.rstrip("\n"), "\n")  # noqa: E731
    assert shown("original") == result["original"]["text"] and shown("intervened") == result["intervened"]["text"]
    assert "controller next_sentence (on" in page.inner_text("#interventions")
    assert "controller next_sentence" in page.inner_text("#intervened-title")
    context.close()
