"""Scoring a label on held-out evidence: label_score is the AUROC of cos(label embedding, context embedding)
separating the prototype's held-out (odd-ranked) evidence contexts from a seeded sample of other prototypes'
contexts (0.5: the label says nothing about the evidence, 1.0: it singles it out). The sibling score is in
contrast.py.

    pool = negative_pool(con, n=256, seed=0)                         # embedded once per run
    scores = score_labels([(pid, label, held_out), ...], pool)       # one AUROC (or None) per item
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb
import numpy as np

from precompute.embed import EMBED_DIM, embed
from precompute.labels.cards import EVIDENCE_COLUMNS, EvidenceContext, evidence_context

N_NEGATIVES = 256  # random contexts of other prototypes that held-out evidence is scored against


def auroc(positives: np.ndarray, negatives: np.ndarray) -> float:
    """Area under the ROC curve from ranks (Mann-Whitney U; ties get the average rank). (P,), (N,) -> [0, 1]."""
    pos, neg = np.asarray(positives, dtype=np.float64), np.asarray(negatives, dtype=np.float64)
    if not len(pos) or not len(neg):
        raise ValueError("AUROC needs at least one positive and one negative")
    scores = np.concatenate([pos, neg])  # (P + N,)
    values, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)  # 1-based rank of the last member of each tie group
    average_rank = ends - (counts - 1) / 2.0  # (U,)
    ranks = average_rank[inverse]  # (P + N,)
    u = ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2.0
    return float(u / (len(pos) * len(neg)))


@dataclass
class NegativePool:
    """A seeded sample of evidence contexts from all prototypes, embedded once per run."""

    prototype_ids: np.ndarray  # (N,) whose evidence each context is
    vectors: np.ndarray  # (N, D)
    ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (N,) their evidence ranks


def negative_pool(con: duckdb.DuckDBPyConnection, n: int = N_NEGATIVES, seed: int = 0) -> NegativePool:
    """Sample n evidence rows uniformly (seeded) over the whole evidence table and embed their contexts."""
    total = con.execute("SELECT count(*) FROM evidence").fetchone()[0]
    picks = np.sort(np.random.default_rng(seed).choice(total, size=min(n, total), replace=False)) if total else []
    rows = con.execute(
        f"SELECT {EVIDENCE_COLUMNS} FROM (SELECT *, row_number() OVER (ORDER BY prototype_id, rank) - 1 AS i "
        "FROM evidence) e LEFT JOIN documents d USING (doc_id) WHERE list_contains(?, e.i) ORDER BY e.i",
        [[int(i) for i in picks]]).fetchall()
    pairs = [(row[0], context) for row in rows if (context := evidence_context(*row[1:])) is not None]
    vectors = embed([c.window() for _, c in pairs]) if pairs else np.zeros((0, EMBED_DIM), np.float32)  # (N, D)
    return NegativePool(prototype_ids=np.array([pid for pid, _ in pairs], dtype=np.int64), vectors=vectors,
                        ranks=np.array([c.rank for _, c in pairs], dtype=np.int64))


def score_labels(items: list[tuple[int, str, list[EvidenceContext]]], pool: NegativePool) -> list[float | None]:
    """label_score for each (prototype_id, label, held-out evidence): AUROC of cos(label, context) separating the
    held-out contexts from the pool's contexts of other prototypes. None when either side is empty."""
    texts = [label for _, label, _ in items] + [e.window() for _, _, held in items for e in held]
    vectors = embed(texts)  # (L + H, D)
    labels, contexts = vectors[:len(items)], vectors[len(items):]
    scores, offset = [], 0
    for (pid, _, held), label in zip(items, labels, strict=True):
        positives = contexts[offset:offset + len(held)] @ label  # (h,)
        offset += len(held)
        others = pool.vectors[pool.prototype_ids != pid] if len(pool.prototype_ids) else pool.vectors[:0]
        scores.append(auroc(positives, others @ label) if len(held) and len(others) else None)
    return scores
