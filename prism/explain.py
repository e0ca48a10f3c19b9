"""How much of a prediction the prototypes carry: the prototype path `W z_hat + b` against the full head `W z + b`.

The decomposition `l = W r + b + sum_i a_i W p_i` is exact whatever the bank, so it can be exact and still explain
little: the directions that separate one candidate token from another may sit in the residual r. These functions
measure what the prototype part decides (docs/DESIGN.md section 2, "What the explanation carries"):

- agreement:   argmax of the prototype path's logits W z_hat + b equals the full model's argmax;
- path CE:     cross-entropy of the prototype path on the true next token (beside the full model's);
- KL:          KL(softmax(full) || softmax(path)), how far the path's distribution is from the model's;
- margin share: for the model's top-1 token a and top-2 token b, the part of the margin l_a - l_b that the
  prototypes' slices carry, (W_a - W_b) . z_hat / (l_a - l_b); 1 - share is the residual's (bias included, as in
  the decomposition, where the residual slice holds the LM head's bias).

    stats = path_statistics(z, z_hat, model.lm_head.weight, model.lm_head.bias, labels)   # per position
    summary = summarize_path(stats)    # {"agreement", "path_ce", "full_ce", "kl", "margin_share_median", ...}
    carried_share(dec_a, dec_b)        # the same share from two Decompositions at one position
    Carried.of(dec_a, dec_b, "runner")  # that share as the app shows it (None when the two logits tie)
    token_diff(original_ids, intervened_ids)   # where an intervened continuation departs from the original
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prism.losses import IGNORE_INDEX

# A share at or above this means the prototypes, not the residual, decide the choice between the two tokens.
CARRIES = 0.5


@dataclass
class PathStatistics:
    """Per-position measures over N positions (all (N,) tensors, float64 unless said).

    agree: bool, path argmax == full argmax; share: margin share (nan where the top two logits tie);
    kl: KL(full || path); full_nll, path_nll: -log p of the label (nan where the label is IGNORE_INDEX)."""

    agree: torch.Tensor
    share: torch.Tensor
    kl: torch.Tensor
    full_nll: torch.Tensor
    path_nll: torch.Tensor

    def cat(self, other: PathStatistics) -> PathStatistics:
        return PathStatistics(*(torch.cat([getattr(self, f), getattr(other, f)]) for f in FIELDS))


FIELDS = ("agree", "share", "kl", "full_nll", "path_nll")


@torch.no_grad()
def path_statistics(z: torch.Tensor, z_hat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None, chunk: int = 512) -> PathStatistics:
    """The measures of the module docstring at every position. z, z_hat (N, d) or (..., d); weight (V, d) the LM
    head; bias (V,) or None; labels (N,) or z's leading shape: the token each position predicts (IGNORE_INDEX where
    none). Computed in float32 over chunks of `chunk` positions, so (chunk, V) is the largest tensor built."""
    d = z.shape[-1]
    z, z_hat = z.reshape(-1, d), z_hat.reshape(-1, d)  # (N, d)
    if z_hat.shape != z.shape:
        raise ValueError(f"z {tuple(z.shape)} and z_hat {tuple(z_hat.shape)} must have the same shape")
    if labels is not None:
        labels = labels.reshape(-1)
        if labels.shape[0] != z.shape[0]:
            raise ValueError(f"{labels.shape[0]} labels for {z.shape[0]} positions")
    w = weight.float()
    b = None if bias is None else bias.float()
    parts = []
    for lo in range(0, z.shape[0], chunk):
        zc, hc = z[lo: lo + chunk].float(), z_hat[lo: lo + chunk].float()
        full = F.linear(zc, w, b)  # (n, V)
        path = F.linear(hc, w, b)  # (n, V)
        top2 = full.topk(2, dim=-1)
        a, second = top2.indices[:, 0], top2.indices[:, 1]  # (n,)
        margin = (top2.values[:, 0] - top2.values[:, 1]).double()  # (n,) includes the bias
        proto = ((w[a] - w[second]) * hc).sum(-1).double()  # (n,) the prototypes' part of the margin
        share = torch.where(margin > 0, proto / margin.clamp_min(1e-30), torch.full_like(margin, math.nan))
        log_full, log_path = full.log_softmax(-1), path.log_softmax(-1)  # (n, V)
        kl = (log_full.exp() * (log_full - log_path)).sum(-1).double()
        if labels is None:
            full_nll = path_nll = torch.full_like(margin, math.nan)
        else:
            lab = labels[lo: lo + chunk]
            keep = lab != IGNORE_INDEX
            safe = torch.where(keep, lab, torch.zeros_like(lab)).unsqueeze(-1)
            nan = torch.full_like(margin, math.nan)
            full_nll = torch.where(keep, -log_full.gather(-1, safe).squeeze(-1).double(), nan)
            path_nll = torch.where(keep, -log_path.gather(-1, safe).squeeze(-1).double(), nan)
        parts.append(PathStatistics(path.argmax(-1) == a, share, kl, full_nll, path_nll))
    out = parts[0]
    for part in parts[1:]:
        out = out.cat(part)
    return out


def summarize_path(stats: PathStatistics) -> dict[str, float]:
    """Means over positions (CE over labelled positions only; the share's median and the fraction of positions
    where it is >= CARRIES, over positions without a tie)."""
    labelled = ~torch.isnan(stats.full_nll)
    share = stats.share[~torch.isnan(stats.share)]
    n = int(stats.agree.numel())
    return {
        "positions": n,
        "agreement": float(stats.agree.double().mean()) if n else math.nan,
        "full_ce": float(stats.full_nll[labelled].mean()) if bool(labelled.any()) else math.nan,
        "path_ce": float(stats.path_nll[labelled].mean()) if bool(labelled.any()) else math.nan,
        "kl": float(stats.kl.mean()) if n else math.nan,
        "margin_share_median": float(share.quantile(0.5)) if share.numel() else math.nan,
        "carried_fraction": float((share >= CARRIES).double().mean()) if share.numel() else math.nan,
    }


def carried_share(top, other) -> float:
    """The prototypes' share of the choice of `top` over `other` at one position, from their two Decompositions
    (prism.model.Decomposition, same position and forward): (sum of top's slices - sum of other's) over
    (top's logit - other's). The residual's share is 1 - this. nan when the two logits are equal."""
    if top.position != other.position:
        raise ValueError(f"the two decompositions are at positions {top.position} and {other.position}")
    margin = top.logit - other.logit
    if margin == 0:
        return math.nan
    return (sum(top.contributions) - sum(other.contributions)) / margin


