"""Cached prototype-space attribution against EK-FAC (kronfluence) and the reference, on one model and corpus sample.

    python -m bench.attribution --model runs/prism/final --db out.duckdb --corpus default \
        --n-train 4096 --seq-len 128 --n-queries 50

Steps (the paper's goals: cached >= 470x faster per query than EK-FAC at no more memory, top-10 overlap >= 0.80):
1. the attribution job (precompute/attribution/) builds the cache into --db over the first --n-train windows of
   --corpus, in its own process (one-off cost: cached_build_s, cached_build_peak_rss_mb). A database that already
   holds the job is used as it is (its own sequences and settings) unless --rebuild.
2. shared inputs, in --work: the training sequences' token ids (read back from the database, so every level sees
   the same sequences), --n-queries queries (a prompt cut from a document the cache does not hold, and the model's
   greedy token after it: a generated token, as in the app), and, only for the levels that run the trainable
   layers themselves, the hidden states entering the first trainable layer for every training sequence (one pass
   of the frozen layers: states_s).
3. the levels, each in its own process so its peak RSS is its own (ru_maxrss of that process):
   cached    the query's forward pass, its k gradient rows and the sparse product, per query (cached_query_ms);
             a click in the app (cached_click_ms): the gradient rows from the state kept during generation, the
             product and the top sequences' highlighted text (cached_text_ms), with speedup_click against EK-FAC;
   ekfac     kronfluence EK-FAC over the trainable layers: fit (ekfac_fit_s), then the queries' states and pairwise
             scores against every training sequence, divided by the number of queries (ekfac_query_ms, amortised
             over query batches of --ekfac-query-batch: every batch is one pass over the training sequences, so
             one query asked alone costs about a whole pass and a larger batch costs less per query, as long as
             its preconditioned gradients fit in memory);
   reference exact gradients with the full coupled curvature (reference_s, all queries), from the per-token
             files (z, e, active prototypes) the cache build's fit pass kept when this bench built the cache
             (the attribution job's keep-tokens hook), else by running the trainable layers over every sequence
             (reference_source says which; the test suite checks both give the same scores).
Prints one JSON line: latencies, one-off costs, the speed-up (ekfac_query_ms / cached_query_ms), peak RSS of each,
and the mean top-10 overlap of cached vs reference (and of EK-FAC vs reference, for scale).

Cost on a CPU: every EK-FAC pass (two to fit, one per query batch) runs the trainable layers and the LM head
forward and backward on every training token; with a 49k vocabulary that is about 0.2 GFLOP per token and pass,
hours for 4096 x 128 tokens on two cores. --ekfac-queries 10 scores one query batch (the per-query cost is the
same); the reference and the cached level take minutes.

--resume keeps what still fits: the prepared inputs when the settings that made them match and the database holds
the same training sequences (compared by content), and each finished level whose own settings match (so a new
--coverage, or another database with the same sequences, re-runs only the levels that read it).

--in-process runs every step in this process (for tests: fast, but then the RSS numbers are this process's peak).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import torch

from precompute import attribution as cache
from precompute.inputs import document_windows
from prism import cli
from prism.attribution import Query, pad_batch, query_gradient, reference_scores, top_overlap, top_sequences

logger = logging.getLogger("bench.attribution")

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ("cached", "ekfac", "reference")
TOP = 10
GOALS = {"speedup": 470.0, "memory_ratio": 1.0, "top10_overlap": 0.80}


# ----------------------------------------------------------------------------------------------------------------
# Shared inputs.


class States:
    """Hidden states entering start_layer for every training sequence: one flat float32 file read by offset
    (plain reads, not a memory map, so a level's RSS holds only what it uses)."""

    def __init__(self, path: Path, offsets: np.ndarray, d_model: int) -> None:
        self.path, self.offsets, self.d = path, offsets, d_model

    def __call__(self, i: int) -> torch.Tensor:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        with self.path.open("rb") as f:
            f.seek(lo * self.d * 4)
            return torch.from_numpy(np.frombuffer(f.read((hi - lo) * self.d * 4), np.float32).reshape(hi - lo, self.d)
                                    .copy())

    def batch(self, index: torch.Tensor, length: int) -> torch.Tensor:
        out = torch.zeros(len(index), length, self.d)
        for b, i in enumerate(index.tolist()):
            s = self(i)
            out[b, : len(s)] = s
        return out


def _load_model(path: str):
    from precompute.inputs import load_model

    model, tokenizer, _ = load_model(path)
    return model.eval(), tokenizer


def start_layer_of(model, peer_layers: int | None) -> int:
    """The peer's first layer: the top peer_layers, else the layers the model trained (the attribution job's
    gradient store reads the same ones)."""
    from prism.grad_cache import trained_start_layer

    if not peer_layers:
        return trained_start_layer(model)
    return model.n_layers - max(1, min(peer_layers, model.n_layers))


@torch.no_grad()
def choose_queries(model, tokenizer, ns, train_ids: list[np.ndarray], train_docs: set[str]) -> tuple[list, str]:
    """n queries: a prompt cut from a held-out document (else from a training sequence) and the greedy token."""
    rng = np.random.default_rng(ns.seed)
    windows, source = [], "held-out"
    if ns.corpus:
        from precompute.inputs import load_corpus

        documents, _ = load_corpus(ns.corpus)
        for i, doc in enumerate(documents):
            if doc.doc_id in train_docs:
                continue
            windows += [w.ids for w in document_windows(i, doc.text, tokenizer, ns.seq_len)[0] if len(w.ids) >= 4]
            if len(windows) >= 4 * ns.n_queries or i > 100_000:
                break
    if len(windows) < ns.n_queries:
        windows, source = [w for w in train_ids if len(w) >= 4], "train"
    picks = rng.choice(len(windows), size=min(ns.n_queries, len(windows)), replace=False)
    queries = []
    for j in picks.tolist():
        w = np.asarray(windows[j], np.int64)
        t = int(rng.integers(min(8, len(w) - 2), len(w) - 1))
        z, _ = model.final_states(torch.from_numpy(w[None, : t + 1]))
        token = int(model.lm_head(z[0, t]).argmax())
        queries.append(Query(tuple(w[: t + 1].tolist()), t, token))
    return queries, source


def _database_sequences(db: str, tokenizer) -> tuple[list[np.ndarray], set[str], int]:
    """The cache's training sequences (token ids), the documents they come from, and the cache's rank."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        train_ids = cache.sequence_token_ids(con, tokenizer)
        train_docs = {r[0] for r in con.execute("SELECT doc_id FROM attribution_documents").fetchall()}
        rank = int(cache.load_factors(con)["basis"].shape[1])
    finally:
        con.close()
    return train_ids, train_docs, rank


def _offsets(train_ids: list[np.ndarray]) -> np.ndarray:
    offsets = np.zeros(len(train_ids) + 1, np.int64)
    offsets[1:] = np.cumsum([len(s) for s in train_ids])
    return offsets


@torch.no_grad()
def prepare(ns, work: Path) -> dict:
    """Token ids of the training sequences, the queries and the start-layer states, into the work folder."""
    model, tokenizer = _load_model(ns.model)
    train_ids, train_docs, rank = _database_sequences(ns.db, tokenizer)
    queries, source = choose_queries(model, tokenizer, ns, train_ids, train_docs)
    layer = start_layer_of(model, ns.peer_layers)
    offsets = _offsets(train_ids)
    np.savez(work / "train.npz", ids=np.concatenate(train_ids), offsets=offsets)
    (work / "queries.json").write_text(json.dumps([q.__dict__ for q in queries]))
    meta = {"start_layer": layer, "n_layers": model.n_layers, "query_source": source, "rank": rank,
            "states_s": None, "n_train": len(train_ids), "train_tokens": int(offsets[-1]),
            "n_queries": len(queries), "seq_len": max(len(s) for s in train_ids), "d_model": model.d_model,
            "n_prototypes": model.config.n_prototypes, "top_k": model.config.top_k}
    (work / "meta.json").write_text(json.dumps(meta))
    return meta


@torch.no_grad()
def ensure_states(ns, work: Path) -> dict:
    """The hidden states entering the first trainable layer for every training sequence (WORK/states.f32), for
    the levels that run the trainable layers themselves (EK-FAC; the reference without the job's token files);
    kept when already complete. Returns the updated meta (states_s: the pass's time)."""
    meta = json.loads((work / "meta.json").read_text())
    path = work / "states.f32"
    if meta.get("states_s") is not None and path.is_file() and \
            path.stat().st_size == meta["train_tokens"] * meta["d_model"] * 4:
        return meta
    model, _ = _load_model(ns.model)
    _, train, _, _ = _inputs(work)
    t0 = time.perf_counter()
    with path.open("wb") as f:
        for lo in range(0, len(train), ns.batch_size):
            part = train[lo: lo + ns.batch_size]
            ids, mask = pad_batch(part)
            states = model.states_before_layer(ids, meta["start_layer"], attention_mask=mask)  # (B, T, d)
            for b, s in enumerate(part):
                f.write(states[b, : len(s)].float().numpy().tobytes())
    meta["states_s"] = time.perf_counter() - t0
    (work / "meta.json").write_text(json.dumps(meta))
    return meta


def kept_tokens(ns, train: list[np.ndarray]) -> Path | None:
    """The attribution job's per-token files for this database (kept by the keep-tokens hook) if they hold exactly these
    training sequences' target tokens, else None."""
    kept = cache.kept_tokens_folder(Path(ns.db))
    try:
        meta = json.loads((kept / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    n_tokens = sum(len(s) - 1 for s in train)
    size_ok = (kept / "z.bin").is_file() and (kept / "z.bin").stat().st_size == n_tokens * meta["d_model"] * 4
    return kept if meta["n_sequences"] == len(train) and meta["n_tokens"] == n_tokens and size_ok else None


def reference_from_tokens(model, curvature, queries: list[Query], kept: Path, n_sequences: int,
                          chunk: int = 1 << 15) -> np.ndarray:
    """The reference's scores from the job's per-token files: the same exact per-sequence gradients
    (sequence_gradients of each token's z, e and active prototypes) without running the model over the training
    sequences again. A sequence split across two chunks adds up the same (the scorer accumulates by index)."""
    from precompute.attribution.job import TokenFiles
    from prism.attribution import ReferenceScorer, TokenStats, sequence_gradients

    meta = json.loads((kept / "meta.json").read_text())
    files = TokenFiles(kept, meta["d_model"], meta["top_k"])
    grads = [query_gradient(model, q.prefix(), q.position, q.token) for q in queries]
    scorer = ReferenceScorer(curvature, grads, n_sequences, model.config.n_prototypes)
    empty = torch.zeros(0)
    for lo in range(0, meta["n_tokens"], chunk):
        part = files.read(lo, min(lo + chunk, meta["n_tokens"]))
        whole = {k: torch.from_numpy(v.astype(np.float32 if k in ("z", "e", "acts") else np.int64))
                 for k, v in part.items()}
        stats = TokenStats(z=whole["z"], e=whole["e"], m=empty, prototype_ids=whole["ids"],
                           activations=whole["acts"], sequence=whole["seq"][:, 0], position=whole["pos"][:, 0],
                           target=whole["y"][:, 0], loss=empty, prob_sum=empty)
        scorer.add(sequence_gradients(model.prototypes.weight, stats))
    return scorer.scores.numpy()


def _inputs(work: Path):
    meta = json.loads((work / "meta.json").read_text())
    with np.load(work / "train.npz") as z:
        ids, offsets = z["ids"], z["offsets"]
    train = [ids[offsets[i]: offsets[i + 1]] for i in range(len(offsets) - 1)]
    queries = [Query(tuple(q["input_ids"]), q["position"], q["token"]) for q in
               json.loads((work / "queries.json").read_text())]
    return meta, train, queries, States(work / "states.f32", offsets, meta["d_model"])


# ----------------------------------------------------------------------------------------------------------------
# The levels (each writes WORK/<level>.json and WORK/<level>_scores.npy).


def run_cached(ns, work: Path) -> dict:
    meta, _, queries, _ = _inputs(work)
    model, tokenizer = _load_model(ns.model)
    con = duckdb.connect(str(ns.db), read_only=True)
    t0 = time.perf_counter()
    store = cache.load_exact_store(con, ns.db) if ns.rerank else None
    index = cache.load_index(con, model.lm_head.weight, mode=ns.mode, extra=ns.extra, coverage=ns.coverage,
                             folder=work / "index" if ns.mmap else None, rerank=ns.rerank, exact=store)
    catalog = cache.SequenceCatalog(con)  # as the app keeps it
    load_s = time.perf_counter() - t0
    latency, product, click, text, scores, read = [], [], [], [], [], []
    with torch.no_grad():
        for q in queries:
            t0 = time.perf_counter()
            z, _ = model.final_states(q.prefix())  # the query's forward pass: its active prototypes and error
            t_state = time.perf_counter()
            ids, rows = query_gradient(model, None, q.position, q.token, z=z[0, q.position])
            t1 = time.perf_counter()
            s, parts = index.scores(ids, rows)
            best = top_sequences(s, TOP)
            t2 = time.perf_counter()
            cache.attribution_rows(con, tokenizer, [int(b) for b in best], s, parts, store=index.exact,
                                   catalog=catalog)  # the panel's text
            t3 = time.perf_counter()
            latency.append(t2 - t0)
            product.append(t2 - t1)
            text.append(t3 - t2)
            click.append(t3 - t_state)  # in the app the state was kept from generation: no forward pass
            read.append(len(parts))
            scores.append(s)
    con.close()
    np.save(work / "cached_scores.npy", np.asarray(scores, np.float32))
    return {"cached_mode": ns.mode, "cached_extra": ns.extra, "cached_coverage": ns.coverage,
            "cached_rerank": index.rerank, "cached_exact": store is not None,
            "cached_prototypes_read": statistics.fmean(read), "cached_load_s": load_s,
            "cached_index_mb": index.nbytes / 1e6,
            "cached_query_ms": 1e3 * statistics.fmean(latency), "cached_query_ms_p50": 1e3 * statistics.median(latency),
            "cached_product_ms": 1e3 * statistics.fmean(product), "cached_text_ms": 1e3 * statistics.fmean(text),
            "cached_click_ms": 1e3 * statistics.fmean(click), "cached_click_ms_p50": 1e3 * statistics.median(click),
            "cached_mmap": ns.mmap}


def run_ekfac(ns, work: Path) -> dict:
    from bench.attribution_ekfac import EkfacPeer, SequenceDataset

    meta, train, queries, states = _inputs(work)
    queries = queries[: ns.ekfac_queries or None]
    model, _ = _load_model(ns.model)
    layer = meta["start_layer"]
    train_set = SequenceDataset(train, states, meta["seq_len"])
    t0 = time.perf_counter()
    peer = EkfacPeer(model, layer, work / "kronfluence")
    peer.fit(train_set, batch_size=ns.batch_size, max_examples=ns.ekfac_fit_sequences)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():  # the queries' own pass through the frozen layers counts as query cost
        q_ids = [np.asarray(q.input_ids[: q.position + 1] + (q.token,), np.int64) for q in queries]
        q_states = [model.states_before_layer(torch.from_numpy(ids[None]), layer)[0] for ids in q_ids]
    query_set = SequenceDataset(q_ids, lambda i: q_states[i], max(len(i) for i in q_ids),
                                target_positions=[[q.position] for q in queries])
    scores = peer.scores(query_set, train_set, query_batch=ns.ekfac_query_batch, train_batch=ns.batch_size)
    total = time.perf_counter() - t0
    np.save(work / "ekfac_scores.npy", scores.float().numpy())
    return {"ekfac_fit_s": fit_s, "ekfac_fit_sequences": min(len(train), ns.ekfac_fit_sequences or len(train)),
            "ekfac_query_ms": 1e3 * total / len(queries), "ekfac_query_total_s": total,
            "ekfac_query_batch": ns.ekfac_query_batch, "ekfac_n_queries": len(queries), "ekfac_modules": peer.n_tracked}


def run_reference(ns, work: Path) -> dict:
    meta, train, queries, states = _inputs(work)
    model, _ = _load_model(ns.model)
    con = duckdb.connect(str(ns.db), read_only=True)
    curvature = cache.load_curvature(con)
    con.close()
    layer = meta["start_layer"]

    def final_states(ids, mask, index):
        z, _ = model.final_states(ids, attention_mask=mask, start_layer=layer,
                                  start_states=states.batch(index, ids.shape[1]))
        return z

    t0 = time.perf_counter()
    kept = kept_tokens(ns, train)
    with torch.no_grad():
        if kept is not None:
            scores = reference_from_tokens(model, curvature, queries, kept, len(train))
        else:
            scores = reference_scores(model, curvature, queries, train, ns.batch_size, final_states)
    np.save(work / "reference_scores.npy", scores.astype(np.float32))
    return {"reference_s": time.perf_counter() - t0,
            "reference_source": "the attribution job's token files" if kept is not None else "a forward pass"}


RUNNERS = {"cached": run_cached, "ekfac": run_ekfac, "reference": run_reference}
# What --resume compares. The prepared inputs (training ids, queries, states) depend on PREPARE_KEYS and on the
# training sequences themselves (checked by content, so another database holding the same sequences reuses them);
# each finished level is reused only when its own LEVEL_KEYS match too, so changing, say, --coverage or the
# database's cache re-runs the cached level alone.
PREPARE_KEYS = ("model", "corpus", "n_train", "seq_len", "n_queries", "batch_size", "peer_layers", "seed")
LEVEL_KEYS = {"cached": ("db", "rank", "damping", "mode", "extra", "coverage", "mmap", "rerank"),
              "ekfac": ("ekfac_query_batch", "ekfac_queries", "ekfac_fit_sequences"),
              "reference": ("db", "rank", "damping")}
RESUME_KEYS = PREPARE_KEYS + tuple(dict.fromkeys(k for keys in LEVEL_KEYS.values() for k in keys))


# ----------------------------------------------------------------------------------------------------------------
# Orchestration.


def _child(argv: list[str], env_extra: dict[str, str] | None = None) -> float:
    """Run a command in its own process; returns its peak RSS in MB (ru_maxrss of that process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **(env_extra or {})}
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed with exit code {proc.returncode}")
    return usage.ru_maxrss / 1024


def _self_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ensure_cache(ns) -> dict:
    """Build the attribution cache unless the database holds it; its one-off cost."""
    db = Path(ns.db)
    if db.is_file() and not ns.rebuild:
        con = duckdb.connect(str(db), read_only=True)
        try:
            built = cache.has_attribution(con)
        except duckdb.Error:
            built = False
        finally:
            con.close()
        if built:
            logger.info("using the attribution cache already in %s", db)
            return {"cached_build_s": None, "cached_build_peak_rss_mb": None, "cache_reused": True}
    if not ns.corpus:
        raise SystemExit("bench.attribution: the database has no attribution cache; give --corpus to build it")
    argv = ["-m", "precompute.attribution", "--model", ns.model, "--corpus", ns.corpus, "--db", str(db),
            "--seq-len", str(ns.seq_len), "--batch-size", str(ns.batch_size), "--attribution-max-sequences",
            str(ns.n_train), "--attribution-rank", str(ns.rank), "--attribution-damping", str(ns.damping)]
    if ns.rebuild:
        argv.append("--overwrite")
    t0 = time.perf_counter()
    if ns.in_process:
        from precompute.attribution.__main__ import main as build_cache

        build_cache([*argv[2:], "--hook", "keep-tokens=1"])
        rss = _self_rss_mb()
    else:
        rss = _child([*argv, "--hook", "keep-tokens=1"])  # the reference level reads the fit pass's token files
    return {"cached_build_s": time.perf_counter() - t0, "cached_build_peak_rss_mb": rss, "cache_reused": False}


def _training_fingerprint(ids: np.ndarray, offsets: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, np.int64).tobytes() +
                          np.ascontiguousarray(offsets, np.int64).tobytes()).hexdigest()


def _database_fingerprint(ns) -> tuple[str, int]:
    """The fingerprint of the training sequences the database's cache holds, and its rank."""
    from precompute.inputs import DEFAULT_MODEL
    from prism.backbones import load_tokenizer

    tokenizer = load_tokenizer(str(DEFAULT_MODEL if ns.model == "default" else ns.model))
    train_ids, _, rank = _database_sequences(ns.db, tokenizer)
    return _training_fingerprint(np.concatenate(train_ids), _offsets(train_ids)), rank


def _reusable_inputs(ns, work: Path, settings: dict) -> int | None:
    """--resume: the rank of the database's cache if the folder's prepared inputs fit these settings and the
    database's training sequences, else None."""
    try:
        stored = json.loads((work / "settings.json").read_text())
        if not (work / "meta.json").is_file() or any(stored.get(k) != settings[k] for k in PREPARE_KEYS):
            return None
        with np.load(work / "train.npz") as z:
            prepared = _training_fingerprint(z["ids"], z["offsets"])
    except (OSError, ValueError, KeyError):
        return None
    fingerprint, rank = _database_fingerprint(ns)
    return rank if prepared == fingerprint else None


def _level_settings(work: Path, level: str) -> dict:
    """The settings a finished level ran with (older folders: the folder's settings.json)."""
    done = json.loads((work / f"{level}.json").read_text())
    return done.get("settings") or json.loads((work / "settings.json").read_text())


def run(ns) -> dict:
    work = Path(ns.work) if ns.work else Path(ns.db).with_name(Path(ns.db).name + ".bench-attribution")
    settings = {k: getattr(ns, k) for k in RESUME_KEYS}
    result: dict = {"model": Path(ns.model).name}
    result.update(ensure_cache(ns))  # the attribution job resumes on its own
    rank = _reusable_inputs(ns, work, settings) if ns.resume and (work / "settings.json").is_file() else None
    resumed = rank is not None
    if ns.resume and work.exists() and not resumed:
        logger.warning("%s was made for other inputs (or is incomplete): starting afresh", work)
    if resumed:
        meta = json.loads((work / "meta.json").read_text())
        meta["rank"] = rank  # the cache in use now, which may not be the one the inputs were prepared with
        result.update(meta)
    else:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        result.update(prepare(ns, work))
        (work / "settings.json").write_text(json.dumps(settings))  # only now is the folder worth resuming
    gc.collect()
    levels = ns.levels.split(",")
    if "ekfac" in levels or ("reference" in levels and kept_tokens(ns, _inputs(work)[1]) is None):
        result.update(ensure_states(ns, work))
    for level in levels:
        done = work / f"{level}.json"
        if resumed and done.is_file() and (work / f"{level}_scores.npy").is_file():
            ran_with = _level_settings(work, level)
            if all(ran_with.get(k) == settings[k] for k in LEVEL_KEYS[level]):
                logger.info("level %s already measured in %s (--resume)", level, work)
                result.update({k: v for k, v in json.loads(done.read_text()).items() if k != "settings"})
                continue
            logger.info("level %s was measured with other settings: running it again", level)
        if ns.in_process:
            out = RUNNERS[level](ns, work)
            out[f"{level}_peak_rss_mb"] = _self_rss_mb()
        else:
            rss = _child(["-m", "bench.attribution", *ns.argv, "--level", level, "--work", str(work)])
            out = json.loads(done.read_text())
            out[f"{level}_peak_rss_mb"] = rss
        # with its peak RSS and its settings, so a resumed run reports it too and knows what it measured
        done.write_text(json.dumps({**out, "settings": {k: settings[k] for k in LEVEL_KEYS[level]}}))
        result.update(out)
    result["rss_per_level_process"] = not ns.in_process
    scores = {lvl: np.load(work / f"{lvl}_scores.npy") for lvl in LEVELS if (work / f"{lvl}_scores.npy").exists()}
    if "cached" in scores and "reference" in scores:
        result["top10_overlap"] = float(np.mean([top_overlap(c, r, TOP) for c, r in
                                                 zip(scores["cached"], scores["reference"])]))
    if "ekfac" in scores and "reference" in scores:
        result["top10_overlap_ekfac_reference"] = float(np.mean([top_overlap(e, r, TOP) for e, r in
                                                                 zip(scores["ekfac"], scores["reference"])]))
    if "cached" in scores and "ekfac" in scores:
        result["speedup"] = result["ekfac_query_ms"] / result["cached_query_ms"]
        if result.get("cached_click_ms"):
            result["speedup_click"] = result["ekfac_query_ms"] / result["cached_click_ms"]
        result["memory_ratio"] = result["cached_peak_rss_mb"] / result["ekfac_peak_rss_mb"]
        result["goals_met"] = {"speedup": result["speedup"] >= GOALS["speedup"],
                               "memory": result["memory_ratio"] <= GOALS["memory_ratio"],
                               "top10_overlap": result.get("top10_overlap", 0.0) >= GOALS["top10_overlap"]}
    if not ns.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m bench.attribution", __doc__)
    parser.add_argument("--model", required=True, help="a PRISM model folder (save_pretrained, tokenizer beside it)")
    parser.add_argument("--db", required=True, help="its precompute database; the attribution cache is built into "
                                                    "it when missing")
    parser.add_argument("--corpus", default=None, help="the training corpus (needed to build the cache; held-out "
                                                       "documents give the queries)")
    parser.add_argument("--n-train", type=int, default=4096, help="training sequences when building the cache")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence when building")
    parser.add_argument("--n-queries", type=int, default=50, help="held-out query tokens to attribute")
    parser.add_argument("--rank", type=int, default=128, help="cached coordinates per vector when building (0: all)")
    parser.add_argument("--damping", type=float, default=0.1, help="relative damping when building")
    parser.add_argument("--mode", choices=("coupled", "block"), default="coupled",
                        help="cached query side: coupled curvature (default) or block-diagonal")
    parser.add_argument("--extra", type=int, default=None,
                        help="coupled mode: read this many prototypes beyond the query's active ones (default: "
                             "as many as --coverage needs, at most 8 k in all)")
    parser.add_argument("--coverage", type=float, default=0.99,
                        help="coupled mode: share of the preconditioned query's squared norm the read prototypes "
                             "must hold")
    parser.add_argument("--rerank", type=int, default=cache.RERANK,
                        help="coupled mode: score the first stage's best N sequences again, exactly, from the "
                             "build's exact store where the database has one (0: off; default "
                             f"{cache.RERANK}, as the app)")
    parser.add_argument("--mmap", action="store_true",
                        help="cached level: memory-map the index from WORK/index as the app does (peak RSS then "
                             "counts the pages queries touch) instead of loading it into memory")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward/backward pass, all levels")
    parser.add_argument("--ekfac-query-batch", type=int, default=10,
                        help="queries kronfluence scores per pass over the training sequences")
    parser.add_argument("--ekfac-queries", type=int, default=None,
                        help="score only the first N queries with EK-FAC (each query batch is a full pass over the "
                             "training sequences; its per-query cost does not depend on how many batches run)")
    parser.add_argument("--ekfac-fit-sequences", type=int, default=None,
                        help="fit EK-FAC's factors on the first N training sequences only (default: all; the "
                             "scores always cover every sequence)")
    parser.add_argument("--peer-layers", type=int, default=None,
                        help="top layers EK-FAC tracks (default: the layers the checkpoint trained, else 2)")
    parser.add_argument("--levels", default=",".join(LEVELS), help="comma-separated subset of cached,ekfac,reference")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cache even if the database holds one")
    parser.add_argument("--work", default=None, help="scratch folder (default: beside the database)")
    parser.add_argument("--keep-work", action="store_true", help="keep the scratch folder (scores, states)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the scratch folder of an earlier run: prepared inputs and finished levels are kept "
                             "where their settings still match, the rest runs; a failed run always leaves its folder")
    parser.add_argument("--in-process", action="store_true", help="run every level in this process (tests)")
    parser.add_argument("--seed", type=int, default=0, help="which queries")
    parser.add_argument("--level", choices=LEVELS, default=None, help=argparse.SUPPRESS)  # internal: one level
    return parser


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = cli.parse(parser, argv)
    unknown = [lvl for lvl in ns.levels.split(",") if lvl not in LEVELS]
    if unknown:
        cli.fail(parser, f"unknown levels {unknown}; levels are {', '.join(LEVELS)}")
    if ns.level is not None:  # a child process: one level, result into the work folder
        out = RUNNERS[ns.level](ns, Path(ns.work))
        (Path(ns.work) / f"{ns.level}.json").write_text(json.dumps(out))
        return out
    ns.argv = [a for a in argv if a not in ("--in-process",)]
    result = run(ns)
    cli.print_json(result)
    return result


if __name__ == "__main__":
    main()
