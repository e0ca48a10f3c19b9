"""The attribution cache's read side: what the app and the benchmark read back from the tables the attribution
job wrote (its factors, the in-memory index, training sequences with their documents and highlighted spans).

    if has_attribution(con):
        index = load_index(con, model.lm_head.weight)                  # CachedIndex, loaded once per database
        scores, parts = index.scores(ids, rows)                        # a query: a sparse product
        rows = attribution_rows(con, tokenizer, best, scores, parts)   # documents, spans, segments to highlight
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import torch
from safetensors.torch import load_file

from precompute.runs import job_done, job_run_id
from prism.attribution import (
    BlockWhitening,
    CachedIndex,
    Curvature,
    ExactStore,
)
from prism.grad_cache import GradientCache, StoredGradients, TokenGradientIndex

logger = logging.getLogger("precompute.attribution")

NAME = "attribution"  # the job's row in `runs`, its tables in schema.JOB_TABLES
BUILD_HINT = ("this database has no attribution cache: build one into a copy of it with `python -m "
              "precompute.attribution --model MODEL --corpus CORPUS --db DB` (docs/COMMANDS.md: Training data "
              "behind a token)")


# The app's second stage: a click scores every training sequence with the cached rows, then its RERANK best again,
# exactly, where the build wrote its exact store (the reference's own scores for them). On a 24,576-sequence cache
# the reference's top 10 shares 0.79 with the first stage alone, 0.97 with the 50 best rescored exactly, 0.99 with
# 100 (docs/RESULTS.md); the second stage's cost grows with RERANK.
RERANK = 50


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
               extra: int | None = None, coverage: float = 0.99, batch_rows: int = 1 << 16,
               folder: str | Path | None = None, rerank: int = 0,
               exact: ExactStore | None = None) -> CachedIndex:
    """Every cached vector and entry, grouped by prototype (what a query reads). output_embeddings: the model's LM
    head weight W (V, d).

    folder=None: loaded into memory. folder=a path: the arrays are written there once as .npy files (made in a
    temporary folder and renamed, so a crash leaves nothing half-written) and memory-mapped, so opening the cache
    costs the pages a query touches, not the whole index (2.1 GB of vectors for 24,576 sequences of 64 tokens);
    a folder already holding them is reused. Either way the rows are streamed from the database in batches and
    scattered to their sorted place (no ORDER BY over the whole table, no second copy).

    rerank=M scores the first stage's M best sequences again, exactly, from `exact` (load_exact_store; without
    one there is no second stage and rerank is ignored)."""
    if not has_attribution(con):
        raise LookupError(BUILD_HINT)
    factors = load_factors(con)
    whitening, basis = index_parts(factors)
    if folder is None:
        arrays = _read_index_arrays(con, int(basis.shape[1]), lambda name, shape, dtype: np.empty(shape, dtype),
                                    batch_rows)
    else:
        arrays = _index_folder(con, Path(folder), int(basis.shape[1]), batch_rows, _database_path(con))
    n_sequences = con.execute("SELECT count(*) FROM attribution_sequences").fetchone()[0]
    coupling = load_curvature(con, factors) if mode == "coupled" else None
    return CachedIndex(whitening, basis, arrays["prototype_ids"], arrays["sequence_ids"], arrays["vectors"],
                       arrays["counts"], arrays["targets"], arrays["activations"], output_embeddings, n_sequences,
                       len(factors["coactivation"]), coupling=coupling, mode=mode, extra=extra, coverage=coverage,
                       rerank=rerank if exact is not None else 0, exact=exact)


def _database_path(con: duckdb.DuckDBPyConnection) -> Path | None:
    """The file behind the connection's database (written beside a memory-mapped index so stale ones can go)."""
    row = con.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()
    return Path(row[0]).resolve() if row and row[0] else None


