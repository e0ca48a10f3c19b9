"""The attribution cache's read side: what the app and the benchmark read back from the tables the attribution
job wrote (its factors, the in-memory index, training sequences with their documents and highlighted spans).

    if has_attribution(con):
        index = load_index(con, model.lm_head.weight)                  # CachedIndex, loaded once per database
        scores, parts = index.scores(ids, rows)                        # a query: a sparse product
        rows = attribution_rows(con, tokenizer, best, scores, parts)   # documents, spans, segments to highlight
"""

from __future__ import annotations

import logging

import duckdb
import numpy as np
import torch

from precompute.runs import job_done
from prism.attribution import (
    BlockWhitening,
    CachedIndex,
    Curvature,
)

logger = logging.getLogger("precompute.attribution")

NAME = "attribution"  # the job's row in `runs`, its tables in schema.JOB_TABLES
BUILD_HINT = ("this database has no attribution cache: build one into a copy of it with `python -m "
              "precompute.attribution --model MODEL --corpus CORPUS --db DB` (README: Training data behind a token)")


def has_attribution(con: duckdb.DuckDBPyConnection) -> bool:
    return job_done(con, NAME)


def load_factors(con: duckdb.DuckDBPyConnection) -> dict[str, np.ndarray]:
    """Every named matrix of attribution_factors as float32 arrays (rows in order)."""
    cursor = con.cursor()
    try:
        table = cursor.sql('SELECT name, "values" FROM attribution_factors ORDER BY name, row').to_arrow_table()
    finally:
        cursor.close()
    names = np.asarray(table.column("name").to_pylist())
    values = table.column("values").combine_chunks()
    flat = values.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    offsets = values.offsets.to_numpy()
    out = {}
    for name in dict.fromkeys(names.tolist()):
        rows = np.flatnonzero(names == name)
        lo, hi = offsets[rows[0]], offsets[rows[-1] + 1]
        out[name] = flat[lo:hi].reshape(len(rows), -1)
    return out


def index_parts(factors: dict[str, np.ndarray]) -> tuple[BlockWhitening, torch.Tensor]:
    whitening = BlockWhitening(output_vectors=torch.from_numpy(factors["output_vectors"]),
                               output_values=torch.from_numpy(factors["output_values"][0]),
                               coactivation_diag=torch.from_numpy(np.diagonal(factors["coactivation"]).copy()),
                               damping=float(factors["damping"][0, 0]))
    return whitening, torch.from_numpy(factors["basis"])


def load_curvature(con: duckdb.DuckDBPyConnection, factors: dict[str, np.ndarray] | None = None) -> Curvature:
    """The stored curvature A (x) S + lambda (the reference level; the coupled query side of the cached level)."""
    f = load_factors(con) if factors is None else factors
    return Curvature.from_eigen(torch.from_numpy(f["coactivation"]), torch.from_numpy(f["output_vectors"]),
                                torch.from_numpy(f["output_values"][0]), float(f["damping"][0, 0]))


def load_index(con: duckdb.DuckDBPyConnection, output_embeddings: torch.Tensor, mode: str = "coupled",
               extra: int | None = None, coverage: float = 0.99, batch_rows: int = 1 << 16) -> CachedIndex:
    """Every cached vector and entry in memory, grouped by prototype (what a query reads); streamed from the
    database in batches into preallocated arrays, so loading never holds two copies. output_embeddings: the
    model's LM head weight W (V, d)."""
    if not has_attribution(con):
        raise LookupError(BUILD_HINT)
    factors = load_factors(con)
    whitening, basis = index_parts(factors)
    rank = basis.shape[1]
    n_rows, n_entries = con.execute("SELECT count(*), coalesce(sum(len(activations)), 0) "
                                    "FROM attribution_vectors").fetchone()
    prototype_ids, sequence_ids = np.empty(n_rows, np.int64), np.empty(n_rows, np.int64)
    vectors, counts = np.empty((n_rows, rank), np.float32), np.empty(n_rows, np.int64)
    targets, activations = np.empty(n_entries, np.int64), np.empty(n_entries, np.float32)
    cursor = con.cursor()  # a relation streams from a connection with no other result pending
    try:
        reader = cursor.sql("SELECT prototype_id, sequence_id, vector, activations, target_ids "
                            "FROM attribution_vectors ORDER BY prototype_id, sequence_id").to_arrow_reader(batch_rows)
        row = entry = 0
        for batch in reader:
            n = batch.num_rows
            prototype_ids[row: row + n] = batch.column(0).to_numpy()
            sequence_ids[row: row + n] = batch.column(1).to_numpy()
            vectors[row: row + n] = batch.column(2).flatten().to_numpy(zero_copy_only=False).reshape(n, rank)
            acts = batch.column(3)
            counts[row: row + n] = np.diff(acts.offsets.to_numpy())
            m = int(counts[row: row + n].sum())
            activations[entry: entry + m] = acts.flatten().to_numpy(zero_copy_only=False)
            targets[entry: entry + m] = batch.column(4).flatten().to_numpy(zero_copy_only=False)
            row, entry = row + n, entry + m
    finally:
        cursor.close()
    n_sequences = con.execute("SELECT count(*) FROM attribution_sequences").fetchone()[0]
    coupling = load_curvature(con, factors) if mode == "coupled" else None
    return CachedIndex(whitening, basis, prototype_ids, sequence_ids, vectors, counts, targets, activations,
                       output_embeddings, n_sequences, len(factors["coactivation"]), coupling=coupling, mode=mode,
                       extra=extra, coverage=coverage)


