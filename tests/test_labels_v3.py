"""Labels v3 (issue 37): two-sided labels with a topic, detection scores, the marked scorer's claims, the schema
upgrade, the presets' label rule, search over predictions with a nearest-match fallback, category colours.

The evidence database is test_contrast's made-up one (three ' the' prototypes in different contexts, a number and a
comma prototype, one dead prototype; no corpus text).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from sklearn.metrics import balanced_accuracy_score
from test_contrast import PROTOTYPES
from test_labels import build_evidence_db

from precompute import labels as labels_job
from precompute import query, schema
from precompute import search as search_job
from precompute.labels import detection, twosided
from precompute.labels.cards import load_cards
from precompute.presets import PRESETS, label_names_marker
from precompute.runs import connect


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = build_evidence_db(tmp_path_factory.mktemp("v3") / "db.duckdb", prototypes=PROTOTYPES, dead=(5,),
                             n_evidence=12)
    con = connect(path)
    labels_job.run(con, batch_size=2)  # the default labeler: v3
    columns = ", ".join(labels_job.LABEL_COLUMNS)
    rows = {r[0]: dict(zip(labels_job.LABEL_COLUMNS, r)) for r in
            con.execute(f"SELECT {columns} FROM labels ORDER BY 1").fetchall()}
    con.close()
    return path, rows


def test_labels_say_where_they_fire_and_what_they_push(db):
    path, rows = db
    con = connect(path, read_only=True)
    try:
        cards = {c.prototype_id: c for c in load_cards(con, list(PROTOTYPES))}
    finally:
        con.close()
    for pid in PROTOTYPES:
        row = rows[pid]
        assert row["labeler"] == twosided.TwoSidedLabeler.name
        assert row["label"] == f"{row['fires_on']}{twosided.ARROW}{row['pushes']}"
        # the pushed tokens follow the prototype's visible evidence and its signature raises them
        visible = cards[pid].evidence[0::2]
        following = {e.context_tokens[e.token_index + 1].strip() for e in visible
                     if e.token_index + 1 < len(e.context_tokens)}
        raised = {t.strip() for t, v in cards[pid].logit_tokens if v > 0}
        _, named = twosided.pushes_part(twosided.contrast.replace_evidence(cards[pid], visible))
        assert named and set(named) <= following & raised, (pid, named)
        assert all(f"'{t}'" in row["pushes"] or t in row["pushes"] for t in named)
        assert "predicting" not in row["fires_on"]  # v2's modifier moved to the pushes side
    assert len({r["label"] for r in rows.values()}) == len(rows)  # distinct
    assert rows[5]["label"] == "inactive prototype" and rows[5]["pushes"] is None


def test_detection_scores_are_held_out_balanced_accuracies(db):
    _, rows = db
    for pid in PROTOTYPES:
        r, s = rows[pid]["detection_random"], rows[pid]["detection_sibling"]
        assert 0.0 <= r <= 1.0
        assert r > 0.5, rows[pid]  # the labels tell these made-up prototypes from the others
        assert (s is None) == (pid not in (0, 1, 2))  # only the ' the' prototypes have siblings
    assert rows[5]["detection_random"] is None


def test_fit_threshold_maximises_balanced_accuracy_by_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        pos, neg = rng.normal(1, 1, rng.integers(1, 12)), rng.normal(0, 1, rng.integers(1, 30))
        t = detection.fit_threshold(pos, neg)
        best = detection.balanced_accuracy(pos, neg, t)
        grid = np.linspace(-5, 6, 2001)
        assert best >= max(detection.balanced_accuracy(pos, neg, g) for g in grid) - 1e-12
        y = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
        pred = np.r_[pos, neg] >= t
        assert abs(best - balanced_accuracy_score(y, pred)) < 1e-12
    with pytest.raises(ValueError):
        detection.fit_threshold(np.zeros(0), np.ones(3))


@pytest.fixture(scope="module")
def job_context(db):
    """(negative pool, contrast context) as the labels job built them."""
    from precompute.labels import contrast
    from precompute.labels.scoring import negative_pool

    con = connect(db[0], read_only=True)
    try:
        pool = negative_pool(con, labels_job.N_NEGATIVES, 0)
        return pool, contrast.build_context(con, pool, 0)
    finally:
        con.close()


def test_stored_detection_equals_a_recomputation_from_the_claims(db, job_context):
    """detection_random of prototypes 1 and 3 recomputed here: claims parsed, features per context, cos from embed."""
    from precompute.embed import embed

    _, rows = db
    pool, ctx = job_context
    for pid in (1, 3):
        label = rows[pid]["label"]
        v = embed([label], progress=False)[0]
        claims = detection.parse_claims(label)
        by_row = {ctx.index[(p, e.rank)]: e for p, c in ctx.cards.items() for e in c.evidence}

        def score(rows_, claims=claims, v=v, by_row=by_row):
            out = []
            for r in rows_:
                token, context = detection.claim_features(claims, detection.context_facts(by_row[int(r)]))
                out.append(float(ctx.vectors[int(r)] @ v) + detection.TOKEN_WEIGHT * token
                           + detection.CONTEXT_WEIGHT * context)
            return np.array(out)

        fit_pos, test_pos = score(ctx.rows(pid, False)), score(ctx.rows(pid, True))
        fit_neg = score(ctx.select_rows[ctx.select_ids != pid])
        test_neg = score([ctx.index[(int(p), int(k))] for p, k in zip(pool.prototype_ids, pool.ranks) if p != pid])
        t = detection.fit_threshold(fit_pos, fit_neg)
        expected = ((test_pos >= t).mean() + (test_neg < t).mean()) / 2
        assert abs(rows[pid]["detection_random"] - expected) < 1e-9


def test_parse_claims_reads_what_a_label_names():
    c = detection.parse_claims("'unto' after 'said' with Moses, LORD, Egypt → names (Aaron, Miriam)")
    assert c.tokens == {"unto"} and c.after == {"said"} and c.words == ["moses", "lord", "egypt"]
    assert c.before == {"aaron", "miriam"} and c.before_kinds == {"proper noun"}
    c = detection.parse_claims("prepositions (of, from) in news reports at line start → 'the'")
    assert c.kinds == {"preposition"} and c.tokens == {"of", "from"} and c.positions == {"line start"}
    c = detection.parse_claims("suffix -eth (saith) before punctuation")
    assert c.suffixes == {"eth"} and c.positions == {"before punctuation"} and not c.before
    c = detection.parse_claims("','/'are' predicting 'the' near rate, Alabama")  # a v2 label
    assert c.tokens == {",", "are"} and c.before == {"the"} and c.words == ["rate", "alabama"]


def test_claim_features_check_the_marked_token_and_its_neighbours():
    from precompute.labels.cards import EvidenceContext

    def ctx(pieces, i):
        return detection.context_facts(EvidenceContext(0, pieces[i], 1.0, pieces, [0.0] * len(pieces), i))

    claims = detection.parse_claims("'unto' after 'said' with Moses → 'him'")
    assert detection.claim_features(claims, ctx([" And", " Moses", " said", " unto", " him"], 3)) == (1.0, 1.0)
    token, context = detection.claim_features(claims, ctx([" And", " he", " said", " unto", " them"], 3))
    assert token == 1.0 and abs(context - 1 / 3) < 1e-12  # after 'said' only: 1 of 3 claims
    assert detection.claim_features(claims, ctx([" the", " river", " flows"], 1)) == (0.0, 0.0)
    kinds = detection.parse_claims("prepositions (of, in)")
    assert detection.claim_features(kinds, ctx([" walked", " into", " town"], 1))[0] == 0.5  # same kind


def test_topic_is_named_only_above_the_floor_and_decides_no_rule_category(db):
    _, rows = db
    topics = {t for t, _, _ in twosided.TOPICS}
    assert all(r["topic"] is None or r["topic"] in topics for r in rows.values())
    categories = {t: c for t, c, _ in twosided.TOPICS}
    assert set(categories.values()) <= set(schema.CATEGORIES)
    assert len(topics) == len(twosided.TOPICS)  # no topic twice
    for r in rows.values():  # a rule category (numbers here) is never overridden by a topic
        if r["prototype_id"] == 3:
            assert r["category"] == "numbers/time"


def test_an_older_database_gains_the_v3_columns_and_old_ones_still_open_read_only(tmp_path):
    path = tmp_path / "old.duckdb"
    con = connect(path)
    con.execute("DROP VIEW prototypes")
    for column, _ in schema.LABEL_COLUMNS_V3:
        con.execute(f"ALTER TABLE labels DROP COLUMN {column}")
    con.execute("INSERT INTO prototype_stats VALUES (0, 3, 0.5, 0.9, [0.0, 1.0], [3])")
    con.execute("INSERT INTO labels (prototype_id, category, label, label_score, labeler) "
                "VALUES (0, 'misc', 'an old label', 0.7, 'offline-v1')")
    con.execute(schema.PROTOTYPES_VIEW)
    con.close()
    ro = connect(path, read_only=True)
    try:
        card = query.prototype_card(ro, 0)
        assert card["label"] == "an old label" and card["fires_on"] is None and card["detection_random"] is None
    finally:
        ro.close()
    con = connect(path)  # opening for writing upgrades it
    try:
        names = {r[0] for r in con.execute("DESCRIBE labels").fetchall()}
        assert {c for c, _ in schema.LABEL_COLUMNS_V3} <= names
        assert con.execute("SELECT label, topic FROM labels").fetchall() == [("an old label", None)]
    finally:
        con.close()


def test_presets_label_rule_matches_named_tokens_not_context_words():
    kjv, numbers = PRESETS["kjv-register"], PRESETS["numbers"]
    assert label_names_marker(kjv, "'unto' after 'said' → 'the'")
    assert label_names_marker(kjv, "'and' → 'thou', 'he'")
    assert label_names_marker(kjv, "archaic 2nd-person pronouns near LORD")
    assert not label_names_marker(kjv, "'the' near thee, thou, unto → 'LORD'")  # context words only
    assert label_names_marker(numbers, "numbers (10, 40) → '%'")
    assert label_names_marker(numbers, "line break → numbers (2, 1)")
    assert not label_names_marker(numbers, "'the' with seven, twelve → 'sons'")


def test_search_embeds_predictions_and_ranks_by_the_best_kind(db, tmp_path):
    import shutil

    from precompute.embed import embed

    path = tmp_path / "search.duckdb"
    shutil.copy(db[0], path)
    con = connect(path)
    try:
        search_job.run(con, batch_size=2)
        kinds = dict(con.execute("SELECT kind, count(*) FROM embeddings GROUP BY 1").fetchall())
        assert kinds["label"] == 6 and kinds["predicts"] == 5 and kinds["evidence"] == 5 * 12
        topics = con.execute("SELECT count(*) FROM labels WHERE topic IS NOT NULL").fetchone()[0]
        assert kinds.get("topic", 0) == topics
        query_text = "Zorblord of hosts in glory"
        got = search_job.semantic_search(con, query_text, k=6, kind="all")
        vq = embed([query_text], progress=False)[0]
        best = {}
        for pid, vector in con.execute("SELECT prototype_id, vector FROM embeddings").fetchall():
            best[pid] = max(best.get(pid, -2.0), float(np.asarray(vector) @ vq))
        assert [r["prototype_id"] for r in got] == sorted(best, key=lambda p: (-best[p], p))
        assert all(abs(r["score"] - best[r["prototype_id"]]) < 1e-4 for r in got)
        assert {r["kind"] for r in got} <= set(search_job.KINDS)
        predicted = search_job.semantic_search(con, "predicts Zorbel", k=2, kind="predicts")
        assert predicted and all(r["kind"] == "predicts" for r in predicted)
    finally:
        con.close()


def test_category_colours_are_distinct_and_far_apart():
    from app.plots import CATEGORY_COLORS

    rgb = {c: tuple(int(CATEGORY_COLORS[c][i:i + 2], 16) for i in (1, 3, 5)) for c in schema.CATEGORIES}
    assert len(set(rgb.values())) == len(schema.CATEGORIES)
    closest = min(sum((a - b) ** 2 for a, b in zip(rgb[x], rgb[y], strict=True)) ** 0.5
                  for x, y in itertools.combinations(rgb, 2))
    assert closest >= 45, closest


def test_intruder_check_finds_the_odd_context_out(job_context):
    pool, ctx = job_context
    accuracy, tried = detection.intruder_accuracy(ctx, pool, seed=0)
    assert tried == len(PROTOTYPES) and accuracy > 1 / (detection.N_INTRUDER_SET + 1)
    assert (accuracy, tried) == detection.intruder_accuracy(ctx, pool, seed=0)  # seeded


def test_pushes_side_names_a_shared_kind_or_one_line_break():
    from precompute.labels.cards import EvidenceContext, PrototypeCard

    def card(nexts, signature):
        evidence = [EvidenceContext(i, " of", 1.0, [" sons", " of", n], [0.0, 1.0, 0.0], 1)
                    for i, n in enumerate(nexts)]
        return PrototypeCard(0, evidence, logit_tokens=signature)

    # the raised next tokens follow most of the evidence: named
    text, named = twosided.pushes_part(card([" Israel", " Israel", " Judah", " the"],
                                            [(" Israel", 2.0), (" Judah", 1.0)]))
    assert named == ["Israel", "Judah"] and text == "names (Israel, Judah)"
    # the signature raises none of them, but most share a kind: the kind with its examples
    text, _ = twosided.pushes_part(card([" eat", " take", " offer", " eat"], [(" the", 1.0)]))
    assert text.startswith("words (") and "eat" in text
    # a single line break reads as one
    text, _ = twosided.pushes_part(card(["\n", "\n", "\n"], [("\n", 1.0)]))
    assert text == "a line break"


def _fires_card(tokens):
    """A card whose evidence (strongest first) fires on `tokens`, each between two made-up words."""
    from precompute.labels.cards import EvidenceContext, PrototypeCard

    evidence = [EvidenceContext(i, t, 1.0 - i / 100, [" zorb", t, " quint"], [0.0, 1.0, 0.0], 1)
                for i, t in enumerate(tokens)]
    return PrototypeCard(0, evidence)


def test_fires_on_names_the_tokens_most_evidence_shows_in_any_case_strongest_first():
    from precompute.labels import contrast

    # 'Today'/'today' (5) counts once across case; 'Now' and 'Let' (4 each) tie, and the stronger evidence wins the
    # tie, not the alphabet ('Let' < 'Now'); listing stops once half the evidence is covered (5 + 4 of 16)
    tokens = [" Today", " Now", " Today", " Let", " Today", " Now", " today", " Let", " year", " Now", " Let",
              " Today", " Let", " Now", " year", " But"]
    bare = contrast.heads(_fires_card(tokens))[-1]
    assert bare == "'Today'/'Now'"
    covered = sum(t.strip().lower() in {"today", "now"} for t in tokens) / len(tokens)
    assert covered >= contrast.BARE_COVER
    # a token seen once is never listed after the first, even when half is not reached
    bare = contrast.heads(_fires_card([" of", " of", " of", " over", " gained", " secure", " reduced", " when"]))[-1]
    assert bare == "'of'"
    # a majority token is named with its kind, and alone
    heads = contrast.heads(_fires_card([" that", " That", " good", " that", " like", " that"]))
    assert heads[0].endswith("'that'") and heads[-1] == "'that'"


def test_topic_support_is_the_share_of_contexts_on_the_topic_one_by_one():
    rng = np.random.default_rng(0)
    topic = rng.normal(size=8)
    topic /= np.linalg.norm(topic)
    vectors = rng.normal(size=(20, 8))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    mean, sd = 0.05, 0.2
    expected = sum(float(v @ topic) >= mean + twosided.TOPIC_SUPPORT_Z * sd for v in vectors) / len(vectors)
    assert twosided.topic_support(vectors, topic, mean, sd) == pytest.approx(expected)
    assert twosided.topic_support(np.tile(topic, (5, 1)), topic, mean, sd) == 1.0  # all on it
    assert twosided.topic_support(np.zeros((0, 8)), topic, mean, sd) == 0.0


def test_blind_read_sheet_hides_which_label_is_which_and_score_unblinds(db, tmp_path, capsys):
    import json
    import random
    import shutil

    from bench import label_blind_read as blind

    path, rows = db
    other = tmp_path / "other.duckdb"
    shutil.copy(path, other)
    con = connect(other)
    con.execute("UPDATE labels SET fires_on = 'OTHER ' || fires_on, label = 'OTHER ' || label")
    con.close()
    key_path = tmp_path / "key.json"
    blind.main(["sheet", "--db", str(path), "--against", str(other), "--key", str(key_path), "--n", "3",
                "--seed", "5"])
    text = capsys.readouterr().out
    key = json.loads(key_path.read_text())
    live = sorted(pid for pid in rows if pid != 5)  # 5 is the dead one
    ids = random.Random(5).sample(live, 3)
    assert list(map(int, key)) == ids and text.count("verdict:") == 3
    assert str(path) not in text and str(other) not in text  # the sheet does not say which is which
    for pid in ids:  # the label shown as OTHER is the one the key says comes from the other database
        block = text.split(f"## #{pid}\n")[1].split("## #")[0]
        a_side = block.split("**A**")[1].split("**B**")[0]
        assert ("OTHER" in a_side) == (key[str(pid)]["A"] == str(other))
    # the reader calls every OTHER label wrong and the rest right: unblinded, each database gets its own verdicts
    verdicts = {pid: {side: "wrong" if key[pid][side] == str(other) else "right" for side in "AB"} for pid in key}
    tally = blind.score(verdicts, key)
    assert tally[str(other)]["wrong"] == 3 and tally[str(path)]["right"] == 3 and tally[str(path)]["right_share"] == 1
    with pytest.raises(ValueError, match="not one of"):
        blind.score({str(ids[0]): "fine"}, None)
    with pytest.raises(SystemExit):  # two databases without a key would print a sheet that cannot be unblinded
        blind.main(["sheet", "--db", str(path), "--against", str(other)])
    assert "needs --key" in capsys.readouterr().err
