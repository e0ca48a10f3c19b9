"""The search job and the app's search queries: label and evidence embeddings in DuckDB, cosine similarity in SQL.

The job writes into `embeddings` one L2-normalised vector per prototype label (kind 'label', item 0, the text
"category - topic: label", or "category: label" without a topic), one for its topic alone where it has one (kind
'topic', item 0: "category - topic", so a one-word query such as "places" meets "named entities - countries and
places" undiluted by the label), one for what it predicts (kind 'predicts', item 0: "predicts " and the tokens its
logit signature raises most) and one per evidence context (kind 'evidence', item = evidence rank, the same context
window the labels job scores with; `--no-evidence` leaves these out, as the shipped database does to stay small).
Semantic search with kind 'all' ranks each prototype by its best match of any kind. Like the labels job it is
resumable: prototypes in id order, each chunk's rows and progress in one transaction; its arguments (embedding
model, the labels and evidence runs it read) are stored.

The queries run on a read-only connection; the query vector is a bound parameter and DuckDB computes the cosine
similarities (list_cosine_similarity), so nothing but the top k rows leaves the database.

    python -m precompute.search --db out.duckdb                                   # the job
    python -m precompute.search --db out.duckdb --query "dates of battles"        # labels, predictions, evidence
    python -m precompute.search --db out.duckdb --query "a hospital" --kind evidence
    python -m precompute.search --db out.duckdb --label year                      # substring search over labels

    from precompute.search import semantic_search, label_search
    semantic_search(con, "years", k=20, kind="label")   # [{prototype_id, score, label, category, item}, ...]
    label_search(con, "suffix", k=50)                   # [{prototype_id, label, category, label_score}, ...]
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from precompute.embed import EMBED_MODEL, embed
from precompute.inputs import Context, Inputs, Job
from precompute.labels.cards import WINDOW_AFTER, WINDOW_BEFORE, load_cards
from precompute.runs import (
    JobArgsMismatch,
    connect,
    finish_job,
    job_done,
    job_run_id,
    remaining_prototypes,
    start_job,
    write_in_chunks,
)
from prism import cli

logger = logging.getLogger("precompute.search")

NAME = "search"  # the job's row in `runs`, its tables in schema.JOB_TABLES
KINDS = ("label", "topic", "predicts", "evidence")
SEARCH_KINDS = (*KINDS, "all")  # what semantic_search takes
N_PREDICTED = 10  # signature tokens in a 'predicts' text
_CHUNK_VIEW = "search_chunk"  # the Arrow table of one chunk, registered while it is inserted


def label_text(category: str, label: str, topic: str | None = None) -> str:
    """What is embedded for a label (kind 'label')."""
    return f"{category} - {topic}: {label}" if topic else f"{category}: {label}"


def predicts_text(tokens: list[str]) -> str | None:
    """What is embedded for a prototype's prediction (kind 'predicts'): the raised signature tokens, in order."""
    words = list(dict.fromkeys(t.strip() for t in tokens if t.strip()))[:N_PREDICTED]
    return "predicts " + ", ".join(words) if words else None


def _arrow_rows(kinds: list[str], prototype_ids: list[int], items: list[int], vectors: np.ndarray) -> pa.Table:
    n, d = vectors.shape  # (N, D)
    offsets = pa.array(np.arange(0, n * d + 1, d, dtype=np.int32))
    values = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).ravel(), type=pa.float32())
    return pa.table({"kind": pa.array(kinds, pa.string()), "prototype_id": pa.array(prototype_ids, pa.int32()),
                     "item": pa.array(items, pa.int32()), "vector": pa.ListArray.from_arrays(offsets, values)})