def sequences(con: duckdb.DuckDBPyConnection) -> list[dict]:
    """Every training sequence with its document pointers, by sequence_id."""
    cur = con.execute("SELECT s.sequence_id, s.doc_id, s.seq_token_start, s.seq_token_end, s.char_start, s.char_end, "
                      "s.n_targets, d.text, d.sha256 FROM attribution_sequences s "
                      "JOIN attribution_documents d USING (doc_id) ORDER BY s.sequence_id")
    names = [c[0] for c in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def document_text(doc_id: str, text: str | None, sha256: str) -> str:
    """The stored text, or for a pointer-only database the installed corpus's text checked against sha256."""
    if text is not None:
        return text
    from precompute.query import _resolve_text

    return _resolve_text(doc_id, sha256)


def sequence_token_ids(con: duckdb.DuckDBPyConnection, tokenizer) -> list[np.ndarray]:
    """The exact input ids of every training sequence, re-tokenized from its document (as the job did)."""
    out, cache = [], {}
    for row in sequences(con):
        if row["doc_id"] not in cache:
            text = document_text(row["doc_id"], row["text"], row["sha256"])
            cache = {row["doc_id"]: np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)}
        out.append(cache[row["doc_id"]][row["seq_token_start"]: row["seq_token_end"]])
    return out


def attribution_rows(con: duckdb.DuckDBPyConnection, tokenizer, sequence_ids: list[int], scores: np.ndarray,
                     parts: dict[int, np.ndarray], context_chars: int = 240) -> list[dict]:
    """The top training sequences as the app shows them: score, document, spans, the prototypes that carry the
    score, and the text around the tokens where those prototypes are active, highlighted by their share."""
    if not sequence_ids:
        return []
    marks = ", ".join("?" for _ in sequence_ids)
    cur = con.execute(f"""
        SELECT s.sequence_id, s.doc_id, s.seq_token_start, s.seq_token_end, s.char_start, s.char_end,
               d.source, d.url, d.title, d.text, d.sha256
        FROM attribution_sequences s JOIN attribution_documents d USING (doc_id)
        WHERE s.sequence_id IN ({marks})""", [int(s) for s in sequence_ids])
    names = [c[0] for c in cur.description]
    meta = {r[0]: dict(zip(names, r)) for r in cur.fetchall()}
    proto_ids = sorted(parts)
    where = ", ".join("?" for _ in proto_ids) or "NULL"
    active = con.execute(f"""
        SELECT sequence_id, prototype_id, token_positions, activations FROM attribution_vectors
        WHERE sequence_id IN ({marks}) AND prototype_id IN ({where})""",
                         [int(s) for s in sequence_ids] + proto_ids).fetchall()
    out = []
    for rank, sid in enumerate(sequence_ids):
        row = meta[int(sid)]
        text, error = None, None
        try:
            text = document_text(row["doc_id"], row.pop("text"), row["sha256"])
        except (KeyError, ValueError, ImportError) as err:
            error = str(err)
        shares = {p: float(parts[p][sid]) for p in proto_ids}
        weight: dict[int, float] = {}  # token position in the sequence -> highlight weight
        for s, p, positions, acts in active:
            if s == sid:
                for pos, act in zip(positions, acts):
                    weight[pos] = weight.get(pos, 0.0) + float(act) * max(shares[p], 0.0)
        segments = [] if text is None else _highlight(text, tokenizer, row, weight, context_chars)
        out.append({**row, "rank": rank, "score": float(scores[sid]),
                    "prototypes": [{"prototype_id": p, "contribution": shares[p]}
                                   for p in sorted(proto_ids, key=lambda p: -shares[p])],
                    "segments": segments, "error": error})
    return out


def _highlight(text: str, tokenizer, row: dict, weight: dict[int, float], context_chars: int) -> list[dict]:
    """The sequence's text as segments {text, activation in [0, 1], target}: tokens weighted by `weight`, the
    heaviest one the target, cut to context_chars around the highlighted tokens."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"][row["seq_token_start"]: row["seq_token_end"]]
    lo_char, hi_char = row["char_start"], row["char_end"]
    top = max(weight.values(), default=0.0)
    if top > 0:
        marked = [offsets[p] for p in weight if p < len(offsets)]
        lo_char = max(lo_char, min(a for a, _ in marked) - context_chars)
        hi_char = min(hi_char, max(b for _, b in marked) + context_chars)
    best = max(weight, key=weight.get) if top > 0 else None
    pieces, cursor = [], lo_char
    for pos, (a, b) in enumerate(offsets):
        if b <= lo_char or a >= hi_char:
            continue
        if a > cursor:
            pieces.append({"text": text[cursor:a], "activation": 0.0, "target": False})
        w = weight.get(pos, 0.0) / top if top > 0 else 0.0
        pieces.append({"text": text[max(a, cursor):b], "activation": w, "target": pos == best})
        cursor = b
    return pieces
