"""Labeler v2 (precompute/labels/contrast.py) on a made-up evidence database: prototypes that fire on the same token in
different contexts get different labels; siblings are found; sibling_score equals an AUROC computed here from
scratch; databases made before sibling_score still open read-only in the query layer.

The evidence is built by test_labels.build_evidence_db (clearly synthetic words, no corpus text). Its token ids are
1000 + the evidence token's index in its context, so the three ' the' prototypes below, whose evidence token sits at
index 4, share a token id: they are each other's siblings. The other prototypes put theirs elsewhere.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score
from test_labels import build_evidence_db

from precompute import labels as labels_job
from precompute import query
from precompute.embed import embed
from precompute.labels import contrast
from precompute.runs import connect


def _of_the(rng):  # ' the' after ' of' in made-up genealogies
    name = rng.choice([" Zorbel", " Quuxan", " Blorpiah", " Frobal", " Gribbon"])
    return [" were", " the", " sons", " of", " the", name, " clan", " who", " begat"], 4


def _the_lord(rng):  # ' the' before a made-up divine title
    lead = rng.choice([[" and", " spake", " unto"], [" and", " praised"], [" for", " blessed", " is"],
                       [" then", " said"]])
    lead = ([" and"] * 4 + lead)[-4:]
    return lead + [" the", " Zorblord", " of", " hosts", " in", " glory"], 4


def _the_prose(rng):  # ' the' in made-up encyclopedic prose
    noun = rng.choice([" algorithm", " museum", " protocol", " compound", " satellite"])
    return [" In", " 1998", " researchers", " described", " the", noun, " using", " statistical", " methods"], 4


def _number(rng):
    return [" about", f" {rng.randint(10, 99)}", " zorbs", " were", " counted"], 1


def _comma(rng):
    words = [rng.choice([" apples", " pears", " zorbs", " red", " big"]) for _ in range(4)]
    return words[:3] + [","] + words[3:], 3


PROTOTYPES = {0: _of_the, 1: _the_lord, 2: _the_prose, 3: _number, 4: _comma}
THE = (0, 1, 2)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = build_evidence_db(tmp_path_factory.mktemp("contrast") / "db.duckdb", prototypes=PROTOTYPES, dead=(5,),
                             n_evidence=12)
    con = connect(path)
    labels_job.run(con, contrast.ContrastiveLabeler(), batch_size=2)  # v2 (the default is v3)
    rows = {r[0]: r for r in con.execute("SELECT prototype_id, category, label, label_score, labeler, sibling_score "
                                         "FROM labels ORDER BY 1").fetchall()}
    con.close()
    return path, rows


def test_same_token_different_context_gets_different_labels(db):
    _, rows = db
    labels = {pid: rows[pid][2] for pid in THE}
    assert len(set(labels.values())) == 3, labels
    assert all("the" in label.lower() for label in labels.values()), labels
    assert all(rows[pid][4] == contrast.ContrastiveLabeler.name for pid in rows)
    assert not any(contrast.CATCH_ALL.search(r[2]) for r in rows.values())
    assert len({r[2] for r in rows.values()}) == len(rows)  # distinct labels
    # each ' the' label names something of its own context
    assert any(w in labels[0] for w in ("'of'", "Zorbel", "Quuxan", "sons", "clan", "begat")), labels[0]
    assert any(w in labels[1] for w in ("Zorblord", "hosts", "glory")), labels[1]
    assert any(w in labels[2] for w in ("researchers", "described", "statistical", "methods", "1998")), labels[2]


def test_siblings_are_the_prototypes_on_the_same_token(db):
    path, rows = db
    con = connect(path, read_only=True)
    try:
        pairs = contrast.sibling_pairs(con)
        assert {pid: sorted(s for s, _ in sibs) for pid, sibs in pairs.items()} == {0: [1, 2], 1: [0, 2], 2: [0, 1]}
        assert all(overlap == 1.0 for sibs in pairs.values() for _, overlap in sibs)
        card = query.siblings(con, 0)
        assert [s["prototype_id"] for s in card] == [1, 2]
        assert card[0]["label"] == rows[1][2] and card[0]["sibling_score"] == rows[1][5]
        assert all(s["separation"].startswith("this: ") and f"#{s['prototype_id']}" in s["separation"] for s in card)
        assert query.siblings(con, 3) == []
        assert query.prototype_card(con, 0)["sibling_score"] == rows[0][5]
        assert [r["prototype_id"] for r in query.prototype_table(con, order_by="sibling_score")][:3] == \
            sorted(THE, key=lambda p: (-rows[p][5], p))
    finally:
        con.close()
    for pid in (3, 4):  # no sibling: no sibling_score
        assert rows[pid][5] is None and rows[pid][3] is not None


def _brute_force_siblings(con) -> dict[int, set[int]]:
    """Token shares per prototype from the raw evidence rows, overlap = sum of the smaller shares, >= MIN_OVERLAP."""
    shares: dict[int, dict[int, float]] = {}
    rows = con.execute("SELECT prototype_id, token_id FROM evidence").fetchall()
    for pid, tid in rows:
        shares.setdefault(pid, {})
        shares[pid][tid] = shares[pid].get(tid, 0) + 1
    for pid, s in shares.items():
        n = sum(s.values())
        shares[pid] = {t: c / n for t, c in s.items()}
    out = {}
    for p, sp in shares.items():
        out[p] = {q for q, sq in shares.items() if q != p and
                  sum(min(v, sq.get(t, 0.0)) for t, v in sp.items()) >= contrast.MIN_OVERLAP}
    return out


def _held_out_windows(con, pid) -> list[str]:
    """The odd-ranked evidence contexts, rebuilt from the documents' text and the stored offsets."""
    out = []
    for doc, start, pos, starts, ends in con.execute(
            "SELECT doc_id, context_start, token_position, context_char_starts, context_char_ends FROM evidence "
            "WHERE prototype_id = ? AND rank % 2 = 1 ORDER BY rank", [pid]).fetchall():
        text = con.execute("SELECT text FROM documents WHERE doc_id = ?", [doc]).fetchone()[0]
        i = pos - start
        lo, hi = max(0, i - labels_job.WINDOW_BEFORE), min(len(starts), i + labels_job.WINDOW_AFTER + 1)
        first = starts[lo] - 1 if starts[lo] > 0 and text[starts[lo] - 1].isspace() else starts[lo]
        out.append(text[first:ends[hi - 1]].strip())
    return out


