"""Training-data attribution in prototype space (docs/DESIGN.md section 4): which training sequences drove a token.

A query is one predicted token: (input ids, position, token). Its measurement is that token's cross-entropy
loss; a training sequence's loss is the summed next-token cross-entropy of its tokens. Influence follows the
usual sign (kronfluence's too): score(q, s) = g_q^T H^-1 G_s > 0 means training on s lowered the query's loss.

The parameters are the prototype bank P (K, d) seen through the prototype route of the logits,

    l_t = W (r_t + sum_{i in K_t} a_{t,i} p_i) + b,    a_{t,i} = ReLU(cos(z_t, p_i)),    r_t held fixed,

which is numerically the model's logit (r_t = z_t - z_hat_t). In the model, l_t = W z_t does not depend on P at
all (r absorbs z_hat), so "the gradient with respect to the bank" only has a meaning with the residual held
fixed: it is what moving p_i does to the logit through its slice a_{t,i} W p_i and through its activation. With
delta_t = softmax(l_t) - onehot(y_t) and e_t = W^T delta_t (d,), the per-token gradient of prototype i is exact:

    g_{t,i} = a_{t,i} e_t + (e_t . p_i) u_{t,i},    u_{t,i} = d cos(z_t, p_i) / d p_i = (z^_t - cos p^_i) / |p_i|

(the first term is the paper's dominant term; the second goes through a's dependence on p_i; the top-k choice is
locally constant). Only the k active rows are non-zero, so a sequence's gradient G_s is a few hundred d-vectors.

Curvature: the Gauss-Newton matrix of the dominant term, Kronecker-factored (K-FAC) in prototype space,

    H ~ A (x) S + lambda I,   A = E_t[a_t a_t^T] (K, K) co-usage,   S = E_t[W^T (diag p_t - p_t p_t^T) W] (d, d),

where p_t is the model's predictive distribution (the true Fisher's expectation, taken exactly), and
lambda = damping * (mean eigenvalue of A (x) S). A's off-diagonal entries are the coupling between co-used
prototypes. Memory: A, S and their eigenvectors, K^2 + d^2 floats each (1.4M for K = 1024, d = 576), never the
(K d)^2 = 3.5e11 of a dense curvature; the inverse is applied exactly through the two eigenbases.

Three levels over the same model and training sequences:

1. reference (ReferenceScorer, reference_scores): exact per-sequence gradients, the query gradient preconditioned
   with the full (A (x) S + lambda)^-1 (through the eigenbases of A and S, so the coupling of co-used prototypes
   is kept); the preconditioned query is dense over all K prototypes, so every training row takes part.
2. cached (CachedIndex): per (prototype i, training sequence s) the attribution job stores c_{s,i} = B^T w_{s,i}
   (r floats), where w = (A_ii sigma + lambda)^-1/2 Q_S^T G_{s,i} whitens the row (Q_S, sigma: eigenpairs of S)
   and B (d, r) holds the top-r principal directions of all whitened training rows. A query is one forward pass,
   its k gradient rows, h = (A (x) S + lambda)^-1 g_q computed sparsely (g_q has k rows: about 2 K^2 d flops,
   never a (Kd)^2 matrix), and a sparse product with the cached rows of the prototypes it reads: its k active
   ones plus the other prototypes where h is largest, i.e. where the co-usage coupling carries the query, until
   they hold 99% of |h|^2 (at most 8 k prototypes in all). The one-hot part of each cached row, -sum a W[y], is
   stored exactly (token ids and activations), so only the smooth remainder is projected. The approximation,
   stated and tested (tests/test_attribution.py):
   (a) rows of prototypes not read are left out. Reading all K prototypes is the reference exactly (at r = d);
       with k = 1 no two prototypes are ever co-active, A is diagonal, h lives on the active rows and nothing is
       left out at all.
   (b) the rank-r projection B: exact for r = d.
   Both errors stay the same per sequence while the sequences competing for a top 10 grow in number, so the top-10
   overlap with the reference falls with the training set (0.85 at 768 sequences, 0.786 at 12,288). A second
   stage (rerank=M) scores the first stage's M best sequences again: with the build's exact store (ExactStore:
   every training sequence's exact gradient rows G_{s,i} Q_S in the eigenbasis of S, float16 with a scale per row,
   about 1.2 KB a row, some 170 rows a 64-token sequence) it computes their scores as the reference does (every
   prototype, no projection; float16 the only error): one dot product per row with the preconditioned query, which
   the first stage already holds in that basis. So the top 10 is the reference's whenever the first stage ranks
   the reference's top 10 among its M best. (Adding every other prototype's projected rows instead, which removes
   (a) but keeps (b), was measured and dropped: top-10 overlap 0.81 -> 0.82 at 3,072 sequences and 0.79 -> 0.79
   at 24,576, for 2.5x the product's time.)
   The simpler block-diagonal variant (mode="block": A replaced by its diagonal, only the k active rows) is kept
   for comparison; it drops the coupling. On a small trained model (K = 96, k = 4, d = 32, r = 8) the block
   variant keeps about 40% of the reference's top 10, the coupled read of the k active rows alone 35%, with k
   more 90% and with a 90% coverage rule (about 11 prototypes) 96%. On the shipped default (K = 1024, k = 8,
   d = 576; 3,072 training sequences, 50 held-out queries; bench/attribution.py) the top-10 overlap with the
   reference is 0.68 at r = 64 and coverage 0.9 (15 prototypes read), 0.74 at r = 128 (the projection was the
   larger loss), 0.81 at r = 128 and coverage 0.99 (49 prototypes read, the sparse product 24 -> 47 ms): hence
   the defaults r = 128, coverage 0.99.
3. EK-FAC peer (bench/attribution_ekfac.py, beside its benchmark: kronfluence is a benchmark dependency, not the
   library's): kronfluence over the model's trainable linear layers, same loss, same sequences, same queries.

Length: about 740 lines, on purpose: the levels share every formula above (the exact gradient, the curvature and
its eigenbases), and the file reads top to bottom in the order of this docstring, so that the cached level and its
exact second stage can be checked against the reference's code on the same page.

Usage:
    stats = token_statistics(model, z, targets)                    # per target token: z, e, ids, a, ...
    curv = CurvatureAccumulator(K, d, V); curv.add(stats); curvature = curv.finish(model.lm_head.weight, 0.1)
    rows = sequence_gradients(model.prototypes.weight, stats)      # sparse per-sequence rows G_{s,i}
    ids, g = query_gradient(model, input_ids, position, token)     # the query's k active rows
    ref = ReferenceScorer(curvature, [(ids, g)], n_sequences, K); ref.add(rows); ref.scores   # (Q, N)
    scores, parts = index.scores(ids, g)                           # cached: (N,) and each prototype's share
    exact = ExactStore(rows, scales, prototype_ids, offsets)      # exact rows G Q_S (the build writes them)
    CachedIndex(..., rerank=100, exact=exact).scores(ids, g)       # the 100 best again, exactly
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from prism.losses import IGNORE_INDEX
from prism.model import PrismForCausalLM

logger = logging.getLogger(__name__)

# Tokens per chunk when computing softmax statistics: (chunk, V) logits stay a few hundred MB for large V.
TOKEN_CHUNK = 512


# ----------------------------------------------------------------------------------------------------------------
# Queries and batches.


@dataclass(frozen=True)
class Query:
    """One predicted token: the model read input_ids[: position + 1] and `token` is what it predicts next."""

    input_ids: tuple[int, ...]
    position: int
    token: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", tuple(int(t) for t in self.input_ids))
        if not 0 <= self.position < len(self.input_ids):
            raise ValueError(f"position {self.position} is outside the {len(self.input_ids)} input tokens")

    def prefix(self) -> torch.Tensor:
        """(1, position + 1) the tokens the prediction depends on."""
        return torch.tensor([self.input_ids[: self.position + 1]])


def pad_batch(sequences: list, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) input ids and attention mask for token arrays of different lengths."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : len(s)] = torch.as_tensor(np.asarray(s, np.int64))
        mask[b, : len(s)] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------------------------
# Per-token statistics and exact gradients.


@dataclass
class TokenStats:
    """What attribution needs from the target tokens of a batch (N tokens; only tokens with a target)."""

    z: torch.Tensor  # (N, d) final states
    e: torch.Tensor  # (N, d) W^T (softmax(l) - onehot(y))
    m: torch.Tensor  # (N, d) W^T softmax(l), for the curvature
    prototype_ids: torch.Tensor  # (N, k) long
    activations: torch.Tensor  # (N, k) >= 0
    sequence: torch.Tensor  # (N,) long, which sequence (row of the batch, or as given) each token belongs to
    position: torch.Tensor  # (N,) long, the token's position in its sequence
    target: torch.Tensor  # (N,) long, the token it predicts (y)
    loss: torch.Tensor  # (N,) cross-entropy of the target
    prob_sum: torch.Tensor  # (V,) float64, sum over the tokens of softmax(l)


def next_token_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """targets[b, t] = input_ids[b, t + 1] (the token position t predicts), IGNORE_INDEX at the end and on padding.
    input_ids (B, T) -> (B, T)."""
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, :-1] = input_ids[:, 1:]
    if attention_mask is not None:
        valid = attention_mask.bool()
        targets[:, :-1] = targets[:, :-1].masked_fill(~(valid[:, :-1] & valid[:, 1:]), IGNORE_INDEX)
    return targets


@torch.no_grad()
def token_statistics(model: PrismForCausalLM, z: torch.Tensor, targets: torch.Tensor,
                     sequence_index: torch.Tensor | None = None) -> TokenStats:
    """z (B, T, d) final states and targets (B, T) (IGNORE_INDEX: no target) -> TokenStats of the target tokens.

    sequence_index (B,) names each batch row (default 0..B-1)."""
    keep = targets != IGNORE_INDEX  # (B, T)
    rows, cols = keep.nonzero(as_tuple=True)
    if sequence_index is None:
        sequence_index = torch.arange(z.shape[0])
    zt = z[rows, cols].float()  # (N, d)
    y = targets[rows, cols]  # (N,)
    weight = model.lm_head.weight.float()  # (V, d)
    e, m, loss, ids, acts = [], [], [], [], []
    prob_sum = torch.zeros(weight.shape[0], dtype=torch.float64)
    for lo in range(0, len(zt), TOKEN_CHUNK):
        part = zt[lo: lo + TOKEN_CHUNK]
        out = model.head(part[None])
        log_probs = out.logits[0].float().log_softmax(-1)  # (n, V), once for the loss and the probabilities
        probs = log_probs.exp()
        yy = y[lo: lo + TOKEN_CHUNK]
        mm = probs @ weight  # (n, d)
        m.append(mm)
        e.append(mm - weight[yy])
        loss.append(-log_probs.gather(1, yy[:, None])[:, 0])
        prob_sum += probs.sum(0, dtype=torch.float64)
        ids.append(out.prototype_ids[0])
        acts.append(out.activations[0].float())
    d, k = zt.shape[1], model.config.top_k

    def cat(parts: list[torch.Tensor], *shape: int) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.zeros(0, *shape)

    return TokenStats(z=zt, e=cat(e, d), m=cat(m, d), prototype_ids=cat(ids, k).long(), activations=cat(acts, k),
                      sequence=sequence_index[rows].long(), position=cols.long(), target=y.long(),
                      loss=cat(loss), prob_sum=prob_sum)


def prototype_gradients(prototypes: torch.Tensor, z: torch.Tensor, e: torch.Tensor, ids: torch.Tensor,
                        acts: torch.Tensor) -> torch.Tensor:
    """The exact gradient of each token's loss with respect to each of its active prototypes (module docstring).

    prototypes (K, d); z, e (N, d); ids, acts (N, k) -> (N, k, d), zero where the activation is 0.

    With z^ = z / |z|, c = cos(p_i, z) and t = p_i . e, the gradient a_i e + t (z^ - c p_i / |p_i|) / |p_i| is
    written as a_i e + (t / |p_i|) z^ - (t (p_i . z^) / |p_i|^3) p_i: two batched dot products and three in-place
    passes over the gathered prototypes, no (N, k, d) temporaries (4-5x faster than the term-by-term form on two
    cores, which the attribution job runs three times per chunk)."""
    w = prototypes.detach().float()
    p = w[ids]  # (N, k, d), a fresh copy: scaled in place below
    p_norm = w.norm(dim=-1).clamp_min(1e-12)[ids]  # (N, k)
    z_hat = z / z.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # (N, d)
    pz = torch.bmm(p, z_hat[:, :, None])[..., 0]  # (N, k): p_i . z^
    pe = torch.bmm(p, e[:, :, None])[..., 0]  # (N, k): p_i . e, how the activation moves the loss
    live = acts > 0
    along_z = torch.where(live, pe / p_norm, 0.0)
    along_p = torch.where(live, -pe * pz / p_norm.pow(3), 0.0)
    g = p.mul_(along_p[..., None])
    g.addcmul_(torch.where(live, acts, 0.0)[..., None], e[:, None, :])
    return g.addcmul_(along_z[..., None], z_hat[:, None, :])


@dataclass
class SequenceRows:
    """Sparse per-sequence gradients: row j is G_{sequence[j], prototype[j]} = the sum over the sequence's tokens
    where that prototype is active. Sorted by (sequence, prototype)."""

    sequence: torch.Tensor  # (n,) long
    prototype: torch.Tensor  # (n,) long
    rows: torch.Tensor  # (n, d)
    # every active (token, prototype) entry, grouped per row: entries of row j are [offsets[j], offsets[j+1])
    offsets: torch.Tensor  # (n + 1,) long
    entry_position: torch.Tensor  # (m,) long, token position in the sequence
    entry_activation: torch.Tensor  # (m,)
    entry_target: torch.Tensor  # (m,) long, the token predicted there

    def softmax_part(self, lm_weight: torch.Tensor) -> torch.Tensor:
        """The rows without their one-hot part: G + sum over entries of a W[y] (n, d). The one-hot part
        -sum a W[y] is exactly sparse (a token id and a weight per entry), so the cache keeps it exactly and
        projects only this smooth remainder (the softmax part of the dominant term and the cosine term)."""
        row_of_entry = torch.repeat_interleave(torch.arange(len(self.rows)), self.offsets.diff())
        weight = lm_weight.detach().float()
        out = self.rows.clone()
        for lo in range(0, len(row_of_entry), 16384):  # (chunk, d) at a time
            part = slice(lo, lo + 16384)
            out.index_add_(0, row_of_entry[part], self.entry_activation[part, None] * weight[self.entry_target[part]])
        return out


def sequence_gradients(prototypes: torch.Tensor, stats: TokenStats, chunk: int = 4096) -> SequenceRows:
    """Sum the per-token gradients of every sequence in stats into its sparse rows (one per active prototype).
    Tokens are processed `chunk` at a time, so memory stays (chunk, k, d) whatever the number of tokens."""
    n_prototypes = prototypes.shape[0]
    active = stats.activations > 0  # (N, k)
    tok, slot = active.nonzero(as_tuple=True)
    key = stats.sequence[tok] * n_prototypes + stats.prototype_ids[tok, slot]
    # order entries by (row key, position) so each row's entries read in text order
    order = torch.from_numpy(np.lexsort((stats.position[tok].numpy(), key.numpy())))
    tok, slot, key = tok[order], slot[order], key[order]
    unique, inverse, counts = torch.unique_consecutive(key, return_inverse=True, return_counts=True)
    rows = torch.zeros(len(unique), stats.z.shape[-1])
    for lo in range(0, len(stats.z), chunk):
        hi = min(lo + chunk, len(stats.z))
        g = prototype_gradients(prototypes, stats.z[lo:hi], stats.e[lo:hi], stats.prototype_ids[lo:hi],
                                stats.activations[lo:hi])  # (n, k, d)
        here = (tok >= lo) & (tok < hi)
        rows.index_add_(0, inverse[here], g[tok[here] - lo, slot[here]])
    offsets = torch.zeros(len(unique) + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    return SequenceRows(sequence=unique // n_prototypes, prototype=unique % n_prototypes, rows=rows,
                        offsets=offsets, entry_position=stats.position[tok],
                        entry_activation=stats.activations[tok, slot], entry_target=stats.target[tok])


@torch.no_grad()
def query_gradient(model: PrismForCausalLM, input_ids: torch.Tensor, position: int, token: int,
                   z: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The query's gradient rows: (ids (k',), rows (k', d)) for its active prototypes (activation > 0).

    input_ids (1, T) must hold the tokens up to `position`; z (d,) the final state there, if already computed."""
    if z is None:
        states, _ = model.final_states(input_ids[:, : position + 1])
        z = states[0, position]
    targets = torch.tensor([[int(token)]])
    stats = token_statistics(model, z.reshape(1, 1, -1), targets)
    g = prototype_gradients(model.prototypes.weight, stats.z, stats.e, stats.prototype_ids, stats.activations)
    keep = stats.activations[0] > 0
    return stats.prototype_ids[0, keep], g[0, keep]


