"""The evidence job against a brute-force recomputation, its exactness, SIGKILL/resume equality and DDP shards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch
from helpers import kill_then_resume, saved_random_prism, write_corpus

from app.render import segments_html
from precompute.__main__ import main as precompute_main
from precompute.evidence import EvidenceArgs
from precompute.evidence import run as run_evidence
from precompute.inputs import encode_sequence
from precompute.query import UnknownPrototype, evidence, open_db, prototype_card, prototype_table
from precompute.runs import JobArgsMismatch
from prism import PrismForCausalLM
from prism.backbones import load_tokenizer
from prism.corpora import iter_documents

ROOT = Path(__file__).resolve().parents[1]
K, TOP_K, TOP_N, SEQ = 12, 3, 4, 24
TABLES = ("documents", "evidence", "prototype_stats", "coactivations", "next_tokens", "logit_signatures")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evidence")
    model = saved_random_prism(root, K, TOP_K, seed=0)
    corpus = write_corpus(root / "corpus", n_docs=30)
    return {"root": root, "model": model, "corpus": str(corpus)}


def _argv(setup, db, *extra):
    return ["build", "--model", setup["model"], "--corpus", setup["corpus"], "--db", str(db), "--jobs", "evidence",
            "--top-n", str(TOP_N), "--seq-len", str(SEQ), "--batch-size", "3", "--docs-per-chunk", "4", *extra]


def _dump(db: Path) -> dict:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {t: con.execute(f"SELECT * FROM {t} ORDER BY ALL").fetchall() for t in TABLES}
    finally:
        con.close()


@pytest.fixture(scope="module")
def built(setup):
    db = setup["root"] / "whole.duckdb"
    precompute_main(_argv(setup, db))
    return db


@torch.no_grad()
def test_evidence_is_exact_and_matches_brute_force(setup, built):
    model = PrismForCausalLM.from_pretrained(setup["model"]).eval()
    tok = load_tokenizer(setup["model"])
    docs = {d.doc_id: d.text for d in iter_documents(setup["corpus"])}
    # Brute force: every window alone (no batching), every active (prototype, token).
    acts = {p: [] for p in range(K)}
    count, total = np.zeros(K, int), np.zeros(K)
    coact = np.zeros((K, K), int)
    for order, (doc_id, text) in enumerate(docs.items()):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), SEQ):
            out = model(torch.tensor([ids[start: start + SEQ]]))
            for t in range(out.prototype_ids.shape[1]):
                active = [(int(p), float(a)) for p, a in zip(out.prototype_ids[0, t], out.activations[0, t]) if a > 0]
                for p, a in active:
                    acts[p].append((-a, order, start + t, doc_id))
                    count[p] += 1
                    total[p] += a
                for p, _ in active:
                    for q, _ in active:
                        if p != q:
                            coact[p, q] += 1
    con = duckdb.connect(str(built), read_only=True)
    stats = con.execute("SELECT prototype_id, activation_count, mean_activation, max_activation, hist_counts "
                        "FROM prototype_stats ORDER BY prototype_id").fetchall()
    for p, c, mean, mx, hist in stats:
        assert c == count[p] and sum(hist) == c
        if c:
            assert mean == pytest.approx(total[p] / c, rel=1e-4)
            assert mx == pytest.approx(-min(acts[p])[0], rel=1e-5)
    for p, q, n in con.execute("SELECT prototype_id, other_id, count FROM coactivations").fetchall():
        assert n == coact[p, q]
    rows = con.execute("SELECT prototype_id, rank, doc_id, token_position, activation, seq_token_start, "
                       "seq_token_end, char_start, char_end, token, context_start, context_activations "
                       "FROM evidence ORDER BY prototype_id, rank").fetchall()
    assert len(rows) == sum(min(TOP_N, len(v)) for v in acts.values())
    for p, rank, doc_id, pos, act, s0, s1, c0, c1, token, ctx0, ctx_acts in rows:
        expected = sorted(acts[p])[rank]
        assert (doc_id, pos) == (expected[3], expected[2]) and act == pytest.approx(-expected[0], abs=1e-5)
        # Exactness: the very input sequence, rebuilt from the stored pointers, gives the stored activation.
        seq = encode_sequence(docs[doc_id], tok, s0, s1)
        out = model(seq)
        t = pos - s0
        j = out.prototype_ids[0, t].tolist().index(p)
        assert float(out.activations[0, t, j]) == pytest.approx(act, abs=1e-5)
        assert token == docs[doc_id][c0:c1] and token
        for i, a in enumerate(ctx_acts):
            hit = (out.prototype_ids[0, ctx0 - s0 + i] == p) * out.activations[0, ctx0 - s0 + i]
            assert float(hit.sum()) == pytest.approx(a, abs=1e-5)
    signature = con.execute("SELECT token_id, value FROM logit_signatures WHERE prototype_id = 2 ORDER BY rank"
                            ).fetchall()
    wp = model.lm_head.weight @ model.prototypes.weight[2]
    assert [t for t, _ in signature] == wp.topk(len(signature)).indices.tolist()


@pytest.mark.slow
def test_killed_job_resumes_to_the_uninterrupted_result(setup, built, tmp_path):
    db = tmp_path / "killed.duckdb"
    kill_then_resume(_argv(setup, db), db.parent / (db.name + ".evidence"))
    assert _dump(db) == _dump(built)


def test_rerun_is_idempotent_and_other_arguments_are_refused(setup, built, tmp_path, capsys):
    before = _dump(built)
    precompute_main(_argv(setup, built))  # same arguments: nothing to do
    assert _dump(built) == before
    with pytest.raises(SystemExit):
        precompute_main([*_argv(setup, built)[:-2], "--docs-per-chunk", "5"])
    assert "other arguments" in capsys.readouterr().err
    with pytest.raises(JobArgsMismatch):
        model = PrismForCausalLM.from_pretrained(setup["model"])
        run_evidence(built, model, load_tokenizer(setup["model"]), iter_documents(setup["corpus"]),
                     EvidenceArgs(top_n=2), {"other": True})
    assert _dump(built) == before


@pytest.mark.slow
def test_two_processes_shard_and_merge_to_the_same_evidence(setup, built, tmp_path):
    db = tmp_path / "ddp.duckdb"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "precompute", *_argv(setup, db)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = _dump(built), _dump(db)
    for table in ("documents", "coactivations", "next_tokens", "logit_signatures"):
        assert one[table] == two[table], table
    ev1, ev2 = (duckdb.connect(str(d), read_only=True).execute(
        "SELECT prototype_id, rank, doc_id, token_position, activation FROM evidence ORDER BY 1, 2").fetchall()
        for d in (built, db))
    assert [r[:4] for r in ev1] == [r[:4] for r in ev2]
    np.testing.assert_allclose([r[4] for r in ev1], [r[4] for r in ev2], atol=1e-5)


def test_query_layer_reads_cards_and_highlighted_evidence(built):
    con = open_db(built)
    card = prototype_card(con, 1)
    assert card["activation_count"] > 0 and len(card["signature"]) == 20 and card["hist_counts"]
    rows = evidence(con, 1, limit=3)
    assert [r["rank"] for r in rows] == [0, 1, 2]
    for r in rows:
        target = [s for s in r["segments"] if s["target"]]
        assert len(target) == 1 and target[0]["text"] == r["token"]
        assert "html" not in r and r["error"] is None  # the query layer returns data; app/render.py draws it
        assert "outline" in segments_html(r["segments"])
    assert [r["prototype_id"] for r in prototype_table(con, order_by="activation_count")][:1] == \
        [con.execute("SELECT prototype_id FROM prototype_stats ORDER BY activation_count DESC, prototype_id "
                     "LIMIT 1").fetchone()[0]]
    for bad in (K, -1, "1; DROP TABLE evidence"):
        with pytest.raises(UnknownPrototype):
            prototype_card(con, bad)
    with pytest.raises(ValueError, match="order_by"):
        prototype_table(con, order_by="activation_count; DROP TABLE evidence")
    assert con.execute("SELECT count(*) FROM evidence").fetchone()[0] > 0


def test_pointer_only_copy_keeps_pointers_and_drops_text(setup, built, tmp_path):
    out = tmp_path / "shipped.duckdb"
    precompute_main(["strip-text", "--db", str(built), "--out", str(out)])
    con = duckdb.connect(str(out), read_only=True)
    assert con.execute("SELECT count(*) FROM documents WHERE text IS NOT NULL").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM evidence WHERE token <> '' OR len(context_tokens) > 0").fetchone()[0] == 0
    pointers = "SELECT doc_id, token_position, char_start, char_end, activation FROM evidence ORDER BY ALL"
    assert con.execute(pointers).fetchall() == duckdb.connect(str(built), read_only=True).execute(pointers).fetchall()
    with pytest.raises(SystemExit):
        precompute_main(["strip-text", "--db", str(built), "--out", str(out)])


def test_missing_or_corrupt_database_gets_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no database"):
        open_db(tmp_path / "none.duckdb")
    bad = tmp_path / "bad.duckdb"
    bad.write_bytes(b"not a database at all" * 100)
    with pytest.raises(ValueError, match="not a readable DuckDB database"):
        open_db(bad)


def test_full_build_fills_every_column_a_card_needs(setup, tmp_path):
    from precompute import search

    db = tmp_path / "full.duckdb"
    argv = [a for a in _argv(setup, db) if a not in ("--jobs", "evidence")]
    summary = precompute_main(argv)
    assert set(summary) == {"evidence", "bands", "labels", "search", "map", "presets"}
    con = open_db(db)
    rows = con.execute("SELECT prototype_id, label, category, label_score, x, y FROM prototypes "
                       "WHERE activation_count > 0").fetchall()
    assert rows and all(r[1] and r[2] and r[4] is not None and r[5] is not None for r in rows)
    card = prototype_card(con, rows[0][0])
    assert card["label"] == rows[0][1]
    hits = search.semantic_search(con, card["label"], k=3)
    assert hits and hits[0]["prototype_id"] == rows[0][0]
    con.close()
    again = {"evidence": None, "bands": None, "labels": 0, "search": 0, "map": 0, "presets": summary["presets"]}
    assert precompute_main(argv) == again  # all done: no-op


def test_pointer_only_database_reads_text_back_from_the_installed_corpus(setup, tmp_path):
    db, shipped = tmp_path / "default.duckdb", tmp_path / "shipped.duckdb"
    precompute_main(["build", "--model", setup["model"], "--corpus", "default", "--db", str(db), "--jobs",
                     "evidence", "--top-n", "2", "--seq-len", "64", "--limit", "4"])
    precompute_main(["strip-text", "--db", str(db), "--out", str(shipped)])
    full, stripped = open_db(db), open_db(shipped)
    for pid in range(K):
        a, b = evidence(full, pid, limit=2), evidence(stripped, pid, limit=2)
        assert [r["error"] for r in b] == [None] * len(b)
        assert [(r["token"], r["segments"]) for r in a] == [(r["token"], r["segments"]) for r in b]
    full.close()
    stripped.close()
    con = duckdb.connect(str(shipped))
    con.execute("UPDATE documents SET sha256 = repeat('0', 64)")
    con.close()
    from precompute import query

    query._resolve_text.cache_clear()
    rows = evidence(open_db(shipped), 0, limit=1)
    assert rows and "sha256" in rows[0]["error"] and rows[0]["segments"] == []
