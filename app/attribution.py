"""The "training data behind this token" panel: the training sequences that most lowered a generated token's loss,
served from the attribution cache of the precompute database (precompute/attribution/, prism/attribution.py), or,
for a database without one, from the cache the app builds on first start (app/training_data.py).

    data = attribute_token(studio, gen, index=3, top=10)     # {"token", "sequences": [...], ...}; AppError if no cache
    html_text, data = attribution_panel(studio, "original", 3, session)   # the Gradio handler (api_name "attribute")
    attribute_token(studio, gen, 3, reading="sequence")      # the whole sequence's loss, not the token's positions

Three readings (READINGS). By default ("gradient") a training sequence counts through the positions where it
predicted the same token, in the trained layers' gradients: the build's gradient store (prism/grad_cache.py), the
reading that found every planted fact in bench.attribution_truth. "token" asks the same question in prototype
space (the token's active prototypes, block-diagonal curvature); "sequence" reads a sequence's whole loss through
those prototypes and the ones co-used with them. A cache built without a gradient store (before it existed, or with
--attribution-grad-rank 0) answers the default with the "token" reading and says so.

A prototype-space query costs one pass of the prototype head on the token's final state (kept with the
generation), a sparse product over the prototypes it reads, and (reading the whole sequence) an exact second stage
over its cache.RERANK best sequences from the build's exact store; a gradient query costs a forward pass of the
trained layers and their backward pass from the token's loss, and a product over the training positions that
predicted the token; the states entering the trained layers are the ones generation kept (start_states; else one
pass of the frozen layers per text). The cached vectors are memory-mapped once per database (load_index and
index_folder_for in precompute/attribution/cache.py; a child process writes them) and shared (read-only) by every
user, as are the exact store (load_exact_store) and the gradient store (load_gradient_store). Attribution uses the
model's own activations: for the intervened text it is computed on that text without the interventions.
"""

from __future__ import annotations

import html
import logging
import threading
import weakref

import torch

from app import limits, training_data
from app.core import AppError, Database, Generation, Studio
from app.messages import problem
from app.render import attribution_html
from precompute import attribution as cache
from prism.attribution import CachedIndex, query_gradient, top_sequences
from prism.grad_cache import StoredGradients

logger = logging.getLogger(__name__)

RUNS = ("original", "intervened", "prompt")
EMPTY = "Click a generated token to see the training sequences behind it."
BUILDING = "prism-attribution-building"  # the class of the panel's line while the first-start cache is not ready


class CacheNotReady(AppError):
    """The cache is the first-start build's, which is still running (or stopped): the message is its status."""


def build_status_html(text: str) -> str:
    """The panel's one line about the first-start build: the click's answer, kept fresh by the page's timer."""
    return f'<p class="prism-attribution-status {BUILDING}">{html.escape(text)}</p>'


# Three readings: "gradient" (the default) keeps, of each training sequence, the positions that predicted this very
# token and reads the trained layers' gradients there (the gradient store, StoredGradients.query); "token" asks the
# same through the token's active prototypes (CachedIndex.token_scores, block-diagonal); "sequence" is the
# sequence's whole loss through them and the prototypes co-used with them (CachedIndex.scores with the exact second
# stage). READINGS: value -> the radio's label.
READINGS = {"gradient": "where they predicted this token (layers' gradients)",
            "token": "where they predicted this token (prototypes)", "sequence": "their whole loss (prototypes)"}
READING_CHOICES = [(label, value) for value, label in READINGS.items()]
DEFAULT_READING = "gradient"
# What the measured recall means, in one line under the panel's head (bench.attribution_truth, RESULTS.md).
MEASURED = {
    "gradient": ("How often this is right, measured: for 120 made-up facts planted in a 300k-token training set, the "
                 "planted sequence was in this top 10 for every one of them (learned or not); EK-FAC influence "
                 "found 99.7% at 60x the cost per query (batched 120 at a time), a plain word search (BM25) 100%."),
    "token": ("How often this is right, measured: for 120 made-up facts planted in a 300k-token training set, the "
              "planted sequence was in this top 10 for 91% of them (87% of those a longer-trained model had "
              "learned); a plain word search (BM25) found 100%, and so did EK-FAC influence, about 50x slower."),
    "sequence": ("How often this is right, measured: for 120 made-up facts planted in a 300k-token training set, the "
                 "planted sequence was in this top 10 for 72% of them (71% of those a longer-trained model had "
                 "learned); reading where they predicted this token finds 91%, a word search (BM25) and EK-FAC "
                 "influence 100%."),
}

