"""The agents' tools (app/tools.py) on a real tiny model and database, called the way Gradio calls them: each
answer is checked against the library or the database computed here on its own (a forward pass for the logit, a
SQL query for the card, generations with prism.Interventions for the texts), and bad arguments get a short
message. tests/test_app_mcp.py calls the same tools through a real MCP client."""

from __future__ import annotations

import shutil

import duckdb
import gradio as gr
import pytest
import torch
from test_app_support import build_tiny_attribution_db, changing_prototype, shared_assets

from app import ui
from app.attribution import attribute_token
from app.core import GenerationSettings, Studio
from app.messages import MAX_MESSAGE_CHARS
from app.tools import TOOLS
from prism import Interventions

PROMPT = "the cat sat on the"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return shared_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def studio(assets):
    return Studio.load(*assets)


@pytest.fixture(scope="module")
def tools(studio):
    demo = ui.build_demo(studio)
    found = {f.api_name: f.fn for f in demo.fns.values() if f.api_name in TOOLS}
    assert set(found) == set(TOOLS)
    return found


def test_explain_token_adds_up_to_the_models_own_logit(studio, tools):
    out = tools["explain_token"](PROMPT, 2, max_new_tokens=5, alternatives=3)
    gen = studio.generate(GenerationSettings(PROMPT, 5))
    ids = gen.input_ids()
    with torch.no_grad():
        logits = studio.model(ids).logits[0]  # one plain forward pass over prompt + text
    position = len(gen.prompt_ids) + 2 - 1
    chosen = out["chosen"]
    assert chosen["token_id"] == gen.token_ids[2] and out["position"] == position
    parts = chosen["residual"] + sum(s["contribution"] for s in chosen["slices"]) + \
        chosen["other_slices"]["contribution"]
    assert parts == pytest.approx(chosen["logit"], abs=1e-4)
    assert chosen["logit"] == pytest.approx(float(logits[position, chosen["token_id"]]), abs=1e-3)
    assert chosen["prototypes_total"] == pytest.approx(chosen["logit"] - chosen["residual"], abs=1e-4)
    assert 0 <= chosen["residual_share_of_parts"] <= 1  # the residual's part is reported beside the prototypes'
    assert len(out["alternatives"]) == 3
    for alt in out["alternatives"]:  # every alternative is the model's own logit of that token, split exactly
        assert alt["logit"] == pytest.approx(float(logits[position, alt["token_id"]]), abs=1e-3)
    top = torch.topk(logits[position], 3).indices.tolist()
    assert [a["token_id"] for a in out["alternatives"]] == top
    # the margin over the runner-up, split: the prototypes' part and the residual's, side by side
    carried, runner = out["carried"], out["alternatives"][1]
    assert carried["runner_up_id"] == runner["token_id"]
    assert carried["gap"] == pytest.approx(chosen["logit"] - runner["logit"], abs=1e-4)
    # shares of the gap: the prototypes' and the residual's (bias included) parts of the margin, adding up to 1
    assert carried["prototypes"] * carried["gap"] == pytest.approx(
        chosen["prototypes_total"] - runner["prototypes_total"], abs=1e-4)
    assert carried["residual"] * carried["gap"] == pytest.approx(chosen["residual"] - runner["residual"], abs=1e-4)
    # the contrast: the same margin, split into the residual's part and one part per prototype
    contrast = out["contrast"]
    assert contrast["against_id"] == runner["token_id"]
    assert contrast["margin"] == pytest.approx(chosen["logit"] - runner["logit"], abs=1e-4)
    assert contrast["residual"] + sum(p["contribution"] for p in contrast["parts"]) + \
        contrast["other_parts"]["contribution"] == pytest.approx(contrast["margin"], abs=1e-4)
    assert contrast["residual"] == pytest.approx(chosen["residual"] - runner["residual"], abs=1e-4)
    third = out["alternatives"][2]
    versus = tools["explain_token"](PROMPT, 2, max_new_tokens=5, alternatives=3, versus=third["token"])["contrast"]
    if versus["note"] is None:  # the text is one token: the contrast is against exactly that token
        assert versus["against_id"] == third["token_id"]
        assert versus["margin"] == pytest.approx(chosen["logit"] - third["logit"], abs=1e-4)


