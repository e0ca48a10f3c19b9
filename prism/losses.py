"""The PRISM training objective as pure functions (docs/DESIGN.md section 2).

    L = L_CE + lambda_rec * L_REC + lambda_1 * L_R1 + lambda_2 * L_R2
        [+ lambda_path_ce * L_PATH_CE + lambda_path_kl * L_PATH_KL + lambda_head_rec * L_HEAD_REC]

The bracketed terms are ours, off by default (weight 0): they ask the prototype path W z_hat + b, not only z_hat,
to carry the prediction (prism.explain measures how much it does). L_PATH_CE is the path's own next-token
cross-entropy, L_PATH_KL the KL from the full model's distribution (a fixed target) to the path's, and L_HEAD_REC
the residual measured through the head, ||W_c r||^2 / ||W_c z||^2 with W_c the head's rows minus their mean (a
shift of every logit by one amount changes no probability), computed with the d x d Gram matrix W_c^T W_c.

Every function takes tensors and returns a scalar tensor; none touches a module, so each can be checked
against an independent computation in the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def ce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy. logits (B, T, V), labels (B, T) aligned with the inputs (shifted here,
    transformers convention); positions labelled IGNORE_INDEX do not count."""
    # The labels move, not the logits: slicing the (B, T, V) logits would make their backward zero-fill and copy a
    # second (B, T, V) buffer every step (400 MB at 2,048 tokens of SmolLM2's vocabulary), the last position
    # simply has no target.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T): the next token, IGNORE_INDEX at the end
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX)


def rec_loss(z: torch.Tensor, z_hat: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_REC = mean over tokens of ||z - z_hat||^2 / ||z||^2. z, z_hat (..., d); mask (...) of kept tokens."""
    return _masked_mean(_RecRatio.apply(z, z_hat), mask)


class _RecRatio(torch.autograd.Function):
    """||z - z_hat||^2 / max(||z||^2, 1e-12) per token, z, z_hat (..., d) -> (...), with its backward written out:
    d/dz_hat = -2 r / |z|^2 and d/dz = 2 r / |z|^2 - 2 |r|^2 z / |z|^4 (the second term only where |z|^2 is above
    the clamp). Autograd of the formula makes about twice as many passes over the (tokens, d) states (pow, sum and
    their backward each read or write one): ~1.2 ms of a 2,048-token step (bench.train_throughput)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, z_hat: torch.Tensor) -> torch.Tensor:
        r = z - z_hat
        rr = torch.linalg.vector_norm(r, dim=-1).square()  # (...): one reduction, where vecdot multiplies first
        zz = torch.linalg.vector_norm(z, dim=-1).square()
        ctx.save_for_backward(z, r, rr, zz)
        return rr / zz.clamp_min(1e-12)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        z, r, rr, zz = ctx.saved_tensors
        den = zz.clamp_min(1e-12)
        along_r = (2.0 * grad / den).unsqueeze(-1)  # (..., 1)
        grad_z = grad_z_hat = None
        if ctx.needs_input_grad[0]:
            along_z = (-2.0 * grad * rr / den.square() * (zz > 1e-12)).unsqueeze(-1)
            grad_z = torch.addcmul(r * along_r, z, along_z)
        if ctx.needs_input_grad[1]:
            grad_z_hat = r * -along_r
        return grad_z, grad_z_hat