def run(con: duckdb.DuckDBPyConnection, overwrite: bool = False, batch_size: int = 64, evidence: bool = True) -> int:
    """Embed every prototype's label, prediction and (with evidence) evidence contexts into `embeddings`; returns
    the rows written now."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not job_done(con, "labels"):
        raise RuntimeError("the labels job has not finished in this database: run it first")
    args = {"embed_model": EMBED_MODEL, "label_text": label_text("{category}", "{label}", "{topic}"),
            "topic_text": "{category} - {topic}", "predicts_text": predicts_text(["{tokens}"]),
            "evidence": bool(evidence),
            "window": [WINDOW_BEFORE, WINDOW_AFTER], "labels_run": job_run_id(con, "labels"),
            "evidence_run": job_run_id(con, "evidence")}
    state = start_job(con, NAME, args, overwrite)
    if state == "done":
        logger.info("search: already done with these arguments")
        return 0
    todo = remaining_prototypes(con, NAME)
    logger.info("search: %s run, %d prototypes to embed", state, len(todo))

    def prepare(chunk: list[int]):
        topic = "topic" if _has_topic(con) else "NULL"
        found = con.execute(f"SELECT prototype_id, category, label, {topic} FROM labels WHERE prototype_id BETWEEN ? "
                            "AND ? ORDER BY prototype_id", [chunk[0], chunk[-1]]).fetchall()
        labels = {pid: label_text(category, label, top) for pid, category, label, top in found}
        topics = {pid: f"{category} - {top}" for pid, category, _, top in found if top}
        rows: list[tuple[str, int, int, str]] = []  # (kind, prototype_id, item, text)
        for card in load_cards(con, chunk):
            if card.prototype_id in labels:
                rows.append(("label", card.prototype_id, 0, labels[card.prototype_id]))
            if card.prototype_id in topics:
                rows.append(("topic", card.prototype_id, 0, topics[card.prototype_id]))
            predicted = predicts_text([t for t, v in card.logit_tokens if v > 0])
            if predicted:
                rows.append(("predicts", card.prototype_id, 0, predicted))
            if evidence:
                rows += [("evidence", card.prototype_id, e.rank, e.window()) for e in card.evidence]
        table = None
        if rows:
            kinds, ids, items, texts = (list(column) for column in zip(*rows, strict=True))
            table = _arrow_rows(kinds, ids, items, embed(texts))

        def write() -> None:
            con.execute("DELETE FROM embeddings WHERE prototype_id BETWEEN ? AND ?", [chunk[0], chunk[-1]])
            if table is not None:
                con.register(_CHUNK_VIEW, table)
                try:
                    con.execute(f"INSERT INTO embeddings SELECT kind, prototype_id, item, vector FROM {_CHUNK_VIEW}")
                finally:
                    con.unregister(_CHUNK_VIEW)

        return len(rows), write

    written = write_in_chunks(con, NAME, todo, batch_size, prepare)
    finish_job(con, NAME)
    return written


def _has_topic(con: duckdb.DuckDBPyConnection) -> bool:
    names = [d[0] for d in con.execute("SELECT * FROM labels LIMIT 0").description]
    return "topic" in names


def semantic_search(con: duckdb.DuckDBPyConnection, query: str, k: int = 20, kind: str = "label") -> list[dict]:
    """The k prototypes whose label (kind='label'), topic ('topic'), prediction ('predicts'), best evidence context
    ('evidence') or best item of any kind ('all') is closest to the query. Each: {prototype_id, score (cosine),
    label, category, item (the best evidence rank; 0 for the other kinds), kind (of the best match)}. Never empty for a
    database with embeddings: the nearest prototypes come back however far they are (callers apply thresholds).
    """
    if kind not in SEARCH_KINDS:
        raise ValueError(f"kind must be one of {', '.join(SEARCH_KINDS)}, got {kind!r}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    vector = [float(v) for v in embed([str(query)], progress=False)[0]]
    # one row per prototype: its best-scoring item (ties: the lowest item), ranked by that score
    kinds = list(KINDS) if kind == "all" else [kind]
    cur = con.execute("""
        WITH scored AS (
            SELECT prototype_id, kind, item, list_cosine_similarity(vector, ?::FLOAT[]) AS score
            FROM embeddings WHERE list_contains(?, kind)),
        best AS (
            SELECT prototype_id, kind, item, score,
                   row_number() OVER (PARTITION BY prototype_id ORDER BY score DESC, kind, item) AS r
            FROM scored)
        SELECT b.prototype_id, b.score, l.label, l.category, b.item, b.kind
        FROM best b LEFT JOIN labels l USING (prototype_id)
        WHERE b.r = 1
        ORDER BY b.score DESC, b.prototype_id
        LIMIT ?""", [vector, kinds, k])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def label_search(con: duckdb.DuckDBPyConnection, text: str, k: int = 50) -> list[dict]:
    """Prototypes whose label, category or topic contains `text` (case-insensitive, taken literally: no
    wildcards). Exact matches first, then by label_score. Each: {prototype_id, label, category, label_score}."""
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    needle = str(text).lower()
    topic = "lower(coalesce(topic, ''))" if _has_topic(con) else "''"
    cur = con.execute(f"""
        SELECT prototype_id, label, category, label_score
        FROM labels
        WHERE contains(lower(label), ?) OR contains(lower(category), ?) OR contains({topic}, ?)
        ORDER BY (lower(label) = ? OR lower(category) = ? OR {topic} = ?) DESC, label_score DESC NULLS LAST,
                 prototype_id
        LIMIT ?""", [needle, needle, needle, needle, needle, needle, k])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


@dataclass
class SearchArgs:
    batch_size: int = 64  # prototypes per transaction; not stored with the output (the rows do not depend on it)
    evidence: bool = True  # embed every evidence context too (kind 'evidence')


def run_job(context: Context) -> int:
    """The job interface (precompute/inputs.py)."""
    return run(context.inputs.connection(), overwrite=context.overwrite, batch_size=context.args.batch_size,
               evidence=context.args.evidence)


JOB = Job(NAME, SearchArgs, run_job, args_from=lambda ns: SearchArgs())


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m precompute.search", __doc__)
    parser.add_argument("--db", required=True, help="the precompute DuckDB file (labels job done)")
    # the job
    parser.add_argument("--batch-size", type=int, default=64, help="prototypes per transaction")
    parser.add_argument("--overwrite", action="store_true", help="replace embeddings made with other arguments")
    parser.add_argument("--no-evidence", action="store_true",
                        help="embed labels and predictions only, not every evidence context (a smaller database)")
    # queries (read-only; the job is not run when one is given)
    parser.add_argument("--query", help="semantic search: show the prototypes closest to this text")
    parser.add_argument("--kind", choices=SEARCH_KINDS, default="all",
                        help="semantic search over labels, topics, predictions, evidence or all of them")
    parser.add_argument("--label", help="substring search over labels and categories")
    parser.add_argument("-k", type=int, default=20, help="how many results")
    return parser


def main(argv: list[str] | None = None) -> int | list[dict]:
    parser = build_parser()
    args = cli.parse(parser, argv)
    with cli.expected_errors(parser, JobArgsMismatch, RuntimeError, ValueError, FileNotFoundError, duckdb.Error):
        if args.query is not None or args.label is not None:
            con = connect(args.db, read_only=True)
            try:
                if args.query is not None:
                    results = semantic_search(con, args.query, k=args.k, kind=args.kind)
                else:
                    results = label_search(con, args.label, k=args.k)
            finally:
                con.close()
            for r in results:
                score = f"{r['score']:+.3f}" if "score" in r else f"{r['label_score'] or 0:.3f}"
                print(f"{r['prototype_id']:>6}  {score}  {r['category']}: {r['label']}")  # noqa: T201
            return results
        if not Path(args.db).is_file():
            raise FileNotFoundError(f"no database at {args.db}: run the evidence and labels jobs first")
        with Inputs(args.db) as inputs:
            written = JOB.run(Context(inputs, SearchArgs(batch_size=args.batch_size, evidence=not args.no_evidence),
                                      args.overwrite))
    print(f"search: wrote {written} embeddings")  # noqa: T201 - the command's output
    return written


if __name__ == "__main__":
    main()