# ----------------------------------------------------------------------------------------------------------------
# Curvature.


class CurvatureAccumulator:
    """Running sums for A = E[a a^T] and S = E[W^T (diag p - p p^T) W] over target tokens (float64)."""

    def __init__(self, n_prototypes: int, d_model: int, vocab_size: int) -> None:
        self.coactivation = torch.zeros(n_prototypes, n_prototypes, dtype=torch.float64)  # sum a a^T
        self.output_moment = torch.zeros(d_model, d_model, dtype=torch.float64)  # sum m m^T, m = W^T p
        self.prob_sum = torch.zeros(vocab_size, dtype=torch.float64)  # sum p
        self.n_tokens = 0

    def add(self, stats: TokenStats) -> None:
        K = self.coactivation.shape[0]
        ids, acts = stats.prototype_ids, stats.activations.double()  # (N, k)
        pair_key = ids[:, :, None] * K + ids[:, None, :]  # (N, k, k)
        pair_value = acts[:, :, None] * acts[:, None, :]
        self.coactivation.view(-1).index_add_(0, pair_key.reshape(-1), pair_value.reshape(-1))
        m = stats.m.double()
        self.output_moment += m.T @ m
        self.prob_sum += stats.prob_sum
        self.n_tokens += len(ids)

    def state(self) -> dict[str, np.ndarray]:
        return {"coactivation": self.coactivation.numpy(), "output_moment": self.output_moment.numpy(),
                "prob_sum": self.prob_sum.numpy(), "n_tokens": np.array(self.n_tokens)}

    def load(self, state: dict[str, np.ndarray]) -> None:
        self.coactivation = torch.from_numpy(np.array(state["coactivation"]))
        self.output_moment = torch.from_numpy(np.array(state["output_moment"]))
        self.prob_sum = torch.from_numpy(np.array(state["prob_sum"]))
        self.n_tokens = int(state["n_tokens"])

    def finish(self, lm_weight: torch.Tensor, damping: float) -> Curvature:
        """The curvature factors (means over tokens) and the absolute damping damping * mean eigenvalue."""
        if self.n_tokens == 0:
            raise ValueError("no target tokens were seen: the curvature is empty")
        n = self.n_tokens
        w = lm_weight.detach().double()  # (V, d)
        output = ((w * self.prob_sum[:, None]).T @ w - self.output_moment) / n  # (d, d)
        coactivation = self.coactivation / n  # (K, K)
        return Curvature.from_factors(coactivation, output, damping)