def _read_only(con: duckdb.DuckDBPyConnection) -> bool:
    row = con.execute("SELECT readonly FROM duckdb_databases() WHERE database_name = current_database()").fetchone()
    return bool(row and row[0])


def progress_file(db: str | Path) -> Path:
    """Where a running attribution job says how far it got (job.Progress writes it, read_progress reads it)."""
    return Path(db).with_name(Path(db).name + ".progress.json")


def read_progress(db: str | Path) -> dict | None:
    """The last progress a job building into `db` reported ({"phase", "done", "total", "eta_s", ...}), or None."""
    try:
        return json.loads(progress_file(db).read_text())
    except (OSError, ValueError):
        return None


def exact_folder(db: str | Path) -> Path:
    """Where the build keeps its exact store (prism.attribution.ExactStore) beside the database."""
    return Path(db).with_name(Path(db).name + ".attribution-exact")


EXACT_ARRAYS = ("rows", "scales", "prototypes", "offsets")
# Each row's entries (token position, activation, predicted token), for the panel's highlighting without a database
# query; a store written before they were added (still format 2) scores the same and the panel reads the database.
EXACT_ENTRY_ARRAYS = ("entry_counts", "entry_positions", "entry_activations", "entry_targets")
# 2: exact gradient rows per (sequence, prototype) in the eigenbasis of S; 1 (no "format" in meta.json): per-token
# z and e, which this version does not read (rebuild with --overwrite)
EXACT_FORMAT = 2


def load_exact_store(con: duckdb.DuckDBPyConnection, db_path: str | Path | None = None) -> ExactStore | None:
    """The exact store the build wrote beside the database, memory-mapped; None when there is none, it belongs
    to another build of the cache or it is of an older format (logged)."""
    path = Path(db_path) if db_path is not None else _database_path(con)
    if path is None:
        return None
    folder = exact_folder(path)
    if not (folder / "meta.json").is_file():
        return None
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("format") != EXACT_FORMAT or not all((folder / f"{n}.npy").is_file() for n in EXACT_ARRAYS):
        logger.warning("ignoring %s: an exact store of format %s, this version reads format %d; rebuild the "
                       "attribution cache with --overwrite for the exact second stage", folder,
                       meta.get("format", 1), EXACT_FORMAT)
        return None
    n_sequences = con.execute("SELECT count(*) FROM attribution_sequences").fetchone()[0]
    if meta.get("run_id") != job_run_id(con, NAME) or meta.get("n_sequences") != n_sequences:
        logger.warning("ignoring %s: it was written by another build of the attribution cache", folder)
        return None
    # copy-on-write maps: never written, but writable arrays become tensors without a copy or a warning
    arrays = {n: np.load(folder / f"{n}.npy", mmap_mode="c") for n in EXACT_ARRAYS}
    entries = None
    if all((folder / f"{n}.npy").is_file() for n in EXACT_ENTRY_ARRAYS):
        entries = {n.removeprefix("entry_"): np.load(folder / f"{n}.npy", mmap_mode="r") for n in EXACT_ENTRY_ARRAYS}
    return ExactStore(arrays["rows"], np.asarray(arrays["scales"]), np.asarray(arrays["prototypes"]),
                      np.asarray(arrays["offsets"]), entries=entries)


def gradient_folder(db: str | Path) -> Path:
    """Where the build keeps its gradient store (prism.grad_cache.StoredGradients) beside the database."""
    return Path(db).with_name(Path(db).name + ".attribution-gradients")


GRADIENT_ARRAYS = ("token", "sequence", "position", "x", "d")
GRADIENT_FORMAT = 1


