"""A gradient cache of the trainable layers, projected: per training sequence (or per training token), a few
thousand numbers from which the influence of that sequence on any later query is one dot product.

For every nn.Linear in the trainable decoder layers (weight W: d_out x d_in), a sequence's loss gradient is
G = sum_t d_t x_t^T, with x_t the layer's input and d_t the loss gradient at its output, position t. The cache keeps
P_out G P_in^T = sum_t (P_out d_t)(P_in x_t)^T, an r x r matrix, with fixed random Gaussian projections P_in (r x d_in)
and P_out (r x d_out): two projected vectors per position, one small outer product per sequence (LoGra's
factorisation), never the d_out x d_in gradient itself. For SmolLM2-135M's top 2 layers (14 linear layers) and
r = 16 that is 3,584 numbers a sequence instead of 7.1M.

Whitening before projecting (whiten(), optional): a random projection keeps plain inner products g^T g', but
attribution needs the preconditioned one, g^T H^-1 g', and the directions that tell one sequence from another are
the low-variance ones a plain projection drowns. With K-FAC's factors (the second moments of a layer's inputs, A,
and of its output gradients, S, over the positions of some training sequences), the projections become
P_in (A + a)^-1/2 and P_out (S + s)^-1/2, so a plain dot product of projected gradients estimates K-FAC's
g^T ((A + a)^-1 (x) (S + s)^-1) g'.

Preconditioning, in the projected space, per linear layer (blocks, as kronfluence's EK-FAC):
  ekfac     the Kronecker factors of the projected inputs and output gradients over every position,
            A = E[x~ x~^T], S = E[d~ d~^T]; their eigenvectors Q_A, Q_S; the eigenvalues corrected to the
            per-sequence gradients' second moment in that basis, L = E_n[(Q_S^T g_n Q_A)^2]; damping 0.1 x mean(L)
            (kronfluence's default heuristic)
  identity  none: the raw dot product of projected gradients (TRAK without its kernel)

Scores: score(query, n) = g_q^T (H + lambda)^-1 g_n, positive = the sequence's own loss gradient points the way
that lowers the query's loss (helpful), as prism/attribution.py and kronfluence sign theirs. The query's gradient is
that of its token's cross-entropy at its position.

The same-token reading (TokenGradientIndex): every position's factors kept, sorted by the token it predicted, and a
query about token y reads only the positions that predicted y. On the planted-fact benchmark
(bench.attribution_truth, docs/RESULTS.md) this reading at r = 16 finds every planted copy, where the whole-loss
reading at r = 16 finds about a quarter: summed over a sequence, the projection's noise drowns the one position
that holds a fact.

    cache = GradientCache(model, start_layer, rank=16)
    # batch = (input_ids, start_states, attention_mask, labels); stats collects the projected Kronecker factors
    grads, parts = zip(*(cache.gradients_and_positions(*batch, stats) for batch in batches))
    cache.fit(torch.cat(grads), stats)                    # EK-FAC in the projected space
    index = TokenGradientIndex(list(parts), n_sequences)  # (each part's .sequence offset to the global numbering)
    g = cache.query_gradient(ids, states, position, token)
    whole = cache.scores(g)                               # (N,) the whole-loss reading
    same = index.scores(cache.apply(g[None])[0], token)   # (N,) where they predicted `token`

Pure torch (no kronfluence): the module is library code so the precompute job and the app could keep the cache
beside the prototype rows. Needs trainable layers made of nn.Linear (Llama, Qwen, SmolLM2; not GPT-2's Conv1D).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from prism.losses import IGNORE_INDEX

PRECONDITIONERS = ("ekfac", "identity")


def trained_start_layer(model) -> int:
    """The first decoder layer prism.train trained (its metadata: mode "top" with n_layers, or "end-to-end"),
    else the top two layers' (a model without that record)."""
    meta = getattr(model.config, "metadata", None) or {}
    n = model.n_layers if meta.get("mode") == "end-to-end" else int(meta.get("n_layers") or 0) \
        if meta.get("mode") == "top" else 0
    n = n or min(2, model.n_layers)
    return model.n_layers - max(1, min(n, model.n_layers))


