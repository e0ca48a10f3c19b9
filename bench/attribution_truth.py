"""Attribution against the truth: fictional facts planted in an ordinary corpus, and which methods find them (issue 41).

    python -m bench.attribution_truth --work runs/truth                       # every stage, resumable
    python -m bench.attribution_truth --work runs/truth --stages report       # the table again
    python -m bench.attribution_truth --work runs/truth --tokens 20000 --facts 12 --epochs 1 --n-prototypes 64 \
        --top-k 4 --backbone tests/tiny-llama                                # a smoke run in minutes

Stages (each writes its result into WORK and is skipped when that result is there and its settings match):
corpus     documents drawn from --corpus (seeded, whole documents cut at --max-doc-chars, no source above
           --max-source-share of the tokens) until --tokens training tokens: WORK/base.jsonl; --facts fictional
           facts (bench/planted_facts.py) planted into 1-3 training documents each: WORK/planted.jsonl and
           WORK/facts.jsonl (subject, prompt, answer, the documents and offsets that hold it).
train      four runs of prism.train with the same arguments (the shipped configuration: top 2 layers, K, k, the
           loss weights), --epochs passes over the data: PRISM and its dense baseline on the planted corpus, and
           both again on the base corpus ("the same model trained without it").
learned    per fact, the answer's log-probability after its prompt under each model; learned = the planted model
           gives it at least --learned-nats more than the model trained without it.
attribute  the methods, side by side in one run over the planted model's training sequences (the attribution job's
           windows of the planted corpus's training documents), each query being a fact's answer token after its
           prompt: cached (the app's first stage), cached+rerank (its exact second stage), the reference (exact
           prototype-space gradients, full coupled curvature), EK-FAC (kronfluence, the same trainable layers),
           BM25 (rank_bm25 over the sequences' text; query = prompt + answer) and sentence-embedding neighbours
           (all-MiniLM-L6-v2, cosine); and cached_same_token, the cache read for the training tokens that
           predicted the answer token itself (CachedIndex.same_token_scores), with the coupled curvature and
           with the block-diagonal one (the query's own active prototypes only: cached_same_token_block); and
           grad_cache, a projected gradient cache of the trainable layers (prism/grad_cache.py: --grad-rank,
           optionally K-FAC-whitened projections (--grad-whiten), EK-FAC in the projected space;
           grad_cache_raw: the plain dot product; grad_cache_same_token: read at the positions that predicted the
           answer token, prism.grad_cache.TokenGradientIndex); and cached_gradient, the app's default reading
           as the app reads it: the gradient store the attribution job wrote (--grad-rank) and
           StoredGradients.query. Each method's per-query latency and its process's peak RSS.
report     recall@1, recall@10 (the share of a fact's planted sequences in the top 1 / 10) and MRR (first planted
           sequence), over learned facts and over all, with a 95% bootstrap interval; and over all facts with the
           "siblings" left out of the ranking (the copies of other facts with the same relation and answer, which
           differ from this fact's statement only in the invented subject); one JSON line, and WORK/report.md.

Ground truth of a fact: the training sequences whose text holds its whole statement (a copy cut by a window
boundary taught the model nothing about it within one sequence, and counts in neither the truth nor the recall).

Length: about 900 lines, on purpose: like prism/train.py, it reads top to bottom in the order a run happens (corpus,
training, learned, the methods, the report), each stage beside the record that lets it resume, and the methods it
does not borrow from bench/attribution.py (BM25, embeddings, the same-token reading, the gradient cache's pass) are
a few lines each.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from prism import cli

logger = logging.getLogger("bench.attribution_truth")

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("corpus", "train", "learned", "attribute", "report")
RUNS = ("prism-planted", "prism-base", "dense-planted", "dense-base")
METHODS = ("cached", "cached_rerank", "cached_same_token", "cached_same_token_block", "reference", "ekfac", "bm25",
           "embedding", "grad_cache", "grad_cache_raw", "grad_cache_same_token", "cached_gradient")
# run by this module, each in a child process of its own
CHILD_METHODS = ("bm25", "embedding", "cached_same_token", "cached_same_token_block", "grad_cache", "grad_cache_raw",
                 "grad_cache_same_token", "cached_gradient")
TOP = 10
DEEP = 100  # the report's deep recall: what a second stage over the best DEEP candidates could at most find


# ----------------------------------------------------------------------------------------------------------------
# Bookkeeping: a stage's result with the settings it ran with.


def _done(work: Path, name: str, settings: dict) -> dict | None:
    path = work / f"{name}.json"
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return out if out.get("settings") == settings else None


def _record(work: Path, name: str, settings: dict, out: dict) -> dict:
    out = {**out, "settings": settings}
    tmp = work / f".{name}.json.tmp"
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(work / f"{name}.json")
    return out


def _write_jsonl(path: Path, rows) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)


def _read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _tokenizer(ns):
    from prism.backbones import load_tokenizer

    return load_tokenizer(ns.backbone)


# ----------------------------------------------------------------------------------------------------------------
# Stage corpus.


def _cut(text: str, limit: int) -> str:
    """The text up to the last sentence or paragraph end before `limit` characters (whole when shorter)."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = max(head.rfind("\n\n"), head.rfind(". "))
    return head[: end + 1] if end > limit // 2 else head


def corpus_settings(ns) -> dict:
    return {k: getattr(ns, k) for k in ("corpus", "tokens", "facts", "seed", "max_doc_chars", "max_source_share",
                                        "val_fraction", "backbone")}


