"""The "training data behind this token" panel: the Studio call against the cache read directly, the hints when
there is no cache or no database, the `attribute` HTTP endpoint, and Playwright driving Debian's chromium: generate,
click a token, see the top training sequences with scores and highlighted spans. Screenshots go to test-artifacts/.
Needs `apt-get install -y chromium`; without it the browser test FAILS.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_app_support import ROOT, build_tiny_attribution_db, running_app, shared_assets

from app.attribution import _start_states, attribute_token, attribution_panel, index_for
from app.core import AppError, GenerationSettings, Studio
from app.session import Session
from precompute import attribution as cache
from prism.attribution import query_gradient

pytestmark = pytest.mark.slow  # servers and browsers: not in the fast tier

ARTIFACTS = ROOT / "test-artifacts"
PROMPT = "the cat sat on the"
TOKENS = 8
TIMEOUT = 60_000


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    attribution_db = build_tiny_attribution_db(tmp_path_factory.getbasetemp() / "app_assets", model, db)
    return {"model": model, "db": db, "attribution_db": attribution_db}


@pytest.fixture(scope="module")
def studio(assets):
    return Studio.load(assets["model"], assets["attribution_db"])


def test_studio_attributes_a_generated_token_from_the_cache(studio):
    gen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=TOKENS))
    data = attribute_token(studio, gen, 2, top=5, reading="sequence")
    assert data["index"] == 2 and data["token_id"] == gen.steps[2].token_id
    rows = data["sequences"]
    assert len(rows) == 5 and [r["rank"] for r in rows] == list(range(5))
    assert [r["score"] for r in rows] == sorted((r["score"] for r in rows), reverse=True)
    # the same numbers as the cache read directly, for the same query: the first stage, then the exact second
    # stage from the store the build wrote beside the database
    store = studio.db.run(cache.load_exact_store, studio.db.path)
    assert store is not None
    index = studio.db.run(cache.load_index, studio.model.lm_head.weight, rerank=cache.RERANK, exact=store)
    assert index_for(studio, studio.db).exact is not None and index_for(studio, studio.db).rerank == cache.RERANK
    position = len(gen.prompt_ids) + 1
    ids, g = query_gradient(studio.model, gen.input_ids(2), position, gen.steps[2].token_id)
    scores, _ = index.scores(ids, g)
    np.testing.assert_allclose([r["score"] for r in rows], np.sort(scores)[::-1][:5], rtol=1e-4, atol=1e-6)
    for r in rows:
        assert r["doc_id"].startswith("doc-") and r["error"] is None and r["char_end"] > r["char_start"]
        assert sum(s["target"] for s in r["segments"]) <= 1 and "".join(s["text"] for s in r["segments"])
        assert sum(p["contribution"] for p in r["prototypes"]) == pytest.approx(r["score"], rel=1e-4, abs=1e-6)
    html, payload = attribution_panel(studio, "original", 2, Session(original=gen), "sequence")
    assert "Training data behind token 2" in html and html.count("prism-attribution\"") == 10
    assert payload["sequences"][0]["doc_id"] == rows[0]["doc_id"] and "segments" not in payload["sequences"][0]
    assert "whole loss gradient" in html
    # the prototype reading of the same token: only the positions where a sequence predicted it, block-diagonally
    token = gen.steps[2].token_id
    data = attribute_token(studio, gen, 2, top=5, reading="token")
    assert data["reading"] == "token" and data["note"] is None
    total, _ = index.token_scores(ids, g, token)
    expected = np.sort(total[total > 0])[::-1][:5]
    assert len(expected) > 0
    np.testing.assert_allclose([r["score"] for r in data["sequences"]], expected, rtol=1e-4, atol=1e-6)
    for r in data["sequences"]:
        assert sum(p["contribution"] for p in r["prototypes"]) == pytest.approx(r["score"], rel=1e-4, abs=1e-6)
        marked = [i for i, seg in enumerate(r["segments"]) if seg["target"]]
        assert len(marked) == 1  # the strongest highlighted position is followed by the queried token itself
        assert r["segments"][marked[0] + 1]["text"] == studio.tokenizer.decode([token])
    html, _ = attribution_panel(studio, "original", 2, Session(original=gen), "token")
    assert f"predicted {repr(data['token'])}" in html.replace("&#x27;", "'") and "91%" in html
    # the default: the same positions read in the trained layers' gradients (the build's gradient store), the
    # same numbers as the store read directly
    stored = studio.db.run(cache.load_gradient_store, studio.model, studio.db.path)
    assert stored is not None
    data = attribute_token(studio, gen, 2, top=5)
    assert data["reading"] == "gradient" and data["note"] is None
    scores, seq, _, _ = stored.query(gen.input_ids(2), position, token)
    expected = np.sort(scores[scores > 0].numpy())[::-1][:5]
    assert len(expected) > 0 and set(seq.tolist()) >= {r["sequence_id"] for r in data["sequences"]}
    np.testing.assert_allclose([r["score"] for r in data["sequences"]], expected, rtol=1e-5, atol=1e-7)
    for r in data["sequences"]:
        assert r["prototypes"] == [] and r["error"] is None
        marked = [i for i, seg in enumerate(r["segments"]) if seg["target"]]
        assert len(marked) == 1 and r["segments"][marked[0] + 1]["text"] == studio.tokenizer.decode([token])
    # the click ran no frozen layer: generation kept the states entering the trained layers, those of a full pass
    assert studio.start_layer == stored.cache.start_layer and gen not in _start_states
    torch.testing.assert_close(gen.layer_states(), studio.model.states_before_layer(
        gen.input_ids(len(gen.steps) - 1), stored.cache.start_layer), rtol=1e-5, atol=1e-5)
    # a generation that kept none (a text past limits.keep_states_tokens): computed on the click, once per text
    bare = replace(gen, steps=tuple(replace(s, layer_states=None) for s in gen.steps))
    assert bare.layer_states() is None
    for which, at in ((4, position + 2), (2, position)):
        again = attribute_token(studio, bare, which, top=5)
        scores, *_ = stored.query(gen.input_ids(which), at, gen.steps[which].token_id)
        np.testing.assert_allclose([r["score"] for r in again["sequences"]],
                                   np.sort(scores[scores > 0].numpy())[::-1][:5], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(_start_states[bare], studio.model.states_before_layer(bare.input_ids(),
                                                                                     stored.cache.start_layer))
    html, _ = attribution_panel(studio, "original", 2, Session(original=gen))
    assert "trained layers' gradients" in html and "every one of them" in html and "via the trained layers" in html
    html, payload = attribution_panel(studio, "original", 2, Session(original=gen), "everything")
    assert payload is None and "reading must be" in html
    # a prompt token: the query gradient of the logit the model gave it, from the prompt before it alone
    n = len(gen.prompt_ids)
    data = attribute_token(studio, gen, n - 1, top=5, in_prompt=True, reading="sequence")
    assert data["in_prompt"] and data["position"] == n - 2 and data["token_id"] == gen.prompt_ids[-1]
    ids, g = query_gradient(studio.model, torch.tensor([list(gen.prompt_ids)]), n - 2, gen.prompt_ids[-1])
    scores, _ = index.scores(ids, g)
    np.testing.assert_allclose([r["score"] for r in data["sequences"]], np.sort(scores)[::-1][:5], rtol=1e-4,
                               atol=1e-6)
    html, _ = attribution_panel(studio, "prompt", n - 1, Session(original=gen))
    assert f"Training data behind prompt token {n - 1}" in html
    data = attribute_token(studio, gen, n - 1, top=5, in_prompt=True)  # the gradient reading of a prompt token
    scores, *_ = stored.query(torch.tensor([list(gen.prompt_ids)]), n - 2, gen.prompt_ids[-1])
    np.testing.assert_allclose([r["score"] for r in data["sequences"]],
                               np.sort(scores[scores > 0].numpy())[::-1][:5], rtol=1e-5, atol=1e-7)


def test_a_cache_without_a_gradient_store_answers_the_default_with_prototypes_and_says_so(assets, studio,
                                                                                          tmp_path):
    db = tmp_path / "no-gradients.duckdb"
    shutil.copyfile(assets["attribution_db"], db)
    shutil.copytree(cache.exact_folder(assets["attribution_db"]), cache.exact_folder(db))
    older = Studio.load(assets["model"], db)
    gen = older.generate(GenerationSettings(PROMPT, max_new_tokens=TOKENS))
    data = attribute_token(older, gen, 2, top=5)
    assert data["reading"] == "token" and "no gradient store" in data["note"]
    expected = attribute_token(studio, gen, 2, top=5, reading="token")
    assert [r["sequence_id"] for r in data["sequences"]] == [r["sequence_id"] for r in expected["sequences"]]
    html, _ = attribution_panel(older, "original", 2, Session(original=gen))
    assert "This attribution cache has no gradient store" in html and "91%" in html


def test_the_panel_says_how_to_build_what_is_missing(assets, studio):
    gen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=3))
    plain = Studio.load(assets["model"], assets["db"])  # evidence and labels, no attribution cache
    html, data = attribution_panel(plain, "original", 1, Session(original=gen))
    assert data is None and "python -m precompute.attribution --model" in html
    with pytest.raises(AppError, match="python -m precompute.attribution --model"):
        attribute_token(plain, gen, 1)
    bare = Studio(studio.model, studio.tokenizer)  # no database at all
    html, _ = attribution_panel(bare, "original", 1, Session(original=gen))
    assert "python -m precompute build" in html
    for run, index in (("original", 99), ("elsewhere", 0), ("intervened", 0), ("prompt", 0), ("prompt", 99)):
        html, data = attribution_panel(studio, run, index, Session(original=gen))
        assert data is None and "⚠️" in html


@pytest.fixture(scope="module")
def app(assets):
    ARTIFACTS.mkdir(exist_ok=True)
    with running_app(assets["model"], assets["attribution_db"]) as url:
        yield url


def test_attribute_endpoint(app, studio):
    gradio_client = pytest.importorskip("gradio_client")
    client = gradio_client.Client(app, verbose=False)
    client.predict(PROMPT, TOKENS, 0, 1, 0, api_name="/generate")
    html, data = client.predict("original", 2, api_name="/attribute")
    gen = studio.generate(GenerationSettings(PROMPT, max_new_tokens=TOKENS))
    expected = attribute_token(studio, gen, 2)
    assert [r["sequence_id"] for r in data["sequences"]] == [r["sequence_id"] for r in expected["sequences"]]
    assert "Training data behind token 2" in html and data["reading"] == "gradient"
    html, data = client.predict("original", 2, "sequence", api_name="/attribute")
    expected = attribute_token(studio, gen, 2, reading="sequence")
    assert [r["sequence_id"] for r in data["sequences"]] == [r["sequence_id"] for r in expected["sequences"]]
    assert data["reading"] == "sequence" and "whole loss gradient" in html


def test_click_a_token_and_see_its_training_data(app, browser):
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.set_default_timeout(TIMEOUT)
    page.goto(app)
    page.wait_for_selector("#prompt")
    page.fill("#prompt textarea", PROMPT)
    page.locator("input[aria-label='number input for Max new tokens']").fill(str(TOKENS))
    page.locator("input[aria-label='number input for Max new tokens']").press("Tab")
    page.click("#generate")
    page.wait_for_function(f"document.querySelectorAll('#original .textfield .token').length == {TOKENS}")
    page.locator("#original .textfield .token").nth(2).click()
    page.wait_for_function("document.querySelector('#attribution').innerText.includes('Training data behind "
                           "token 2')")
    cards = page.locator("#attribution .prism-attribution")
    assert 1 <= cards.count() <= 10  # by default only sequences that predicted this token count
    assert "score" in cards.first.inner_text() and "doc-" in cards.first.inner_text()
    assert "via the trained layers" in cards.first.inner_text()  # the default: the layers' gradients
    assert page.locator("#attribution span[style*='outline']").count() >= 1  # the strongest token is marked
    page.locator("#attribution").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "app-attribution-token.png"), full_page=True)
    page.get_by_label("their whole loss").check()  # the other reading: the same token, the sequences' whole loss
    page.wait_for_function("document.querySelector('#attribution').innerText.includes('whole loss gradient')")
    assert cards.count() == 10
    page.locator("#attribution").scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "app-attribution.png"), full_page=True)
    page.close()


@pytest.mark.parametrize("in_memory", [False, True])
def test_memory_bench_opens_the_cache_as_the_app_does(assets, studio, tmp_path, monkeypatch, capsys, in_memory):
    """bench.attribution_memory on the tiny cache: the index it reports is the database's, memory-mapped under the
    cache folder (or not, with --in-memory), and the memory figures are the kernel's split of this process."""
    from bench.attribution_memory import main as memory_main
    from bench.attribution_memory import rss_mb

    monkeypatch.setenv("PRISM_CACHE", str(tmp_path / "cache"))
    # counted through the app's own connection (DuckDB refuses a second one with another configuration)
    n = studio.db.run(lambda con: con.execute("SELECT count(*) FROM attribution_sequences").fetchone()[0])
    result = memory_main(["--model", str(assets["model"]), "--db", str(assets["attribution_db"]), "--clicks", "3",
                          "--tokens", "4"] + (["--in-memory"] if in_memory else []))
    assert result["n_sequences"] == n > 0 and result["memory_mapped"] is not in_memory
    assert result["extra_anon_mb"] == round(result["after_mb"]["anon"] - result["before_mb"]["anon"], 1)
    assert bool(list((tmp_path / "cache").glob("attribution-index/*"))) is not in_memory
    now = rss_mb()
    assert now["rss"] == pytest.approx(now["anon"] + now["file"] + now["shmem"], abs=1)
    assert '"extra_anon_mb"' in capsys.readouterr().out
