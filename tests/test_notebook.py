"""The notebook display (app/notebook.py) and the example notebook. On a tiny model: the HTML a cell shows holds
the same numbers as the library (slices and residual adding up to the model's logit, the category colours of the
app, the changed tokens), and bad input is refused. The example notebook, docs/notebook.ipynb, runs top to
bottom in a fresh kernel on the shipped default (nbclient, slow)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_app_support import changing_prototype, shared_assets

from app.core import GenerationSettings
from app.notebook import Notebook
from app.plots import RESIDUAL_COLOR, category_color

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "the cat sat on the"


@pytest.fixture(scope="module")
def nb(tmp_path_factory):
    return Notebook.load(*shared_assets(tmp_path_factory))


def test_a_token_shows_its_exact_decomposition(nb):
    gen = nb.generate(PROMPT, max_new_tokens=5)
    tok = nb.explain(gen, 1, alternatives=3)
    page = tok._repr_html_()
    chosen = tok.view.chosen
    ids = gen.original.input_ids()
    with torch.no_grad():
        logit = float(nb.studio.model(ids).logits[0, len(gen.original.prompt_ids), chosen.token_id])
    assert chosen.logit == pytest.approx(logit, abs=1e-3)
    assert f"logit {chosen.logit:.4f}" in page and f"residual {chosen.residual:+.4f}" in page
    bars = [float(v) for v in re.findall(r'padding-right: 8px">([+-][0-9.]+)</td>', page)]
    # residual + slices (+ the rest): the logit, up to the bars' rounding to 3 decimals
    assert sum(bars) == pytest.approx(chosen.logit, abs=5e-4 * len(bars) + 1e-6)
    assert RESIDUAL_COLOR in page
    for s in chosen.slices[:3]:
        assert f"#{s.prototype_id} " in page and category_color(s.category) in page
    assert "carry" in page or tok.view.carried is None  # how much of the choice the prototypes carry
    assert tok.data["chosen"]["sum"] == pytest.approx(chosen.logit, abs=1e-4)


def test_a_generation_and_an_intervention_show_their_tokens_and_changes(nb):
    settings = GenerationSettings(PROMPT, max_new_tokens=6)
    pid = changing_prototype(nb.studio, settings, "reroute")
    plain = nb.generate(PROMPT, max_new_tokens=6)
    assert plain.changed == [] and "intervened" not in plain._repr_html_()
    both = nb.generate(PROMPT, max_new_tokens=6, suppress=[pid])
    a, b = both.original.token_ids, both.intervened.token_ids
    assert both.changed == [i for i in range(len(a)) if a[i] != b[i]] and both.changed
    page = both._repr_html_()
    assert page.count("border-bottom: 3px solid") == len(both.changed)
    assert f"{len(both.changed)} token(s) changed" in page
    step = both.original.steps[0]
    assert category_color(nb.studio.label(step.prototype_ids[0])[1]) in page
    with pytest.raises(ValueError, match="no intervened text"):
        nb.explain(plain, 0, intervened=True)


def test_a_card_shows_label_signature_and_evidence(nb):
    card = nb.card(3, n_evidence=2)
    page = card._repr_html_()
    label, category = nb.studio.label(3)
    assert "#3" in page and category_color(category) in page
    assert card.data["raises"][0]["token_id"] == int(torch.argmax(
        nb.studio.model.lm_head.weight @ nb.studio.model.prototypes.weight[3]))
    assert page.count("prism-evidence-text") == len(card.card.evidence) == 2


@pytest.mark.slow
def test_the_example_notebook_runs_clean_in_a_fresh_kernel():
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(ROOT / "docs" / "notebook.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code")  # kept without outputs
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()  # raises on any cell's error
    code = [c for c in notebook.cells if c.cell_type == "code"]
    shown = [o for c in code for o in c.outputs if "text/html" in o.get("data", {})]
    assert len(shown) == 4  # the generation, the token, the card, the comparison
    printed = "".join(o.get("text", "") for c in code for o in c.outputs if o.get("output_type") == "stream")
    assert re.search(r"logit [0-9.-]+ = residual [+-][0-9.]+ \+ prototypes [+-][0-9.]+", printed)