def stage_corpus(ns, work: Path) -> dict:
    from bench.planted_facts import make_facts, plant
    from prism.corpora import iter_documents
    from prism.data import is_validation

    settings = corpus_settings(ns)
    if (done := _done(work, "corpus", settings)) and (work / "planted.jsonl").is_file():
        return done
    tokenizer = _tokenizer(ns)
    docs = [d for d in iter_documents(ns.corpus) if d.text.strip()]
    if not docs:
        raise SystemExit(f"bench.attribution_truth: corpus {ns.corpus!r} has no documents")
    random.Random(ns.seed).shuffle(docs)
    budget = ns.tokens / (1 - ns.val_fraction)  # training tokens after the validation split
    cap = ns.max_source_share * budget
    chosen, per_source, total = [], {}, 0
    for doc in tqdm_iter(docs, "choosing documents"):
        text = _cut(doc.text, ns.max_doc_chars)
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if n < 32 or per_source.get(doc.source, 0) + n > cap:
            continue
        chosen.append({"id": doc.doc_id, "text": text, "source": doc.source, "title": doc.title})
        per_source[doc.source] = per_source.get(doc.source, 0) + n
        total += n
        if total >= budget:
            break
    if total < 0.9 * budget:
        logger.warning("the corpus gave %d tokens, fewer than --tokens %d asks", total, ns.tokens)
    words = {w.lower() for d in chosen for w in re.findall(r"[A-Za-z]+", d["text"])}
    facts = make_facts(tokenizer, ns.facts, ns.seed, reserved=words)
    planted = plant(chosen, facts, seed=ns.seed, eligible=lambda i: not is_validation(i, ns.val_fraction))
    _write_jsonl(work / "base.jsonl", chosen)
    _write_jsonl(work / "planted.jsonl", planted)
    _write_jsonl(work / "facts.jsonl", [f.to_dict() for f in facts])
    out = {"documents": len(chosen), "tokens": total, "tokens_per_source": per_source, "facts": len(facts),
           "planted_copies": sum(len(f.documents) for f in facts),
           "planted_documents": len({d for f in facts for d in f.documents})}
    logger.info("corpus: %s", out)
    return _record(work, "corpus", settings, out)


def tqdm_iter(items, desc: str):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="doc", mininterval=5, disable=None)


# ----------------------------------------------------------------------------------------------------------------
# Stage train.


