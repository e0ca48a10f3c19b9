"""The Prototypes tab's logic (issue 14's browser part): a semantic search lists exactly the prototypes whose label,
topic, prediction or evidence embedding is at least SEMANTIC_MIN similar to the query (checked against numpy cosines
of the stored vectors), most similar first, and says how many, or the nearest ones when none is; every sort order
sorts; the filter offers every category the legend shows plus 'never active'; the map rings search results, stars the
open card and greys other categories; the card shows a v3 label's two sides."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import pytest
from test_app_support import shared_assets

from app import handlers, ui
from app.core import NEVER_ACTIVE, NO_PROTOTYPE, UNLABELLED, Studio
from precompute.embed import embed


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    model, db = shared_assets(tmp_path_factory)
    return Studio.load(model, db)


def cosines(studio, text: str) -> dict[int, float]:
    """Independent: the query's MiniLM vector against every stored vector (labels, predictions, evidence) in
    numpy, the best of each prototype."""
    rows = studio.db.run(lambda c: c.execute("SELECT prototype_id, vector FROM embeddings ORDER BY 1").fetchall())
    q = np.asarray(embed([text], progress=False)[0], dtype=np.float64)
    best: dict[int, float] = {}
    for pid, v in rows:
        best[pid] = max(best.get(pid, -2.0), float(np.dot(q, v) / (np.linalg.norm(q) * np.linalg.norm(v))))
    return best


def test_semantic_search_lists_the_matches_by_similarity_and_counts_them(studio):
    from precompute.search import label_text

    pid = max(range(studio.n_prototypes), key=lambda p: len(studio.label(p)[0]))
    label, category = studio.label(pid)
    own = label_text(category, label, studio.need_db().card(pid).topic)
    for text in (own, label, "'; DROP TABLE labels; --", "qwertyuiop zxcv"):
        rows, status = handlers.search(studio, text, "semantic", "all", "relevance")
        sims = cosines(studio, text)
        expected = {p: c for p, c in sims.items() if c >= handlers.SEMANTIC_MIN - 1e-6}
        if expected:
            assert {r[0] for r in rows} == set(expected), text
            assert status.startswith(f"{len(rows)} prototype(s) with similarity >= {handlers.SEMANTIC_MIN:.2f}")
        else:  # nothing passes: the nearest ones with their similarity, never an empty table
            nearest = sorted(sims.values(), reverse=True)[:handlers.N_NEAREST]
            assert len(rows) == handlers.N_NEAREST and [r[6] for r in rows] == pytest.approx(nearest, abs=2e-3)
            assert status.startswith(f"no prototype has similarity >= {handlers.SEMANTIC_MIN:.2f}"), status
        similarities = [r[6] for r in rows]
        assert similarities == sorted(similarities, reverse=True)
        for r in rows:
            assert abs(r[6] - sims[r[0]]) < 2e-3
    assert max(cosines(studio, "qwertyuiop zxcv").values()) < handlers.SEMANTIC_MIN  # so the fallback ran above
    rows, _ = handlers.search(studio, own, "semantic", "all", "relevance")
    assert rows[0][0] == pid and rows[0][6] > 0.99  # the label itself is the best match


@pytest.mark.parametrize("text, mode", [("", "label"), ("e", "label"), ("words", "semantic")])
def test_every_sort_order_sorts(studio, text, mode):
    columns = {"prototype id": 0, "label score": 3, "activation count": 5}
    for order, column in columns.items():
        rows, status = handlers.search(studio, text, mode, "all", order)
        assert f"sorted by {order}" in status
        values = [r[column] for r in rows]
        if order == "prototype id":
            assert values == sorted(values)
        else:
            present = [v for v in values if v is not None]
            assert present == sorted(present, reverse=True) and values[: len(present)] == present
    rows, _ = handlers.search(studio, text, mode, "all", "relevance")
    by_id, _ = handlers.search(studio, text, mode, "all", "prototype id")
    assert sorted(r[0] for r in rows) == [r[0] for r in by_id]  # the same set in every order
    _, status = handlers.search(studio, text, mode, "all", "nonsense")
    assert status.startswith("⚠️")


def test_the_filter_has_every_category_the_legend_shows(studio):
    filters = studio.filters()
    assert set(studio.db.categories) <= set(filters) and UNLABELLED in filters and NEVER_ACTIVE in filters
    counts = dict(studio.db.run(lambda c: c.execute(
        "SELECT prototype_id, coalesce(activation_count, 0) FROM prototypes").fetchall()))
    rows, status = handlers.search(studio, "", "label", NEVER_ACTIVE, "prototype id")
    assert [r[0] for r in rows] == sorted(p for p, n in counts.items() if n == 0)
    assert status.startswith(f"{len(rows)} prototype(s) in never active")
    unlabelled = sorted(p for p in range(studio.n_prototypes) if not studio.label(p)[0])
    assert [r[0] for r in handlers.search(studio, "", "label", UNLABELLED, "prototype id")[0]] == unlabelled
    for category in studio.db.categories:
        rows, _ = handlers.search(studio, "", "label", category, "prototype id")
        assert rows and all(r[2] == category for r in rows)
    demo = ui.build_demo(studio)
    legend = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "original").color_map
    assert set(legend) - {handlers.CHANGED, NO_PROTOTYPE} == set(filters) - {NEVER_ACTIVE}


def test_the_map_marks_results_the_open_card_and_the_category(studio):
    label = studio.label(3)[0]
    word = max(label.split(), key=len).strip("'(),")
    rows, _ = handlers.search(studio, word, "label", "all", "relevance")
    assert rows
    table = pd.DataFrame(rows, columns=handlers.TABLE_HEADERS)
    card = {"prototype_id": 5}
    category = studio.label(5)[1]
    fig = handlers.map_plot(studio, word, table, card, category)
    traces = {t.name: t for t in fig.data}
    ringed = next(t for name, t in traces.items() if name.startswith("search results"))
    assert sorted(ringed.customdata) == sorted(r[0] for r in rows)
    assert list(traces["#5 (open card)"].customdata) == [5]
    grey = traces.get("other categories")
    others = [p for p in range(studio.n_prototypes) if studio.label(p)[1] != category]
    assert sorted(grey.customdata if grey is not None else []) == others
    everyone = [p for t in fig.data if not t.name.startswith(("search results", "#5")) for p in t.customdata]
    assert sorted(everyone) == list(range(studio.n_prototypes))  # every prototype drawn once, outliers included
    # without a search nothing is ringed, without a card nothing is starred
    plain = handlers.map_plot(studio, "", table, None, "all")
    assert not any(t.name.startswith(("search results", "other categories")) or "open card" in t.name
                   for t in plain.data)


def test_the_card_explains_both_scores_and_lists_the_siblings(studio):
    from precompute import query

    with_siblings = [p for p in range(studio.n_prototypes) if studio.db.run(query.siblings, p)]
    assert with_siblings, "the tiny database should have prototypes that share tokens"
    pid = with_siblings[0]
    md, *_, data = handlers.prototype(studio, pid)
    siblings = studio.db.run(query.siblings, pid)
    score = studio.db.run(lambda c: c.execute("SELECT sibling_score FROM labels WHERE prototype_id = ?",
                                              [pid]).fetchone()[0])
    assert f"sibling score {score:.3f}" in md and "against its siblings' only" in md
    for s in siblings[:6]:
        # each sibling is a link that opens its card in place (the page's CLICK_JS follows #prototype-N)
        assert f"- [#{s['prototype_id']} " in md and f"](#prototype-{s['prototype_id']}) (overlap " \
            f"{s['overlap']:.2f}" in md
    assert [s["prototype_id"] for s in data["siblings"]] == [s["prototype_id"] for s in siblings]


def test_the_card_shows_where_a_prototype_fires_and_what_it_pushes_apart(studio):
    """Labeler v3's two sides, topic and detection scores, as the labels table holds them."""
    rows = studio.db.run(lambda c: c.execute(
        "SELECT prototype_id, fires_on, pushes, topic, detection_random, detection_sibling FROM labels "
        "WHERE pushes IS NOT NULL ORDER BY 1").fetchall())
    assert rows, "the tiny database is labelled by v3"
    for pid, fires_on, pushes, topic, d_rand, d_sib in rows[:5]:
        md, *_, data = handlers.prototype(studio, pid)
        assert f"- **fires on** {html.escape(fires_on)}\n" in md
        assert f"- **pushes the next token toward** {html.escape(pushes)}\n" in md
        assert data["fires_on"] == fires_on and data["pushes"] == pushes and data["topic"] == topic
        if topic:
            assert f" · {html.escape(topic)}" in md
        assert f"detection {d_rand:.3f} vs random" in md
        assert (f"{d_sib:.3f} vs siblings" if d_sib is not None else "n/a vs siblings") in md