def test_generate_and_compare_give_the_librarys_texts(studio, tools):
    settings = GenerationSettings(PROMPT, max_new_tokens=6)
    pid = changing_prototype(studio, settings, "reroute")
    original = studio.generate(settings)
    intervened = studio.generate(settings, Interventions(suppress={pid}, suppress_mode="reroute"))
    out = tools["generate_explained"](PROMPT, 6, suppress=[pid])
    assert [t["token_id"] for t in out["original"]["tokens"]] == original.token_ids
    assert [t["token_id"] for t in out["intervened"]["tokens"]] == intervened.token_ids
    expected = [i for i, (a, b) in enumerate(zip(original.token_ids, intervened.token_ids, strict=True)) if a != b]
    assert out["changed"] == expected and expected
    for token, step in zip(out["original"]["tokens"], original.steps, strict=True):
        assert [p["id"] for p in token["prototypes"]] == step.prototype_ids[:3]
    plain = tools["generate_explained"](PROMPT, 6)
    assert plain["intervened"] is None and plain["original"]["text"] == original.text

    compared = tools["compare_interventions"](PROMPT, suppress=[pid], max_new_tokens=6)
    assert (compared["original"], compared["intervened"]) == (original.text, intervened.text)
    assert compared["first_change"] == expected[0]
    why = compared["why"]
    assert why["index"] == expected[0] and why["new_token"] == intervened.steps[expected[0]].text
    injected = tools["compare_interventions"](PROMPT, max_new_tokens=6, inject={str(pid): 3.0})
    assert injected["intervened"] == studio.generate(settings, Interventions(inject={pid: 3.0})).text
    scaled = tools["generate_explained"](PROMPT, 6, scale={str(pid): 0.0})  # JSON keys arrive as strings
    assert [t["token_id"] for t in scaled["intervened"]["tokens"]] == \
        studio.generate(settings, Interventions(scale={pid: 0.0})).token_ids


def test_search_and_card_read_what_the_database_holds(studio, tools, assets, tmp_path):
    _, db = assets
    shutil.copyfile(db, tmp_path / "copy.duckdb")  # the studio holds the file open with its own settings
    con = duckdb.connect(str(tmp_path / "copy.duckdb"), read_only=True)
    pid, label, category = con.execute("SELECT prototype_id, label, category FROM labels ORDER BY prototype_id "
                                       "LIMIT 1 OFFSET 3").fetchone()
    word = max(label.replace("'", " ").split(), key=len)
    rows = tools["search_prototypes"](word, mode="label", k=50)
    assert rows and all(word.lower() in r["label"].lower() for r in rows)
    assert pid in [r["prototype_id"] for r in rows]
    card = tools["prototype_card"](pid, n_evidence=3)
    assert (card["prototype_id"], card["label"], card["category"]) == (pid, label, category)
    stored = con.execute("SELECT doc_id, activation FROM evidence WHERE prototype_id = ? ORDER BY rank LIMIT 3",
                         [pid]).fetchall()
    assert [(e["doc_id"], pytest.approx(e["activation"])) for e in card["evidence"]] == stored
    assert all(e["token"] in e["context"] for e in card["evidence"] if e["context"])
    weights = studio.model.lm_head.weight @ studio.model.prototypes.weight[pid]  # the signature, computed here
    assert card["raises"][0]["token_id"] == int(torch.argmax(weights))


def test_training_data_is_the_apps_attribution(tmp_path_factory, assets):
    model, db = assets
    studio = Studio.load(model, build_tiny_attribution_db(tmp_path_factory.getbasetemp() / "app_assets", model, db))
    tools = {f.api_name: f.fn for f in ui.build_demo(studio).fns.values() if f.api_name in TOOLS}
    out = tools["training_data"](PROMPT, 1, max_new_tokens=4, top=5)
    expected = attribute_token(studio, studio.generate(GenerationSettings(PROMPT, 4)), 1, top=5)
    assert [r["score"] for r in out["sequences"]] == pytest.approx([r["score"] for r in expected["sequences"]])
    assert [r["doc_id"] for r in out["sequences"]] == [r["doc_id"] for r in expected["sequences"]]
    scores = [r["score"] for r in out["sequences"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 5
    assert all("segments" not in r for r in out["sequences"])


@pytest.mark.parametrize(("tool", "kwargs", "words"), [
    ("explain_token", {"prompt": PROMPT, "index": 99, "max_new_tokens": 3}, "no generated token 99"),
    ("explain_token", {"prompt": PROMPT, "index": 1, "suppress": "7"}, "list of prototype ids"),
    ("generate_explained", {"prompt": PROMPT, "suppress": [10**9]}, "no prototype"),
    ("generate_explained", {"prompt": PROMPT, "scale": {"1": float("nan")}}, "finite"),
    ("generate_explained", {"prompt": "", "max_new_tokens": 3}, "empty"),
    ("compare_interventions", {"prompt": PROMPT}, "at least one prototype"),
    ("compare_interventions", {"prompt": PROMPT, "inject": {"1": 0}}, "above 0"),
    ("generate_explained", {"prompt": PROMPT, "inject": [1]}, "must be an object"),
    ("prototype_card", {"prototype_id": -1}, "no prototype"),
    ("search_prototypes", {"query": "x", "mode": "regex"}, "search mode"),
])
def test_bad_arguments_get_a_short_message(tools, tool, kwargs, words):
    with pytest.raises(gr.Error) as err:
        tools[tool](**kwargs)
    assert words in err.value.message and len(err.value.message) <= MAX_MESSAGE_CHARS, err.value.message