def load_gradient_store(con: duckdb.DuckDBPyConnection, model, db_path: str | Path | None = None
                        ) -> StoredGradients | None:
    """The gradient store the build wrote beside the database (job.write_gradient_store), memory-mapped, for
    `model`; None when there is none (built with --attribution-grad-rank 0, or before the store existed), it
    belongs to another build of the cache, or does not fit the model (logged)."""
    path = Path(db_path) if db_path is not None else _database_path(con)
    if path is None:
        return None
    folder = gradient_folder(path)
    if not (folder / "meta.json").is_file():
        return None
    meta = json.loads((folder / "meta.json").read_text())
    files = [folder / f"{n}.npy" for n in GRADIENT_ARRAYS] + [folder / "preconditioner.safetensors"]
    if meta.get("format") != GRADIENT_FORMAT or not all(f.is_file() for f in files):
        logger.warning("ignoring %s: a gradient store of format %s, this version reads format %d; rebuild the "
                       "attribution cache with --overwrite", folder, meta.get("format"), GRADIENT_FORMAT)
        return None
    n_sequences = con.execute("SELECT count(*) FROM attribution_sequences").fetchone()[0]
    if meta.get("run_id") != job_run_id(con, NAME) or meta.get("n_sequences") != n_sequences:
        logger.warning("ignoring %s: it was written by another build of the attribution cache", folder)
        return None
    try:
        grads = GradientCache(model, int(meta["start_layer"]), rank=int(meta["rank"]), seed=int(meta["seed"]))
        if [name for name, _ in grads.modules] != meta["modules"]:
            raise ValueError(f"it describes layers {meta['modules'][:2]}..., the model has "
                             f"{[name for name, _ in grads.modules][:2]}...")
        grads.load_state(load_file(str(folder / "preconditioner.safetensors")))
    except (ValueError, KeyError) as err:
        logger.warning("ignoring %s: %s", folder, err)
        return None
    # copy-on-write maps: never written, but writable arrays become tensors without a copy or a warning
    arrays = {n: torch.from_numpy(np.load(folder / f"{n}.npy", mmap_mode="c")) for n in GRADIENT_ARRAYS}
    index = TokenGradientIndex.from_sorted(arrays["token"], arrays["sequence"], arrays["x"], arrays["d"],
                                           n_sequences, position=arrays["position"])
    return StoredGradients(grads, index)


INDEX_ARRAYS = ("prototype_ids", "sequence_ids", "vectors", "counts", "targets", "activations")


def _read_index_arrays(con: duckdb.DuckDBPyConnection, rank: int, allocate, batch_rows: int) -> dict[str, np.ndarray]:
    """The index's arrays sorted by (prototype, sequence), entries row after row, into arrays from
    allocate(name, shape, dtype). Two passes: the keys and entry counts of every row (by rowid), then the vectors
    and entries, each scattered to its row's sorted position."""
    cursor = con.cursor()  # a relation streams from a connection with no other result pending
    try:
        keys = cursor.sql("SELECT rowid, prototype_id, sequence_id, len(activations) AS n FROM attribution_vectors"
                          ).fetchnumpy()
        rowid = np.asarray(keys["rowid"], np.int64)
        prototype_ids, sequence_ids = (np.asarray(keys[c], np.int64) for c in ("prototype_id", "sequence_id"))
        counts = np.asarray(keys["n"], np.int64)
        order = np.lexsort((sequence_ids, prototype_ids))
        destination = np.zeros(int(rowid.max()) + 1 if len(rowid) else 0, np.int64)  # rowid -> sorted row
        destination[rowid[order]] = np.arange(len(order))
        n_rows, n_entries = len(order), int(counts.sum())
        out = {"prototype_ids": allocate("prototype_ids", (n_rows,), np.int64),
               "sequence_ids": allocate("sequence_ids", (n_rows,), np.int64),
               "vectors": allocate("vectors", (n_rows, rank), np.float32),
               "counts": allocate("counts", (n_rows,), np.int64),
               "targets": allocate("targets", (n_entries,), np.int64),
               "activations": allocate("activations", (n_entries,), np.float32)}
        out["prototype_ids"][:] = prototype_ids[order]
        out["sequence_ids"][:] = sequence_ids[order]
        out["counts"][:] = counts[order]
        entry_start = np.zeros(n_rows + 1, np.int64)
        np.cumsum(out["counts"], out=entry_start[1:])
        del keys, prototype_ids, sequence_ids, counts, order
        reader = cursor.sql("SELECT rowid, vector, activations, target_ids FROM attribution_vectors"
                            ).to_arrow_reader(batch_rows)
        for batch in reader:
            rows = destination[batch.column(0).to_numpy()]
            n = len(rows)
            out["vectors"][rows] = batch.column(1).flatten().to_numpy(zero_copy_only=False).reshape(n, rank)
            acts = batch.column(2)
            sizes = np.diff(acts.offsets.to_numpy()).astype(np.int64)
            local = np.repeat(np.cumsum(sizes) - sizes, sizes)  # each entry's row start within the batch
            where = np.repeat(entry_start[rows], sizes) + (np.arange(int(sizes.sum())) - local)
            out["activations"][where] = acts.flatten().to_numpy(zero_copy_only=False)
            out["targets"][where] = batch.column(3).flatten().to_numpy(zero_copy_only=False)
    finally:
        cursor.close()
    return out


