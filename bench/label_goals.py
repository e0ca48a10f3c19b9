"""The label goals of issue 14, measured on a precompute database: one JSON line.

    python -m bench.label_goals --db assets/prism-default.duckdb
    python -m bench.label_goals --db runs/before.duckdb --db runs/after.duckdb     # one line per database
    python -m bench.label_goals --db assets/prism-default.duckdb --draw 10 --seed 0  # plus 10 drawn labels

Over the live prototypes (activation_count > 0): the share with a label no other live prototype has (goal >= 95%),
the share of catch-all labels ("mixed tokens" and the like, precompute.labels.contrast.CATCH_ALL; goal <= 3%), the mean
label_score (goal >= 0.85) and the mean sibling_score (goal >= 0.70; over the prototypes that have siblings, NULL
in databases made before it existed; --rescore computes both scores of the stored labels afresh with the labels job's
scoring code, which gives a sibling_score to labels made before it). --draw adds seeded random labels with their top
evidence pointers: the token (read from the installed corpus for a pointer-only database), the word before and after
it, and the document id; never more of the corpus text.
"""

from __future__ import annotations

import json
import random

import duckdb

from precompute.labels.cards import load_cards
from precompute.labels.contrast import CATCH_ALL
from prism import cli

GOALS = {"distinct_share": (">=", 0.95), "catch_all_share": ("<=", 0.03), "mean_label_score": (">=", 0.85),
         "mean_sibling_score": (">=", 0.70)}


def measure(con: duckdb.DuckDBPyConnection) -> dict:
    columns = {r[0] for r in con.execute("DESCRIBE labels").fetchall()}
    sibling = "l.sibling_score" if "sibling_score" in columns else "NULL::DOUBLE"
    rows = con.execute(f"""
        SELECT l.prototype_id, l.label, l.label_score, {sibling}
        FROM labels l JOIN prototype_stats s USING (prototype_id)
        WHERE s.activation_count > 0 ORDER BY l.prototype_id""").fetchall()
    counts: dict[str, int] = {}
    for _, label, _, _ in rows:
        counts[label] = counts.get(label, 0) + 1
    live = len(rows)
    scores = [r[2] for r in rows if r[2] is not None]
    siblings = [r[3] for r in rows if r[3] is not None]
    out = {
        "live_prototypes": live,
        "distinct_labels": len(counts),
        "distinct_share": round(sum(1 for _, label, _, _ in rows if counts[label] == 1) / live, 4) if live else None,
        "catch_all_share": round(sum(1 for _, label, _, _ in rows if CATCH_ALL.search(label)) / live, 4)
        if live else None,
        "mean_label_score": round(sum(scores) / len(scores), 4) if scores else None,
        "mean_sibling_score": round(sum(siblings) / len(siblings), 4) if siblings else None,
        "with_sibling_score": len(siblings),
        "labeler": con.execute("SELECT min(labeler) FROM labels").fetchone()[0],
    }
    out["goals_met"] = {name: (out[name] is not None and (out[name] >= bound if op == ">=" else out[name] <= bound))
                        for name, (op, bound) in GOALS.items()}
    return out


def job_context(con: duckdb.DuckDBPyConnection):
    """(negative pool, contrast context) as the labels job that wrote the database built them (its stored seed and
    number of negatives): every evidence context embedded, so minutes on a full database."""
    from precompute.labels import N_NEGATIVES, contrast, negative_pool

    row = con.execute("SELECT args_json FROM runs WHERE job = 'labels'").fetchone()
    job = json.loads(row[0]) if row else {}
    pool = negative_pool(con, job.get("n_negatives", N_NEGATIVES), job.get("seed", 0))
    return pool, contrast.build_context(con, pool, job.get("seed", 0))


def rescore(con: duckdb.DuckDBPyConnection) -> dict:
    """Both held-out scores of the stored labels of the live prototypes, computed as the labels job does now (its
    stored seed and negatives): {mean_label_score, mean_sibling_score, with_sibling_score}."""
    from precompute.labels import contrast

    pool, ctx = job_context(con)
    items = con.execute("SELECT l.prototype_id, l.label FROM labels l JOIN prototype_stats s USING (prototype_id) "
                        "WHERE s.activation_count > 0 ORDER BY l.prototype_id").fetchall()
    scores = contrast.score_labels(ctx, pool, items)
    label = [a for a, _ in scores if a is not None]
    sibling = [b for _, b in scores if b is not None]
    return {"mean_label_score": round(sum(label) / len(label), 4) if label else None,
            "mean_sibling_score": round(sum(sibling) / len(sibling), 4) if sibling else None,
            "with_sibling_score": len(sibling)}


def _word(pieces: list[str], start: int, step: int) -> str:
    i = start
    while 0 <= i < len(pieces):
        if pieces[i].strip():
            return pieces[i].strip()
        i += step
    return ""


def draw(con: duckdb.DuckDBPyConnection, n: int, seed: int) -> list[dict]:
    """n seeded random live prototypes: label, scores and their top 3 evidence tokens with one word either side."""
    ids = [r[0] for r in con.execute("SELECT prototype_id FROM prototype_stats WHERE activation_count > 0 "
                                     "ORDER BY prototype_id").fetchall()]
    picked = sorted(random.Random(seed).sample(ids, min(n, len(ids))))
    columns = {r[0] for r in con.execute("DESCRIBE labels").fetchall()}
    sibling = "sibling_score" if "sibling_score" in columns else "NULL"
    out = []
    for card in load_cards(con, picked):
        label, score, sib = con.execute(f"SELECT label, label_score, {sibling} FROM labels WHERE prototype_id = ?",
                                        [card.prototype_id]).fetchone()
        evidence = [{"doc_id": e.doc_id, "before": _word(e.context_tokens, e.token_index - 1, -1),
                     "token": e.context_tokens[e.token_index].strip() or "\\n",
                     "after": _word(e.context_tokens, e.token_index + 1, 1)} for e in card.evidence[:3]]
        out.append({"prototype_id": card.prototype_id, "label": label, "label_score": score, "sibling_score": sib,
                    "evidence": evidence})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = cli.parser("python -m bench.label_goals", __doc__, formatter="plain")
    parser.add_argument("--db", action="append", required=True, help="a precompute database (repeatable)")
    parser.add_argument("--draw", type=int, default=0, help="also draw this many labels with their evidence")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw")
    parser.add_argument("--rescore", action="store_true",
                        help="also score the stored labels afresh (embeds every evidence context: minutes)")
    args = parser.parse_args(argv)
    results = []
    for path in args.db:
        con = duckdb.connect(path, read_only=True)
        try:
            result = {"db": path, **measure(con)}
            if args.rescore:
                result["rescored"] = rescore(con)
            if args.draw:
                result["drawn"] = draw(con, args.draw, args.seed)
        finally:
            con.close()
        cli.print_json(result)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
