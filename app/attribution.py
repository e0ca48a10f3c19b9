"""The "training data behind this token" panel: the training sequences that most lowered a generated token's loss,
served from the attribution cache of the precompute database (precompute/attribution/, prism/attribution.py), or,
for a database without one, from the cache the app builds on first start (app/training_data.py).

    data = attribute_token(studio, gen, index=3, top=10)     # {"token", "sequences": [...], ...}; AppError if no cache
    html_text, data = attribution_panel(studio, "original", 3, session)   # the Gradio handler (api_name "attribute")

A query costs one pass of the prototype head on the token's final state (kept with the generation), a sparse
product over the prototypes it reads, and an exact second stage over its cache.RERANK best sequences from the
build's exact store; the cached vectors are memory-mapped once per database (load_index and index_folder_for in
precompute/attribution/cache.py; a child process writes them) and shared (read-only) by every user, as is the
exact store (load_exact_store). Attribution uses the
model's own activations: for the intervened text it is computed on that text without the interventions.
"""

from __future__ import annotations

import html
import logging
import threading
import weakref

from app import limits, training_data
from app.core import AppError, Database, Generation, Studio
from app.messages import problem
from app.render import attribution_html
from precompute import attribution as cache
from prism.attribution import CachedIndex, query_gradient, top_sequences

logger = logging.getLogger(__name__)

RUNS = ("original", "intervened", "prompt")
EMPTY = "Click a generated token to see the training sequences behind it."
# What the measured recall means, in one line under the panel's head (bench.attribution_truth, RESULTS.md).
MEASURED = ("How often this is right, measured: for 120 made-up facts planted in a 300k-token training set, the "
            "planted sequence was in this top 10 for 72% of them and in a plain word search's (BM25) for 100%; "
            "the model had not learned those facts, so the figure is for tokens it predicts poorly.")

CacheDatabase = Database | training_data.ReadOnly  # the served database, or the first-start build's
_indexes: weakref.WeakKeyDictionary[CacheDatabase, CachedIndex] = weakref.WeakKeyDictionary()
_catalogs: weakref.WeakKeyDictionary[CacheDatabase, cache.SequenceCatalog] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def cache_database(studio: Studio) -> CacheDatabase:
    """Where the training-data cache is: the served database, else the first-start build's once finished
    (app/training_data.py); AppError with the build command, or with the build's progress while it runs."""
    db = studio.need_db()
    if db in _indexes or db.run(cache.has_attribution):
        return db
    build = training_data.builder_for(studio)
    if build is None:
        raise AppError(f"{cache.BUILD_HINT}.")
    ready = build.database()
    if ready is None:
        raise AppError(build.status())
    return ready


def index_for(studio: Studio, db: CacheDatabase) -> CachedIndex:
    """The database's cache in memory, loaded on first use; AppError with the build command if it has none."""
    with _lock:
        if db not in _indexes:
            if not db.run(cache.has_attribution):
                raise AppError(f"{cache.BUILD_HINT}.")
            _indexes[db] = db.run(_load_index, db.path, studio.model.lm_head.weight)
        if db not in _catalogs:  # the panel's spans and documents (an index set by hand comes without one)
            _catalogs[db] = db.run(cache.SequenceCatalog)
        return _indexes[db]




def _load_index(con, path, output_embeddings) -> CachedIndex:
    """Memory-mapped from the user's cache folder (written there on first use; a large cache then costs the pages
    a click touches), or into memory where that folder cannot be written; with the build's exact store, if any,
    for the exact second stage."""
    exact = cache.load_exact_store(con, path)
    try:
        folder = cache.index_folder_for(path)
        folder.parent.mkdir(parents=True, exist_ok=True)
        return cache.load_index(con, output_embeddings, folder=folder, rerank=cache.RERANK, exact=exact)
    except OSError as err:  # a read-only or full disk
        logger.warning("could not write the memory-mapped attribution index (%s): loading it into memory", err)
        return cache.load_index(con, output_embeddings, rerank=cache.RERANK, exact=exact)


def attribute_token(studio: Studio, gen: Generation, index: int, top: int = 10, in_prompt: bool = False) -> dict:
    """The top training sequences for generated token `index` of `gen` (with in_prompt: its prompt's token
    `index`), with scores, documents and spans."""
    db = cache_database(studio)
    cached = index_for(studio, db)
    if cached.n_prototypes != studio.n_prototypes:
        raise AppError(f"the attribution cache describes {cached.n_prototypes} prototypes but the model has "
                       f"{studio.n_prototypes}: rebuild it for this model")
    target = studio.target(gen, index, in_prompt)
    index, position, token = target.index, target.position, target.token_id
    z = studio.state(gen, index, in_prompt)  # (d,)
    ids, rows = query_gradient(studio.model, None, position, token, z=z)
    if len(ids) == 0:
        return {"index": index, "in_prompt": in_prompt, "position": position, "token_id": token,
                "token": studio.tokenizer.decode([token]),
                "prototype_ids": [], "n_sequences": cached.n_sequences, "sequences": [],
                "message": "no prototype is active at this token"}
    scores, parts = cached.scores(ids, rows)
    best = [int(s) for s in top_sequences(scores, top)]
    sequences = db.run(cache.attribution_rows, studio.tokenizer, best, scores, parts, store=cached.exact,
                       catalog=_catalogs[db])
    for row in sequences:
        for p in row["prototypes"]:
            p["label"], p["category"] = studio.label(p["prototype_id"])
    return {"index": index, "in_prompt": in_prompt, "position": position, "token_id": token,
            "token": studio.tokenizer.decode([token]),
            "prototype_ids": [int(i) for i in ids], "n_sequences": cached.n_sequences, "sequences": sequences,
            "message": None}


def attribution_panel(studio: Studio, run: str, index, session) -> tuple[str, dict | None]:
    """Gradio handler: (panel HTML, data) for the selected token of the original or intervened text."""
    try:
        if run not in RUNS:
            raise AppError(f"run must be 'original', 'intervened' or 'prompt', got {limits.shown(run)}")
        gen = session.intervened if run == "intervened" else session.original
        if gen is None:
            raise AppError("there is no intervened text" if run == "intervened" else "generate first")
        data = attribute_token(studio, gen, limits.whole("the token index", index, -2**31, 2**31, default=0),
                               in_prompt=run == "prompt")
    except AppError as err:
        return f'<p class="prism-attribution-status">{html.escape(problem(err))}</p>', None
    which = "prompt token" if run == "prompt" else "token"
    head = (f'<p class="prism-attribution-status"><b>Training data behind {which} {data["index"]} '
            f'{html.escape(repr(data["token"]))}</b>: the training sequences whose loss gradient, through the '
            f'token\'s active prototypes {", ".join(f"#{p}" for p in data["prototype_ids"])} and those co-used with '
            f'them, most lowered its loss '
            f'(cached prototype-space influence, {data["n_sequences"]:,} training sequences searched).</p>'
            f'<p class="prism-attribution-measured">{html.escape(MEASURED)}</p>')
    if run == "intervened":
        head += '<p class="prism-attribution-status">Computed without the interventions.</p>'
    if data["message"]:
        return head + f"<p>{html.escape(data['message'])}</p>", _json(data)
    return head + attribution_html(data["sequences"]), _json(data)


def _json(data: dict) -> dict:
    """The panel's data without the long text segments (the API returns spans and scores)."""
    out = dict(data)
    out["sequences"] = [{k: v for k, v in r.items() if k not in ("segments", "sha256")} for r in data["sequences"]]
    return out