# Memory DuckDB may use in the process that writes a memory-mapped index (its buffer pool would otherwise keep much
# of the table it scanned: +1.1 GB for a 12,288-sequence cache when the app wrote the index itself).
WRITER_MEMORY_LIMIT = "512MB"


def _index_folder(con: duckdb.DuckDBPyConnection, folder: Path, rank: int, batch_rows: int,
                  source: Path | None = None) -> dict[str, np.ndarray]:
    """The index's arrays memory-mapped from folder, written there first unless it already holds them.

    A read-only database with a file behind it is read by a child process (_write_index_process): the scan of the
    whole attribution table then leaves nothing behind in this process (the app's), whose DuckDB buffer pool would
    keep the pages it read. A writable connection holds the file's lock, so it is read here."""
    if not all((folder / f"{name}.npy").is_file() for name in INDEX_ARRAYS):
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            if source is not None and _read_only(con):
                _write_index_process(source, tmp, rank, batch_rows)
            else:
                _write_index_arrays(con, tmp, rank, batch_rows)
            (tmp / "source.txt").write_text(str(source) if source else "")
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder (a crash before this rename)
            try:
                tmp.rename(folder)
            except OSError:  # another process finished the same folder first
                if not all((folder / f"{name}.npy").is_file() for name in INDEX_ARRAYS):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in INDEX_ARRAYS}


def _write_index_arrays(con: duckdb.DuckDBPyConnection, folder: Path, rank: int, batch_rows: int) -> None:
    arrays = _read_index_arrays(
        con, rank, lambda name, shape, dtype: np.lib.format.open_memmap(folder / f"{name}.npy", "w+", dtype, shape),
        batch_rows)
    for a in arrays.values():
        a.flush()