def train_argv(ns, work: Path, run: str, tokens: int) -> list[str]:
    """prism.train's arguments for one of RUNS: the same for all four but the corpus and the bank."""
    kind, corpus = run.split("-")
    steps = max(1, math.ceil(ns.epochs * tokens * (1 - ns.val_fraction) / (ns.batch_size * ns.seq_len)))
    argv = ["-m", "prism.train", "--backbone", ns.backbone, "--corpus", str(work / f"{corpus}.jsonl"),
            "--out", str(work / run), "--mode", "top", "--n-layers", str(ns.n_layers),
            "--cache-dir", str(work / f"cache-{corpus}"), "--n-prototypes", str(ns.n_prototypes),
            "--top-k", str(ns.top_k), "--lambda-r1", "1", "--lambda-r2", "1", "--lambda-rec", "1",
            "--seq-len", str(ns.seq_len), "--batch-size", str(ns.batch_size), "--steps", str(steps),
            "--warmup", str(max(1, steps // 30)), "--lr", str(ns.lr), "--val-fraction", str(ns.val_fraction),
            "--seed", str(ns.seed), "--checkpoint-every", "25", "--autocast", ns.autocast]
    if kind == "dense":
        argv.append("--dense-baseline")
    elif ns.lambda_path_kl:
        argv += ["--lambda-path-kl", str(ns.lambda_path_kl)]
    return argv


def train_settings(ns) -> dict:
    return {**corpus_settings(ns), **{k: getattr(ns, k) for k in (
        "epochs", "n_layers", "n_prototypes", "top_k", "lambda_path_kl", "seq_len", "batch_size", "lr", "autocast")}}


def _child(argv: list[str], log: Path | None = None) -> float:
    """Run `python argv` in its own process (output to log when given); its peak RSS in MB. Fails loudly."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with (log.open("a") if log else open(os.devnull, "w")) as out:
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env,
                                stdout=out if log else None, stderr=subprocess.STDOUT if log else None)
        _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"python {' '.join(argv[:4])} ... failed with exit code {code}"
                           + (f"; see {log}" if log else ""))
    return usage.ru_maxrss / 1024


def stage_train(ns, work: Path, runs: tuple[str, ...] = RUNS) -> dict:
    settings = train_settings(ns)
    tokens = json.loads((work / "corpus.json").read_text())["tokens"]
    out = (_done(work, "train", settings) or {}).copy()
    out.pop("settings", None)
    for run in runs:
        if run in out and (work / run / "final").is_dir():
            continue
        logger.info("training %s (log: %s)", run, work / f"{run}.log")
        t0 = time.perf_counter()
        _child(train_argv(ns, work, run, tokens), work / f"{run}.log")
        out[run] = {"wall_s": round(time.perf_counter() - t0, 1), **_train_summary(work / run)}
        _record(work, "train", settings, out)  # after each run, so a killed stage keeps the finished ones
    return {**out, "settings": settings}


def _train_summary(folder: Path) -> dict:
    """Tokens/s and the last logged losses of a finished run (its train_log.jsonl)."""
    try:
        rows = _read_jsonl(folder / "train_log.jsonl")
    except OSError:
        return {}
    steps = [r for r in rows if "step" in r]
    last = steps[-1] if steps else {}
    keep = ("step", "loss", "ce", "tokens_per_s", "val_ce", "r1_bar", "r2")
    return {k: last[k] for k in keep if k in last}


# ----------------------------------------------------------------------------------------------------------------
# Stage learned.


def _load(folder: Path):
    from precompute.inputs import load_model

    model, tokenizer, _ = load_model(str(folder))
    return model.eval(), tokenizer


def answer_scores(folder: Path, facts: list[dict]) -> list[dict]:
    """Per fact, under the model in folder: log p(answer token | prompt) (the prompt alone, no special tokens),
    whether the answer is the model's top token, and its rank among its relation's candidate answers (1 = the
    model prefers it to every other colour, month, ... that the fact could have had)."""
    import torch

    from bench.planted_facts import RELATIONS, single_token

    model, tokenizer = _load(folder)
    pools = {r: [t for w in words if (t := single_token(tokenizer, w)) is not None]
             for r, (_, words) in RELATIONS.items()}
    out = []
    with torch.no_grad():
        for fact in facts:
            ids = tokenizer(fact["prompt"], add_special_tokens=False)["input_ids"]
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            answer = float(logp[fact["answer_token"]])
            others = [float(logp[t]) for t in pools[fact["relation"]] if t != fact["answer_token"]]
            out.append({"logp": answer, "top1": int(logp.argmax()) == fact["answer_token"],
                        "pool_rank": 1 + sum(o > answer for o in others), "pool_size": len(others) + 1})
    return out


def stage_learned(ns, work: Path) -> dict:
    """Learned, two ways: against the same model trained without the facts (when that run exists), and within the
    planted model (the answer ranks first among its relation's candidates: chance is 1 in the pool's size)."""
    present = [run for run in RUNS if (work / run / "final").is_dir()]
    settings = {**train_settings(ns), "learned_nats": ns.learned_nats, "runs": present}
    if done := _done(work, "learned", settings):
        return done
    facts = _read_jsonl(work / "facts.jsonl")
    scores = {run: answer_scores(work / run / "final", facts) for run in present}
    out: dict = {"per_fact": [], "summary": {}}
    for i, fact in enumerate(facts):
        row: dict = {"fact_id": fact["fact_id"]}
        for run, v in scores.items():
            row[f"logp_{run}"] = round(v[i]["logp"], 4)
            row[f"pool_rank_{run}"] = v[i]["pool_rank"]
        for kind in ("prism", "dense"):
            if f"{kind}-planted" in scores:
                row[f"learned_{kind}_pool"] = scores[f"{kind}-planted"][i]["pool_rank"] == 1
            if f"{kind}-planted" in scores and f"{kind}-base" in scores:
                gain = scores[f"{kind}-planted"][i]["logp"] - scores[f"{kind}-base"][i]["logp"]
                row[f"gain_{kind}"] = round(gain, 4)
                row[f"learned_{kind}"] = gain >= ns.learned_nats
        out["per_fact"].append(row)
    for run, v in scores.items():
        out["summary"][run] = {"facts": len(v), "median_logp": round(statistics.median(x["logp"] for x in v), 3),
                               "top1": sum(x["top1"] for x in v), "pool_rank_1": sum(x["pool_rank"] == 1 for x in v),
                               "chance_pool_rank_1": round(sum(1 / x["pool_size"] for x in v), 1)}
    for kind in ("prism", "dense"):
        gains = [r[f"gain_{kind}"] for r in out["per_fact"] if f"gain_{kind}" in r]
        if gains:
            out["summary"][kind] = {"learned": sum(g >= ns.learned_nats for g in gains), "facts": len(gains),
                                    "median_gain_nats": round(statistics.median(gains), 3)}
    logger.info("learned: %s", out["summary"])
    return _record(work, "learned", settings, out)


def learned_flags(learned: dict | None, n: int) -> tuple[list[bool], str]:
    """Which facts PRISM learned, and by which test: against the model trained without them where it exists, else
    the within-model pool rank."""
    if not learned:
        return [False] * n, "none"
    rows = learned["per_fact"]
    if all("learned_prism" in r for r in rows):
        return [r["learned_prism"] for r in rows], "gain over the model trained without the facts"
    if all("learned_prism_pool" in r for r in rows):
        return [r["learned_prism_pool"] for r in rows], "pool rank 1 in the planted model"
    return [False] * n, "none"


# ----------------------------------------------------------------------------------------------------------------
# Stage attribute.


def attribute_settings(ns) -> dict:
    return {**train_settings(ns), **{k: getattr(ns, k) for k in ("rank", "rerank", "embedder")}}


def _db(work: Path) -> Path:
    return work / "truth.duckdb"


def build_cache(ns, work: Path) -> dict:
    """The attribution job over the planted model's training documents (its validation documents left out)."""
    import duckdb

    from precompute.attribution import has_attribution

    db = _db(work)
    if db.is_file():
        con = duckdb.connect(str(db), read_only=True)
        try:
            if has_attribution(con):
                return {}
        except duckdb.Error:
            pass
        finally:
            con.close()
    argv = ["-m", "precompute.attribution", "--model", str(work / "prism-planted" / "final"),
            "--corpus", str(work / "planted.jsonl"), "--db", str(db), "--seq-len", str(ns.seq_len),
            "--batch-size", str(ns.batch_size), "--attribution-rank", str(ns.rank),
            "--attribution-holdout", str(ns.val_fraction), "--attribution-grad-rank", str(ns.grad_rank),
            "--hook", "keep-tokens=1"]
    t0 = time.perf_counter()
    rss = _child(argv, work / "attribution-job.log")
    return {"cached_build_s": round(time.perf_counter() - t0, 1), "cached_build_peak_rss_mb": round(rss)}


def ground_truth(work: Path) -> tuple[list[dict], list[list[int]]]:
    """The training sequences (as the cache holds them) and, per fact, the indices of those holding its whole
    statement."""
    import duckdb

    from precompute.attribution import sequences

    con = duckdb.connect(str(_db(work)), read_only=True)
    try:
        rows = sequences(con)
    finally:
        con.close()
    by_doc: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_doc.setdefault(row["doc_id"], []).append(i)
    truth = []
    for fact in _read_jsonl(work / "facts.jsonl"):
        hits = set()
        for doc, offset in zip(fact["documents"], fact["offsets"]):
            end = offset + len(fact["statement"])
            hits |= {i for i in by_doc.get(doc, []) if rows[i]["char_start"] <= offset and end <= rows[i]["char_end"]}
        truth.append(sorted(hits))
    return rows, truth


def prepare_levels(ns, work: Path) -> Path:
    """bench.attribution's work folder for the prototype-space levels and EK-FAC: the cache's training sequences,
    one query per fact (its prompt and answer token), and the meta the levels read."""
    import duckdb

    from bench.attribution import _offsets, start_layer_of
    from precompute.attribution import load_factors, sequence_token_ids

    levels = work / "levels"
    levels.mkdir(exist_ok=True)
    model, tokenizer = _load(work / "prism-planted" / "final")
    con = duckdb.connect(str(_db(work)), read_only=True)
    try:
        train_ids = sequence_token_ids(con, tokenizer)
        rank = int(load_factors(con)["basis"].shape[1])
    finally:
        con.close()
    offsets = _offsets(train_ids)
    np.savez(levels / "train.npz", ids=np.concatenate(train_ids), offsets=offsets)
    queries = []
    for fact in _read_jsonl(work / "facts.jsonl"):
        ids = tokenizer(fact["prompt"], add_special_tokens=False)["input_ids"]
        queries.append({"input_ids": ids, "position": len(ids) - 1, "token": fact["answer_token"]})
    (levels / "queries.json").write_text(json.dumps(queries))
    meta = {"start_layer": start_layer_of(model, None), "n_layers": model.n_layers, "query_source": "facts",
            "rank": rank, "states_s": None, "n_train": len(train_ids), "train_tokens": int(offsets[-1]),
            "n_queries": len(queries), "seq_len": max(len(s) for s in train_ids), "d_model": model.d_model,
            "n_prototypes": model.config.n_prototypes, "top_k": model.config.top_k}
    (levels / "meta.json").write_text(json.dumps(meta))
    return levels


def _level_argv(ns, work: Path, level: str, rerank: int) -> list[str]:
    return ["-m", "bench.attribution", "--model", str(work / "prism-planted" / "final"), "--db", str(_db(work)),
            "--level", level, "--work", str(work / "levels"), "--batch-size", str(ns.batch_size),
            "--rerank", str(rerank), "--ekfac-query-batch", str(ns.ekfac_query_batch),
            *(["--ekfac-fit-sequences", str(ns.ekfac_fit_sequences)] if ns.ekfac_fit_sequences else [])]


def run_prototype_and_ekfac(ns, work: Path, method: str) -> dict:
    """One of cached, cached_rerank, reference, ekfac via bench.attribution's level runners, in a child process;
    its scores saved as WORK/scores/METHOD.npy."""
    level = "cached" if method.startswith("cached") else method
    levels = work / "levels"
    if level == "ekfac":
        from bench.attribution import ensure_states

        ensure_states(argparse.Namespace(model=str(work / "prism-planted" / "final"), batch_size=ns.batch_size),
                      levels)
    rss = _child(_level_argv(ns, work, level, ns.rerank if method == "cached_rerank" else 0),
                 work / "attribute.log")
    out = json.loads((levels / f"{level}.json").read_text())
    scores = np.load(levels / f"{level}_scores.npy")
    np.save(work / "scores" / f"{method}.npy", scores.astype(np.float32))
    if level == "cached":
        ms, extra = out["cached_query_ms"], {"click_ms": round(out["cached_click_ms"], 2)}
    elif level == "ekfac":
        ms, extra = out["ekfac_query_ms"], {"fit_s": round(out["ekfac_fit_s"], 1),
                                            "fit_sequences": out["ekfac_fit_sequences"]}
    else:
        ms, extra = 1e3 * out["reference_s"] / len(scores), {"source": out["reference_source"]}
    return {"query_ms": round(ms, 3), "peak_rss_mb": round(rss), **extra}


def sequence_texts(rows: list[dict]) -> list[str]:
    from precompute.attribution import document_text

    texts, cache = [], {}
    for row in rows:
        if row["doc_id"] not in cache:
            cache = {row["doc_id"]: document_text(row["doc_id"], row["text"], row["sha256"])}
        texts.append(cache[row["doc_id"]][row["char_start"]: row["char_end"]])
    return texts


def _query_texts(work: Path) -> list[str]:
    return [f"{f['prompt']} {f['answer']}" for f in _read_jsonl(work / "facts.jsonl")]


_WORD = re.compile(r"\w+")


def bm25_scores(texts: list[str], queries: list[str]) -> tuple[np.ndarray, float]:
    """Okapi BM25 (rank_bm25, its default k1 and b) of every sequence for every query, lower-cased word tokens;
    the mean seconds per query."""
    from rank_bm25 import BM25Okapi

    index = BM25Okapi([_WORD.findall(t.lower()) for t in texts])
    t0 = time.perf_counter()
    scores = np.stack([index.get_scores(_WORD.findall(q.lower())) for q in queries])
    return scores.astype(np.float32), (time.perf_counter() - t0) / len(queries)


def embedding_scores(texts: list[str], queries: list[str], model_name: str) -> tuple[np.ndarray, float, float]:
    """Cosine of sentence embeddings (sentence-transformers) of every sequence's text and every query; the index
    build's seconds and the mean seconds per query (its embedding and the product)."""
    from sentence_transformers import SentenceTransformer

    from precompute.embed import load_model

    embedder = load_model("cpu") if model_name == "default" else SentenceTransformer(model_name, device="cpu")
    t0 = time.perf_counter()
    index = embedder.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = []
    for q in queries:
        e = embedder.encode([q], normalize_embeddings=True, convert_to_numpy=True)
        rows.append(index @ e[0])
    return np.stack(rows).astype(np.float32), build, (time.perf_counter() - t0) / len(queries)


def same_token_scores(work: Path, mode: str = "coupled") -> tuple[np.ndarray, float]:
    """The cache read differently (CachedIndex.same_token_scores): per fact, only the training tokens that predicted
    its answer token through the prototypes the query reads; the mean seconds per query (its forward pass
    included, as the cached level's query_ms)."""
    import duckdb
    import torch

    from precompute.attribution import load_index
    from prism.attribution import query_gradient

    model, tokenizer = _load(work / "prism-planted" / "final")
    con = duckdb.connect(str(_db(work)), read_only=True)
    try:
        index = load_index(con, model.lm_head.weight, mode=mode)
    finally:
        con.close()
    out, t0 = [], time.perf_counter()
    with torch.no_grad():
        for fact in _read_jsonl(work / "facts.jsonl"):
            ids = tokenizer(fact["prompt"], add_special_tokens=False)["input_ids"]
            z, _ = model.final_states(torch.tensor([ids]))
            active, rows = query_gradient(model, None, len(ids) - 1, fact["answer_token"], z=z[0, -1])
            out.append(index.same_token_scores(active, rows, fact["answer_token"]))
    return np.stack(out).astype(np.float32), (time.perf_counter() - t0) / len(out)


def stored_gradient_scores(work: Path) -> tuple[np.ndarray, dict]:
    """The app's default reading, as the app reads it: the gradient store the attribution job wrote beside the
    cache (precompute.attribution.load_gradient_store, memory-mapped) and StoredGradients.query per fact (the
    frozen layers' forward, the trained layers' forward and backward, the product over the positions that
    predicted the answer token). Returns the scores and the record."""
    import duckdb
    import torch

    from precompute.attribution import gradient_folder, load_gradient_store

    model, tokenizer = _load(work / "prism-planted" / "final")
    con = duckdb.connect(str(_db(work)), read_only=True)
    try:
        t0 = time.perf_counter()
        store = load_gradient_store(con, model, _db(work))
        load_s = time.perf_counter() - t0
    finally:
        con.close()
    if store is None:
        raise SystemExit(f"{_db(work)} has no gradient store: rebuild the cache (delete it and run --stages attribute)")
    out, frozen, rest = [], [], []
    for fact in _read_jsonl(work / "facts.jsonl"):
        ids = torch.tensor([tokenizer(fact["prompt"], add_special_tokens=False)["input_ids"]])
        t0 = time.perf_counter()
        states = store.start_states(ids)  # the frozen layers' forward (the app keeps it per text)
        t1 = time.perf_counter()
        scores, *_ = store.query(ids, ids.shape[1] - 1, fact["answer_token"], states=states)
        rest.append(time.perf_counter() - t1)
        frozen.append(t1 - t0)
        out.append(scores.numpy())
    per_query = (sum(frozen) + sum(rest)) / len(out)
    folder = gradient_folder(_db(work))
    size = sum(f.stat().st_size for f in folder.iterdir())
    return np.stack(out).astype(np.float32), {
        "query_ms": round(1e3 * per_query, 3), "query_ms_p50": round(1e3 * statistics.median(
            f + r for f, r in zip(frozen, rest)), 3),
        # what a click costs once the app keeps the text's states entering the trained layers (app/attribution.py)
        "click_ms": round(1e3 * statistics.fmean(rest), 3),
        "frozen_forward_ms": round(1e3 * statistics.fmean(frozen), 3),
        "load_s": round(load_s, 2), "rank": store.cache.rank, "index_mb": round(size / 1e6, 1)}


def grad_cache_scores(ns, work: Path, precondition: str, same_token: bool = False) -> tuple[np.ndarray, dict]:
    """The projected gradient cache (prism/grad_cache.py) over the planted model's trainable layers: with
    --grad-whiten N, K-FAC's factors from one pass over the first N training sequences and whitened projections;
    then one forward and backward of the trainable layers per training sequence (from the frozen layers' states, as
    EK-FAC), kept as WORK/levels/grad_cache-rRANK-wN-sSEED.pt so the other preconditioner reuses them; then per fact
    the query's own pass (frozen layers, trainable layers forward and backward) and one product. same_token: read
    only the positions that predicted the query's token (prism.grad_cache.TokenGradientIndex, EK-FAC's
    preconditioner from the whole gradients applied to the query). Returns the scores and the record."""
    import torch
    from tqdm.auto import tqdm

    from bench.attribution import _inputs, ensure_states
    from prism.grad_cache import GradientCache, PositionFactors, TokenGradientIndex, batches
    from prism.losses import IGNORE_INDEX

    levels = work / "levels"
    folder = work / "prism-planted" / "final"
    ensure_states(argparse.Namespace(model=str(folder), batch_size=ns.batch_size), levels)
    meta, train, queries, states = _inputs(levels)
    model, _ = _load(folder)

    def batch(idx: range) -> tuple:
        length = max(len(train[i]) for i in idx)
        ids = torch.zeros(len(idx), length, dtype=torch.long)
        mask = torch.zeros(len(idx), length, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, : len(train[i])] = torch.from_numpy(train[i].astype(np.int64))
            mask[b, : len(train[i])] = 1
        return ids, states.batch(torch.tensor(list(idx)), length), mask, ids.masked_fill(mask == 0, IGNORE_INDEX)

    cache = GradientCache(model, meta["start_layer"], rank=ns.grad_rank, seed=ns.seed)
    saved = levels / f"grad_cache-r{ns.grad_rank}-w{ns.grad_whiten}-s{ns.seed}.pt"
    if saved.is_file():
        kept = torch.load(saved, weights_only=True)
        cache.p_in, cache.p_out = kept["p_in"], kept["p_out"]
        grads, stats = kept["grads"], {k: kept[k] for k in ("a", "s", "positions")}
        build_s, whiten_s = kept["build_s"], kept["whiten_s"]
        positions = PositionFactors(kept["pos_sequence"], kept["pos_token"], kept["pos_x"], kept["pos_d"])
    else:
        t0 = time.perf_counter()
        if ns.grad_whiten:  # K-FAC's factors on the first sequences, unprojected, then whitened projections
            cov: dict = {}
            for idx in tqdm(list(batches(min(ns.grad_whiten, len(train)), ns.batch_size)), desc="gradient cache: "
                            "covariances", unit="batch", mininterval=5, disable=None):
                cache.covariances(*batch(idx), cov)
            cache.whiten(cov)
        whiten_s, t0 = time.perf_counter() - t0, time.perf_counter()
        stats, parts, factors = {}, [], []
        for idx in tqdm(list(batches(len(train), ns.batch_size)), desc="gradient cache", unit="batch",
                        mininterval=5, disable=None):
            g, f = cache.gradients_and_positions(*batch(idx), stats)
            f.sequence = f.sequence + idx.start
            parts.append(g)
            factors.append(PositionFactors(f.sequence, f.token, f.x.half(), f.d.half()))
        grads, build_s = torch.cat(parts), time.perf_counter() - t0
        positions = PositionFactors(*(torch.cat([getattr(f, k) for f in factors])
                                      for k in ("sequence", "token", "x", "d")))
        torch.save({"grads": grads, **stats, "build_s": build_s, "whiten_s": whiten_s, "p_in": cache.p_in,
                    "p_out": cache.p_out, "pos_sequence": positions.sequence, "pos_token": positions.token,
                    "pos_x": positions.x, "pos_d": positions.d}, saved)
    t0 = time.perf_counter()
    cache.fit(grads, stats, precondition=precondition)
    index = TokenGradientIndex([positions], len(train)) if same_token else None
    fit_s = time.perf_counter() - t0
    out, frozen, t0 = [], 0.0, time.perf_counter()
    for q in queries:
        ids = torch.tensor([list(q.input_ids[: q.position + 1])])
        t1 = time.perf_counter()
        q_states = model.states_before_layer(ids, meta["start_layer"])
        frozen += time.perf_counter() - t1
        g = cache.query_gradient(ids, q_states, q.position, q.token)
        out.append((index.scores(cache.apply(g[None])[0], q.token) if same_token else cache.scores(g)).numpy())
    per_query = (time.perf_counter() - t0) / len(queries)
    # a click in an app that kept the states entering the trained layers from generation pays the rest only
    click = per_query - frozen / len(queries)
    return np.stack(out).astype(np.float32), {
        "query_ms": round(1e3 * per_query, 3), "click_ms": round(1e3 * click, 3), "rank": ns.grad_rank,
        "whiten": ns.grad_whiten, "whiten_s": round(whiten_s, 1), "precondition": precondition, "dims": cache.dim,
        "modules": len(cache.modules), "index_mb": round((index.nbytes if same_token else cache.nbytes) / 1e6, 1),
        "gradients_s": round(build_s, 1), "fit_s": round(fit_s, 2)}


def run_text_method(ns, work: Path, method: str) -> dict:
    """bm25, embedding, cached_same_token or grad_cache, in this process (called in a child of its own by
    stage_attribute)."""
    if method.startswith("grad_cache"):
        scores, out = grad_cache_scores(ns, work, "identity" if method.endswith("_raw") else "ekfac",
                                        same_token=method.endswith("_same_token"))
        np.save(work / "scores" / f"{method}.npy", scores)
        (work / "scores" / f"{method}.json").write_text(json.dumps(out))
        return out
    if method == "cached_gradient":
        scores, out = stored_gradient_scores(work)
        np.save(work / "scores" / f"{method}.npy", scores)
        (work / "scores" / f"{method}.json").write_text(json.dumps(out))
        return out
    if method.startswith("cached_same_token"):
        scores, per_query = same_token_scores(work, "block" if method.endswith("_block") else "coupled")
        np.save(work / "scores" / f"{method}.npy", scores)
        out = {"query_ms": round(1e3 * per_query, 3)}
        (work / "scores" / f"{method}.json").write_text(json.dumps(out))
        return out
    rows, _ = ground_truth(work)
    texts, queries = sequence_texts(rows), _query_texts(work)
    if method == "bm25":
        scores, per_query = bm25_scores(texts, queries)
        extra = {}
    else:
        scores, build, per_query = embedding_scores(texts, queries, ns.embedder)
        extra = {"index_build_s": round(build, 1)}
    np.save(work / "scores" / f"{method}.npy", scores)
    out = {"query_ms": round(1e3 * per_query, 3), **extra}
    (work / "scores" / f"{method}.json").write_text(json.dumps(out))
    return out


def stage_attribute(ns, work: Path) -> dict:
    settings = attribute_settings(ns)
    out = (_done(work, "attribute", settings) or {}).copy()
    out.pop("settings", None)
    (work / "scores").mkdir(exist_ok=True)
    if "cache" not in out:
        out["cache"] = build_cache(ns, work)
        prepare_levels(ns, work)
        _record(work, "attribute", settings, out)
    for method in ns.methods.split(","):
        if method in out and (work / "scores" / f"{method}.npy").is_file() and \
                out[method].get("rank", ns.grad_rank) == ns.grad_rank and \
                out[method].get("whiten", ns.grad_whiten) == ns.grad_whiten:  # grad_cache's own settings
            continue
        logger.info("attribution method %s", method)
        if method in CHILD_METHODS:
            rss = _child(["-m", "bench.attribution_truth", *ns.argv, "--method", method], work / "attribute.log")
            out[method] = {**json.loads((work / "scores" / f"{method}.json").read_text()), "peak_rss_mb": round(rss)}
        else:
            out[method] = run_prototype_and_ekfac(ns, work, method)
        _record(work, "attribute", settings, out)
    return {**out, "settings": settings}


# ----------------------------------------------------------------------------------------------------------------
# Stage report.


def rank_metrics(scores: np.ndarray, truth: list[int], top: int = TOP) -> dict:
    """recall@1 and recall@top (share of the true sequences among the best 1 / top; ties broken by index) and the
    reciprocal rank of the first true sequence, for one query's scores over every sequence."""
    order = np.lexsort((np.arange(len(scores)), -scores))
    ranks = np.empty(len(scores), np.int64)
    ranks[order] = np.arange(1, len(scores) + 1)
    r = ranks[truth]
    return {"recall@1": float(np.mean(r <= 1)), f"recall@{top}": float(np.mean(r <= top)),
            "mrr": float(1.0 / r.min())}


def _bootstrap(values: list[float], seed: int = 0, n: int = 2000) -> list[float]:
    if not values:
        return [None, None]
    rng = np.random.default_rng(seed)
    v = np.asarray(values)
    means = v[rng.integers(0, len(v), size=(n, len(v)))].mean(1)
    return [round(float(np.quantile(means, 0.025)), 3), round(float(np.quantile(means, 0.975)), 3)]


def stage_report(ns, work: Path) -> dict:
    rows, truth = ground_truth(work)
    learned = json.loads((work / "learned.json").read_text()) if (work / "learned.json").is_file() else None
    attribute = json.loads((work / "attribute.json").read_text())
    is_learned, learned_by = learned_flags(learned, len(truth))
    scored = [i for i, t in enumerate(truth) if t]
    facts = _read_jsonl(work / "facts.jsonl")
    same: dict[tuple[str, str], list[int]] = {}
    for i, fact in enumerate(facts):
        same.setdefault((fact["relation"], fact["answer"]), []).append(i)
    # siblings: the sequences of the other facts with the same statement but the subject (not this fact's own)
    siblings = [sorted({s for j in same[(f["relation"], f["answer"])] if j != i for s in truth[j]} - set(truth[i]))
                for i, f in enumerate(facts)]
    table = {}
    for method in METHODS:
        path = work / "scores" / f"{method}.npy"
        if not path.is_file():
            continue
        scores = np.load(path)
        per = {i: rank_metrics(scores[i], truth[i]) for i in scored}
        apart = {}  # the same with other facts' copies that share this fact's relation and answer left out
        for i in scored:
            row_scores = scores[i].astype(np.float64).copy()
            row_scores[siblings[i]] = -np.inf
            apart[i] = rank_metrics(row_scores, truth[i])
        row = {"query_ms": attribute.get(method, {}).get("query_ms"),
               "click_ms": attribute.get(method, {}).get("click_ms"),
               "peak_rss_mb": attribute.get(method, {}).get("peak_rss_mb")}
        for subset, ids in (("learned", [i for i in scored if is_learned[i]]), ("all", scored)):
            for metric in ("recall@1", f"recall@{TOP}", "mrr"):
                values = [per[i][metric] for i in ids]
                row[f"{subset}_{metric}"] = round(statistics.fmean(values), 3) if values else None
                row[f"{subset}_{metric}_ci95"] = _bootstrap(values)
        for metric in ("recall@1", f"recall@{TOP}", "mrr"):
            values = [apart[i][metric] for i in scored]
            row[f"siblings_apart_{metric}"] = round(statistics.fmean(values), 3) if values else None
        # how deep the method would have to be read, and the copies it cannot rank at all: a sparse reading gives a
        # sequence exactly 0 where none of the query's prototypes predicted the answer there, and no second stage
        # over its best candidates brings those back
        deep = [rank_metrics(scores[i], truth[i], top=DEEP)[f"recall@{DEEP}"] for i in scored]
        row[f"all_recall@{DEEP}"] = round(statistics.fmean(deep), 3) if deep else None
        row["copies"] = sum(len(truth[i]) for i in scored)
        row["copies_scored_zero"] = int(sum(int((scores[i][truth[i]] == 0).sum()) for i in scored))
        table[method] = row
    out = {"facts": len(truth), "facts_with_intact_copy": len(scored),
           "facts_with_a_sibling": sum(bool(siblings[i]) for i in scored),
           "learned_prism": sum(is_learned[i] for i in scored), "learned_by": learned_by, "sequences": None,
           "methods": table,
           "learned": learned["summary"] if learned else None, "train": _maybe(work / "train.json"),
           "cache": attribute.get("cache")}
    out["sequences"] = len(rows)
    for method in ("cached", "cached_gradient"):  # EK-FAC's amortised query time over the method's
        if method in table and "ekfac" in table and table[method]["query_ms"]:
            out[f"speedup_{method}_vs_ekfac"] = round(table["ekfac"]["query_ms"] / table[method]["query_ms"], 1)
            if table[method]["click_ms"]:  # a click on a text whose states the app kept
                out[f"speedup_{method}_click_vs_ekfac"] = round(
                    table["ekfac"]["query_ms"] / table[method]["click_ms"], 1)
    (work / "report.md").write_text(markdown_table(out))
    return out


def _maybe(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    data.pop("settings", None)
    return data


def markdown_table(out: dict) -> str:
    lines = [f"Facts {out['facts']} ({out['facts_with_intact_copy']} with an intact copy in a training sequence, "
             f"{out['learned_prism']} of them learned by PRISM: {out['learned_by']}); {out['sequences']} training "
             "sequences.", "",
             "| method | query ms | click ms | peak RSS MB | learned R@1 | learned R@10 | learned MRR | all R@1 | "
             "all R@10 | "
             f"all MRR | all R@10, siblings apart | all R@{DEEP} | copies scored 0 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for method, r in out["methods"].items():
        cells = [method, r["query_ms"], r.get("click_ms") or "-", r["peak_rss_mb"]]
        for subset in ("learned", "all"):
            for metric in ("recall@1", f"recall@{TOP}", "mrr"):
                v, ci = r[f"{subset}_{metric}"], r[f"{subset}_{metric}_ci95"]
                cells.append("-" if v is None else f"{v:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]")
        cells += [r[f"siblings_apart_recall@{TOP}"], r[f"all_recall@{DEEP}"],
                  f"{r['copies_scored_zero']} of {r['copies']}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Command line.


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m bench.attribution_truth", __doc__)
    parser.add_argument("--work", required=True, help="the benchmark's folder (corpus, runs, caches, scores)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    data = parser.add_argument_group("corpus and facts")
    data.add_argument("--corpus", default="default-v3", help="the ordinary corpus the facts go into")
    data.add_argument("--tokens", type=int, default=300_000, help="training tokens to draw from it")
    data.add_argument("--facts", type=int, default=120, help="fictional facts to plant")
    data.add_argument("--max-doc-chars", type=int, default=8000, help="documents are cut to this many characters")
    data.add_argument("--max-source-share", type=float, default=0.3, help="no source above this share of tokens")
    data.add_argument("--val-fraction", type=float, default=0.05, help="documents held out (never planted)")
    data.add_argument("--seed", type=int, default=0, help="documents, facts, where they go, training order")
    train = parser.add_argument_group("training (the shipped configuration by default)")
    train.add_argument("--backbone", default="smollm2", help="prism.train's --backbone")
    train.add_argument("--epochs", type=float, default=3.0, help="passes over the training tokens")
    train.add_argument("--n-layers", type=int, default=2, help="top decoder layers that train")
    train.add_argument("--n-prototypes", type=int, default=4096, help="prototypes in the bank (the shipped K)")
    train.add_argument("--top-k", type=int, default=32, help="active prototypes per token (the shipped k)")
    train.add_argument("--lambda-path-kl", type=float, default=0.0,
                       help="the shipped model's KL term (1.0 there); off by default: on an AVX2-only CPU it takes "
                            "a step from ~3.8 to ~7.3 s, and the benchmark trains two PRISM models")
    train.add_argument("--seq-len", type=int, default=256,
                       help="tokens per training sequence, and per window the methods rank")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per step and per forward pass")
    train.add_argument("--lr", type=float, default=3e-4, help="learning rate of the trained layers")
    train.add_argument("--autocast", default="auto", choices=("auto", "none", "bfloat16"),
                       help="prism.train's --autocast (auto: bfloat16 only where it is native and faster)")
    train.add_argument("--runs", default=",".join(RUNS), help="which of the four runs to train (the rest later)")
    measure = parser.add_argument_group("measurement")
    measure.add_argument("--learned-nats", type=float, default=1.0,
                         help="a fact is learned when the planted model's log-probability of its answer beats the "
                              "model trained without it by at least this much")
    measure.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    measure.add_argument("--rank", type=int, default=128, help="the attribution cache's rank")
    measure.add_argument("--rerank", type=int, default=None, help="cached_rerank's second stage (default: the app's)")
    measure.add_argument("--ekfac-query-batch", type=int, default=120,
                         help="queries per EK-FAC pass over the training sequences (each pass costs about as much "
                              "as one epoch's forward and backward)")
    measure.add_argument("--ekfac-fit-sequences", type=int, default=300,
                         help="training sequences EK-FAC's factors are fitted on (0: all)")
    measure.add_argument("--grad-rank", type=int, default=16,
                         help="grad_cache's projection: r x r numbers per trainable linear layer and sequence")
    measure.add_argument("--grad-whiten", type=int, default=0,
                         help="grad_cache: fit K-FAC's factors on this many training sequences and project whitened "
                              "gradients (0: project them as they are)")
    measure.add_argument("--embedder", default="default",
                         help="sentence-transformers model for the embedding method (default: the app's, offline)")
    parser.add_argument("--method", choices=CHILD_METHODS, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = cli.parse(parser, argv)
    if ns.rerank is None:
        from precompute.attribution import RERANK

        ns.rerank = RERANK
    for name, allowed in (("stages", STAGES), ("methods", METHODS), ("runs", RUNS)):
        bad = [x for x in getattr(ns, name).split(",") if x not in allowed]
        if bad:
            cli.fail(parser, f"unknown {name} {bad}; choose from {', '.join(allowed)}")
    if ns.tokens < ns.batch_size * ns.seq_len or ns.facts < 1 or ns.epochs <= 0:
        cli.fail(parser, "--tokens must hold one batch, --facts >= 1 and --epochs > 0")
    ns.argv = list(argv)
    work = Path(ns.work)
    work.mkdir(parents=True, exist_ok=True)
    if ns.method is not None:  # a child process: one text method
        return run_text_method(ns, work, ns.method)
    result: dict = {}
    for stage in ns.stages.split(","):
        t0 = time.perf_counter()
        if stage == "corpus":
            result["corpus"] = stage_corpus(ns, work)
        elif stage == "train":
            result["train"] = stage_train(ns, work, tuple(ns.runs.split(",")))
        elif stage == "learned":
            result["learned"] = stage_learned(ns, work)["summary"]
        elif stage == "attribute":
            result["attribute"] = stage_attribute(ns, work)
        else:
            result["report"] = stage_report(ns, work)
        logger.info("stage %s: %.0f s", stage, time.perf_counter() - t0)
    cli.print_json(result.get("report", result))
    return result


if __name__ == "__main__":
    main()
