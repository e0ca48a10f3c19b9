"""Training-data attribution (prism/attribution.py, precompute/attribution/, bench/attribution.py).

Math against independent computations (autograd for the gradients, dense Kronecker algebra for the curvature), the
meaning of the answers (a training sequence planted in the query ranks first for the reference and the cached
level; where the cached approximation leaves nothing out it equals the reference), the job's exactness, resume
after SIGKILL and idempotence, pointer-only text, the EK-FAC peer and the benchmark end to end on a tiny model.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import random_ids, synthetic_documents, tiny_backbone_dir, tiny_prism

from app.render import attribution_html
from precompute import attribution as cache
from precompute.__main__ import main as precompute_main
from precompute.runs import JobArgsMismatch
from prism import PrismConfig, PrismForCausalLM
from prism.attribution import (
    CachedIndex,
    CurvatureAccumulator,
    Query,
    next_token_targets,
    query_gradient,
    reference_scores,
    sequence_gradients,
    token_statistics,
    top_overlap,
    top_sequences,
)
from prism.backbones import load_backbone, load_tokenizer
from prism.grad_cache import GradientCache, batches
from prism.losses import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[1]
K, TOP_K, SEQ, RANK = 24, 3, 24, 16  # the tiny backbone has d = 32: the cache keeps half
PLANTED = "Quixotic zebras vex jumpy wizards while fog blows past old kilns."
TABLES = ("attribution_documents", "attribution_sequences", "attribution_factors", "attribution_vectors")


def _save_model(root: Path, backbone_dir: Path, top_k: int, name: str) -> Path:
    model = PrismForCausalLM.from_backbone(load_backbone(str(backbone_dir)), PrismConfig(n_prototypes=K, top_k=top_k))
    torch.manual_seed(0)
    with torch.no_grad():
        model.prototypes.weight.normal_()
    model.save_pretrained(root / name)
    load_tokenizer(str(backbone_dir)).save_pretrained(root / name)
    return root / name


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("attribution")
    backbone_dir = tiny_backbone_dir(root / "bb")
    docs = synthetic_documents(24)
    docs.insert(12, {"id": "planted", "text": PLANTED})
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return {"root": root, "model": str(_save_model(root, backbone_dir, TOP_K, "model")),
            "model_k1": str(_save_model(root, backbone_dir, 1, "model_k1")), "corpus": str(corpus)}


def _argv(setup, db, *extra, model=None):
    return ["build", "--model", model or setup["model"], "--corpus", setup["corpus"], "--db", str(db), "--jobs",
            "attribution", "--seq-len", str(SEQ), "--batch-size", "3", "--docs-per-chunk", "4",
            "--attribution-rank", str(RANK), "--attribution-chunk", "16", *extra]


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


@pytest.fixture(scope="module")
def loaded(setup, built):
    model = PrismForCausalLM.from_pretrained(setup["model"]).eval()
    tokenizer = load_tokenizer(setup["model"])
    con = duckdb.connect(str(built), read_only=True)
    yield {"model": model, "tokenizer": tokenizer, "con": con, "sequences": cache.sequence_token_ids(con, tokenizer),
           "rows": cache.sequences(con)}
    con.close()


# ----------------------------------------------------------------------------------------------------------------
# Math against independent computations.


def _autograd_bank_gradient(model, ids: torch.Tensor) -> torch.Tensor:
    """d (summed next-token CE of ids (1, T)) / d P through the prototype route, residual held fixed: autograd."""
    z, _ = model.final_states(ids)
    z = z.detach()
    bank = model.prototypes.weight.detach().clone().requires_grad_(True)
    sims = F.normalize(z, dim=-1) @ F.normalize(bank, dim=-1).T  # (1, T, K)
    top = sims.topk(model.config.top_k, dim=-1).indices
    acts = F.relu(sims.gather(-1, top))
    z_hat = torch.einsum("btk,btkd->btd", acts, bank[top])
    logits = model.lm_head((z - z_hat).detach() + z_hat)  # numerically the model's logits
    assert torch.allclose(logits, model(ids).logits, atol=1e-4)
    loss = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
    return torch.autograd.grad(loss, bank)[0]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_prototype_gradients_match_autograd(kind):
    model = tiny_prism(kind, n_prototypes=16, top_k=4)
    ids = random_ids(3, 10, seed=1)
    z, _ = model.final_states(ids)
    rows = sequence_gradients(model.prototypes.weight, token_statistics(model, z, next_token_targets(ids)))
    for b in range(3):
        expected = _autograd_bank_gradient(model, ids[b: b + 1])
        mine = torch.zeros_like(expected)
        mine.index_add_(0, rows.prototype[rows.sequence == b], rows.rows[rows.sequence == b])
        torch.testing.assert_close(mine, expected, atol=1e-6, rtol=1e-5)
        assert set(rows.prototype[rows.sequence == b].tolist()) == set(expected.abs().sum(1).nonzero()[:, 0].tolist())
    # one token: the query gradient is the gradient of that token's loss alone
    active, g = query_gradient(model, ids[:1], 6, int(ids[0, 7]))
    expected = _autograd_bank_gradient(model, ids[:1, :8]) - _autograd_bank_gradient(model, ids[:1, :7])
    mine = torch.zeros_like(expected).index_add_(0, active, g)
    torch.testing.assert_close(mine, expected, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_curvature_factors_and_inverse_match_a_dense_computation():
    model = tiny_prism("llama", n_prototypes=6, top_k=3)
    ids = random_ids(4, 9, seed=2)
    z, _ = model.final_states(ids)
    stats = token_statistics(model, z, next_token_targets(ids))
    acc = CurvatureAccumulator(6, model.d_model, model.vocab_size)
    acc.add(stats)
    curvature = acc.finish(model.lm_head.weight, damping=0.1)
    # the factors, token by token
    w = model.lm_head.weight.double()
    dense_a = torch.zeros(len(stats.z), 6, dtype=torch.float64)
    dense_a.scatter_(1, stats.prototype_ids, stats.activations.double())
    a_expected = dense_a.T @ dense_a / len(stats.z)
    probs = model.lm_head(stats.z).double().softmax(-1)  # (N, V)
    s_expected = sum(w.T @ (torch.diag(p) - torch.outer(p, p)) @ w for p in probs) / len(stats.z)
    torch.testing.assert_close(curvature.coactivation.double(), a_expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(curvature.output.double(), s_expected, atol=1e-6, rtol=1e-4)
    lam = curvature.damping
    assert lam == pytest.approx(0.1 * float(a_expected.trace() / 6 * s_expected.trace() / model.d_model), rel=1e-4)
    # the inverse through the eigenbases against a dense (K d) x (K d) solve, coupling included
    d = model.d_model
    dense = torch.kron(a_expected, s_expected) + lam * torch.eye(6 * d, dtype=torch.float64)
    g = torch.randn(6, d, dtype=torch.float64)
    g[[1, 4]] = 0  # a query has few rows
    expected = torch.linalg.solve(dense, g.reshape(-1)).reshape(6, d)
    torch.testing.assert_close(curvature.precondition(g.float()).double(), expected, atol=1e-4, rtol=1e-3)
    active = torch.tensor([0, 2, 3, 5])
    sparse = curvature.precondition_sparse(active, g[active].float()) @ curvature.output_vectors.T
    torch.testing.assert_close(sparse.double(), expected, atol=1e-4, rtol=1e-3)
    # the block whitening: dot products of whitened rows are g^T (A_ii S + lambda)^-1 g'
    whiten = curvature.block_whitening()
    other = torch.randn(d, dtype=torch.float64)
    for i in range(6):
        block = a_expected[i, i] * s_expected + lam * torch.eye(d, dtype=torch.float64)
        exact = g[0] @ torch.linalg.solve(block, other)
        wq = whiten(torch.tensor([i]), g[:1].float())
        ws = whiten(torch.tensor([i]), other[None].float())
        assert float(wq @ ws.T) == pytest.approx(float(exact), rel=1e-3, abs=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# The job and its meaning.


def test_job_writes_sequences_linked_to_documents(setup, built, loaded):
    con, tok = loaded["con"], loaded["tokenizer"]
    docs = {json.loads(line)["id"]: json.loads(line)["text"] for line in Path(setup["corpus"]).read_text().splitlines()}
    rows = loaded["rows"]
    expected = []
    for doc_id, text in docs.items():
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        expected += [(doc_id, s, min(s + SEQ, n)) for s in range(0, n, SEQ) if min(s + SEQ, n) - s >= 2]
    assert [(r["doc_id"], r["seq_token_start"], r["seq_token_end"]) for r in rows] == expected
    for r, ids in zip(rows, loaded["sequences"]):
        enc = tok(docs[r["doc_id"]], add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"][r["seq_token_start"]: r["seq_token_end"]]
        assert (r["char_start"], r["char_end"]) == (offsets[0][0], offsets[-1][1])
        assert r["n_targets"] == len(ids) - 1
    factors = cache.load_factors(con)
    d = loaded["model"].d_model
    assert factors["coactivation"].shape == (K, K) and factors["output_vectors"].shape == (d, d)
    assert factors["basis"].shape == (d, RANK) and factors["damping"][0, 0] > 0
    # every active (prototype, sequence) pair has exactly one row
    n_pairs = con.execute("SELECT count(*), count(DISTINCT (prototype_id, sequence_id)) FROM attribution_vectors"
                          ).fetchone()
    assert n_pairs[0] == n_pairs[1] > len(rows)


@torch.no_grad()
def test_cached_vectors_are_projected_exact_gradients_of_each_sequence(loaded):
    """Recompute a few sequences alone (no batching, no work files) and compare with what the job stored."""
    model, con = loaded["model"], loaded["con"]
    index = cache.load_index(con, model.lm_head.weight)
    for sid in (0, 7, len(loaded["sequences"]) - 1):
        ids = torch.from_numpy(loaded["sequences"][sid][None])
        z, _ = model.final_states(ids)
        rows = sequence_gradients(model.prototypes.weight, token_statistics(model, z, next_token_targets(ids)))
        expected = index.project(rows.prototype, rows.softmax_part(model.lm_head.weight)).numpy()
        stored = {p: index.vectors[index.offsets[p]: index.offsets[p + 1]][index.sequence_ids[
            index.offsets[p]: index.offsets[p + 1]] == sid][0] for p in rows.prototype.tolist()}
        np.testing.assert_allclose(np.stack([stored[p] for p in rows.prototype.tolist()]), expected,
                                   atol=1e-4 * max(1.0, float(np.abs(expected).max())), rtol=1e-3)


@torch.no_grad()
def test_same_token_scores_keep_only_the_tokens_that_predicted_the_queried_token(loaded):
    """CachedIndex.same_token_scores against the training side recomputed from the model: for every sequence,
    -sum over its positions predicting `token` and the read prototypes active there of a (h_i . W[token])."""
    model, con = loaded["model"], loaded["con"]
    index = cache.load_index(con, model.lm_head.weight)
    sid, queries = _planted_queries(loaded)
    for q in queries[:3]:
        ids, rows = query_gradient(model, q.prefix(), q.position, q.token)
        read, x = index.preconditioned_query(ids, rows)
        h = {int(p): x[j] @ index.whitening.output_vectors.T for j, p in enumerate(read.tolist())}
        expected = np.sum(list(_same_token_by_hand(model, loaded["sequences"], h, q.token).values()), axis=0)
        got = index.same_token_scores(ids, rows, q.token)
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-5 * max(1.0, float(np.abs(expected).max())))
        assert got[sid] > 0 and int(np.argmax(got)) == sid  # the planted window predicts this token; no other does
    predicted = {int(t) for seq in loaded["sequences"] for t in seq[1:]}
    never = next(t for t in range(model.vocab_size) if t not in predicted)
    assert not np.any(index.same_token_scores(ids, rows, never))  # no training token predicted it


@torch.no_grad()
def test_token_scores_read_any_index_block_diagonally_with_shares_that_add_up(loaded):
    """CachedIndex.token_scores (the app's "where they predicted this token" reading) on the app's coupled index
    against the same reading recomputed from the model with the block-diagonal query of an index loaded in the block
    mode: every prototype's share is its own positions' -a (h_i . W[token]), the shares add up to the scores, and
    the planted window ranks first."""
    model, con = loaded["model"], loaded["con"]
    coupled = cache.load_index(con, model.lm_head.weight)
    block = cache.load_index(con, model.lm_head.weight, mode="block")
    sid, queries = _planted_queries(loaded)
    for q in queries[:3]:
        ids, rows = query_gradient(model, q.prefix(), q.position, q.token)
        read, x = block.preconditioned_query(ids, rows)
        assert sorted(read.tolist()) == sorted(ids.tolist())  # the block reading stays on the active prototypes
        h = {int(p): x[j] @ block.whitening.output_vectors.T for j, p in enumerate(read.tolist())}
        expected = _same_token_by_hand(model, loaded["sequences"], h, q.token)
        total, parts = coupled.token_scores(ids, rows, q.token)
        assert set(parts) == set(h)
        scale = max(1.0, max(float(np.abs(e).max()) for e in expected.values()))
        for p, e in expected.items():
            np.testing.assert_allclose(parts[p], e, rtol=1e-3, atol=1e-5 * scale)
        np.testing.assert_allclose(total, np.sum(list(parts.values()), axis=0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(total, block.same_token_scores(ids, rows, q.token), rtol=1e-6, atol=1e-9)
        assert int(np.argmax(total)) == sid
    with pytest.raises(ValueError, match="token must be in"):
        coupled.token_scores(ids, rows, model.vocab_size)
    with pytest.raises(ValueError, match="coupled mode needs"):
        block.token_scores(ids, rows, q.token, mode="coupled")


def _same_token_by_hand(model, sequences, h: dict, token: int) -> dict[int, np.ndarray]:
    """Per prototype p in h (its preconditioned query row in model coordinates), over every training sequence:
    -sum of a (h_p . W[token]) over the sequence's positions predicting `token` where p is active with activation a,
    from the model's own token statistics."""
    W = model.lm_head.weight.float()
    out = {p: np.zeros(len(sequences)) for p in h}
    for s, seq in enumerate(sequences):
        t = torch.from_numpy(seq[None])
        z, _ = model.final_states(t)
        stats = token_statistics(model, z, next_token_targets(t))
        for pos in (stats.target == token).nonzero().flatten().tolist():
            for slot, p in enumerate(stats.prototype_ids[pos].tolist()):
                a = float(stats.activations[pos, slot])
                if a > 0 and p in h:
                    out[p][s] -= a * float(h[p] @ W[token])
    return out


def _planted_queries(loaded) -> tuple[int, list[Query]]:
    """Queries that contain the planted document's first window, exactly or with one early token changed.

    In an untrained model influence only sees which tokens are predicted through which prototypes, so the planted
    content must be identifiable: the queries predict tokens that occur in no other document, at positions in the
    window's second half (a near duplicate then shares all but one of at least 12 prompt tokens)."""
    sid = next(r["sequence_id"] for r in loaded["rows"] if r["doc_id"] == "planted" and r["seq_token_start"] == 0)
    window = [int(t) for t in loaded["sequences"][sid]]
    elsewhere = {int(t) for r, s in zip(loaded["rows"], loaded["sequences"]) if r["doc_id"] != "planted" for t in s}
    positions = [t for t in range(SEQ // 2, len(window) - 1) if window[t + 1] not in elsewhere]
    assert len(positions) >= 3
    queries = []
    for t in positions:
        queries.append(Query(window[: t + 1], t, window[t + 1]))  # the exact training text
        near = list(window[: t + 1])
        near[1] = (near[1] + 1) % loaded["model"].vocab_size  # one token changed early in the prompt
        queries.append(Query(near, t, window[t + 1]))
    return sid, queries


def test_planted_training_sequence_ranks_first_for_reference_and_cached(loaded):
    model, con = loaded["model"], loaded["con"]
    sid, queries = _planted_queries(loaded)
    reference = reference_scores(model, cache.load_curvature(con), queries, loaded["sequences"], batch_size=4)
    index = cache.load_index(con, model.lm_head.weight)
    for q, ref in zip(queries, reference):
        assert int(top_sequences(ref, 1)[0]) == sid
        cached, parts = index.scores(*query_gradient(model, q.prefix(), q.position, q.token))
        assert int(top_sequences(cached, 1)[0]) == sid
        np.testing.assert_allclose(sum(parts.values()), cached, rtol=1e-6, atol=1e-9)
    # the app's rows: the planted document, its span and the highlighted text
    cached, parts = index.scores(*query_gradient(model, queries[0].prefix(), queries[0].position, queries[0].token))
    rows = cache.attribution_rows(con, loaded["tokenizer"], [int(s) for s in top_sequences(cached, 3)], cached, parts)
    assert rows[0]["doc_id"] == "planted" and rows[0]["score"] == pytest.approx(float(cached[sid]))
    text = "".join(s["text"] for s in rows[0]["segments"])
    assert text and text in PLANTED[rows[0]["char_start"]: rows[0]["char_end"]]
    assert sum(s["target"] for s in rows[0]["segments"]) == 1
    assert sum(p["contribution"] for p in rows[0]["prototypes"]) == pytest.approx(rows[0]["score"], rel=1e-5)
    assert "outline" in attribution_html(rows)


def _stored_gradients(loaded, built):
    store = cache.load_gradient_store(loaded["con"], loaded["model"], built)
    assert store is not None
    return store


def test_gradient_store_holds_every_tokens_factors_of_the_trained_layers(loaded, built):
    """The store against each sequence recomputed alone by GradientCache.gradients_and_positions (the loss through
    lm_head, not the job's e-backward), with the store's own projections: every training token once, sorted by the
    token it predicted, at its sequence and position, its factors equal up to float16."""
    model, sequences = loaded["model"], loaded["sequences"]
    store = _stored_gradients(loaded, built)
    index, grads = store.index, store.cache
    assert grads.start_layer == model.n_layers - 2 and len(grads.modules) == 14  # a Llama layer: 7 linear layers
    assert index.n_sequences == len(sequences) and len(index.token) == sum(len(s) - 1 for s in sequences)
    assert bool((index.token[1:] >= index.token[:-1]).all())
    fresh = GradientCache(model, grads.start_layer, rank=grads.rank)
    fresh.p_in, fresh.p_out = grads.p_in, grads.p_out
    order = np.lexsort((index.position.numpy(), index.sequence.numpy()))  # (sequence, position) order
    at = 0
    for sid, ids in enumerate(sequences):
        ids = torch.from_numpy(ids[None].astype(np.int64))
        _, f = fresh.gradients_and_positions(ids, model.states_before_layer(ids, grads.start_layer), None, ids)
        rows = order[at: at + len(f.token)]
        at += len(f.token)
        assert (index.sequence[rows] == sid).all() and (index.position[rows] == f.position).all()
        assert (index.token[rows] == f.token).all()
        for name, expected in (("x", f.x), ("d", f.d)):
            got = getattr(index, name)[rows].float()
            scale = float(expected.abs().max())
            torch.testing.assert_close(got, expected, atol=2e-3 * scale, rtol=2e-3, msg=f"{sid} {name}")
    assert at == len(order)


def test_gradient_store_reading_sums_to_the_whole_sequence_gradient_and_fits_ekfac_on_it(loaded, built):
    """Summed over every token a sequence predicted, the stored reading is the query's preconditioned gradient
    dotted with the sequence's whole projected loss gradient (GradientCache.gradients, computed here, batched);
    the stored preconditioner is EK-FAC fitted on those gradients; a query's scores are the sums of its
    positions' parts, and only sequences that predicted the token score."""
    model, sequences = loaded["model"], loaded["sequences"]
    store = _stored_gradients(loaded, built)
    grads = store.cache
    fresh = GradientCache(model, grads.start_layer, rank=grads.rank)
    fresh.p_in, fresh.p_out = grads.p_in, grads.p_out
    n_modules = len(grads.modules)
    stats = {"a": [torch.zeros(grads.rank, grads.rank, dtype=torch.float64) for _ in range(n_modules)],
             "s": [torch.zeros(grads.rank, grads.rank, dtype=torch.float64) for _ in range(n_modules)], "positions": 0}
    whole = []
    for idx in batches(len(sequences), 5):
        length = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), length, dtype=torch.long)
        mask = torch.zeros(len(idx), length, dtype=torch.long)
        for b, i in enumerate(idx):
            ids[b, : len(sequences[i])] = torch.from_numpy(sequences[i].astype(np.int64))
            mask[b, : len(sequences[i])] = 1
        g, f = fresh.gradients_and_positions(ids, model.states_before_layer(ids, grads.start_layer, mask), mask,
                                             ids.masked_fill(mask == 0, IGNORE_INDEX))
        whole.append(g)
        for i in range(n_modules):  # the Kronecker factors over the tokens with a target, as the job keeps them
            stats["a"][i] += (f.x[:, i].T @ f.x[:, i]).double()
            stats["s"][i] += (f.d[:, i].T @ f.d[:, i]).double()
        stats["positions"] += len(f.token)
    whole = torch.cat(whole)
    fresh.fit(whole, stats)
    for i in range(n_modules):  # the same curvature, up to float16 factors
        torch.testing.assert_close(grads.eigen[i], fresh.eigen[i], rtol=2e-2, atol=1e-3 * float(fresh.eigen[i].max()))
    query = torch.from_numpy(loaded["sequences"][3][None].astype(np.int64))
    position, token = 6, int(query[0, 7])
    scores, seq, pos, value = store.query(query, position, token)
    q = grads.apply(grads.query_gradient(query[:, : position + 1], model.states_before_layer(
        query[:, : position + 1], grads.start_layer), position, token)[None])[0]
    total = torch.zeros(len(sequences))
    for y in torch.unique(store.index.token).tolist():
        total += store.index.scores(q, y)
    torch.testing.assert_close(total, whole @ q, rtol=1e-2, atol=1e-3 * float((whole @ q).abs().max()))
    assert len(value) == int((store.index.token == token).sum()) > 0
    by_hand = torch.zeros(len(sequences)).index_add_(0, seq, value)
    torch.testing.assert_close(scores, by_hand)
    predicted = {s for s, ids in enumerate(sequences) if token in ids[1:].tolist()}
    assert set(torch.nonzero(scores).flatten().tolist()) <= predicted
    assert set(seq.tolist()) == predicted
    # the app's rows: highlighted where the sequence predicted the token, no prototypes
    best = [int(s) for s in top_sequences(scores.numpy(), 3) if scores[s] > 0]
    rows = cache.gradient_rows(loaded["con"], loaded["tokenizer"], best, scores.numpy(), seq.numpy(), pos.numpy(),
                               value.numpy(), token)
    assert [r["sequence_id"] for r in rows] == best and rows[0]["prototypes"] == []
    assert rows[0]["score"] == pytest.approx(float(scores[best[0]]))
    assert sum(seg["target"] for seg in rows[0]["segments"]) == 1
    assert "the trained layers" in attribution_html(rows)


def test_planted_training_sequence_ranks_first_in_the_gradient_store(loaded, built):
    sid, queries = _planted_queries(loaded)
    store = _stored_gradients(loaded, built)
    for q in queries:
        scores, *_ = store.query(q.prefix(), q.position, q.token)
        assert int(top_sequences(scores.numpy(), 1)[0]) == sid


def test_a_gradient_query_from_kept_states_equals_one_that_runs_the_frozen_layers(loaded, built):
    """The app keeps a text's states entering the trained layers (one forward of the frozen layers per text): a
    query at any position of it, from those states, answers what a query that runs the frozen layers on the prefix
    answers; states of the wrong shape are refused."""
    store = _stored_gradients(loaded, built)
    text = torch.from_numpy(loaded["sequences"][4][None].astype(np.int64))
    kept = store.start_states(text)
    assert kept.shape == (1, text.shape[1], loaded["model"].d_model)
    for position in (3, 9, text.shape[1] - 2):
        token = int(text[0, position + 1])
        fresh = store.query(text[:, : position + 1], position, token)
        reused = store.query(text[:, : position + 1], position, token, states=kept)
        torch.testing.assert_close(reused[0], fresh[0], rtol=1e-4, atol=1e-6 * float(fresh[0].abs().max()))
        assert torch.equal(reused[1], fresh[1]) and torch.equal(reused[2], fresh[2])
    with pytest.raises(ValueError, match="states must be"):
        store.query(text, 9, int(text[0, 10]), states=kept[:, :5])
    with pytest.raises(ValueError, match="states must be"):
        store.query(text, 9, int(text[0, 10]), states=kept[0])


def test_a_gradient_query_leaves_other_threads_using_the_model_alone(loaded, built):
    """The app's users share one model: a gradient query's hooks (the states entering the trained layers, the
    layers' inputs and output gradients) must neither stop nor read another thread's forward pass, and two queries
    at once give each its own answer."""
    model = loaded["model"]
    store = _stored_gradients(loaded, built)
    text = torch.from_numpy(loaded["sequences"][5][None].astype(np.int64))
    with torch.no_grad():
        logits = model(text).logits
    queries = [(torch.from_numpy(loaded["sequences"][s][None].astype(np.int64)), 9) for s in (2, 11)]
    expected = [store.query(ids, pos, int(ids[0, pos + 1]))[0] for ids, pos in queries]
    errors: list[BaseException] = []

    def forwards():
        try:
            for _ in range(60):
                with torch.no_grad():
                    torch.testing.assert_close(model(text).logits, logits)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    def gradient_queries(which: int):
        try:
            ids, pos = queries[which]
            for _ in range(15):
                torch.testing.assert_close(store.query(ids, pos, int(ids[0, pos + 1]))[0], expected[which])
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=forwards), threading.Thread(target=gradient_queries, args=(0,)),
               threading.Thread(target=gradient_queries, args=(1,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_a_gradient_store_of_another_build_or_model_is_not_read(setup, loaded, built, tmp_path, caplog):
    db = tmp_path / "copy.duckdb"
    shutil.copyfile(built, db)
    shutil.copytree(cache.gradient_folder(built), cache.gradient_folder(db))
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert cache.load_gradient_store(con, loaded["model"], db) is not None
        meta = cache.gradient_folder(db) / "meta.json"
        saved = meta.read_text()
        meta.write_text(saved.replace('"run_id": "', '"run_id": "x'))
        assert cache.load_gradient_store(con, loaded["model"], db) is None and "another build" in caplog.text
        meta.write_text(saved.replace('"rank": 16', '"rank": 8'))  # projections that do not fit its rank
        assert cache.load_gradient_store(con, loaded["model"], db) is None
        meta.write_text(saved)
        shutil.rmtree(cache.gradient_folder(db))
        assert cache.load_gradient_store(con, loaded["model"], db) is None  # none written: nothing to read
    finally:
        con.close()


def test_where_the_approximation_leaves_nothing_out_cached_equals_reference(setup, loaded, tmp_path):
    """k = 1: prototypes are never co-active, A is diagonal: cached (coupled or block) equals the reference.
    k = 3, reading every prototype: the coupled read is the reference. Both at r = d (no projection)."""
    for model_dir, modes in ((setup["model_k1"], [("coupled", 0), ("block", 0)]), (setup["model"], [("coupled", K)])):
        db = tmp_path / f"{Path(model_dir).name}.duckdb"
        precompute_main([*_argv(setup, db, model=model_dir)[:-4], "--attribution-rank", "0"])
        model = PrismForCausalLM.from_pretrained(model_dir).eval()
        con = duckdb.connect(str(db), read_only=True)
        sequences = cache.sequence_token_ids(con, loaded["tokenizer"])
        queries = [Query(sequences[j][: t + 1], t, int(sequences[j][t + 1])) for j, t in ((3, 5), (20, 12), (40, 1))]
        reference = reference_scores(model, cache.load_curvature(con), queries, sequences, batch_size=4)
        for mode, extra in modes:
            index = cache.load_index(con, model.lm_head.weight, mode=mode, extra=extra)
            assert index.rank == model.d_model
            for q, ref in zip(queries, reference):
                cached, _ = index.scores(*query_gradient(model, q.prefix(), q.position, q.token))
                np.testing.assert_allclose(cached, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max())
        con.close()


def test_the_exact_second_stage_gives_the_reference_scores_of_its_candidates(loaded, built):
    """With the build's exact store (float16 z and e beside the database), the first stage's M best sequences get
    the reference's own scores (full coupled curvature, every prototype, no projection); the others keep the first
    stage's; per-prototype shares add up to the scores. M = every sequence: the whole reference."""
    model, con = loaded["model"], loaded["con"]
    store = cache.load_exact_store(con)
    assert store is not None and store.n_sequences == len(loaded["sequences"])
    assert store.rows.dtype == np.float16 and isinstance(store.rows, np.memmap)
    sequences = loaded["sequences"]
    queries = [Query(sequences[j][: t + 1], t, int(sequences[j][t + 1])) for j, t in ((3, 5), (20, 12), (40, 1))]
    reference = reference_scores(model, cache.load_curvature(con), queries, sequences, batch_size=4)
    first = cache.load_index(con, model.lm_head.weight)
    for q, ref in zip(queries, reference):
        query = query_gradient(model, q.prefix(), q.position, q.token)
        stage_one, _ = first.scores(*query)
        for m in (6, len(sequences)):
            scores, parts = cache.load_index(con, model.lm_head.weight, rerank=m, exact=store).scores(*query)
            done = top_sequences(stage_one, m)
            rest = np.setdiff1d(np.arange(len(sequences)), done)
            np.testing.assert_allclose(scores[done], ref[done], rtol=5e-3, atol=2e-3 * np.abs(ref).max())
            np.testing.assert_array_equal(scores[rest], stage_one[rest])
            np.testing.assert_allclose(sum(parts.values()), scores, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
        assert top_overlap(scores, ref, 10) == 1.0  # M = every sequence: the reference's top 10
    # a second stage needs the store and the coupled mode; load_index without a store has none
    for mode, exact in (("coupled", None), ("block", store)):
        with pytest.raises(ValueError, match="rerank"):
            CachedIndex(first.whitening, first.basis, first.prototype_ids, first.sequence_ids, first.vectors,
                        np.diff(first.entry_offsets), first.entry_targets, first.entry_activations,
                        model.lm_head.weight, first.n_sequences, first.n_prototypes, coupling=first.coupling,
                        mode=mode, rerank=5, exact=exact)
    assert cache.load_index(con, model.lm_head.weight, rerank=5).rerank == 0
    # a store from another build of the cache is not used
    meta = cache.exact_folder(built) / "meta.json"
    saved = meta.read_text()
    try:
        meta.write_text(json.dumps({**json.loads(saved), "run_id": "another"}))
        assert cache.load_exact_store(con) is None
        meta.write_text(json.dumps({k: v for k, v in json.loads(saved).items() if k != "format"}))  # format 1
        assert cache.load_exact_store(con) is None
    finally:
        meta.write_text(saved)
    assert cache.load_exact_store(con) is not None


def test_the_exact_stores_rows_are_each_sequences_bank_gradient_by_autograd(loaded):
    """Decoded (scale x float16 row, rotated back by Q_S^T), the store's rows of a sequence are autograd's gradient
    of its summed loss with respect to the bank, row for row, and no other prototype has one."""
    model, con = loaded["model"], loaded["con"]
    store = cache.load_exact_store(con)
    q_s = cache.load_curvature(con).output_vectors
    for s in (0, 9, len(loaded["sequences"]) - 1):
        lo, hi = store.offsets[s], store.offsets[s + 1]
        decoded = torch.from_numpy(np.asarray(store.rows[lo:hi], np.float32) * store.scales[lo:hi, None]) @ q_s.T
        expected = _autograd_bank_gradient(model, torch.as_tensor(loaded["sequences"][s][None], dtype=torch.long))
        ids = torch.from_numpy(np.asarray(store.prototypes[lo:hi], np.int64))
        assert sorted(ids.tolist()) == ids.tolist() and len(set(ids.tolist())) == len(ids)
        torch.testing.assert_close(decoded, expected[ids], rtol=2e-3, atol=2e-3 * float(expected.abs().max()))
        others = torch.ones(len(expected), dtype=torch.bool)
        others[ids] = False
        assert float(expected[others].abs().max()) == 0.0


def test_the_exact_stores_entries_are_the_databases_and_the_panel_reads_either_alike(loaded):
    """The store's entries of a sequence (prototype, token position, activation, predicted token) are the rows the
    database holds for it, entry for entry; the panel built from the store's entries equals the panel built from
    the database, and a store without entries (written before they were kept) still scores and falls back."""
    from prism.attribution import ExactStore

    model, con, tok = loaded["model"], loaded["con"], loaded["tokenizer"]
    store = cache.load_exact_store(con)
    assert store.entries is not None
    for s in range(len(loaded["sequences"])):
        want = [[], [], [], []]
        for p, positions, acts, targets in con.execute(
                "SELECT prototype_id, token_positions, activations, target_ids FROM attribution_vectors "
                "WHERE sequence_id = ? ORDER BY prototype_id", [s]).fetchall():
            for column, values in zip(want, ([p] * len(positions), positions, acts, targets)):
                column.extend(values)
        got = store.active(s)
        for column, (a, b) in enumerate(zip(got, want)):
            np.testing.assert_allclose(a, np.asarray(b, np.float64), rtol=1e-6, err_msg=f"sequence {s}, {column}")
    sequences = loaded["sequences"]
    query = query_gradient(model, torch.as_tensor(sequences[7][None, :10]), 9, int(sequences[7][10]))
    scores, parts = cache.load_index(con, model.lm_head.weight, rerank=8, exact=store).scores(*query)
    best = [int(b) for b in top_sequences(scores, 5)]
    from_store = cache.attribution_rows(con, tok, best, scores, parts, store=store)
    from_database = cache.attribution_rows(con, tok, best, scores, parts)
    assert [r["prototypes"] for r in from_store] == [r["prototypes"] for r in from_database]
    for a, b in zip(from_store, from_database):
        assert [g["text"] for g in a["segments"]] == [g["text"] for g in b["segments"]]
        np.testing.assert_allclose([g["activation"] for g in a["segments"]],
                                   [g["activation"] for g in b["segments"]], rtol=1e-9, atol=1e-12)
        assert any(g["activation"] > 0 for g in a["segments"])
    bare = ExactStore(store.rows, store.scales, store.prototypes, store.offsets)
    with pytest.raises(LookupError, match="no entries"):
        bare.active(0)
    again, _ = cache.load_index(con, model.lm_head.weight, rerank=8, exact=bare).scores(*query)
    np.testing.assert_array_equal(again, scores)
    assert [r["segments"] for r in cache.attribution_rows(con, tok, best, scores, parts, store=bare)] == \
        [r["segments"] for r in from_database]
    with pytest.raises(ValueError, match="entries disagree"):
        ExactStore(store.rows, store.scales, store.prototypes, store.offsets,
                   entries={"counts": np.ones(3), "positions": [], "activations": [], "targets": []})


def test_exact_shares_equal_one_float64_product():
    """ExactStore.shares scores its candidates' rows a sequence at a time, where they lie: the same as one float64
    product of the decoded rows with h, candidates in any order, empty sequences included."""
    from prism.attribution import ExactStore

    gen = torch.Generator().manual_seed(3)
    n_seq, k, d = 9, 6, 8
    counts = torch.randint(0, 5, (n_seq,), generator=gen).numpy()
    offsets = np.concatenate([[0], np.cumsum(counts)])
    prototypes = np.concatenate([np.sort(np.random.default_rng(s).choice(k, c, replace=False)) for s, c in
                                 enumerate(counts)]).astype(np.int32)
    rows, scales = ExactStore.encode(torch.randn(int(offsets[-1]), d, generator=gen), torch.eye(d))
    store = ExactStore(rows, scales, prototypes, offsets)
    h = torch.randn(k, d, generator=gen)
    candidates = np.array([7, 0, 3, 8])
    decoded = rows.astype(np.float64) * scales[:, None].astype(np.float64)
    want = [float(decoded[j] @ h[int(prototypes[j])].double().numpy())
            for s in candidates for j in range(offsets[s], offsets[s + 1])]
    assert 0 in counts[candidates]  # a candidate with no rows
    owner, prototype, share = store.shares(candidates, h)
    np.testing.assert_allclose(share, want, rtol=1e-5)
    assert prototype.tolist() == [int(prototypes[j]) for s in candidates for j in range(offsets[s], offsets[s + 1])]
    assert owner.tolist() == [i for i, s in enumerate(candidates) for _ in range(counts[s])]


@pytest.mark.slow
def test_killed_job_resumes_to_the_uninterrupted_result(setup, built, tmp_path):
    for where in ("fit:2", "vectors:2", "gradients:1"):
        db = tmp_path / f"killed-{where.replace(':', '')}.duckdb"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-m", "precompute", *_argv(setup, db), "--hook", f"kill-at={where}"],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == -9, proc.stderr[-2000:]
        assert cache.work_folder(db).exists()
        if where.startswith("vectors"):  # two chunks committed, the rest missing
            con = duckdb.connect(str(db), read_only=True)
            assert con.execute("SELECT value FROM progress WHERE job = 'attribution' AND key = 'next_sequence'"
                               ).fetchone()[0] == "32"
            con.close()
        if where.startswith("gradients"):  # the exact store written, the gradient store only half
            assert cache.exact_folder(db).exists() and not cache.gradient_folder(db).exists()
        else:
            assert not cache.exact_folder(db).exists()  # written last, after every vector
        precompute_main(_argv(setup, db))
        assert _dump(db) == _dump(built), where
        assert not cache.work_folder(db).exists()
        stored = importlib.import_module("precompute.attribution.cache")
        for name in stored.EXACT_ARRAYS + stored.EXACT_ENTRY_ARRAYS:  # the exact store too
            resumed, whole = (np.load(cache.exact_folder(path) / f"{name}.npy") for path in (db, built))
            np.testing.assert_array_equal(resumed, whole, err_msg=f"{where}: {name}")
        for name in [*stored.GRADIENT_ARRAYS, "preconditioner.safetensors"]:  # and the gradient store
            path = name if "." in name else f"{name}.npy"
            resumed, whole = ((cache.gradient_folder(p) / path).read_bytes() for p in (db, built))
            assert resumed == whole, f"{where}: {name}"


def test_rerun_is_idempotent_and_other_arguments_are_refused(setup, built, tmp_path, capsys):
    db = tmp_path / "copy.duckdb"
    shutil.copyfile(built, db)
    before = _dump(db)
    assert precompute_main(_argv(setup, db)) == {"attribution": None}
    assert _dump(db) == before
    with pytest.raises(SystemExit):
        precompute_main([*_argv(setup, db)[:-2], "--attribution-chunk", "5"])
    assert "other arguments" in capsys.readouterr().err
    with pytest.raises(JobArgsMismatch):
        cache.run(db, PrismForCausalLM.from_pretrained(setup["model"]), load_tokenizer(setup["model"]), [],
                  cache.AttributionArgs(rank=3), {"other": True})
    assert _dump(db) == before


def test_pointer_only_database_reads_attribution_text_back(setup, tmp_path, monkeypatch):
    db, shipped = tmp_path / "default.duckdb", tmp_path / "shipped.duckdb"
    precompute_main(["build", "--model", setup["model"], "--corpus", "default", "--db", str(db), "--jobs",
                     "attribution", "--seq-len", "32", "--limit", "2", "--attribution-max-sequences", "6"])
    precompute_main(["strip-text", "--db", str(db), "--out", str(shipped)])
    tok = load_tokenizer(setup["model"])
    full, stripped = duckdb.connect(str(db), read_only=True), duckdb.connect(str(shipped), read_only=True)
    assert stripped.execute("SELECT count(*) FROM attribution_documents WHERE text IS NOT NULL").fetchone()[0] == 0
    assert [s.tolist() for s in cache.sequence_token_ids(full, tok)] == \
        [s.tolist() for s in cache.sequence_token_ids(stripped, tok)]
    scores = np.arange(6, dtype=np.float64)
    parts = {0: scores}
    a = cache.attribution_rows(full, tok, [5, 2], scores, parts)
    b = cache.attribution_rows(stripped, tok, [5, 2], scores, parts)
    assert [r["error"] for r in b] == [None, None]
    assert [r["segments"] for r in a] == [r["segments"] for r in b]
    # the in-memory catalog gives the same rows as the query, whether the database stores its text or not
    for con, want in ((full, a), (stripped, b)):
        assert cache.attribution_rows(con, tok, [5, 2], scores, parts, catalog=cache.SequenceCatalog(con)) == want
    monkeypatch.setattr(cache.SequenceCatalog, "TEXT_BUDGET", 10)  # over the budget: the text is read per click
    catalog = cache.SequenceCatalog(full)
    assert catalog._text is None
    assert cache.attribution_rows(full, tok, [5, 2], scores, parts, catalog=catalog) == a
    assert all(r["text"] for r in cache.SequenceCatalog.rows(full, [0, 5], cache.SequenceCatalog(full)).values())


# ----------------------------------------------------------------------------------------------------------------
# The EK-FAC peer and the benchmark.


@pytest.mark.slow
def test_ekfac_peer_uses_the_same_loss_and_finds_the_planted_sequence(setup, loaded, tmp_path):
    from bench.attribution_ekfac import EkfacPeer, PrismLanguageModelingTask, SequenceDataset, TopLayers

    model = loaded["model"]
    sequences = loaded["sequences"]
    layer = model.n_layers - 1
    states = [model.states_before_layer(torch.from_numpy(s[None]), layer)[0] for s in sequences]
    train = SequenceDataset(sequences, lambda i: states[i], SEQ)
    top = TopLayers(model, layer)
    batch = {k: torch.stack([train[i][k] for i in range(3)]) for k in ("input_ids", "start_states",
                                                                        "attention_mask", "labels")}
    full = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = top(batch["input_ids"], batch["start_states"], batch["attention_mask"])
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[valid], full.logits[valid], atol=1e-4, rtol=1e-4)
    task = PrismLanguageModelingTask(top.tracked_module_names())
    expected = sum(float(token_statistics(model, full.z[b: b + 1], next_token_targets(
        batch["input_ids"][b: b + 1], batch["attention_mask"][b: b + 1])).loss.sum()) for b in range(3))
    assert float(task.compute_train_loss(batch, top).detach()) == pytest.approx(expected, rel=1e-4)
    assert all(name.startswith("model.backbone") and f".{layer}." in name for name in task.tracked)

    sid, queries = _planted_queries(loaded)
    peer_model = PrismForCausalLM.from_pretrained(setup["model"]).eval()  # kronfluence wraps its layers in place
    peer = EkfacPeer(peer_model, layer, tmp_path / "kronfluence")
    peer.fit(train, batch_size=8)
    q_ids = [np.asarray(q.input_ids[: q.position + 1] + (q.token,)) for q in queries[:2]]
    q_states = [peer_model.states_before_layer(torch.from_numpy(i[None]), layer)[0] for i in q_ids]
    query_set = SequenceDataset(q_ids, lambda i: q_states[i], max(len(i) for i in q_ids),
                                target_positions=[[q.position] for q in queries[:2]])
    scores = peer.scores(query_set, train, query_batch=2, train_batch=8)
    assert scores.shape == (2, len(sequences))
    assert int(scores[0].argmax()) == sid  # the exact duplicate


@pytest.mark.slow
def test_bench_runs_end_to_end_on_a_tiny_model(setup, tmp_path, capsys):
    bench = importlib.import_module("bench.attribution")
    result = bench.main(["--model", setup["model"], "--db", str(tmp_path / "bench.duckdb"), "--corpus",
                         setup["corpus"], "--n-train", "40", "--seq-len", str(SEQ), "--n-queries", "4", "--rank", "8",
                         "--batch-size", "4", "--peer-layers", "1", "--in-process", "--work", str(tmp_path / "w")])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line) == json.loads(json.dumps(result))
    for key in ("cached_query_ms", "cached_product_ms", "cached_build_s", "cached_load_s", "cached_peak_rss_mb",
                "cached_click_ms", "cached_text_ms", "speedup_click",
                "ekfac_query_ms", "ekfac_fit_s", "ekfac_peak_rss_mb", "reference_s", "states_s", "speedup",
                "memory_ratio", "top10_overlap", "top10_overlap_ekfac_reference"):
        assert key in result and result[key] is not None and result[key] >= 0, key
    assert result["n_train"] == 40 and result["n_queries"] == 4 and result["rank"] == 8
    assert result["speedup"] == pytest.approx(result["ekfac_query_ms"] / result["cached_query_ms"])
    assert 0 <= result["top10_overlap"] <= 1 and result["cached_product_ms"] <= result["cached_query_ms"]
    assert result["cached_product_ms"] + result["cached_text_ms"] <= result["cached_click_ms"]
    assert set(result["goals_met"]) == {"speedup", "memory", "top10_overlap"}
    assert result["reference_source"] == "the attribution job's token files" and result["states_s"] >= 0
    assert not (tmp_path / "w").exists()  # scratch removed


def test_bench_resume_reruns_only_the_unfinished_level(setup, tmp_path, capsys):
    bench = importlib.import_module("bench.attribution")
    argv = ["--model", setup["model"], "--db", str(tmp_path / "bench.duckdb"), "--corpus", setup["corpus"],
            "--n-train", "24", "--seq-len", str(SEQ), "--n-queries", "3", "--rank", "8", "--batch-size", "4",
            "--peer-layers", "1", "--in-process", "--levels", "cached,reference", "--work", str(tmp_path / "w"),
            "--resume", "--keep-work"]
    full = bench.main(argv)
    work = tmp_path / "w"
    cached_before = (work / "cached_scores.npy").read_bytes()
    inputs_mtime = (work / "train.npz").stat().st_mtime_ns
    assert full["reference_source"] == "the attribution job's token files"
    assert not (work / "states.f32").exists()  # neither level needed the states entering the trainable layers
    (work / "reference.json").unlink()  # as if the run died during the reference level
    (work / "reference_scores.npy").unlink()
    resumed = bench.main(argv)
    assert (work / "train.npz").stat().st_mtime_ns == inputs_mtime  # inputs reused, not prepared again
    assert (work / "cached_scores.npy").read_bytes() == cached_before
    assert resumed["top10_overlap"] == full["top10_overlap"]
    assert resumed["cached_query_ms"] == full["cached_query_ms"]  # the finished level is reported, not re-run
    # a setting of the cached level alone: only that level runs again
    reference_before = (work / "reference_scores.npy").read_bytes()
    reference_scores = np.load(work / "reference_scores.npy")
    wider = bench.main([*argv, "--coverage", "0.99"])
    assert (work / "train.npz").stat().st_mtime_ns == inputs_mtime
    assert (work / "reference_scores.npy").read_bytes() == reference_before
    assert wider["cached_coverage"] == 0.99 and wider["reference_s"] == resumed["reference_s"]
    assert json.loads((work / "cached.json").read_text())["settings"]["coverage"] == 0.99
    # another database holding the same training sequences: inputs reused, the levels that read it run again
    shutil.copy(tmp_path / "bench.duckdb", tmp_path / "copy.duckdb")
    copied = bench.main([a if a != str(tmp_path / "bench.duckdb") else str(tmp_path / "copy.duckdb") for a in argv])
    assert (work / "train.npz").stat().st_mtime_ns == inputs_mtime
    assert copied["reference_s"] != resumed["reference_s"] and copied["cache_reused"]
    # the copy has no kept token files: its reference ran the model (from the states, now prepared) and gives
    # the scores the token files gave
    assert copied["reference_source"] == "a forward pass" and (work / "states.f32").is_file()
    np.testing.assert_allclose(np.load(work / "reference_scores.npy"), reference_scores, rtol=1e-4,
                               atol=1e-6 * np.abs(reference_scores).max())
    # other settings: the folder is not reused
    other = bench.main([a if a != "3" else "2" for a in argv])
    assert other["n_queries"] == 2 and (work / "train.npz").stat().st_mtime_ns != inputs_mtime
    capsys.readouterr()


def test_cached_index_sorts_rows_and_scores_sparsely():
    """Rows given out of order are grouped by prototype with their entries; a query reads only its prototypes and
    a score is the projected part minus the exact one-hot part, sum a (h . W[y])."""
    from prism.attribution import BlockWhitening

    d = 4
    whitening = BlockWhitening(torch.eye(d), torch.ones(d), torch.zeros(3), damping=1.0)  # identity whitening
    embeddings = torch.eye(d)  # W[y] = e_y
    index = CachedIndex(whitening, torch.eye(d), np.array([2, 0, 2, 1]), np.array([1, 0, 0, 2]),
                        np.eye(4, dtype=np.float32), entry_counts=np.array([1, 0, 2, 1]),
                        entry_targets=np.array([3, 1, 2, 0]), entry_activations=np.array([0.5, 1.0, 2.0, 3.0]),
                        output_embeddings=embeddings, n_sequences=3, n_prototypes=3, mode="block")
    assert index.prototype_ids.tolist() == [0, 1, 2, 2] and index.sequence_ids.tolist() == [0, 2, 0, 1]
    assert index.entry_targets.tolist() == [0, 1, 2, 3] and index.entry_sequence.tolist() == [2, 0, 0, 1]
    scores, parts = index.scores(torch.tensor([2]), torch.tensor([[1.0, 0.0, 2.0, 4.0]]))
    # sequence 0: vector e_2 . h = 2, minus 1.0 * h[1] + 2.0 * h[2] = 4; sequence 1: e_0 . h - 0.5 * h[3] = -1
    assert scores.tolist() == [-2.0, -1.0, 0.0] and list(parts) == [2]


def test_cached_index_reads_several_prototypes_at_once():
    """Two prototypes read in one query: each share is its own rows' projected part minus its own entries, and
    the shares add up to the scores (the product gathers every read prototype's entries in one pass)."""
    from prism.attribution import BlockWhitening

    d = 4
    whitening = BlockWhitening(torch.eye(d), torch.ones(d), torch.zeros(3), damping=1.0)
    index = CachedIndex(whitening, torch.eye(d), np.array([2, 0, 2, 1]), np.array([1, 0, 0, 2]),
                        np.eye(4, dtype=np.float32), entry_counts=np.array([1, 0, 2, 1]),
                        entry_targets=np.array([3, 1, 2, 0]), entry_activations=np.array([0.5, 1.0, 2.0, 3.0]),
                        output_embeddings=torch.eye(d), n_sequences=3, n_prototypes=3, mode="block")
    scores, parts = index.scores(torch.tensor([2, 0]), torch.tensor([[1.0, 0.0, 2.0, 4.0], [3.0, 5.0, 7.0, 11.0]]))
    # prototype 0 has one row (sequence 0, vector e_1, no entries): h_0[1] = 5 on sequence 0
    assert parts[0].tolist() == [5.0, 0.0, 0.0] and parts[2].tolist() == [-2.0, -1.0, 0.0]
    assert scores.tolist() == [3.0, -1.0, 0.0]


# few of the vocabulary's tokens predicted (their rows gathered), or most of them (one product with all of W)
@pytest.mark.parametrize("V, vocab_used", [(200, 3), (8, 8)])
def test_cached_scores_equal_a_loop_over_every_row_and_entry(V, vocab_used):
    """The product against its definition, one row and one entry at a time: share_j(s) = q_j . c_{s,j} - sum over
    j's entries in s of a (h_j . W[y]), with q and h from the same preconditioned query."""
    from prism.attribution import BlockWhitening

    rng = np.random.default_rng(vocab_used)
    d, r, K, N = 6, 4, 5, 7
    whitening = BlockWhitening(torch.linalg.qr(torch.randn(d, d)).Q, torch.rand(d) + 0.5, torch.rand(K) + 0.1,
                               damping=0.3)
    keys = sorted(rng.choice(K * N, size=20, replace=False).tolist())
    proto, seq = np.array([k // N for k in keys]), np.array([k % N for k in keys])
    counts = rng.integers(0, 4, size=len(keys))
    targets = rng.choice(vocab_used, size=int(counts.sum()))
    acts = rng.random(int(counts.sum())).astype(np.float32)
    vectors = rng.standard_normal((len(keys), r)).astype(np.float32)
    W = torch.randn(V, d)
    index = CachedIndex(whitening, torch.linalg.qr(torch.randn(d, r)).Q, proto, seq, vectors, counts, targets, acts,
                        output_embeddings=W, n_sequences=N, n_prototypes=K, mode="block")
    ids, rows = torch.tensor([int(proto[0]), int(proto[-1])]), torch.randn(2, d)
    scores, parts = index.scores(ids, rows)
    read, x = index.preconditioned_query(ids, rows)
    scale = whitening.coactivation_diag[read][:, None] * whitening.output_values[None] + whitening.damping
    q = ((x * scale.sqrt()) @ index.basis).double()
    h = (x @ whitening.output_vectors.T).double()
    expected = {int(p): np.zeros(N) for p in read}
    starts = np.concatenate([[0], np.cumsum(counts)])
    for row in range(len(keys)):
        if int(proto[row]) not in expected:
            continue
        j = read.tolist().index(int(proto[row]))
        share = float(q[j] @ torch.from_numpy(vectors[row]).double())
        for e in range(starts[row], starts[row + 1]):
            share -= float(acts[e]) * float(h[j] @ W[targets[e]].double())
        expected[int(proto[row])][seq[row]] += share
    assert set(parts) == set(expected)
    for p in expected:
        np.testing.assert_allclose(parts[p], expected[p], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scores, sum(expected.values()), rtol=1e-5, atol=1e-5)


def test_memory_mapped_index_equals_the_in_memory_one(loaded, tmp_path):
    model, con = loaded["model"], loaded["con"]
    in_memory = cache.load_index(con, model.lm_head.weight)
    folder = tmp_path / "index"
    mapped = cache.load_index(con, model.lm_head.weight, folder=folder, batch_rows=7)  # many small batches
    assert isinstance(mapped.vectors.base, np.memmap) or isinstance(mapped.vectors, np.memmap)
    for name in ("prototype_ids", "sequence_ids", "vectors", "offsets", "entry_offsets", "entry_sequence",
                 "entry_targets", "entry_activations"):
        np.testing.assert_array_equal(getattr(mapped, name), getattr(in_memory, name), err_msg=name)
    # the in-memory rows are the database's own, in (prototype, sequence) order
    expected = con.execute("SELECT prototype_id, sequence_id, vector, activations FROM attribution_vectors "
                           "ORDER BY prototype_id, sequence_id").fetchall()
    assert in_memory.prototype_ids.tolist() == [r[0] for r in expected]
    np.testing.assert_array_equal(in_memory.vectors, np.asarray([r[2] for r in expected], np.float32))
    np.testing.assert_array_equal(in_memory.entry_activations,
                                  np.asarray([a for r in expected for a in r[3]], np.float32))
    _, queries = _planted_queries(loaded)
    for q in queries[:3]:
        query = query_gradient(model, q.prefix(), q.position, q.token)
        np.testing.assert_array_equal(mapped.scores(*query)[0], in_memory.scores(*query)[0])
    # a second open reuses the folder; an incomplete one (a file missing) is written again
    stamps = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    cache.load_index(con, model.lm_head.weight, folder=folder)
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    (folder / "vectors.npy").unlink()
    again = cache.load_index(con, model.lm_head.weight, folder=folder)
    np.testing.assert_array_equal(again.vectors, in_memory.vectors)
    assert not list(tmp_path.glob("index.tmp-*"))


def test_a_read_only_database_writes_its_mapped_index_in_a_child_process(built, loaded, tmp_path):
    """The app's connection is read-only: its index folder is written by a child process (the scan of the whole
    table stays out of the app's memory); a writable connection writes it in this process. Same arrays."""
    model = loaded["model"]
    copy = tmp_path / "writable.duckdb"
    shutil.copy(built, copy)
    writable = duckdb.connect(str(copy))
    try:
        here = cache.load_index(writable, model.lm_head.weight, folder=tmp_path / "here")
    finally:
        writable.close()
    child = cache.load_index(loaded["con"], model.lm_head.weight, folder=tmp_path / "child")
    for name in ("prototype_ids", "sequence_ids", "vectors", "entry_targets", "entry_activations"):
        np.testing.assert_array_equal(getattr(child, name), getattr(here, name), err_msg=name)
    assert (tmp_path / "child" / "source.txt").read_text() == str(Path(built).resolve())
    # a child that cannot read the database: OSError (the app then loads into memory), no folder left behind
    with pytest.raises(OSError, match="writing the attribution index"):
        reader = importlib.import_module("precompute.attribution.cache")
        reader._index_folder(loaded["con"], tmp_path / "broken", 4, 1024, source=tmp_path / "missing.duckdb")
    assert not list(tmp_path.glob("broken*"))


def test_index_folders_follow_the_database_file(built, tmp_path):
    db = tmp_path / "copy.duckdb"
    shutil.copy(built, db)
    first = cache.index_folder_for(db, root=tmp_path / "cache")
    assert first == cache.index_folder_for(db, root=tmp_path / "cache")  # the same file, the same folder
    first.mkdir(parents=True)
    (first / "source.txt").write_text(str(db.resolve()))
    os.utime(db, ns=(db.stat().st_atime_ns, db.stat().st_mtime_ns + 10**9))  # the database was rebuilt
    second = cache.index_folder_for(db, root=tmp_path / "cache")
    assert second != first and not first.exists()  # the older version's folder is gone
    second.mkdir()
    (second / "source.txt").write_text(str(db.resolve()))
    other = tmp_path / "other.duckdb"
    shutil.copy(built, other)
    db.unlink()  # a database that no longer exists: its folder goes when any other is looked up
    cache.index_folder_for(other, root=tmp_path / "cache")
    assert not second.exists()


def test_scaling_fits_and_extrapolation_recover_the_laws_they_are_given():
    from bench.attribution_scaling import extrapolate, power_law

    n = [100.0, 400.0, 1600.0]
    c, p = power_law(n, [3.0 * x ** 0.7 for x in n])
    assert c == pytest.approx(3.0) and p == pytest.approx(0.7)
    lines = [{"n_train": 100, "ekfac_query_ms": 50.0 + 2.0 * 100, "cached_query_ms": 5.0},
             {"n_train": 200, "ekfac_query_ms": 50.0 + 2.0 * 200, "cached_query_ms": 5.0},
             {"n_train": 800, "cached_query_ms": 10.0}]
    extrapolate(lines)
    assert "ekfac_query_ms_extrapolated" not in lines[0]  # measured sizes keep their measured numbers only
    assert lines[2]["ekfac_query_ms_extrapolated"] == pytest.approx(50.0 + 2.0 * 800)
    assert lines[2]["speedup_extrapolated"] == pytest.approx((50.0 + 2.0 * 800) / 10.0)
    assert lines[2]["ekfac_extrapolated_from"] == [100, 200]


@pytest.mark.slow
def test_scaling_bench_runs_each_size_and_resumes(setup, tmp_path, capsys):
    scaling = importlib.import_module("bench.attribution_scaling")
    base = tmp_path / "base.duckdb"
    duckdb.connect(str(base)).close()  # an empty precompute database: each size copies it and builds its cache
    argv = ["--model", setup["model"], "--base-db", str(base), "--corpus", setup["corpus"], "--sizes", "24,12",
            "--ekfac-max", "12", "--seq-len", str(SEQ), "--n-queries", "3", "--ekfac-queries", "3", "--out",
            str(tmp_path / "out"), "--plot", str(tmp_path / "scaling.png"), "--", "--rank", "8", "--batch-size", "4",
            "--peer-layers", "1"]
    result = scaling.main(argv)
    lines = [json.loads(t) for t in (tmp_path / "out" / "scaling.jsonl").read_text().splitlines()]
    assert [line["n_train"] for line in lines] == [12, 24] == result["sizes"]
    assert all(line["machine"] == scaling.machine_label() and line["measured_on"] for line in lines)  # date, CPU
    assert lines[0]["speedup"] == pytest.approx(lines[0]["ekfac_query_ms"] / lines[0]["cached_query_ms"])
    assert "ekfac_query_ms" not in lines[1] and result["largest_ekfac_size"] == 12
    assert result["lines"][1]["ekfac_query_ms_extrapolated"] == pytest.approx(24 / 12 * lines[0]["ekfac_query_ms"])
    assert set(result["fits"]) == {"cached", "reference"}  # EK-FAC ran at one size: no fit
    for line in lines:  # each size's database holds a cache over exactly its own training sequences
        con = duckdb.connect(str(tmp_path / "out" / f"n{line['n_train']}.duckdb"), read_only=True)
        assert con.execute("SELECT count(*) FROM attribution_sequences").fetchone()[0] == line["n_train"]
        con.close()
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a rerun measures nothing again: every level of every size is resumed from its work folder
    again = scaling.main(argv)
    assert again["lines"] == result["lines"]
    capsys.readouterr()


def test_window_offsets_equal_the_whole_documents_tokenization(loaded):
    """The highlight's character offsets come from tokenizing the window alone when that gives the job's tokens;
    either way (and when the check fails, forced here by a wrong recorded token) they are the offsets of the
    document's own tokenization."""
    from precompute.attribution.cache import window_offsets

    con, tok = loaded["con"], loaded["tokenizer"]
    targets: dict[int, dict[int, int]] = {}
    for sid, positions, ids in con.execute("SELECT sequence_id, token_positions, target_ids FROM attribution_vectors"
                                           ).fetchall():
        targets.setdefault(sid, {}).update(zip(positions, ids))
    for row, ids in zip(loaded["rows"], loaded["sequences"]):
        text = cache.document_text(row["doc_id"], row["text"], row["sha256"])
        full = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        want = [tuple(o) for o in full[row["seq_token_start"]: row["seq_token_end"]]]
        assert [tuple(o) for o in window_offsets(text, tok, row, targets.get(row["sequence_id"], {}))] == want
        wrong = {0: (int(ids[1]) + 1) % loaded["model"].vocab_size}
        assert [tuple(o) for o in window_offsets(text, tok, row, wrong)] == want


def test_app_loads_the_index_into_memory_when_it_cannot_write_the_mapped_one(loaded, built, tmp_path, monkeypatch):
    from app import attribution as panel

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("PRISM_CACHE", str(blocker))
    model, con = loaded["model"], loaded["con"]
    index = panel._load_index(con, built, model.lm_head.weight)
    assert not isinstance(index.vectors.base, np.memmap)
    np.testing.assert_array_equal(index.vectors, cache.load_index(con, model.lm_head.weight).vectors)
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path / "cache"))  # writable: mapped, under that folder
    mapped = panel._load_index(con, built, model.lm_head.weight)
    assert isinstance(mapped.vectors.base, np.memmap)
    assert list((tmp_path / "cache" / "attribution-index").iterdir())