def _write_index_process(db: Path, folder: Path, rank: int, batch_rows: int) -> None:
    """Write the index's .npy files into folder from a child process with its own read-only connection (DuckDB
    memory capped at WRITER_MEMORY_LIMIT). OSError if it fails, so the app falls back to an in-memory index."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-c", "import sys; from precompute.attribution.cache import _index_writer_main; "
            "_index_writer_main(sys.argv[1:])", str(db), str(folder), str(rank), str(batch_rows)]
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise OSError(f"writing the attribution index from {db} failed: {tail[0]}")


def _index_writer_main(argv: list[str]) -> None:
    """The child process of _write_index_process: DB FOLDER RANK BATCH_ROWS."""
    db, folder, rank, batch_rows = argv
    con = duckdb.connect(db, read_only=True, config={"enable_external_access": False,
                                                     "memory_limit": WRITER_MEMORY_LIMIT})
    try:
        _write_index_arrays(con, Path(folder), int(rank), int(batch_rows))
    finally:
        con.close()


def index_folder_for(db_path: str | Path, root: str | Path | None = None) -> Path:
    """Where the app keeps a database's memory-mapped index: ROOT/attribution-index/<path hash>-<version hash>
    (ROOT: prism.backbones.cache_dir()), the version from the file's size and modification time, so a rebuilt
    database gets a new folder; folders of the same path's older versions are removed."""
    from prism.backbones import cache_dir

    db_path = Path(db_path).resolve()
    stat = db_path.stat()
    base = Path(root) if root is not None else cache_dir()
    where = hashlib.sha256(str(db_path).encode()).hexdigest()[:16]
    version = hashlib.sha256(f"{INDEX_FORMAT}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = base / "attribution-index" / f"{where}-{version}"
    if folder.parent.is_dir():  # drop folders of this path's older versions and of databases that are gone
        for old in folder.parent.iterdir():
            source = old / "source.txt"
            gone = source.is_file() and not Path(source.read_text()).exists()
            if old != folder and ".tmp-" not in old.name and (old.name.startswith(f"{where}-") or gone):
                shutil.rmtree(old, ignore_errors=True)
    return folder


INDEX_FORMAT = 1  # raise when the folder's arrays change meaning


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


class SequenceCatalog:
    """Every training sequence's span and its document's fields, in memory (3.2 MB for 3,072 sequences, their
    text included), so the panel's rows need no database query per click (2.5 ms of its 7). Stored document text is
    kept too while it totals at most TEXT_BUDGET characters (0.8 MB for the 152 documents behind 3,072 default
    sequences), else read from the database per click; a pointer-only database's text comes from the installed
    corpus either way."""

    TEXT_BUDGET = 64_000_000

    COLUMNS = ("sequence_id", "doc_id", "seq_token_start", "seq_token_end", "char_start", "char_end", "source", "url",
               "title", "text", "sha256")  # the panel's row, in order (the catalog keeps "stores its text" for text)
    SELECT = """
        SELECT s.sequence_id, s.doc_id, s.seq_token_start, s.seq_token_end, s.char_start, s.char_end,
               d.source, d.url, d.title, {text}, d.sha256
        FROM attribution_sequences s JOIN attribution_documents d USING (doc_id)"""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        cur = con.execute(self.SELECT.format(text="d.text IS NOT NULL"))
        self._rows = {r[0]: r for r in cur.fetchall()}  # sequence id -> the row, with "stores its text" for text
        stored = con.execute("SELECT coalesce(sum(length(text)), 0) FROM attribution_documents").fetchone()[0]
        self._text = dict(con.execute("SELECT doc_id, text FROM attribution_documents WHERE text IS NOT NULL"
                                      ).fetchall()) if stored <= self.TEXT_BUDGET else None

    @classmethod
    def rows(cls, con: duckdb.DuckDBPyConnection, sequence_ids: list[int],
             catalog: SequenceCatalog | None = None) -> dict[int, dict]:
        """{sequence id: the panel's row} for the given sequences: from the catalog when given (its kept text, or
        over its budget one query for the documents that store theirs), else one query."""
        ids = [int(s) for s in sequence_ids]
        if catalog is None:
            marks = ", ".join("?" for _ in ids)
            cur = con.execute(cls.SELECT.format(text="d.text") + f" WHERE s.sequence_id IN ({marks})", ids)
            return {r[0]: dict(zip(cls.COLUMNS, r)) for r in cur.fetchall()}
        out = {s: dict(zip(cls.COLUMNS, catalog._rows[s])) for s in ids if s in catalog._rows}
        stored = sorted({r["doc_id"] for r in out.values() if r["text"]})
        if catalog._text is not None:
            text = catalog._text
        elif stored:
            text = dict(con.execute(f"SELECT doc_id, text FROM attribution_documents WHERE doc_id IN "
                                    f"({', '.join('?' for _ in stored)})", stored).fetchall())
        else:
            text = {}
        for r in out.values():
            r["text"] = text.get(r["doc_id"])
        return out


def attribution_rows(con: duckdb.DuckDBPyConnection, tokenizer, sequence_ids: list[int], scores: np.ndarray,
                     parts: dict[int, np.ndarray], context_chars: int = 240,
                     store: ExactStore | None = None, catalog: SequenceCatalog | None = None,
                     token: int | None = None) -> list[dict]:
    """The top training sequences as the app shows them: score, document, spans, the prototypes that carry the
    score, and the text around the tokens where those prototypes are active, highlighted by their share (with
    `token`: only the positions that predicted that token, the ones the same-token reading scores). Where
    they were active comes from the exact store's entries when it has them (a slice per sequence), else from the
    database (one query over the sequences' rows); their documents and spans from `catalog` when given (no query
    for a pointer-only database), else from the database."""
    if not sequence_ids:
        return []
    meta = SequenceCatalog.rows(con, sequence_ids, catalog)
    # each prototype's share in each of these sequences (a reranked query holds hundreds of prototypes, most of
    # them zero in any one sequence)
    proto_ids = np.fromiter(parts, np.int64, len(parts))
    share_of = np.stack([parts[p][np.asarray(sequence_ids, np.int64)] for p in proto_ids.tolist()]) if len(parts) \
        else np.zeros((0, len(sequence_ids)))  # (P, n)
    row_of = np.full(int(proto_ids.max()) + 1 if len(proto_ids) else 0, -1)  # prototype id -> row of share_of
    row_of[proto_ids] = np.arange(len(proto_ids))
    held = set(proto_ids[np.any(share_of != 0, axis=1)].tolist())
    active = _active_entries(con, sequence_ids, held, store)
    out = []
    for rank, sid in enumerate(sequence_ids):
        row = meta[int(sid)]
        text, error = _row_text(row)
        carried = np.flatnonzero(share_of[:, rank])
        carried = carried[np.lexsort((proto_ids[carried], -share_of[carried, rank]))]  # largest share first
        prototype, positions, acts, target_ids = active[int(sid)]
        if token is not None:  # the positions that predicted the token, and only those
            keep = target_ids == int(token)
            prototype, positions, acts, target_ids = prototype[keep], positions[keep], acts[keep], target_ids[keep]
        gain = acts * np.maximum(share_of[row_of[prototype], rank], 0.0)  # every entry's prototype is held
        at, where = np.unique(positions, return_inverse=True)
        # token position in the sequence -> highlight weight, and -> the token that follows it (as recorded)
        weight = dict(zip(at.tolist(), np.bincount(where, gain, minlength=len(at)).tolist()))
        targets = dict(zip(positions.tolist(), target_ids.tolist()))
        segments = [] if text is None else _highlight(text, tokenizer, row, weight, context_chars, targets)
        out.append({**row, "rank": rank, "score": float(scores[sid]),
                    "prototypes": [{"prototype_id": p, "contribution": c} for p, c in
                                   zip(proto_ids[carried].tolist(), share_of[carried, rank].tolist())],
                    "segments": segments, "error": error})
    return out


def _row_text(row: dict) -> tuple[str | None, str | None]:
    """A sequence row's document text (its "text" popped: a pointer-only database reads it from the package), or
    why it could not be read."""
    try:
        return document_text(row["doc_id"], row.pop("text"), row["sha256"]), None
    except (KeyError, ValueError, ImportError) as err:
        return None, str(err)


def gradient_rows(con: duckdb.DuckDBPyConnection, tokenizer, sequence_ids: list[int], scores: np.ndarray,
                  sequence: np.ndarray, position: np.ndarray, value: np.ndarray, token: int,
                  context_chars: int = 240, catalog: SequenceCatalog | None = None) -> list[dict]:
    """The top training sequences of the gradient store's reading (StoredGradients.query) as the app shows them:
    score, document, spans, and the text around the positions that predicted `token`, highlighted by their part
    of the score (those that raised the loss are not highlighted). No prototypes carry these scores: "prototypes"
    is empty."""
    if not sequence_ids:
        return []
    meta = SequenceCatalog.rows(con, sequence_ids, catalog)
    out = []
    for rank, sid in enumerate(sequence_ids):
        row = meta[int(sid)]
        text, error = _row_text(row)
        mine = sequence == int(sid)
        weight: dict[int, float] = {}
        for pos, v in zip(position[mine].tolist(), value[mine].tolist()):
            weight[pos] = weight.get(pos, 0.0) + max(v, 0.0)
        segments = [] if text is None else _highlight(text, tokenizer, row, weight, context_chars,
                                                      {pos: int(token) for pos in weight})
        out.append({**row, "rank": rank, "score": float(scores[sid]), "prototypes": [], "segments": segments,
                    "error": error})
    return out


def _active_entries(con: duckdb.DuckDBPyConnection, sequence_ids: list[int], held: set[int],
                    store: ExactStore | None) -> dict[int, tuple[np.ndarray, ...]]:
    """Per sequence, its entries of the prototypes in `held`: (prototype, position, activation, target) arrays."""
    out = {}
    if store is not None and store.entries is not None:
        held_ids = np.fromiter(held, np.int64, len(held))
        for sid in sequence_ids:
            prototype, *rest = store.active(int(sid))
            keep = np.isin(prototype, held_ids)
            out[int(sid)] = (prototype[keep], *(a[keep] for a in rest))
        return out
    # one equality per sequence: each reads only the row groups of its sequence (rows are stored in sequence
    # order), where an IN list scans the whole table (26 -> 8 ms for 10 sequences of a 24,576-sequence cache)
    union = " UNION ALL ".join("SELECT sequence_id, prototype_id, token_positions, activations, target_ids "
                               "FROM attribution_vectors WHERE sequence_id = ?" for _ in sequence_ids)
    found: dict[int, list[list]] = {int(s): [[], [], [], []] for s in sequence_ids}
    for s, p, positions, acts, target_ids in con.execute(union, [int(s) for s in sequence_ids]).fetchall():
        if p in held:
            for column, values in zip(found[s], ([p] * len(positions), positions, acts, target_ids)):
                column.extend(values)
    for s, (prototype, positions, acts, target_ids) in found.items():
        out[s] = (np.asarray(prototype, np.int64), np.asarray(positions, np.int64), np.asarray(acts, np.float64),
                  np.asarray(target_ids, np.int64))
    return out


def window_offsets(text: str, tokenizer, row: dict, targets: dict[int, int]) -> list[tuple[int, int]]:
    """Character offsets in `text` of the sequence's tokens (seq_token_start..seq_token_end of the document's
    tokenization). Tokenizing only the sequence's characters is enough when it gives the same tokens: as many, and
    at every position the cache recorded, the same next token (`targets`: position -> token id); otherwise (a
    window that starts inside a word can split differently) the whole document is tokenized, as the job did. A
    long document costs tens of milliseconds to tokenize, its window well under one."""
    n = row["seq_token_end"] - row["seq_token_start"]
    lo, hi = row["char_start"], row["char_end"]
    enc = tokenizer(text[lo:hi], add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if len(ids) == n and all(ids[p + 1] == t for p, t in targets.items() if p + 1 < n):
        return [(a + lo, b + lo) for a, b in enc["offset_mapping"]]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["offset_mapping"][row["seq_token_start"]: row["seq_token_end"]]


def _highlight(text: str, tokenizer, row: dict, weight: dict[int, float], context_chars: int,
               targets: dict[int, int] | None = None) -> list[dict]:
    """The sequence's text as segments {text, activation in [0, 1], target}: tokens weighted by `weight`, the
    heaviest one the target, cut to context_chars around the highlighted tokens."""
    offsets = window_offsets(text, tokenizer, row, targets or {})
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