def test_the_card_shows_contexts_from_three_bands_and_both_ends_of_the_signature(studio):
    """Top contexts from the evidence job, then the middle and the low end of the bands job's uniform sample
    (checked against the table itself); the signature's most lowered tokens against W p computed here."""
    import torch

    from app import cards

    counts = dict(studio.db.run(lambda c: c.execute(
        "SELECT prototype_id, count(*) FROM evidence_bands GROUP BY 1").fetchall()))
    pid = max(counts, key=counts.get)
    n = counts[pid]
    assert n > 2 * cards.N_BAND, "the tiny database should sample more positions than a card shows"
    md, signature, _, evidence_html, data = handlers.prototype(studio, pid)
    sample = studio.db.run(lambda c: c.execute(
        "SELECT activation, doc_id, token_position FROM evidence_bands WHERE prototype_id = ? ORDER BY rank",
        [pid]).fetchall())
    low = [(r["doc_id"], r["activation"]) for r in data["bands"]["low"]]
    assert low == [(d, a) for a, d, _ in sample[-cards.N_BAND:]]  # the sample's weakest rows
    middle = [r["activation"] for r in data["bands"]["middle"]]
    median = sorted(a for a, _, _ in sample)[n // 2]
    assert len(middle) == cards.N_BAND and min(middle) <= median <= max(middle)
    assert max(a for _, a in low) <= min(middle) and data["bands"]["sampled"] == n
    top = [r["activation"] for r in data["evidence"]]
    assert min(top) >= max(middle)
    for band in ("<b>Top</b>", "<b>Middle</b>", "<b>Low</b>"):
        assert band in evidence_html
    assert evidence_html.count('class="prism-evidence"') == len(top) + len(middle) + len(low)
    # both ends of W p, from the model's own weights
    values = studio.model.lm_head.weight @ studio.model.prototypes.weight[pid]
    lowest = torch.topk(-values, 10).indices.tolist()
    assert [r["token_id"] for r in data["signature_lowers"]] == lowest
    assert len(signature.data[0].x) == 20 and min(signature.data[0].x) == pytest.approx(float(values.min()))


def test_try_it_on_your_text_gives_the_activation_the_evidence_job_stored(studio):
    """The card's "try it on your text": for a top context at the start of its document, the document's text up to
    the evidence token, typed in, gives the stored activation at its last token."""
    from app.cards import try_text

    rows = studio.db.run(lambda c: c.execute(
        "SELECT e.prototype_id, e.activation, e.char_end, e.token_position, d.text FROM evidence e "
        "JOIN documents d USING (doc_id) WHERE e.seq_token_start = 0 AND e.token_position > 2 "
        "ORDER BY e.activation DESC LIMIT 5").fetchall())
    assert rows
    for pid, activation, char_end, position, text in rows:
        shown, data = try_text(studio, pid, text[:char_end])
        assert len(data["tokens"]) == position + 1
        assert data["activations"][-1] == pytest.approx(activation, abs=1e-4)
        assert f"#{pid} is active on" in shown and 'data-activation="' in shown
    message, data = try_text(studio, rows[0][0], "   ")
    assert data is None and "type a text" in message
    message, data = try_text(studio, studio.n_prototypes + 5, "hello")
    assert data is None and "prototype" in message.lower()