def test_sibling_score_equals_a_brute_force_auroc(db):
    path, rows = db
    con = connect(path, read_only=True)
    try:
        siblings = _brute_force_siblings(con)
        for pid in THE:
            assert siblings[pid] == set(THE) - {pid}
            label = embed([rows[pid][2]])[0]  # (D,)
            windows = _held_out_windows(con, pid)
            others = [w for s in sorted(siblings[pid]) for w in _held_out_windows(con, s)]
            vectors = embed(windows + others)  # (P + N, D)
            sims = vectors @ label
            expected = roc_auc_score([1] * len(windows) + [0] * len(others), sims)
            assert rows[pid][5] == pytest.approx(expected, abs=1e-9), (pid, rows[pid])
    finally:
        con.close()


def test_candidates_respect_the_length_limit_and_choice_is_distinct():
    heads = ["determiner 'the'"]
    mods = {"words": "near " + ", ".join(["extraordinarily"] * 3), "source": "in Bible verse (Deuteronomy, Leviticus)",
            "prev": "after 'of'"}
    out = contrast.candidates(heads, mods)
    assert out[0] == heads[0] and all(len(c) <= labels_job.MAX_LABEL_CHARS for c in out)
    options = {1: [(0.9, "a", ""), (0.8, "b", "")], 2: [(0.95, "a", ""), (0.1, "c", "")], 3: [(0.5, "a", "")]}
    assert contrast.distinct_choice(options) == {1: ("b", ""), 2: ("a", ""), 3: ("a", "")}  # 3 has nothing left


def test_a_database_made_before_sibling_score_still_opens(tmp_path):
    """Schema version 1 (no sibling_score, no label_siblings): the query layer reads it read-only, NULL scores and
    siblings computed from the evidence; a writable connection upgrades it."""
    path = build_evidence_db(tmp_path / "old.duckdb", prototypes=PROTOTYPES, dead=(5,), n_evidence=6)
    con = connect(path)
    labels_job.run(con, labels_job.OfflineLabeler())
    con.execute("DROP VIEW prototypes")
    con.execute("DROP TABLE label_siblings")
    con.execute("ALTER TABLE labels DROP COLUMN sibling_score")
    con.execute("""CREATE VIEW prototypes AS SELECT s.prototype_id, l.label, l.category, l.label_score,
        s.activation_count, s.mean_activation, s.max_activation, m.x, m.y, s.hist_edges, s.hist_counts
        FROM prototype_stats s LEFT JOIN labels l USING (prototype_id)
        LEFT JOIN prototype_map m USING (prototype_id)""")
    con.close()
    con = query.open_db(path)
    try:
        assert query.prototype_card(con, 0)["sibling_score"] is None
        table = query.prototype_table(con, order_by="sibling_score")
        assert len(table) == 6 and all(r["sibling_score"] is None for r in table)
        sibs = query.siblings(con, 0)
        assert [s["prototype_id"] for s in sibs] == [1, 2] and all(s["separation"] is None for s in sibs)
        assert sibs[0]["label"]
    finally:
        con.close()
    con = connect(path)  # writable: create_all adds the column and the table back
    assert "sibling_score" in [d[0] for d in con.execute("SELECT * FROM prototypes LIMIT 0").description]
    con.close()