CacheDatabase = Database | training_data.ReadOnly  # the served database, or the first-start build's
_indexes: weakref.WeakKeyDictionary[CacheDatabase, CachedIndex] = weakref.WeakKeyDictionary()
_gradients: weakref.WeakKeyDictionary[CacheDatabase, StoredGradients | None] = weakref.WeakKeyDictionary()
_catalogs: weakref.WeakKeyDictionary[CacheDatabase, cache.SequenceCatalog] = weakref.WeakKeyDictionary()
# the states entering the trained layers of a whole text (1, T, d) where its generation did not keep them (a text
# longer than limits.keep_states_tokens keeps none), computed on a click and kept beside the generation while it
# lives and is at most that long
_start_states: weakref.WeakKeyDictionary[Generation, torch.Tensor] = weakref.WeakKeyDictionary()
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
        raise CacheNotReady(build.status())
    return ready


def start_states(studio: Studio, stored: StoredGradients, gen: Generation, position: int) -> torch.Tensor:
    """(1, >= position + 1, d): the states entering the trained layers for gen's text: as its generation kept them
    (Generation.layer_states: a click runs no frozen layer), else computed once per text (_start_states) when it is
    short enough, else for the tokens up to `position` only, on every click."""
    if studio.start_layer == stored.cache.start_layer:
        generated = gen.layer_states()
        if generated is not None and generated.shape[1] > position:
            return generated
    ids = gen.input_ids()
    with _lock:
        kept = _start_states.get(gen)
    if kept is not None and kept.shape[1] == ids.shape[1]:
        return kept
    if ids.shape[1] > studio.limits.keep_states_tokens:
        return stored.start_states(ids[:, : position + 1])
    states = stored.start_states(ids)
    with _lock:
        _start_states[gen] = states
    return states


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


def gradients_for(studio: Studio, db: CacheDatabase) -> StoredGradients | None:
    """The database's gradient store, memory-mapped on first use; None when its build wrote none."""
    with _lock:
        if db not in _gradients:
            _gradients[db] = db.run(cache.load_gradient_store, studio.model, db.path)
        return _gradients[db]




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


def check_reading(reading) -> str:
    """'gradient', 'token' or 'sequence' (READINGS), else AppError."""
    if not isinstance(reading, str) or reading not in READINGS:
        raise AppError(f"reading must be {' or '.join(repr(r) for r in READINGS)}, got {limits.shown(reading)}")
    return reading


