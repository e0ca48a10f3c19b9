"""The labels job: one row per prototype of prototype_stats in `labels` (category, label, both held-out scores,
labeler, explanation) and its siblings in `label_siblings`.

    written = run(con, make_labeler("offline"), seed=0)     # or python -m precompute.labels --db out.duckdb

The job is resumable: prototypes are labelled in id order, in chunks, and each chunk's rows are written together
with its progress in one transaction, so a killed job that is started again writes exactly the rows an
uninterrupted run writes. Its arguments (labeler, seed, ...) are stored; other arguments need --overwrite.
For tests, the hold_chunk_s hook (precompute.runs.JobHooks; `--hook hold-chunk-s=1` on the command line) holds
each chunk's transaction open that many seconds (after the rows are written, before the commit) so a test can kill
the job mid-transaction.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import duckdb

from precompute.embed import EMBED_MODEL
from precompute.inputs import Context, Job
from precompute.labels import contrast, detection
from precompute.labels.cards import WINDOW_AFTER, WINDOW_BEFORE, PrototypeCard, load_cards
from precompute.labels.labeler import Labeler, LabelResult
from precompute.labels.llm import LocalInstructLabeler, OpenAICompatibleLabeler
from precompute.labels.offline import OfflineLabeler
from precompute.labels.scoring import N_NEGATIVES, NegativePool, negative_pool, score_labels
from precompute.labels.twosided import TwoSidedLabeler
from precompute.runs import finish_job, job_done, job_run_id, remaining_prototypes, start_job, write_in_chunks
from precompute.schema import CATEGORIES

logger = logging.getLogger("precompute.labels")

NAME = "labels"  # the job's row in `runs`, its tables in schema.JOB_TABLES


def label_prototypes(cards: list[PrototypeCard], labeler: Labeler, pool: NegativePool,
                     context=None) -> list[tuple]:
    """Rows of `labels` for the cards: label the even-ranked evidence, score on the odd-ranked. With a
    precompute.labels.contrast.ContrastContext the rows also carry sibling_score and both detection scores
    (precompute/labels/detection.py; columns: LABEL_COLUMNS)."""
    results, items = [], []
    for card in cards:
        train, held_out = card.split()
        result = labeler.label(train)
        if result.category not in CATEGORIES:  # a custom labeler's slip: keep the row, mark it
            result = LabelResult("misc", result.label, f"(category {result.category!r} not in the taxonomy) "
                                 f"{result.explanation}")
        results.append(result)
        items.append((card.prototype_id, result.label, held_out))
    if context is None:
        scores = [(s, None, None, None) for s in score_labels(items, pool)]
    else:
        scores = detection.score_labels(context, pool, [(pid, label) for pid, label, _ in items])
    return [(card.prototype_id, r.category, r.label, s, labeler.name, r.explanation, sib, r.fires_on, r.pushes,
             r.topic, d_rand, d_sib)
            for card, r, (s, sib, d_rand, d_sib) in zip(cards, results, scores, strict=True)]


LABEL_COLUMNS = ("prototype_id", "category", "label", "label_score", "labeler", "explanation", "sibling_score",
                 "fires_on", "pushes", "topic", "detection_random", "detection_sibling")


def run(con: duckdb.DuckDBPyConnection, labeler: Labeler | None = None, overwrite: bool = False,
        batch_size: int = 64, seed: int = 0, n_negatives: int = N_NEGATIVES, hold_chunk_s: float = 0.0) -> int:
    """Label every prototype of prototype_stats; returns the number of rows written by this call.

    Every labeler's rows get both held-out scores (label_score, sibling_score; precompute/labels/contrast.py) and the
    prototype's siblings go into label_siblings. Resumable (see the module docstring); 'done' with the same
    arguments writes nothing; other arguments raise JobArgsMismatch unless overwrite. batch_size is the number of
    prototypes per transaction and not part of the job's arguments (the rows do not depend on it).
    """
    labeler = labeler or TwoSidedLabeler()
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not job_done(con, "evidence"):
        raise RuntimeError("the evidence job has not finished in this database: run it first")
    args = {"labeler": labeler.name, "labeler_model": getattr(labeler, "model_id", None), "embed_model": EMBED_MODEL,
            "seed": seed, "n_negatives": n_negatives, "window": [WINDOW_BEFORE, WINDOW_AFTER],
            "evidence_run": job_run_id(con, "evidence"),
            "siblings": {"n": contrast.N_SIBLINGS, "min_overlap": contrast.MIN_OVERLAP, "n_select": contrast.N_SELECT}}
    state = start_job(con, NAME, args, overwrite)
    if state == "done":
        logger.info("labels: already done with these arguments")
        return 0
    todo = remaining_prototypes(con, NAME)
    logger.info("labels: %s run, %d prototypes to label with %s", state, len(todo), labeler.name)
    pool = negative_pool(con, n_negatives, seed)
    if hasattr(labeler, "prepare"):
        labeler.prepare(pool.vectors)
    context = contrast.build_context(con, pool, seed)
    if hasattr(labeler, "prepare_contrast"):
        labeler.prepare_contrast(context)
    insert = f"INSERT INTO labels ({', '.join(LABEL_COLUMNS)}) VALUES ({', '.join('?' * len(LABEL_COLUMNS))})"

    def prepare(chunk: list[int]):
        rows = label_prototypes(load_cards(con, chunk), labeler, pool, context)
        siblings = [row for pid in chunk for row in contrast.separations(context, pid)]

        def write() -> None:
            con.execute("DELETE FROM labels WHERE prototype_id BETWEEN ? AND ?", [chunk[0], chunk[-1]])
            con.execute("DELETE FROM label_siblings WHERE prototype_id BETWEEN ? AND ?", [chunk[0], chunk[-1]])
            con.executemany(insert, rows)
            if siblings:
                con.executemany("INSERT INTO label_siblings VALUES (?, ?, ?, ?, ?)", siblings)

        return len(rows), write

    written = write_in_chunks(con, NAME, todo, batch_size, prepare, hold_chunk_s)
    finish_job(con, NAME)
    return written


LABELERS = ("offline", "offline-v2", "offline-v1", "openai", "local")


def check_labeler_arguments(kind: str, endpoint: str | None = None, model: str | None = None) -> None:
    """The argument errors make_labeler raises, found without building anything (no model loaded, no request)."""
    if kind not in LABELERS:
        raise ValueError(f"unknown labeler {kind!r}: offline, offline-v2, offline-v1, openai or local")
    if kind == "openai" and (not endpoint or not model):
        raise ValueError("--labeler openai needs --endpoint URL and --llm-model NAME")
    if kind == "local" and not model:
        raise ValueError("--labeler local needs --llm-model FOLDER (a local transformers model)")


def make_labeler(kind: str, endpoint: str | None = None, model: str | None = None, api_key: str | None = None,
                 timeout: float = 60.0) -> Labeler:
    """The labeler the command line names: offline (v3, two-sided) | offline-v2 (contrastive) | offline-v1 |
    openai (endpoint + model) | local (model folder)."""
    check_labeler_arguments(kind, endpoint, model)
    if kind == "offline":
        return TwoSidedLabeler()
    if kind == "offline-v2":
        return contrast.ContrastiveLabeler()
    if kind == "offline-v1":
        return OfflineLabeler()
    if kind == "openai":
        return OpenAICompatibleLabeler(endpoint, model, api_key=api_key, timeout=timeout)
    return LocalInstructLabeler(model)


@dataclass
class LabelsArgs:
    labeler: str = "offline"  # one of LABELERS (offline = v3)
    endpoint: str | None = None  # openai: the API root
    llm_model: str | None = None  # openai: the model name; local: the model folder
    api_key_env: str | None = None  # openai: the environment variable holding the API key (never the key itself)
    timeout: float = 60.0  # openai: seconds per request
    seed: int = 0  # seed of the negative contexts for label_score
    n_negatives: int = N_NEGATIVES
    batch_size: int = 64  # prototypes per transaction; not stored with the output (the rows do not depend on it)

    def __post_init__(self) -> None:
        check_labeler_arguments(self.labeler, self.endpoint, self.llm_model)


def run_job(context: Context) -> int:
    """The job interface (precompute/inputs.py)."""
    a = context.args
    api_key = os.environ.get(a.api_key_env) if a.api_key_env else None
    labeler = make_labeler(a.labeler, a.endpoint, a.llm_model, api_key, a.timeout)
    return run(context.inputs.connection(), labeler, overwrite=context.overwrite, batch_size=a.batch_size,
               seed=a.seed, n_negatives=a.n_negatives, hold_chunk_s=context.hooks.hold_chunk_s)


JOB = Job(NAME, LabelsArgs, run_job,
          args_from=lambda ns: LabelsArgs(labeler=ns.labeler, endpoint=ns.endpoint, llm_model=ns.llm_model,
                                          seed=ns.seed))


def category_mix(con: duckdb.DuckDBPyConnection) -> list[tuple]:
    """(category, prototypes, mean label_score, mean sibling_score, mean detection_random, mean detection_sibling)
    from the labels table, largest first."""
    return con.execute("SELECT category, count(*) AS n, avg(label_score), avg(sibling_score), avg(detection_random), "
                       "avg(detection_sibling) FROM labels GROUP BY category ORDER BY n DESC, category").fetchall()