def test_profile_counts_context_facts():
    rng = random.Random(0)
    cards = []
    for rank in range(4):
        tokens, index = _of_the(rng)
        cards.append(labels_job.EvidenceContext(rank=rank, token=tokens[index], activation=1.0,
                                                context_tokens=tokens, context_activations=[0.0] * len(tokens),
                                                token_index=index, doc_id=f"kjv/Zorb/{rank}"))
    p = contrast.profile(cards, {f"kjv/Zorb/{r}": ("kjv", "Zorb 1") for r in range(4)})
    assert p.n == 4 and p.prev["of"] == 4 and p.source["kjv"] == 4 and p.topic[("kjv", "Zorb")] == 4
    assert p.words["sons"] == 4 and "the" not in p.words  # function words are not context words
    assert contrast._source_phrase(p) == "in Bible verse (Zorb)".removeprefix("in ")
    assert np.isclose(p.share("prev", "of"), 1.0)


def test_label_goals_bench_measures_the_database(db, capsys):
    from bench.label_goals import main

    path, rows = db
    (result,) = main(["--db", str(path), "--draw", "2", "--seed", "1", "--rescore"])
    live = len(PROTOTYPES)
    assert result["live_prototypes"] == live and result["distinct_share"] == 1.0 and result["catch_all_share"] == 0
    scores = [r[3] for pid, r in rows.items() if pid in PROTOTYPES]
    assert result["mean_label_score"] == pytest.approx(sum(scores) / live, abs=1e-4)
    assert result["with_sibling_score"] == len(THE)
    assert result["rescored"]["mean_label_score"] == pytest.approx(result["mean_label_score"], abs=1e-4)
    assert result["rescored"]["mean_sibling_score"] == pytest.approx(result["mean_sibling_score"], abs=1e-4)
    assert len(result["drawn"]) == 2 and all(len(d["evidence"]) == 3 and d["evidence"][0]["token"]
                                             for d in result["drawn"])
    assert '"goals_met"' in capsys.readouterr().out


def test_label_ceiling_bench_bounds_the_stored_labels(db, capsys):
    """bench.label_ceiling: the best candidate's held-out scores, recomputed here with sklearn from the rebuilt
    contexts, bound every choice among the candidates, the stored labels included."""
    from bench.label_ceiling import main

    path, rows = db
    result = main(["--db", str(path), "--weights", "0.8,1.0"])
    assert result["prototypes"] == len(PROTOTYPES) and result["candidates"] >= len(PROTOTYPES)
    stored = [rows[pid][3] for pid in PROTOTYPES]
    assert result["stored"]["label_score"] == pytest.approx(sum(stored) / len(stored), abs=1e-4)
    for score in ("label_score", "sibling_score"):
        assert result["ceiling"][score] >= result["stored"][score] - 1e-6
        assert all(result["ceiling"][score] >= pick[score] - 1e-6 for pick in result["by_weight"].values())
    # the sibling ceiling from scratch: every candidate of each ' the' prototype against its siblings' held-out text
    con = connect(path, read_only=True)
    try:
        pool = labels_job.negative_pool(con, labels_job.N_NEGATIVES, 0)
        ctx = contrast.build_context(con, pool, 0)
        best = []
        for pid in THE:
            texts, _, _ = contrast.candidate_set(ctx, ctx.cards[pid])
            windows = _held_out_windows(con, pid)
            others = [w for s in THE if s != pid for w in _held_out_windows(con, s)]
            sims = embed(windows + others) @ embed(texts).T  # (P + N, C)
            truth = [1] * len(windows) + [0] * len(others)
            best.append(max(roc_auc_score(truth, sims[:, c]) for c in range(len(texts))))
    finally:
        con.close()
    assert result["ceiling"]["sibling_score"] == pytest.approx(sum(best) / len(best), abs=1e-4)
    assert '"ceiling"' in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [(["--weights", "0.8,x"], "comma-separated numbers"),
                                           (["--weights", "1.5"], "comma-separated numbers"),
                                           ([], "no such database")])
def test_label_ceiling_bench_rejects_bad_input(tmp_path, capsys, argv, message):
    from bench.label_ceiling import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--db", str(tmp_path / "missing.duckdb"), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