@dataclass
class BlockWhitening:
    """The cached level's preconditioner: prototype i alone, (A_ii S + lambda)^-1, as a whitening of its rows."""

    output_vectors: torch.Tensor  # (d, d) Q_S, columns by decreasing eigenvalue
    output_values: torch.Tensor  # (d,) sigma >= 0
    coactivation_diag: torch.Tensor  # (K,) A_ii
    damping: float  # lambda, absolute

    def __call__(self, prototype: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """prototype (n,), rows (n, d) -> whitened (n, d): (A_ii sigma + lambda)^-1/2 Q_S^T g; dot products of
        whitened rows are g_q^T (A_ii S + lambda)^-1 g_s."""
        scale = self.coactivation_diag[prototype][:, None] * self.output_values[None] + self.damping  # (n, d)
        return (rows.float() @ self.output_vectors) * scale.rsqrt()


@dataclass
class Curvature:
    """H ~ A (x) S + lambda I in prototype space, with the eigenbases that apply its inverse exactly."""

    coactivation: torch.Tensor  # (K, K) A
    output: torch.Tensor  # (d, d) S
    damping: float  # lambda, absolute
    coactivation_values: torch.Tensor  # (K,)
    coactivation_vectors: torch.Tensor  # (K, K)
    output_values: torch.Tensor  # (d,) descending
    output_vectors: torch.Tensor  # (d, d)

    @classmethod
    def from_factors(cls, coactivation: torch.Tensor, output: torch.Tensor, damping: float,
                     absolute: bool = False) -> Curvature:
        """Eigendecompose the factors (float64). damping is relative to the mean eigenvalue of A (x) S unless
        absolute."""
        a = coactivation.double()
        s = output.double()
        a, s = (a + a.T) / 2, (s + s.T) / 2
        a_values, a_vectors = torch.linalg.eigh(a)
        s_values, s_vectors = torch.linalg.eigh(s)
        s_values, s_vectors = s_values.flip(0), s_vectors.flip(1)  # descending
        if not absolute:
            mean = float(a.diagonal().mean() * s.diagonal().mean())
            damping = float(damping) * mean if mean > 0 else float(damping)
        if damping <= 0:
            raise ValueError(f"the damping must be > 0, got {damping}")
        return cls(coactivation=a.float(), output=s.float(), damping=float(damping),
                   coactivation_values=a_values.clamp_min(0).float(), coactivation_vectors=a_vectors.float(),
                   output_values=s_values.clamp_min(0).float(), output_vectors=s_vectors.float())

    def precondition(self, g: torch.Tensor) -> torch.Tensor:
        """(A (x) S + lambda I)^-1 applied to g (..., K, d), coupling of co-used prototypes included."""
        qa, qs = self.coactivation_vectors, self.output_vectors
        x = qa.T @ g.float() @ qs  # (..., K, d) in the Kronecker eigenbasis
        x = x / (self.coactivation_values[:, None] * self.output_values[None] + self.damping)
        return qa @ x @ qs.T

    @classmethod
    def from_eigen(cls, coactivation: torch.Tensor, output_vectors: torch.Tensor, output_values: torch.Tensor,
                   damping: float) -> Curvature:
        """From A, the eigenpairs of S (as stored by the attribution job, kept as they are so that coordinates in
        Q_S agree with the cached vectors) and the absolute damping."""
        a = coactivation.double()
        a_values, a_vectors = torch.linalg.eigh((a + a.T) / 2)
        q, s = output_vectors.double(), output_values.double()
        return cls(coactivation=a.float(), output=((q * s) @ q.T).float(), damping=float(damping),
                   coactivation_values=a_values.clamp_min(0).float(), coactivation_vectors=a_vectors.float(),
                   output_values=output_values.float().clamp_min(0), output_vectors=output_vectors.float())

    def precondition_sparse(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(A (x) S + lambda I)^-1 g for g non-zero only on rows ids (k,), rows (k, d), returned in the eigenbasis
        of S: row i is h_i Q_S (K, d). Costs 2 K k d + 2 k d^2 + 2 K^2 d, never a (Kd)^2 matrix."""
        qa, qs = self.coactivation_vectors, self.output_vectors
        x = qa[ids.long()].T @ (rows.float() @ qs)  # (K, d) in the Kronecker eigenbasis
        x = x / (self.coactivation_values[:, None] * self.output_values[None] + self.damping)
        return qa @ x

    def block_whitening(self) -> BlockWhitening:
        return BlockWhitening(output_vectors=self.output_vectors, output_values=self.output_values,
                              coactivation_diag=self.coactivation.diagonal().clamp_min(0).clone(),
                              damping=self.damping)


# ----------------------------------------------------------------------------------------------------------------
# Level 1: the reference.


class ReferenceScorer:
    """Exact gradients, full coupled preconditioning. Feed it every training sequence's rows (in any batches);
    scores (Q, N) accumulates g_q^T (A (x) S + lambda)^-1 G_s."""

    def __init__(self, curvature: Curvature, queries: list[tuple[torch.Tensor, torch.Tensor]], n_sequences: int,
                 n_prototypes: int) -> None:
        d = curvature.output.shape[0]
        dense = torch.zeros(len(queries), n_prototypes, d)  # (Q, K, d), only the active rows are non-zero
        for q, (ids, rows) in enumerate(queries):
            dense[q].index_add_(0, ids.long(), rows.float())
        self.preconditioned = curvature.precondition(dense)  # (Q, K, d), dense over K
        self.scores = torch.zeros(len(queries), n_sequences, dtype=torch.float64)

    def add(self, rows: SequenceRows) -> None:
        for q in range(self.preconditioned.shape[0]):
            contribution = (self.preconditioned[q, rows.prototype] * rows.rows).sum(-1)  # (n,)
            self.scores[q].index_add_(0, rows.sequence, contribution.double())


@torch.no_grad()
def reference_scores(model: PrismForCausalLM, curvature: Curvature, queries: list[Query], sequences: list,
                     batch_size: int = 8, final_states=None) -> np.ndarray:
    """Level 1 end to end: (Q, N) scores of every query on every training sequence (token arrays).

    final_states(ids (B, T), mask (B, T), index (B,) of the sequences) -> z (B, T, d) may replace the full
    forward pass (e.g. cached states entering the first trainable layer)."""
    grads = [query_gradient(model, q.prefix(), q.position, q.token) for q in queries]
    scorer = ReferenceScorer(curvature, grads, len(sequences), model.config.n_prototypes)
    for lo in range(0, len(sequences), batch_size):
        index = torch.arange(lo, min(lo + batch_size, len(sequences)))
        ids, mask = pad_batch([sequences[i] for i in index.tolist()])
        if final_states is None:
            z, _ = model.final_states(ids, attention_mask=mask)
        else:
            z = final_states(ids, mask, index)
        stats = token_statistics(model, z, next_token_targets(ids, mask), sequence_index=index)
        scorer.add(sequence_gradients(model.prototypes.weight, stats))
    return scorer.scores.numpy()


# ----------------------------------------------------------------------------------------------------------------
# Level 2: the cached index.


def whitened_basis(moment: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-`rank` principal directions (d, r) of whitened rows from their second moment (d, d); the
    identity when rank >= d (no projection)."""
    d = moment.shape[0]
    if rank <= 0 or rank >= d:
        return torch.eye(d)
    values, vectors = torch.linalg.eigh(moment.double())
    return vectors.flip(1)[:, :rank].float().contiguous()


class ExactStore:
    """What an exact second stage needs: every training sequence's exact gradient rows (SequenceRows.rows, the
    sum over its tokens of prototype_gradients, one row per prototype active in it) rotated into the eigenbasis of
    S, R_{s,i} = G_{s,i} Q_S, grouped by sequence (rows offsets[s]:offsets[s + 1] are sequence s's). With h Q_S
    the preconditioned query in the same basis (what CachedIndex's first stage computes), a candidate's score is
    exactly the reference's: sum_i (h_i Q_S) . R_{s,i}, nothing left out and nothing projected; Q_S is orthogonal,
    so the rotation changes no dot product. Rows are stored as float16 times a float32 scale per row (the row's
    largest magnitude: no overflow, about 5e-4 relative error per entry). Arrays may be memory maps: a query reads
    its candidates' rows only (about 1.2 KB a row at d = 576)."""

    def __init__(self, rows: np.ndarray, scales: np.ndarray, prototypes: np.ndarray, offsets: np.ndarray,
                 entries: dict[str, np.ndarray] | None = None) -> None:
        """rows (n, d) float16 (or float32), scales (n,), prototypes (n,) prototype id of each row, offsets
        (n_sequences + 1,) where each sequence's rows start; entries (optional, for display): "counts" (n,)
        entries per row and, row after row, each entry's "positions" (token position in its sequence),
        "activations" and "targets" (the token predicted there), as SequenceRows holds them."""
        if not (len(rows) == len(scales) == len(prototypes) == int(offsets[-1])) or int(offsets[0]) != 0:
            raise ValueError(f"the exact store's arrays disagree: {len(rows)} rows, {len(scales)} scales, "
                             f"{len(prototypes)} prototype ids, offsets from {int(offsets[0])} to {int(offsets[-1])}")
        self.rows, self.scales, self.prototypes = rows, scales, prototypes
        self.offsets = np.asarray(offsets, np.int64)  # (n_sequences + 1,)
        self.entries = None
        if entries is not None:
            counts = np.asarray(entries["counts"], np.int64)
            n_entries = int(counts.sum())
            if len(counts) != len(rows) or any(len(entries[k]) != n_entries
                                               for k in ("positions", "activations", "targets")):
                raise ValueError(f"the exact store's entries disagree with its {len(rows)} rows: "
                                 + ", ".join(f"{k} {len(v)}" for k, v in entries.items()))
            self.entries = {k: v for k, v in entries.items() if k != "counts"}
            self.entry_offsets = np.concatenate([[0], np.cumsum(counts)])  # (n + 1,)

    def active(self, sequence: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where each prototype was active in one sequence: (prototype, position, activation, target) per entry
        (arrays in row order, each row's entries in text order). LookupError when the store has no entries."""
        if self.entries is None:
            raise LookupError("this exact store holds no entries (written before they were stored)")
        a, b = int(self.offsets[sequence]), int(self.offsets[sequence + 1])
        lo, hi = int(self.entry_offsets[a]), int(self.entry_offsets[b])
        prototype = np.repeat(np.asarray(self.prototypes[a:b], np.int64), np.diff(self.entry_offsets[a: b + 1]))
        return (prototype, np.asarray(self.entries["positions"][lo:hi], np.int64),
                np.asarray(self.entries["activations"][lo:hi], np.float64),
                np.asarray(self.entries["targets"][lo:hi], np.int64))

    @staticmethod
    def encode(rows: torch.Tensor, output_vectors: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Exact rows G (n, d) in model coordinates -> what the store keeps: (G Q_S / scale in float16, scale)."""
        rotated = rows.float() @ output_vectors.float()  # (n, d)
        scale = rotated.abs().amax(-1).clamp_min(1e-30)  # (n,)
        return (rotated / scale[:, None]).half().numpy(), scale.numpy()

    @property
    def n_sequences(self) -> int:
        return len(self.offsets) - 1

    def shares(self, sequences: np.ndarray, h: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Exact shares of the given sequences (M,) for the preconditioned query h (K, d) in the eigenbasis of S
        (h Q_S): (sequence index into `sequences`, prototype id, share) per row with a non-zero share. Each
        sequence's rows are one contiguous slice, scored where they lie (a product and a sum per sequence: 3.5 ms
        for 50 sequences of 170 rows at d = 576, against 5 ms gathered into one array first and 18 ms as one
        einsum)."""
        spans = [(int(self.offsets[s]), int(self.offsets[s + 1])) for s in np.asarray(sequences).tolist()]
        if sum(b - a for a, b in spans) == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
        owner = np.repeat(np.arange(len(spans)), [b - a for a, b in spans])

        def read(array: np.ndarray) -> np.ndarray:
            return np.concatenate([array[a:b] for a, b in spans])

        prototype = read(self.prototypes).astype(np.int64)  # (n,)
        index, h = torch.from_numpy(prototype), h.float()
        values = torch.empty(len(prototype))
        at = 0
        for a, b in spans:  # a sequence at a time: its rows read in place, its gathered h rows stay in cache
            rows = torch.from_numpy(np.asarray(self.rows[a:b]))  # float16, widened by the product
            values[at: at + b - a] = (h[index[at: at + b - a]] * rows).sum(-1)
            at += b - a
        values = values.double().numpy() * read(self.scales)
        keep = values != 0
        return owner[keep], prototype[keep], values[keep]


class CachedIndex:
    """What the attribution job cached, in memory, grouped by prototype, and the query that reads it.

    Per (prototype i, sequence s): c_{s,i} = B^T w~_{s,i} (r,), the whitened smooth part of G_{s,i} projected on B,
    and its entries (token predicted y, activation a), the exact one-hot part -sum a W[y]. A query reads a few
    prototypes and adds up, for each, h_i . G_{s,i} = (B^T (A_ii sigma + lambda)^{1/2} Q_S^T h_i) . c_{s,i}
    - sum_entries a (h_i . W[y]), where h is the query gradient preconditioned by mode:
      "coupled" (default): h = (A (x) S + lambda)^-1 g_q with the full coupled curvature (cheap: g_q has k rows),
                 read on the query's active prototypes plus the other prototypes where h is largest (the co-used
                 prototypes the coupling spreads the query to): `extra` of them, or by default as many as it takes
                 to hold `coverage` of sum_i |h_i|^2, at most `max_read` prototypes in all (default 8 k). Reading
                 every prototype at r = d is exactly the reference.
      "block":   h_i = (A_ii S + lambda)^-1 g_{q,i} on the active prototypes only (block-diagonal curvature;
                 exact when prototypes are never co-active, k = 1).
    rerank=M (coupled only, with `exact`, an ExactStore): the M best sequences of that first stage are scored
    again, exactly; the other sequences keep their first-stage scores, and the shares in `parts` still add up to
    the scores everywhere.
    """

    MODES = ("coupled", "block")

    def __init__(self, whitening: BlockWhitening, basis: torch.Tensor, prototype_ids: np.ndarray,
                 sequence_ids: np.ndarray, vectors: np.ndarray, entry_counts: np.ndarray, entry_targets: np.ndarray,
                 entry_activations: np.ndarray, output_embeddings: torch.Tensor, n_sequences: int, n_prototypes: int,
                 coupling: Curvature | None = None, mode: str = "coupled", extra: int | None = None,
                 coverage: float = 0.99, max_read: int | None = None, rerank: int = 0,
                 exact: ExactStore | None = None) -> None:
        """Rows (n,) of prototype_ids, sequence_ids, vectors (n, r) and entry_counts (entries per row); entries
        (m,) row after row; output_embeddings W (V, d), the model's LM head weight."""
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if mode == "coupled" and coupling is None:
            raise ValueError("the coupled mode needs the full curvature (coupling=)")
        if rerank < 0 or (rerank and (mode != "coupled" or exact is None)):
            raise ValueError(f"rerank must be >= 0 and needs the coupled mode and an exact store, got {rerank} with "
                             f"{mode!r} and {'a' if exact is not None else 'no'} store")
        prototype_ids, sequence_ids = np.asarray(prototype_ids, np.int64), np.asarray(sequence_ids, np.int64)
        entry_counts = np.asarray(entry_counts, np.int64)
        keys = prototype_ids * (int(n_sequences) + 1) + sequence_ids
        if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):  # the database returns them sorted
            order = np.argsort(keys, kind="stable")
            starts = np.concatenate([[0], np.cumsum(entry_counts)])
            entry_order = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in order]) if len(order) else order
            prototype_ids, sequence_ids, vectors = prototype_ids[order], sequence_ids[order], vectors[order]
            entry_counts = entry_counts[order]
            entry_targets, entry_activations = entry_targets[entry_order], entry_activations[entry_order]
        self.prototype_ids = np.ascontiguousarray(prototype_ids)
        self.sequence_ids = np.ascontiguousarray(sequence_ids)
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # (n, r)
        self.offsets = np.searchsorted(self.prototype_ids, np.arange(n_prototypes + 1))  # (K + 1,) rows
        self.entry_offsets = np.concatenate([[0], np.cumsum(entry_counts)])  # (n + 1,) entries of each row
        self.entry_sequence = np.repeat(self.sequence_ids, entry_counts).astype(np.int32)  # (m,)
        self.entry_targets = np.ascontiguousarray(entry_targets, dtype=np.int64)
        self.entry_activations = np.ascontiguousarray(entry_activations, dtype=np.float32)
        self.has_rows = torch.from_numpy(np.diff(self.offsets) > 0)  # (K,)
        self.output_embeddings = output_embeddings.detach().float()  # (V, d)
        self.whitening = whitening
        self.basis = basis.float()  # (d, r)
        self.coupling = coupling
        self.mode = mode
        self.extra = extra  # a fixed number of prototypes read beyond the active ones; None: by coverage
        self.coverage = coverage
        self.max_read = max_read  # None: 8 x the query's active prototypes
        self.rerank = rerank  # candidates scored again, exactly, in a second stage (0: none)
        if exact is not None and exact.n_sequences != n_sequences:
            raise ValueError(f"the exact store holds {exact.n_sequences} sequences, the index {n_sequences}")
        self.exact = exact
        self.n_sequences = n_sequences
        self.n_prototypes = n_prototypes

    @property
    def rank(self) -> int:
        return self.basis.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.vectors, self.sequence_ids, self.prototype_ids, self.entry_sequence,
                                      self.entry_targets, self.entry_activations))

    def project(self, prototype: torch.Tensor, smooth_rows: torch.Tensor) -> torch.Tensor:
        """Training-side smooth rows (n, d) (SequenceRows.softmax_part) of the given prototypes -> cached
        coordinates (n, r)."""
        return self.whitening(prototype.long(), smooth_rows) @ self.basis

    def preconditioned_query(self, ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prototypes to read (m,) and the preconditioned query on them in the eigenbasis of S, h Q_S (m, d)."""
        read, x, _ = self._preconditioned(ids, rows)
        return read, x

    def _preconditioned(self, ids: torch.Tensor, rows: torch.Tensor, mode: str | None = None):
        """preconditioned_query's (read, x) and the whole h Q_S (K, d) (None in the block mode); mode: the index's
        unless given (the block mode needs only the whitening, so any index can read that way)."""
        ids = ids.long()
        w = self.whitening
        if (mode or self.mode) == "block":
            scale = w.coactivation_diag[ids][:, None] * w.output_values[None] + w.damping  # (k, d)
            return ids, (rows.float() @ w.output_vectors) / scale, None
        h = self.coupling.precondition_sparse(ids, rows)  # (K, d)
        mass = h.pow(2).sum(1).masked_fill(~self.has_rows, 0.0)  # (K,) where the preconditioned query lies
        others = mass.clone()
        others[ids] = -1.0
        order = others.argsort(descending=True)
        order = order[others[order] > 0]  # prototypes beyond the active ones, by decreasing mass
        if self.extra is not None:
            n = self.extra
        else:
            total = float(mass.sum())
            held = float(mass[ids].sum()) + mass[order].cumsum(0)  # mass held after reading 1, 2, ... more
            n = int((held < self.coverage * total).sum()) + 1 if total > 0 and len(order) else 0
            n = min(n, (self.max_read or 8 * len(ids)) - len(ids))
        read = ids if n <= 0 else torch.cat([ids, order[:n]])
        return read, h[read], h

    def scores(self, ids: torch.Tensor, rows: torch.Tensor) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """The query's active ids (k,) and gradient rows (k, d) -> scores (N,) over all training sequences and
        each read prototype's share, {prototype_id: (N,) contribution} (they add up to the scores)."""
        read, x, h_all = self._preconditioned(ids, rows)  # (m,), (m, d), (K, d)
        w = self.whitening
        scale = w.coactivation_diag[read][:, None] * w.output_values[None] + w.damping  # (m, d)
        q = ((x * scale.sqrt()) @ self.basis).numpy()  # (m, r): the smooth part's query vectors
        h = x @ w.output_vectors.T  # (m, d): the preconditioned query in model coordinates
        n = self.n_sequences
        parts_matrix = np.zeros((len(read), n), np.float64)  # row j: read prototype j's share
        spans = [(int(self.offsets[p]), int(self.offsets[p + 1])) for p in read.tolist()]
        for j, (lo, hi) in enumerate(spans):  # the smooth part: one matrix-vector product per prototype
            parts_matrix[j, self.sequence_ids[lo:hi]] = self.vectors[lo:hi] @ q[j]
        # the one-hot part: sum over each read prototype's entries a (h_j . W[y]) into (j, sequence); the tokens
        # predicted anywhere in the read entries are marked in a table over the vocabulary (no sort), and their
        # output embeddings meet every h_j in one product
        entry_spans = [(int(self.entry_offsets[lo]), int(self.entry_offsets[hi])) for lo, hi in spans]
        if any(b > a for a, b in entry_spans):
            seen = np.zeros(len(self.output_embeddings), bool)
            for a, b in entry_spans:
                seen[self.entry_targets[a:b]] = True
            targets = np.flatnonzero(seen)
            if 4 * len(targets) > len(seen):  # over a quarter of the vocabulary: one product beats a gather
                slot = np.arange(len(seen))
                dots = (h @ self.output_embeddings.T).numpy()  # (m, V)
            else:
                slot = np.empty(len(seen), np.int64)
                slot[targets] = np.arange(len(targets))  # token id -> column of dots
                dots = (h @ self.output_embeddings[torch.from_numpy(targets)].T).numpy()  # (m, |targets|)
            for j, (a, b) in enumerate(entry_spans):
                if b > a:
                    weights = self.entry_activations[a:b] * dots[j, slot[self.entry_targets[a:b]]]
                    parts_matrix[j] -= np.bincount(self.entry_sequence[a:b], weights, minlength=n)
        parts = {pid: parts_matrix[j] for j, pid in enumerate(read.tolist())}
        total = parts_matrix.sum(0)
        if self.rerank:
            self._exact_stage(total, parts, h_all)
        return total, parts

    def same_token_scores(self, ids: torch.Tensor, rows: torch.Tensor, token: int) -> np.ndarray:
        """The one-hot part of scores() restricted to the training tokens that predicted `token` itself: (N,)
        -sum a (h_j . W[token]) over the read prototypes' entries whose target is `token`. It keeps, of a sequence's
        summed gradient, only the positions where the same token was predicted through the prototypes the query
        reads, so a sequence's other 255 tokens cannot drown them (bench.attribution_truth's cached_same_token)."""
        return self.token_scores(ids, rows, token, mode=self.mode)[0]

    def token_scores(self, ids: torch.Tensor, rows: torch.Tensor, token: int,
                     mode: str = "block") -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """same_token_scores with each read prototype's share, {prototype_id: (N,)} (they add up to the scores),
        preconditioned by `mode` whatever the index's ("block", the default: the query's active prototypes only,
        which found the planted documents best in bench.attribution_truth). The app's "where they predicted this
        token" reading."""
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if mode == "coupled" and self.coupling is None:
            raise ValueError("the coupled mode needs the full curvature, and this index has none")
        token = int(token)
        if not 0 <= token < len(self.output_embeddings):
            raise ValueError(f"token must be in [0, {len(self.output_embeddings)}), got {token}")
        read, x, _ = self._preconditioned(ids, rows, mode)
        h = x @ self.whitening.output_vectors.T  # (m, d)
        dots = (h @ self.output_embeddings[token]).numpy()  # (m,)
        parts = {}
        for j, p in enumerate(read.tolist()):
            lo, hi = int(self.entry_offsets[self.offsets[p]]), int(self.entry_offsets[self.offsets[p + 1]])
            hit = np.flatnonzero(self.entry_targets[lo:hi] == token) + lo
            parts[p] = -np.bincount(self.entry_sequence[hit], self.entry_activations[hit] * dots[j],
                                    minlength=self.n_sequences).astype(np.float64)
        total = np.sum(list(parts.values()), axis=0) if parts else np.zeros(self.n_sequences, np.float64)
        return total, parts

    def _exact_stage(self, total: np.ndarray, parts: dict[int, np.ndarray], h_all: torch.Tensor) -> None:
        """Stage two with the exact store: the `rerank` best sequences of the first stage get their exact scores
        (the reference's, for the same query) and exact shares per prototype; the others keep the first stage's.
        In place on `total` and `parts` (shares of prototypes not read in the first stage are zero elsewhere)."""
        candidates = top_sequences(total, self.rerank)
        owner, prototype, share = self.exact.shares(candidates, h_all)  # h Q_S, the store's basis
        for values in parts.values():
            values[candidates] = 0.0
        total[candidates] = 0.0
        held, inverse = np.unique(prototype, return_inverse=True)
        # sequence-major, so the candidates' entries share a few pages and the rest of it is never touched; a
        # prototype's share is a strided column of it
        shares = np.zeros((self.n_sequences, len(held)))
        shares[candidates[owner], inverse] = share  # one entry per (prototype, candidate)
        for j, p in enumerate(held.tolist()):
            if p in parts:
                parts[p][candidates] = shares[candidates, j]
            else:
                parts[p] = shares[:, j]
        total += np.bincount(candidates[owner], share, minlength=self.n_sequences)


def top_sequences(scores: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n highest scores, best first (ties by index)."""
    n = min(n, len(scores))
    order = np.lexsort((np.arange(len(scores)), -np.asarray(scores, np.float64)))
    return order[:n]


def top_overlap(a: np.ndarray, b: np.ndarray, n: int = 10) -> float:
    """|top-n(a) & top-n(b)| / n for two score vectors over the same sequences."""
    n = min(n, len(a))
    return len(set(top_sequences(a, n).tolist()) & set(top_sequences(b, n).tolist())) / max(n, 1)