def attribute_token(studio: Studio, gen: Generation, index: int, top: int = 10, in_prompt: bool = False,
                    reading: str = DEFAULT_READING) -> dict:
    """The top training sequences for generated token `index` of `gen` (with in_prompt: its prompt's token
    `index`), with scores, documents and spans; `reading` as READINGS says ("reading" in the result: the one
    used, "token" where a "gradient" reading was asked of a cache without a gradient store, with "note")."""
    check_reading(reading)
    db = cache_database(studio)
    cached = index_for(studio, db)
    if cached.n_prototypes != studio.n_prototypes:
        raise AppError(f"the attribution cache describes {cached.n_prototypes} prototypes but the model has "
                       f"{studio.n_prototypes}: rebuild it for this model")
    target = studio.target(gen, index, in_prompt)
    index, position, token = target.index, target.position, target.token_id
    note = None
    stored = gradients_for(studio, db) if reading == "gradient" else None
    if reading == "gradient" and stored is None:
        reading, note = "token", ("this attribution cache has no gradient store (built before it existed, or "
                                  "with --attribution-grad-rank 0): shown where they predicted this token through "
                                  "its prototypes; rebuild the cache for the gradient reading")
    z = studio.state(gen, index, in_prompt)  # (d,)
    ids, rows = query_gradient(studio.model, None, position, token, z=z)
    head = {"index": index, "in_prompt": in_prompt, "position": position, "token_id": token,
            "token": studio.tokenizer.decode([token]), "reading": reading, "n_sequences": cached.n_sequences,
            "note": note}
    if stored is not None:
        input_ids = gen.input_ids()[:, : position + 1]
        scores, seq, pos, value = stored.query(input_ids, position, token,
                                               states=start_states(studio, stored, gen, position))
        scores = scores.numpy()
        best = [s for s in (int(s) for s in top_sequences(scores, top)) if scores[s] > 0]
        sequences = db.run(cache.gradient_rows, studio.tokenizer, best, scores, seq.numpy(), pos.numpy(),
                           value.numpy(), token, catalog=_catalogs[db])
        message = None if sequences else ("no training sequence predicted this token in a way that lowers its "
                                          "loss through the trained layers")
        return {**head, "prototype_ids": [int(i) for i in ids], "sequences": sequences, "message": message}
    if len(ids) == 0:
        return {**head, "prototype_ids": [], "sequences": [], "message": "no prototype is active at this token"}
    if reading == "token":
        scores, parts = cached.token_scores(ids, rows, token)
        if not (scores > 0).any():
            return {**head, "prototype_ids": [int(i) for i in ids], "sequences": [],
                    "message": "no training sequence predicted this token through its active prototypes in a way "
                               "that lowers its loss: read their whole loss instead"}
    else:
        scores, parts = cached.scores(ids, rows)
    best = [int(s) for s in top_sequences(scores, top)]
    if reading == "token":
        best = [s for s in best if scores[s] > 0]  # a sequence that never predicted the token scores 0: not shown
    sequences = db.run(cache.attribution_rows, studio.tokenizer, best, scores, parts, store=cached.exact,
                       catalog=_catalogs[db], token=token if reading == "token" else None)
    for row in sequences:
        for p in row["prototypes"]:
            p["label"], p["category"] = studio.label(p["prototype_id"])
    return {**head, "prototype_ids": [int(i) for i in ids], "sequences": sequences, "message": None}


def attribution_panel(studio: Studio, run: str, index, session, reading=DEFAULT_READING) -> tuple[str, dict | None]:
    """Gradio handler: (panel HTML, data) for the selected token of the original or intervened text."""
    try:
        if run not in RUNS:
            raise AppError(f"run must be 'original', 'intervened' or 'prompt', got {limits.shown(run)}")
        reading = check_reading(reading)
        gen = session.intervened if run == "intervened" else session.original
        if gen is None:
            raise AppError("there is no intervened text" if run == "intervened" else "generate first")
        data = attribute_token(studio, gen, limits.whole("the token index", index, -2**31, 2**31, default=0),
                               in_prompt=run == "prompt", reading=reading)
    except CacheNotReady as err:  # one line, which the page's timer keeps fresh (app/ui.py)
        return build_status_html(problem(err)), None
    except AppError as err:
        return f'<p class="prism-attribution-status">{html.escape(problem(err))}</p>', None
    which = "prompt token" if run == "prompt" else "token"
    active = ", ".join(f"#{p}" for p in data["prototype_ids"])
    reading = data["reading"]
    if reading == "gradient":
        how = (f"the training sequences whose tokens predicted {html.escape(repr(data['token']))} in the way that "
               f"most lowered its loss, read in the trained layers' gradients; highlighted: those positions")
        kind = "EK-FAC influence in a projection of the trained layers' gradients"
    elif reading == "token":
        how = (f"the training sequences whose tokens predicted {html.escape(repr(data['token']))} through the "
               f"token's active prototypes {active} in the way that most lowered its loss (highlighted: those "
               f"positions)")
    else:
        how = (f"the training sequences whose whole loss gradient, through the token's active prototypes {active} "
               f"and those co-used with them, most lowered its loss")
    if reading != "gradient":
        kind = "cached prototype-space influence"
    head = (f'<p class="prism-attribution-status"><b>Training data behind {which} {data["index"]} '
            f'{html.escape(repr(data["token"]))}</b>: {how} '
            f'({kind}, {data["n_sequences"]:,} training sequences searched).</p>'
            f'<p class="prism-attribution-measured">{html.escape(MEASURED[reading])}</p>')
    if data.get("note"):
        head += f'<p class="prism-attribution-status">{html.escape(data["note"][:1].upper() + data["note"][1:])}.</p>'
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
