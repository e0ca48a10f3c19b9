"""The bands job (precompute/bands.py) against a brute-force recomputation: its rows are the sample_n active positions
of highest priority per prototype, each with the activation the model gives it; the priority is uniform; a killed
job resumes, and another chunk size gives, the same rows; the pointer-only copy drops the sample's text too.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch
from helpers import kill_then_resume, saved_random_prism, write_corpus

from precompute.__main__ import main as precompute_main
from precompute.bands import POSITION_BITS, priority
from precompute.inputs import encode_sequence
from precompute.query import evidence
from prism import PrismForCausalLM
from prism.backbones import load_tokenizer
from prism.corpora import iter_documents

ROOT = Path(__file__).resolve().parents[1]
K, TOP_K, SAMPLE, SEQ = 12, 3, 5, 24
COLUMNS = "prototype_id, rank, doc_id, token_position, activation, seq_token_start, seq_token_end, char_start, " \
          "char_end, token, context_start, context_activations"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bands")
    model = saved_random_prism(root, K, TOP_K, seed=1)
    corpus = write_corpus(root / "corpus", n_docs=30)
    return {"root": root, "model": model, "corpus": str(corpus)}


def _argv(setup, db, *extra, chunk: int = 4, jobs: str = "bands", sample: int = SAMPLE):
    return ["build", "--model", setup["model"], "--corpus", setup["corpus"], "--db", str(db), "--jobs", jobs,
            "--band-sample-n", str(sample), "--seq-len", str(SEQ), "--batch-size", "3", "--docs-per-chunk",
            str(chunk), *extra]


def _rows(db: Path) -> list:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(f"SELECT {COLUMNS} FROM evidence_bands ORDER BY prototype_id, rank").fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def built(setup):
    db = setup["root"] / "whole.duckdb"
    summary = precompute_main(_argv(setup, db, jobs="evidence,bands"))  # the query layer checks ids on evidence's
    assert summary["bands"]["sampled_rows"] > 0
    return db


def test_priority_is_uniform_and_fixed():
    keys = (np.arange(2000, dtype=np.int64)[:, None] << POSITION_BITS | np.arange(50)[None, :]).ravel()
    u = priority(np.full(len(keys), 7), keys)
    assert u.min() >= 0 and u.max() < 1
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    expected = len(u) / 10
    assert ((counts - expected) ** 2 / expected).sum() < 30  # chi-square, 9 degrees of freedom: p < 0.001
    other = priority(np.full(len(keys), 8), keys)
    assert abs(np.corrcoef(u, other)[0, 1]) < 0.02  # another prototype draws independently
    assert np.array_equal(u, priority(np.full(len(keys), 7), keys.copy()))


@torch.no_grad()
def test_bands_are_the_highest_priority_positions_with_their_activations(setup, built):
    model = PrismForCausalLM.from_pretrained(setup["model"]).eval()
    tok = load_tokenizer(setup["model"])
    docs = {d.doc_id: d.text for d in iter_documents(setup["corpus"])}
    active = {p: [] for p in range(K)}  # p -> [(priority, key, doc_id, position, activation)]
    for order, (doc_id, text) in enumerate(docs.items()):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), SEQ):
            out = model(torch.tensor([ids[start: start + SEQ]]))
            for t in range(out.prototype_ids.shape[1]):
                for p, a in zip(out.prototype_ids[0, t].tolist(), out.activations[0, t].tolist()):
                    if a > 0:
                        key = order << POSITION_BITS | (start + t)
                        u = float(priority(np.array([p]), np.array([key]))[0])
                        active[p].append((u, key, doc_id, start + t, a))
    rows = _rows(built)
    assert len(rows) == sum(min(SAMPLE, len(v)) for v in active.values())
    for p in range(K):
        want = sorted(active[p], key=lambda r: (-r[0], r[1]))[:SAMPLE]
        got = [r for r in rows if r[0] == p]
        assert sorted((r[2], r[3]) for r in got) == sorted((w[2], w[3]) for w in want)
        assert [r[1] for r in got] == list(range(len(got)))
        assert all(a[4] >= b[4] for a, b in zip(got, got[1:]))  # ranked by activation, highest first
        for _, _, doc_id, pos, act, s0, s1, c0, c1, token, _ctx0, ctx_acts in got:
            w = next(w for w in want if (w[2], w[3]) == (doc_id, pos))
            assert act == pytest.approx(w[4], abs=1e-5)
            out = model(encode_sequence(docs[doc_id], tok, s0, s1))  # the stored pointers give the activation
            j = out.prototype_ids[0, pos - s0].tolist().index(p)
            assert float(out.activations[0, pos - s0, j]) == pytest.approx(act, abs=1e-5)
            assert token == docs[doc_id][c0:c1] and len(ctx_acts) >= 1
    # a sample, not the top: over all prototypes with more active positions than kept, it reaches below the top
    tops = [p for p in range(K) if len(active[p]) > 3 * SAMPLE]
    assert tops
    below = [p for p in tops if min(r[4] for r in rows if r[0] == p) <
             sorted((w[4] for w in active[p]), reverse=True)[SAMPLE - 1]]
    assert len(below) == len(tops)
    # the query layer reads them, with their documents, as it reads the evidence
    con = duckdb.connect(str(built), read_only=True)
    try:
        read = evidence(con, tops[0], limit=SAMPLE, table="evidence_bands")
    finally:
        con.close()
    assert [r["token_position"] for r in read] == [r[3] for r in rows if r[0] == tops[0]]
    assert all(any(s["target"] for s in r["segments"]) for r in read)


def test_another_chunk_size_gives_the_same_rows(setup, built, tmp_path):
    db = tmp_path / "chunks.duckdb"
    precompute_main(_argv(setup, db, chunk=7))
    assert _rows(db) == _rows(built)


@pytest.mark.slow
def test_killed_job_resumes_to_the_uninterrupted_result(setup, built, tmp_path):
    db = tmp_path / "killed.duckdb"
    kill_then_resume(_argv(setup, db), db.parent / (db.name + ".bands"))
    assert _rows(db) == _rows(built)


def test_pointer_only_copy_drops_the_sample_text(built, tmp_path):
    out = tmp_path / "shipped.duckdb"
    precompute_main(["strip-text", "--db", str(built), "--out", str(out)])
    con = duckdb.connect(str(out), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM band_documents WHERE text IS NOT NULL").fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM evidence_bands WHERE token <> '' OR len(context_tokens) > 0"
                           ).fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM evidence_bands").fetchone()[0] == len(_rows(built))
    finally:
        con.close()


def test_trimming_a_sample_gives_the_smaller_sample_a_run_would(setup, built, tmp_path):
    """The sketch is nested: the 3 highest-priority of 5 rows are what --band-sample-n 3 keeps, ranks and run
    record included (so a later build with those arguments sees its own run and does nothing)."""
    import shutil

    from precompute.bands import main as bands_main

    small = tmp_path / "small.duckdb"
    precompute_main(_argv(setup, small, sample=3))
    trimmed = tmp_path / "trimmed.duckdb"
    shutil.copyfile(built, trimmed)
    summary = bands_main(["trim", "--db", str(trimmed), "--corpus", setup["corpus"], "--sample-n", "3"])
    assert summary["sampled_rows"] == len(_rows(small)) and _rows(trimmed) == _rows(small)
    con = duckdb.connect(str(trimmed), read_only=True)
    other = duckdb.connect(str(small), read_only=True)
    try:
        assert con.execute("SELECT run_id, args_json FROM runs WHERE job = 'bands'").fetchone() == \
            other.execute("SELECT run_id, args_json FROM runs WHERE job = 'bands'").fetchone()
        assert sorted(con.execute("SELECT doc_id FROM band_documents").fetchall()) == \
            sorted(other.execute("SELECT doc_id FROM band_documents").fetchall())
    finally:
        con.close()
        other.close()
    with pytest.raises(SystemExit):  # a bigger sample than the one held cannot be made by trimming
        bands_main(["trim", "--db", str(trimmed), "--corpus", setup["corpus"], "--sample-n", "4"])
