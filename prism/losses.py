"""The PRISM training objective as pure functions (docs/DESIGN.md section 2).

    L = L_CE + lambda_rec * L_REC + lambda_1 * L_R1 + lambda_2 * L_R2

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
    shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1])  # (B*(T-1), V)
    shift_labels = labels[:, 1:].reshape(-1)  # (B*(T-1),)
    return F.cross_entropy(shift_logits.float(), shift_labels, ignore_index=IGNORE_INDEX)


def rec_loss(z: torch.Tensor, z_hat: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_REC = mean over tokens of ||z - z_hat||^2 / ||z||^2. z, z_hat (..., d); mask (...) of kept tokens."""
    ratio = (z - z_hat).pow(2).sum(-1) / z.pow(2).sum(-1).clamp_min(1e-12)  # (...)
    return _masked_mean(ratio, mask)


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


def prism_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    z: torch.Tensor,
    z_hat: torch.Tensor,
    sims: torch.Tensor,
    lambda_rec: float,
    lambda_r1: float,
    lambda_r2: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum and its terms. Tokens whose label is IGNORE_INDEX (padding) are left out of every term."""
    mask = labels != IGNORE_INDEX  # (B, T)
    losses = {
        "ce": ce_loss(logits, labels),
        "rec": rec_loss(z, z_hat, mask),
        "r1": r1_loss(sims, mask),
        "r2": r2_loss(sims, mask),
    }
    total = losses["ce"] + lambda_rec * losses["rec"] + lambda_r1 * losses["r1"] + lambda_r2 * losses["r2"]
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


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)