def tracked_linears(model, start_layer: int) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every nn.Linear inside decoder layers start_layer.. (the trainable top layers), in order."""
    layers = list(model.decoder_layers())
    if not 0 <= start_layer < len(layers):
        raise ValueError(f"start_layer must be in [0, {len(layers)}), got {start_layer}")
    out = []
    for i, layer in enumerate(layers[start_layer:], start=start_layer):
        out += [(f"layers.{i}.{name}", m) for name, m in layer.named_modules() if isinstance(m, nn.Linear)]
    if not out:
        raise ValueError("the trainable decoder layers hold no nn.Linear modules (GPT-2's Conv1D is not supported)")
    return out


@torch.no_grad()
def token_loss_gradient(head: nn.Linear, z: torch.Tensor, token: int) -> torch.Tensor:
    """(d,) float32: the gradient of -log softmax(head(z))[token] with respect to z (d,), W^T (softmax - onehot)."""
    p = torch.softmax(head(z).float(), -1)  # (V,)
    p[token] -= 1.0
    return (p.to(head.weight.dtype) @ head.weight).float()


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy; labels follow the transformers convention (shifted here), IGNORE_INDEX
    where no target counts."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class GradientCache:
    """Projected per-sequence gradients of a PRISM model's trainable linear layers, and their preconditioner.

    The model is run from the states entering start_layer (model.final_states with start_states), so a gradient
    costs the trainable layers' forward and backward only. The model's weights are left untouched and get no
    .grad: the backward pass runs from the input states, never into the weights."""

    def __init__(self, model, start_layer: int, rank: int = 16, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.model, self.start_layer, self.rank = model.eval(), start_layer, rank
        self.modules = tracked_linears(model, start_layer)
        g = torch.Generator().manual_seed(seed)
        self.p_in, self.p_out = [], []
        for _, m in self.modules:  # N(0, 1/r): inner products kept in expectation
            self.p_in.append(torch.randn(rank, m.in_features, generator=g) / rank ** 0.5)
            self.p_out.append(torch.randn(rank, m.out_features, generator=g) / rank ** 0.5)
        self.block = rank * rank
        self.dim = self.block * len(self.modules)
        self.q_a = self.q_s = self.eigen = self.damping = None
        self.precondition = None
        self.preconditioned: torch.Tensor | None = None  # (N, D), H^-1 g_n of the fitted training sequences

    # -- gradients ------------------------------------------------------------------------------------------------

    def _run(self, input_ids, start_states, attention_mask, labels, project: bool = True, output_grad=None):
        """Forward and backward of the summed loss (or, with output_grad (B, T, d), of <z, output_grad>: the
        loss's gradient at the final states given, no vocabulary product; or a function of z (B, T, d), without
        gradient, that returns it); per module the inputs and output gradients, projected (B, T, r) each, or as
        they are (project=False)."""
        xs: list[torch.Tensor | None] = [None] * len(self.modules)
        ds: list[torch.Tensor | None] = [None] * len(self.modules)
        handles = []
        owner = threading.get_ident()  # the hooks see this pass only, not another thread's use of the same model

        def hook(i):
            def forward(module, args, output):
                if threading.get_ident() != owner:
                    return
                xs[i] = args[0].detach().float()
                if project:
                    xs[i] = xs[i] @ self.p_in[i].T

                def backward(grad):
                    ds[i] = grad.detach().float()
                    if project:
                        ds[i] = ds[i] @ self.p_out[i].T
                output.register_hook(backward)
            return forward

        for i, (_, m) in enumerate(self.modules):
            handles.append(m.register_forward_hook(hook(i)))
        try:
            with torch.enable_grad():
                states = start_states.detach().float().requires_grad_(True)
                z, _ = self.model.final_states(input_ids, attention_mask=attention_mask,
                                               start_layer=self.start_layer, start_states=states)
                if output_grad is None:
                    shifted_loss(self.model.lm_head(z), labels).backward(inputs=[states])
                else:
                    if callable(output_grad):  # the gradient depends on z itself (query_gradient)
                        output_grad = output_grad(z.detach())
                    z.backward(output_grad.to(z.dtype), inputs=[states])
        finally:
            for h in handles:
                h.remove()
        if attention_mask is not None:  # padded positions carry no loss, but their inputs are not zero
            keep = attention_mask.unsqueeze(-1).float()
            xs = [x * keep for x in xs]
        return xs, ds

    def covariances(self, input_ids: torch.Tensor, start_states: torch.Tensor, attention_mask: torch.Tensor | None,
                    labels: torch.Tensor, stats: dict) -> None:
        """Add one batch's per-position second moments of every module's inputs and output gradients, unprojected
        (d_in x d_in and d_out x d_out, K-FAC's factors A and S), to stats, for whiten()."""
        xs, ds = self._run(input_ids, start_states, attention_mask, labels, project=False)
        for key, values in (("cov_in", xs), ("cov_out", ds)):
            into = stats.setdefault(key, [None] * len(self.modules))
            for i, v in enumerate(values):
                v = v.reshape(-1, v.shape[-1])
                moment = (v.T @ v).double()  # float32 product, float64 sums across batches
                into[i] = moment if into[i] is None else into[i] + moment
        stats["cov_positions"] = stats.get("cov_positions", 0) + int(
            attention_mask.sum() if attention_mask is not None else input_ids.numel())

    def whiten(self, stats: dict, damping_factor: float = 0.1) -> None:
        """Project K-FAC-whitened gradients from now on: P_in <- P_in (A + a)^-1/2, P_out <- P_out (S + s)^-1/2,
        with A, S the factors covariances() collected and a, s = damping_factor x their mean eigenvalue. The plain
        dot product of two such projected gradients then estimates g^T (A + a)^-1 (x) (S + s)^-1 g' (K-FAC's
        influence) instead of g^T g': whitening before the random projection, because a projection keeps inner
        products, and the preconditioned inner product is the one attribution needs. Call before gradients()."""
        n = stats["cov_positions"]
        for i in range(len(self.modules)):
            for key, proj in (("cov_in", self.p_in), ("cov_out", self.p_out)):
                values, vectors = torch.linalg.eigh(stats[key][i] / n)
                values = values.clamp_min(0)
                inv_sqrt = (vectors * (values + damping_factor * values.mean()).rsqrt()) @ vectors.T
                proj[i] = proj[i] @ inv_sqrt.float()

    def gradients(self, input_ids: torch.Tensor, start_states: torch.Tensor, attention_mask: torch.Tensor | None,
                  labels: torch.Tensor, stats: dict | None = None) -> torch.Tensor:
        """(B, D): per sequence, every module's sum_t (P_out d_t)(P_in x_t)^T flattened (row-major, r_out x r_in),
        modules in order. Sequences are independent within a batch (each one's loss reaches only its own
        positions). With stats, adds the batch's per-position Kronecker statistics (ekfac's A and S) to it."""
        xs, ds = self._run(input_ids, start_states, attention_mask, labels)
        return self._combine(xs, ds, stats, attention_mask, input_ids)

    def gradients_and_positions(self, input_ids: torch.Tensor, start_states: torch.Tensor,
                                attention_mask: torch.Tensor | None, labels: torch.Tensor,
                                stats: dict | None = None) -> tuple[torch.Tensor, PositionFactors]:
        """gradients() and, from the same pass, every position's own part of them: for each position t with a
        target (labels[:, t + 1] set), the projected input and output gradient of every module there, so that
        sum_t d~_t x~_t^T over a sequence's positions is its row of gradients() (TokenGradientIndex keeps them)."""
        xs, ds = self._run(input_ids, start_states, attention_mask, labels)
        grads = self._combine(xs, ds, stats, attention_mask, input_ids)
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[:, :-1] = labels[:, 1:]  # position t predicts token t + 1
        b, t = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
        return grads, PositionFactors(sequence=b, token=targets[b, t],
                                      x=torch.stack([x[b, t] for x in xs], 1), d=torch.stack([d[b, t] for d in ds], 1),
                                      position=t)

    def position_factors(self, input_ids: torch.Tensor, start_states: torch.Tensor,
                         attention_mask: torch.Tensor | None, output_grad: torch.Tensor, sequence: torch.Tensor,
                         position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projected inputs and output gradients (n, M, r) each at the positions (sequence[i], position[i]),
        when the loss's gradient at the final states is known already (output_grad (B, T, d), e.g. the attribution
        job's per-token W^T (softmax - onehot), zero where no target counts): one forward and backward of the
        trainable layers, no vocabulary product. Equals gradients_and_positions()'s factors at those positions."""
        xs, ds = self._run(input_ids, start_states, attention_mask, None, output_grad=output_grad)
        return (torch.stack([x[sequence, position] for x in xs], 1),
                torch.stack([d[sequence, position] for d in ds], 1))

    def _combine(self, xs, ds, stats, attention_mask, input_ids) -> torch.Tensor:
        out = []
        for i in range(len(self.modules)):
            out.append(torch.einsum("bto,bti->boi", ds[i], xs[i]).reshape(len(input_ids), -1))
            if stats is not None:
                x, d = xs[i].reshape(-1, self.rank), ds[i].reshape(-1, self.rank)
                stats.setdefault("a", [torch.zeros(self.rank, self.rank, dtype=torch.float64)
                                       for _ in self.modules])[i] += (x.T @ x).double()
                stats.setdefault("s", [torch.zeros(self.rank, self.rank, dtype=torch.float64)
                                       for _ in self.modules])[i] += (d.T @ d).double()
        if stats is not None:
            stats["positions"] = stats.get("positions", 0) + int(
                attention_mask.sum() if attention_mask is not None else input_ids.numel())
        return torch.cat(out, 1)

    def query_gradient(self, input_ids: torch.Tensor, start_states: torch.Tensor, position: int,
                       token: int) -> torch.Tensor:
        """(D,): the projected gradient of one query's loss, -log p(token | input_ids[:position + 1]); input_ids
        (1, T) with T > position (anything after the position is cut), start_states (1, T, d) its states entering
        start_layer."""
        if not 0 <= position < input_ids.shape[1]:
            raise ValueError(f"position {position} outside the query's {input_ids.shape[1]} tokens")
        if start_states.shape[1] <= position:
            raise ValueError(f"start_states cover {start_states.shape[1]} positions, the query needs {position + 1}")
        head = self.model.lm_head

        def loss_gradient(z: torch.Tensor) -> torch.Tensor:
            # only the last position carries the loss: its W^T (softmax(W z + b) - onehot), two passes over the
            # vocabulary matrix for one row, instead of autograd's logits and their gradient at every position
            out = torch.zeros(z.shape, dtype=torch.float32)
            out[0, -1] = token_loss_gradient(head, z[0, -1], int(token))
            return out

        xs, ds = self._run(input_ids[:, : position + 1], start_states[:, : position + 1], None, None,
                           output_grad=loss_gradient)
        return self._combine(xs, ds, None, None, input_ids[:, : position + 1])[0]

    # -- preconditioner -------------------------------------------------------------------------------------------

    def fit(self, grads: torch.Tensor, stats: dict | None = None, precondition: str = "ekfac",
            damping_factor: float = 0.1) -> None:
        """Fit the preconditioner on the training sequences' projected gradients (N, D) (and, for ekfac, the
        per-position statistics gradients() collected) and keep H^-1 g_n for every one of them."""
        if precondition not in PRECONDITIONERS:
            raise ValueError(f"precondition must be one of {PRECONDITIONERS}, got {precondition!r}")
        if grads.dim() != 2 or grads.shape[1] != self.dim:
            raise ValueError(f"grads must be (N, {self.dim}), got {tuple(grads.shape)}")
        self.precondition = precondition
        if precondition == "identity":
            self.preconditioned = grads.float().clone()
            return
        if not stats or "a" not in stats:
            raise ValueError("ekfac needs the per-position statistics: pass stats=... to gradients()")
        n = stats["positions"]
        self.q_a, self.q_s, self.eigen, self.damping = [], [], [], []
        for i in range(len(self.modules)):
            _, q_a = torch.linalg.eigh(stats["a"][i] / n)
            _, q_s = torch.linalg.eigh(stats["s"][i] / n)
            q_a, q_s = q_a.float(), q_s.float()
            g = grads[:, i * self.block: (i + 1) * self.block].float().reshape(-1, self.rank, self.rank)
            rotated = q_s.T @ g @ q_a  # (N, r_out, r_in) in the Kronecker eigenbasis
            eigen = (rotated.double() ** 2).mean(0).float()  # EK-FAC's corrected eigenvalues
            self.q_a.append(q_a)
            self.q_s.append(q_s)
            self.eigen.append(eigen)
            self.damping.append(damping_factor * float(eigen.mean()))
        self.preconditioned = self.apply(grads)

    def apply(self, grads: torch.Tensor) -> torch.Tensor:
        """(H + lambda)^-1 g for rows g of grads (N, D), block by block."""
        if self.precondition == "identity":
            return grads.float().clone()
        if self.q_a is None:
            raise RuntimeError("fit() the preconditioner first")
        out = torch.empty(grads.shape, dtype=torch.float32)
        for i in range(len(self.modules)):
            sl = slice(i * self.block, (i + 1) * self.block)
            g = grads[:, sl].float().reshape(-1, self.rank, self.rank)
            rotated = self.q_s[i].T @ g @ self.q_a[i] / (self.eigen[i] + self.damping[i])
            out[:, sl] = (self.q_s[i] @ rotated @ self.q_a[i].T).reshape(len(grads), -1)
        return out

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """(N,) g_q^T (H + lambda)^-1 g_n over the fitted training sequences (H symmetric: one product)."""
        if self.preconditioned is None:
            raise RuntimeError("fit() the preconditioner first")
        return self.preconditioned @ query.float()

    @property
    def nbytes(self) -> int:
        return 0 if self.preconditioned is None else self.preconditioned.numel() * 4

    # -- keeping it -----------------------------------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        """The projections and the fitted EK-FAC preconditioner as named tensors (for safetensors; the fitted
        sequences' H^-1 g_n are not kept: a stored cache reads positions, TokenGradientIndex)."""
        if self.precondition != "ekfac" or self.q_a is None:
            raise RuntimeError("fit() the ekfac preconditioner first")
        out = {"damping": torch.tensor(self.damping, dtype=torch.float32)}
        for i in range(len(self.modules)):
            for key, values in (("p_in", self.p_in), ("p_out", self.p_out), ("q_a", self.q_a), ("q_s", self.q_s),
                                ("eigen", self.eigen)):
                out[f"{key}.{i}"] = values[i].float().contiguous()
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """The inverse of state(): projections and preconditioner, checked against this model's layers."""
        n = len(self.modules)
        missing = [f"{k}.{i}" for k in ("p_in", "p_out", "q_a", "q_s", "eigen") for i in range(n)
                   if f"{k}.{i}" not in state] + ([] if "damping" in state else ["damping"])
        if missing or f"p_in.{n}" in state:
            raise ValueError(f"the stored gradient cache does not match this model's {n} trainable linear layers "
                             f"(missing {missing[:3]})" if missing else
                             f"the stored gradient cache has more layers than this model's {n}")
        for i, (name, m) in enumerate(self.modules):
            if tuple(state[f"p_in.{i}"].shape) != (self.rank, m.in_features) or \
                    tuple(state[f"p_out.{i}"].shape) != (self.rank, m.out_features):
                raise ValueError(f"the stored projections of {name} do not match rank {self.rank} and the layer's "
                                 f"{m.out_features} x {m.in_features} weight")
        self.p_in = [state[f"p_in.{i}"].float() for i in range(n)]
        self.p_out = [state[f"p_out.{i}"].float() for i in range(n)]
        self.q_a = [state[f"q_a.{i}"].float() for i in range(n)]
        self.q_s = [state[f"q_s.{i}"].float() for i in range(n)]
        self.eigen = [state[f"eigen.{i}"].float() for i in range(n)]
        self.damping = [float(v) for v in state["damping"]]
        self.precondition, self.preconditioned = "ekfac", None


def summed_gradients(sequence: torch.Tensor, x: torch.Tensor, d: torch.Tensor, n_sequences: int,
                       stats: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """(n_sequences, M r r): per sequence sum_t d~_t x~_t^T of its positions' factors (x, d (n, M, r); sequence
    (n,)), as GradientCache.gradients() gives it when every position with a gradient is in x and d; with stats,
    adds the positions' projected Kronecker statistics (fit()'s "a", "s", "positions") to it. For factors kept
    in pieces (the attribution job's token files): call per piece with the same `out`, which it adds to."""
    n, n_modules, rank = x.shape
    x, d = x.float(), d.float()
    outer = torch.einsum("nmo,nmi->nmoi", d, x).reshape(n, -1)
    if out is None:
        out = torch.zeros(n_sequences, n_modules * rank * rank, dtype=torch.float32)
    out.index_add_(0, sequence.long(), outer)
    if stats is not None:
        for key, v in (("a", x), ("s", d)):
            into = stats.setdefault(key, [torch.zeros(rank, rank, dtype=torch.float64) for _ in range(n_modules)])
            for i in range(n_modules):
                into[i] += (v[:, i].T @ v[:, i]).double()
        stats["positions"] = stats.get("positions", 0) + n
    return out


@dataclass
class PositionFactors:
    """Per position with a target: its sequence (as given), the token it predicts, and every module's projected
    input x~ (n, M, r) and output gradient d~ (n, M, r)."""

    sequence: torch.Tensor
    token: torch.Tensor
    x: torch.Tensor
    d: torch.Tensor
    position: torch.Tensor | None = None  # where in its sequence (gradients_and_positions fills it)


class TokenGradientIndex:
    """The gradient cache read where the training sequences predicted a given token: a sequence's score for a query
    about token y is sum over its positions t that predicted y of <H^-1 g_q, d~_t x~_t^T>, the part of its own
    (projected) loss gradient that flows through the trained layers' activations at those positions. The same
    question as prism.attribution's same-token reading of prototype space, asked in the layers' gradient space.

    Keeps every training position's factors (float16, sorted by the token predicted): 2 r M numbers a position."""

    def __init__(self, parts: list[PositionFactors], n_sequences: int) -> None:
        token = torch.cat([p.token for p in parts])
        order = torch.argsort(token, stable=True)
        self.token = token[order]
        self.sequence = torch.cat([p.sequence for p in parts])[order]
        self.x = torch.cat([p.x for p in parts])[order].half()
        self.d = torch.cat([p.d for p in parts])[order].half()
        self.position = torch.cat([p.position for p in parts])[order] if all(
            p.position is not None for p in parts) else None
        self.n_sequences = n_sequences
        self._check()

    @classmethod
    def from_sorted(cls, token: torch.Tensor, sequence: torch.Tensor, x: torch.Tensor, d: torch.Tensor,
                    n_sequences: int, position: torch.Tensor | None = None) -> TokenGradientIndex:
        """An index over arrays already sorted by token (as a stored index keeps them, e.g. memory-mapped): no
        copy, no sort. token, sequence, position (n,); x, d (n, M, r) float16."""
        self = cls.__new__(cls)
        self.token, self.sequence, self.x, self.d, self.position = token, sequence, x, d, position
        self.n_sequences = n_sequences
        if x.dim() != 3 or x.shape != d.shape or len(token) != len(x) or len(sequence) != len(x):
            raise ValueError(f"x and d must be (n, M, r) with n = len(token) = len(sequence), got x "
                             f"{tuple(x.shape)}, d {tuple(d.shape)}, {len(token)} tokens, {len(sequence)} sequences")
        if len(token) > 1 and bool((token[1:] < token[:-1]).any()):
            raise ValueError("token must be sorted (ascending)")
        self._check()
        return self

    def _check(self) -> None:
        if len(self.sequence) and int(self.sequence.max()) >= self.n_sequences:
            raise ValueError(f"a position's sequence {int(self.sequence.max())} is not below n_sequences "
                             f"{self.n_sequences}")

    def position_scores(self, query: torch.Tensor, token: int) -> tuple[slice, torch.Tensor]:
        """The rows (a slice of the sorted arrays: sequence[rows], position[rows]) of the positions that predicted
        `token` and each one's <query, d~_t x~_t^T>, for a query's (preconditioned) projected gradient (D,) = M
        blocks of r x r."""
        n_modules, rank = self.x.shape[1], self.x.shape[2]
        if query.numel() != n_modules * rank * rank:
            raise ValueError(f"query must hold {n_modules} x {rank} x {rank} numbers, got {query.numel()}")
        lo = int(torch.searchsorted(self.token, int(token)))
        hi = int(torch.searchsorted(self.token, int(token), right=True))
        if hi <= lo:
            return slice(lo, lo), torch.zeros(0)
        m = query.float().reshape(n_modules, rank, rank)
        return slice(lo, hi), torch.einsum("nmo,moi,nmi->n", self.d[lo:hi].float(), m, self.x[lo:hi].float())

    def scores(self, query: torch.Tensor, token: int) -> torch.Tensor:
        """(n_sequences,) for a query's (preconditioned) projected gradient (D,) = M blocks of r x r: per sequence
        the sum of position_scores over its positions; zero for the sequences that never predicted the token."""
        rows, value = self.position_scores(query, token)
        out = torch.zeros(self.n_sequences, dtype=torch.float32)
        if len(value):
            out.index_add_(0, self.sequence[rows].long(), value)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.d, self.token, self.sequence, self.position)
                   if t is not None)


def batches(n: int, size: int) -> Iterable[range]:
    for lo in range(0, n, size):
        yield range(lo, min(n, lo + size))


class StoredGradients:
    """A gradient store read back (the attribution job writes it, precompute.attribution.load_gradient_store reads
    it): the projections and EK-FAC preconditioner (a GradientCache) and every training token's factors sorted by
    the token predicted (a TokenGradientIndex, memory-mapped). A query is one forward of the frozen layers, one
    forward and backward of the trained layers and a product over the positions that predicted the token."""

    def __init__(self, cache: GradientCache, index: TokenGradientIndex) -> None:
        if index.position is None:
            raise ValueError("a stored gradient index keeps each token's position")
        if index.x.shape[1:] != (len(cache.modules), cache.rank):
            raise ValueError(f"the index holds {tuple(index.x.shape[1:])} factors per token, the cache "
                             f"{len(cache.modules)} layers x rank {cache.rank}")
        self.cache, self.index = cache, index
        # one query at a time: a pass from the trained layers' input states sets them on the model's shared top
        # view (PrismForCausalLM.final_states with start_states)
        self._lock = threading.Lock()

    @property
    def n_sequences(self) -> int:
        return self.index.n_sequences

    @torch.no_grad()
    def start_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(1, T, d): the states entering the trained layers for input_ids (1, T), for query(states=...)."""
        with self._lock:
            return self.cache.model.states_before_layer(input_ids, self.cache.start_layer)

    @torch.no_grad()
    def query(self, input_ids: torch.Tensor, position: int, token: int, states: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the loss of `token` predicted at `position` of input_ids (1, T): the scores (n_sequences,) and,
        of every training position that predicted the token, its sequence, its position and its part of its
        sequence's score (the panel highlights them). states (1, >= position + 1, d): the states entering the
        trained layers at those tokens, kept from an earlier pass (the frozen layers' forward, most of a query's
        cost, is then skipped; start_states() computes them); computed here when None."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be (1, T), got {tuple(input_ids.shape)}")
        if not 0 <= position < input_ids.shape[1]:
            raise ValueError(f"position {position} outside the query's {input_ids.shape[1]} tokens")
        ids = input_ids[:, : position + 1]
        if states is not None and (states.dim() != 3 or states.shape[0] != 1 or states.shape[1] <= position
                                   or states.shape[2] != self.cache.model.d_model):
            raise ValueError(f"states must be (1, >= {position + 1}, {self.cache.model.d_model}), got "
                             f"{tuple(states.shape)}")
        with self._lock:
            if states is None:
                states = self.cache.model.states_before_layer(ids, self.cache.start_layer)
            g = self.cache.query_gradient(ids, states, position, token)
        rows, value = self.index.position_scores(self.cache.apply(g[None])[0], token)
        sequence, where = self.index.sequence[rows].long(), self.index.position[rows].long()
        scores = torch.zeros(self.n_sequences, dtype=torch.float32)
        if len(value):
            scores.index_add_(0, sequence, value)
        return scores, sequence, where, value