def r1_loss(sims: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_R1 = mean over prototypes of (1 - max over tokens of cos(p_i, z_t)).

    sims (..., K) are the cosine similarities of the batch's tokens with every prototype; gradients reach
    each prototype only through its nearest token state, which is what pulls it onto real data.
    """
    flat = sims.reshape(-1, sims.shape[-1])  # (N, K)
    if mask is not None and not bool(mask.all()):  # a copy of (N, K) only when some tokens are left out
        flat = flat[mask.reshape(-1)]
    return (1.0 - _ColumnMax.apply(flat)).mean()


def r2_loss(sims: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_R2 = mean over tokens of (1 - max over prototypes of cos(z_t, p_i)). sims (..., K)."""
    return _masked_mean(1.0 - sims.max(dim=-1).values, mask)


def coverage_losses(sims: torch.Tensor, top_similarity: torch.Tensor, z: torch.Tensor, prototypes: torch.Tensor,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """L_R1 and L_R2 as r1_loss and r2_loss compute them, without a gradient through the (..., K) similarities
    (training's way: prism.model's routing gives sims without gradient).

    sims (..., K) only find each prototype's best token (no gradient needed); top_similarity (...) is each token's
    best similarity, with its gradient (the first of the routing's top-k values); z (..., d) the token states and
    prototypes (K, d) the bank, from which each prototype's best similarity is computed again, in float32, at its
    best token, so its gradient reaches one token state and the prototype. Where several tokens tie for a
    prototype's maximum the first takes the gradient (r1_loss shares it; the values are equal)."""
    r2 = _masked_mean(1.0 - _wide(top_similarity), mask)
    flat = sims.detach().reshape(-1, sims.shape[-1])  # (N, K)
    states = z.reshape(-1, z.shape[-1])  # (N, d)
    if mask is not None and not bool(mask.all()):
        keep = mask.reshape(-1)
        flat, states = flat[keep], states[keep]
    rows = _first_max_rows(flat)  # (K,) each prototype's first best token
    return (1.0 - _CosineAt.apply(states, prototypes, rows)).mean(), r2


def _first_max_rows(flat: torch.Tensor) -> torch.Tensor:
    """The first row of each column's maximum, flat (N, K) -> (K,) long. A column's maximum is a fast pass (amax
    reduces along the contiguous rows); argmax along dim 0, or a uint8 mask's argmax, reduces across them and took
    about 3.5 ms at (2,048, 1,024) against 2 ms this way (the rows' numbers in the smallest integer type that holds
    them, the columns' minimum where the maximum is)."""
    n = flat.shape[0]
    dtype = torch.int16 if n < 2**15 - 1 else torch.int32 if n < 2**31 - 1 else torch.int64
    numbers = torch.arange(n, dtype=dtype, device=flat.device).unsqueeze(1)  # (N, 1)
    beyond = torch.tensor(torch.iinfo(dtype).max, dtype=dtype, device=flat.device)
    rows = torch.where(flat == flat.amax(dim=0), numbers, beyond).amin(dim=0)
    return rows.clamp_max(n - 1).long()  # a NaN column matches no row: row n - 1 (argmax gave 0), no index error


def path_kl_loss(logits: torch.Tensor, path_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_PATH_KL = mean over tokens of KL(softmax(logits) || softmax(path_logits)), logits and path_logits (..., V).
    The full model's distribution is the target and gets no gradient from this term (the path follows the model,
    the model is not pulled toward the path); its own CE keeps it good."""
    target = _wide(logits.detach()).log_softmax(-1)  # (..., V)
    kl = (target.exp() * (target - _wide(path_logits).log_softmax(-1))).sum(-1)  # (...)
    return _masked_mean(kl, mask)


def path_terms(z_hat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logits: torch.Tensor,
               labels: torch.Tensor, *, ce: bool = True, kl: bool = True, matmul_dtype: torch.dtype | None = None,
               chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """L_PATH_CE and L_PATH_KL of the path's logits z_hat @ W^T + b, without ever holding them.

    The same values and gradients as ce_loss(path_logits, labels) and path_kl_loss(logits, path_logits, labels !=
    IGNORE_INDEX) with path_logits = F.linear(z_hat, weight, bias), but computed chunk tokens at a time, each
    gradient formed in the forward ((softmax(path) - one-hot) / n for the CE, (softmax(path) - softmax(logits)) / n
    for the KL) and carried back through the head at once. The (tokens x vocabulary) path logits, their
    log-softmax and every gradient of that size never exist whole: on a CPU those passes over 400 MB buffers, not
    the products, were what made the KL term cost 2.5x a dense step (docs/RESULTS.md, training throughput).

    z_hat (B, T, d) or (N, d); weight (V, d) and bias (V,) the LM head's; logits (..., V) the full model's (a fixed
    target: no gradient reaches them); labels aligned with the inputs as in ce_loss. matmul_dtype: the dtype the
    two products run in (bfloat16 under autocast), the softmaxes are float32 whatever it is. Returns (path_ce,
    path_kl, agreement), a term that is off (ce / kl False) as 0, agreement the share of all positions where the
    path's top-1 token is the model's (no gradient). The gradient is formed only where one is needed."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    shape = labels.shape
    targets = F.pad(labels.reshape(-1, shape[-1])[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)  # the next token
    kl_mask = labels.reshape(-1) != IGNORE_INDEX
    return _PathTerms.apply(z_hat.reshape(-1, z_hat.shape[-1]), weight, bias,
                            logits.detach().reshape(-1, logits.shape[-1]), targets, kl_mask, ce, kl,
                            matmul_dtype, chunk)


class _PathTerms(torch.autograd.Function):
    """path_terms' work: see there. The gradients are formed in the forward, so the backward only scales them."""

    @staticmethod
    def forward(ctx, z_hat, weight, bias, logits, targets, kl_mask, want_ce, want_kl, matmul_dtype, chunk):
        n, d = z_hat.shape
        dtype = matmul_dtype or weight.dtype
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        need = {"z": ctx.needs_input_grad[0], "w": ctx.needs_input_grad[1],
                "b": bias is not None and ctx.needs_input_grad[2]}
        terms = [t for t, on in (("ce", want_ce), ("kl", want_kl)) if on]
        counts = {"ce": (targets != IGNORE_INDEX).sum().clamp_min(1).double(),
                  "kl": kl_mask.sum().clamp_min(1).double()}
        sums = {t: torch.zeros((), dtype=torch.float64) for t in terms}
        grads = {t: {"z": torch.zeros(n, d, dtype=torch.float32) if need["z"] else None,
                     "w": torch.zeros_like(weight, dtype=torch.float32) if need["w"] else None,
                     "b": torch.zeros_like(bias, dtype=torch.float32) if need["b"] else None} for t in terms}
        agree = torch.zeros((), dtype=torch.float64)
        for start in range(0, n, chunk):
            part = slice(start, min(n, start + chunk))
            zc, lc = z_hat[part].to(dtype), logits[part]
            logq = F.linear(zc, w, b).float()  # (c, V) the path's logits, in place its log-probabilities below
            agree += (logq.argmax(-1) == lc.argmax(-1)).sum()
            logq -= torch.logsumexp(logq, -1, keepdim=True)
            rows = torch.zeros(0, dtype=torch.long)
            if want_ce:
                rows = (targets[part] != IGNORE_INDEX).nonzero().squeeze(1)  # (m,)
                sums["ce"] -= logq[rows, targets[part][rows]].sum(dtype=torch.float64)
            if want_kl:
                logp = lc.to(torch.float32, copy=True)  # (c, V) the model's log-probabilities
                logp -= torch.logsumexp(logp, -1, keepdim=True)
                p = logp.exp()
                sums["kl"] += torch.linalg.vecdot(p, logp.sub_(logq))[kl_mask[part]].sum(dtype=torch.float64)
                del logp
            if not any(need.values()):
                continue
            q = logq.exp_()  # (c, V) the path's probabilities
            for t in terms:
                if t == "ce":
                    keep = torch.zeros(q.shape[0], dtype=torch.float32)
                    keep[rows] = 1.0
                    g = q * (keep / float(counts["ce"])).unsqueeze(1)
                    g[rows, targets[part][rows]] -= 1.0 / float(counts["ce"])
                else:
                    g = (q - p).mul_((kl_mask[part].float() / float(counts["kl"])).unsqueeze(1))
                if need["b"]:
                    grads[t]["b"] += g.sum(0)
                g = g.to(dtype)
                if need["z"]:
                    grads[t]["z"][part] = (g @ w).float()
                if need["w"]:
                    grads[t]["w"] += (g.T @ zc).float()
        ctx.grads, ctx.dtypes = grads, (z_hat.dtype, weight.dtype, None if bias is None else bias.dtype)
        values = [(sums[t] / counts[t]).float() if t in terms else torch.zeros(()) for t in ("ce", "kl")]
        share = (agree / max(n, 1)).float()
        ctx.mark_non_differentiable(share)
        return values[0], values[1], share

    @staticmethod
    def backward(ctx, grad_ce, grad_kl, _grad_share):
        out = []
        for key, dtype in zip(("z", "w", "b"), ctx.dtypes):
            total = None
            for t, scale in (("ce", grad_ce), ("kl", grad_kl)):
                part = ctx.grads.get(t, {}).get(key)
                if part is not None:
                    total = part * scale if total is None else total + part * scale
            out.append(None if total is None else total.to(dtype))
        return (*out, None, None, None, None, None, None, None)


def head_gram(weight: torch.Tensor) -> torch.Tensor:
    """W_c^T W_c (d, d) for the LM head's weight (V, d), W_c = W minus its mean row: ||W_c x||^2 = x^T G x is how
    much x moves the logits apart from each other."""
    centered = _wide(weight) - _wide(weight).mean(0, keepdim=True)  # (V, d)
    return centered.T @ centered


def head_rec_loss(z: torch.Tensor, z_hat: torch.Tensor, gram: torch.Tensor,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_HEAD_REC = mean over tokens of ||W_c r||^2 / ||W_c z||^2, r = z - z_hat; gram = head_gram(W) (d, d)."""
    r, z = _wide(z - z_hat), _wide(z)
    num = ((r @ gram) * r).sum(-1)  # (...)
    den = ((z @ gram) * z).sum(-1).clamp_min(1e-12)
    return _masked_mean(num / den, mask)


def prism_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    z: torch.Tensor,
    z_hat: torch.Tensor,
    sims: torch.Tensor,
    lambda_rec: float,
    lambda_r1: float,
    lambda_r2: float,
    *,
    path_logits: torch.Tensor | None = None,
    path_head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    path_dtype: torch.dtype | None = None,
    lambda_path_ce: float = 0.0,
    lambda_path_kl: float = 0.0,
    gram: torch.Tensor | None = None,
    lambda_head_rec: float = 0.0,
    top_similarity: torch.Tensor | None = None,
    prototypes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum and its terms. Tokens whose label is IGNORE_INDEX (padding) are left out of every term.

    R1 and R2 come from sims with their gradient (r1_loss, r2_loss) or, given top_similarity (B, T) and the bank's
    prototypes (K, d), from coverage_losses (sims then need no gradient): the same values, training's cheaper way.

    The path terms (lambda_path_ce or lambda_path_kl > 0) need either path_head = (W, b), the LM head's weight
    and bias, computed chunk by chunk with path_terms (products in path_dtype, training's way), or path_logits
    (B, T, V) = lm_head(z_hat) whole (the reference); gram (d, d) = head_gram(W) is needed when lambda_head_rec > 0.
    A term whose weight is 0 is neither computed nor reported; with path_head, losses["path_agreement"] is the share
    of positions where the path's top-1 token is the model's (no gradient)."""
    mask = labels != IGNORE_INDEX  # (B, T)
    losses = {
        "ce": ce_loss(logits, labels),
        "rec": rec_loss(z, z_hat, mask),
    }
    if (top_similarity is None) != (prototypes is None):
        raise ValueError("top_similarity and prototypes go together (coverage_losses); give both or neither")
    if top_similarity is None:
        losses["r1"], losses["r2"] = r1_loss(sims, mask), r2_loss(sims, mask)
    else:
        losses["r1"], losses["r2"] = coverage_losses(sims, top_similarity, z, prototypes, mask)
    total = losses["ce"] + lambda_rec * losses["rec"] + lambda_r1 * losses["r1"] + lambda_r2 * losses["r2"]
    if (lambda_path_ce or lambda_path_kl) and path_logits is None and path_head is None:
        raise ValueError("lambda_path_ce / lambda_path_kl > 0 need path_head = (lm_head.weight, lm_head.bias) "
                         "or path_logits = lm_head(z_hat)")
    if lambda_head_rec and gram is None:
        raise ValueError("lambda_head_rec > 0 needs gram = head_gram(lm_head.weight)")
    if (lambda_path_ce or lambda_path_kl) and path_logits is None:
        path_ce, path_kl, losses["path_agreement"] = path_terms(
            z_hat, path_head[0], path_head[1], logits, labels, ce=bool(lambda_path_ce), kl=bool(lambda_path_kl),
            matmul_dtype=path_dtype)
        for name, value, weight in (("path_ce", path_ce, lambda_path_ce), ("path_kl", path_kl, lambda_path_kl)):
            if weight:
                losses[name] = value
                total = total + weight * value
    elif lambda_path_ce:
        losses["path_ce"] = ce_loss(path_logits, labels)
        total = total + lambda_path_ce * losses["path_ce"]
    if lambda_path_kl and path_logits is not None:
        losses["path_kl"] = path_kl_loss(logits, path_logits, mask)
        total = total + lambda_path_kl * losses["path_kl"]
    if lambda_head_rec:
        losses["head_rec"] = head_rec_loss(z, z_hat, gram, mask)
        total = total + lambda_head_rec * losses["head_rec"]
    return total, losses


class _ColumnMax(torch.autograd.Function):
    """x.max(dim=0).values for x (N, K), with the gradient on the maximum's entry (shared if several tie). On CPU
    torch's max over the first axis with indices is about ten times slower than amax, which finds the values only;
    the backward finds the entries again by comparison."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        values = x.amax(dim=0)  # (K,)
        ctx.save_for_backward(x, values)
        return values

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        x, values = ctx.saved_tensors
        hit = x == values  # (N, K), one True per column unless values tie
        return torch.where(hit, grad / hit.sum(dim=0), 0.0)


NORMALIZE_EPS = 1e-12  # F.normalize's default eps (prism.model's routing uses it too)


class _CosineAt(torch.autograd.Function):
    """cos(z[rows_i], w_i) for each i: z (N, d), w (K, d), rows (K,) -> (K,), in at least float32. Its backward is
    written out, d cos / d s = (w^ - cos s^) / |s| and the same for w (autograd of F.normalize takes about three
    times as many passes over the (K, d) rows); the states' gradient lands on rows only."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        s, p = _wide(z[rows]), _wide(w)  # (K, d) each
        s_norm = s.norm(dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)  # (K, 1)
        p_norm = p.norm(dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)
        sn, pn = s / s_norm, p / p_norm
        cos = (sn * pn).sum(-1)  # (K,)
        ctx.save_for_backward(sn, pn, s_norm, p_norm, cos, rows)
        ctx.n_states = z.shape[0]
        return cos

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sn, pn, s_norm, p_norm, cos, rows = ctx.saved_tensors
        grad = grad.to(sn.dtype)[:, None]  # (K, 1)
        grad_z = grad_w = None
        if ctx.needs_input_grad[0]:  # where |s| <= eps F.normalize divides by eps: no radial part
            grad_s = torch.addcmul(pn, cos[:, None] * (s_norm > NORMALIZE_EPS), sn, value=-1.0).mul_(grad / s_norm)
            grad_z = grad_s.new_zeros(ctx.n_states, sn.shape[1]).index_add_(0, rows, grad_s)  # (N, d)
        if ctx.needs_input_grad[1]:
            grad_w = torch.addcmul(sn, cos[:, None] * (p_norm > NORMALIZE_EPS), pn, value=-1.0).mul_(grad / p_norm)
        return grad_z, grad_w, None


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least float32 (bfloat16 products under autocast widened; float64 kept, for gradient checks)."""
    return x if x.dtype == torch.float64 else x.float()


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)
