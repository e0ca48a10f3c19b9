"""How far labeler v2 could get on a database by choosing better among its own candidates: one JSON line.

    python -m bench.label_ceiling --db runs/v2/full.duckdb
    python -m bench.label_ceiling --db assets/prism-default.duckdb --weights 0.5,0.8,1.0

For every live prototype it rebuilds the candidate labels the labels job chose from (precompute/labels/contrast.py:
candidate_set, built from the visible even-ranked evidence) and scores each on the held-out odd-ranked evidence
the way the job scores the label it keeps (contrast.score_pair: AUROC against the seeded negative pool, AUROC
against the siblings' held-out contexts). It prints

    stored        the mean held-out scores of the labels in the database (what bench.label_goals reports)
    ceiling       the mean over prototypes of the best candidate's held-out score, each score maximised on its own:
                  no rule that picks among these candidates can beat it, so a goal above the ceiling needs other
                  candidates or another bank, not another choice
    by_weight     for each candidate-objective weight w (w x visible AUROC vs other prototypes + (1 - w) x vs
                  siblings), the mean held-out scores of the best candidate by that objective (no distinctness
                  step, so stored and by_weight at the job's weight differ by what distinctness costs)

It embeds every evidence context and every candidate once: minutes on a full database.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
from tqdm.auto import tqdm

from prism import cli

DEFAULT_WEIGHTS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(float(np.mean(kept)), 4) if kept else None


def measure(con: duckdb.DuckDBPyConnection, weights: tuple[float, ...] = DEFAULT_WEIGHTS) -> dict:
    from bench.label_goals import job_context
    from precompute.labels import contrast

    pool, ctx = job_context(con)
    stored = dict(con.execute("SELECT l.prototype_id, l.label FROM labels l JOIN prototype_stats s "
                              "USING (prototype_id) WHERE s.activation_count > 0").fetchall())
    live = [pid for pid in sorted(stored) if pid in ctx.cards and ctx.cards[pid].evidence]
    stored_scores = contrast.score_labels(ctx, pool, [(pid, stored[pid]) for pid in live])
    best_label, best_sibling, n_candidates = [], [], 0
    picked: dict[float, list[tuple[float | None, float | None]]] = {w: [] for w in weights}
    for pid in tqdm(live, desc="ceiling", unit="prototype"):
        texts, vectors, _ = contrast.candidate_set(ctx, ctx.cards[pid])
        n_candidates += len(texts)
        held = [contrast.score_pair(ctx, pool, pid, v) for v in vectors]  # [(label_score, sibling_score)]
        labels = [a for a, _ in held if a is not None]
        siblings = [b for _, b in held if b is not None]
        best_label.append(max(labels) if labels else None)
        best_sibling.append(max(siblings) if siblings else None)
        visible = contrast.visible_scores(ctx, pid, vectors)
        for w in weights:
            objective = [w * r + (1 - w) * s - 1e-6 * i for i, (r, s) in enumerate(visible)]
            picked[w].append(held[int(np.argmax(objective))])
    return {
        "prototypes": len(live), "candidates": n_candidates, "job_weight": contrast.RANDOM_WEIGHT,
        "stored": {"label_score": _mean([a for a, _ in stored_scores]),
                   "sibling_score": _mean([b for _, b in stored_scores])},
        "ceiling": {"label_score": _mean(best_label), "sibling_score": _mean(best_sibling)},
        "by_weight": {str(w): {"label_score": _mean([a for a, _ in picked[w]]),
                               "sibling_score": _mean([b for _, b in picked[w]])} for w in weights},
    }


def _weights(text: str) -> tuple[float, ...]:
    try:
        weights = tuple(float(w) for w in text.split(",") if w.strip())
    except ValueError as exc:
        raise ValueError(f"--weights takes comma-separated numbers in [0, 1], got {text!r}") from exc
    if not weights or not all(0.0 <= w <= 1.0 for w in weights):
        raise ValueError(f"--weights takes comma-separated numbers in [0, 1], got {text!r}")
    return weights


def main(argv: list[str] | None = None) -> dict:
    parser = cli.parser("python -m bench.label_ceiling", __doc__, formatter="plain")
    parser.add_argument("--db", required=True, help="a precompute database with evidence and labels")
    parser.add_argument("--weights", default=",".join(str(w) for w in DEFAULT_WEIGHTS),
                        help="candidate-objective weights to try (comma-separated, each in [0, 1])")
    args = parser.parse_args(argv)
    try:
        weights = _weights(args.weights)
    except ValueError as exc:
        cli.fail(parser, str(exc))
    if not Path(args.db).is_file():
        cli.fail(parser, f"--db {args.db}: no such database file")
    con = duckdb.connect(args.db, read_only=True)
    try:
        result = {"db": args.db, **measure(con, weights)}
    finally:
        con.close()
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