@dataclass
class Carried:
    """How much of the choice of a token over the runner-up (the highest-logit other token) the prototypes carry,
    carried_share of their two decompositions; the residual (W r + b) carries the rest. Above 1 or below 0 when
    the two parts pull opposite ways."""

    runner_up_id: int
    runner_up: str  # the runner-up token's text
    prototypes: float  # share of the logit gap carried by the prototypes' slices
    gap: float  # logit(token) - logit(runner-up); negative when a sampled token was not the top one

    @classmethod
    def of(cls, top, other, other_text: str) -> Carried | None:
        share = carried_share(top, other)
        if math.isnan(share):
            return None
        return cls(runner_up_id=other.token_id, runner_up=other_text, prototypes=share, gap=top.logit - other.logit)

    @property
    def residual(self) -> float:
        return 1.0 - self.prototypes

    @property
    def residual_decides(self) -> bool:
        return self.prototypes < CARRIES

    def as_dict(self) -> dict:
        return {"runner_up_id": self.runner_up_id, "runner_up": self.runner_up, "gap": self.gap,
                "prototypes": self.prototypes, "residual": self.residual, "residual_decides": self.residual_decides}


@dataclass
class Diff:
    """Token-by-token comparison of two continuations of the same prompt and seed."""

    status: list[str]  # per intervened token: same | first change | changed | after change
    first_change: int | None  # index of the first differing token

    def changed(self, index: int) -> bool:
        return self.status[index] in ("first change", "changed")


def token_diff(original: list[int], intervened: list[int]) -> Diff:
    """Per intervened token: 'same' before the first difference, 'first change' there, then 'changed' where the
    tokens at the same index differ and 'after change' where they agree again (the texts before them differ)."""
    a, b = original, intervened
    first = next((i for i in range(len(b)) if i >= len(a) or a[i] != b[i]), None)
    status = []
    for i, token in enumerate(b):
        if first is None or i < first:
            status.append("same")
        elif i == first:
            status.append("first change")
        else:
            status.append("changed" if i >= len(a) or a[i] != token else "after change")
    return Diff(status=status, first_change=first)
