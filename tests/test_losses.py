"""Loss functions against plain loops, and their gradients against finite differences."""

from __future__ import annotations

import math

import pytest
import torch

from prism.losses import IGNORE_INDEX, ce_loss, prism_loss, r1_loss, r2_loss, rec_loss


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_ce_matches_a_loop_over_positions():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    labels[1, 3] = IGNORE_INDEX
    terms = []
    for b in range(2):
        for t in range(4):
            y = int(labels[b, t + 1])
            if y != IGNORE_INDEX:
                row = logits[b, t]
                terms.append(-(float(row[y]) - math.log(float(row.exp().sum()))))
    assert float(ce_loss(logits, labels)) == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def test_rec_r1_r2_match_loops():
    g = torch.Generator().manual_seed(1)
    z, z_hat, protos = torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, 6, generator=g), torch.randn(5, 6)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 1:] = False
    tokens = [(b, t) for b in range(3) for t in range(4) if mask[b, t]]
    rec = sum(float((z[b, t] - z_hat[b, t]).pow(2).sum() / z[b, t].pow(2).sum()) for b, t in tokens) / len(tokens)
    sims = torch.nn.functional.normalize(z, dim=-1) @ torch.nn.functional.normalize(protos, dim=-1).T
    r1 = sum(1 - max(_cos(protos[i], z[b, t]) for b, t in tokens) for i in range(5)) / 5
    r2 = sum(1 - max(_cos(z[b, t], protos[i]) for i in range(5)) for b, t in tokens) / len(tokens)
    assert float(rec_loss(z, z_hat, mask)) == pytest.approx(rec, rel=1e-5)
    assert float(r1_loss(sims, mask)) == pytest.approx(r1, rel=1e-5)
    assert float(r2_loss(sims, mask)) == pytest.approx(r2, rel=1e-5)


def test_gradients_match_finite_differences():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    z_hat = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    protos = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)

    def sims_of(z, protos):
        return torch.nn.functional.normalize(z, dim=-1) @ torch.nn.functional.normalize(protos, dim=-1).T

    assert torch.autograd.gradcheck(lambda a, b: rec_loss(a, b), (z, z_hat))
    assert torch.autograd.gradcheck(lambda a, p: r1_loss(sims_of(a, p)), (z, protos))
    assert torch.autograd.gradcheck(lambda a, p: r2_loss(sims_of(a, p)), (z, protos))


def test_prism_loss_is_the_weighted_sum_and_ignores_padding():
    g = torch.Generator().manual_seed(3)
    logits, labels = torch.randn(1, 4, 9, generator=g), torch.randint(0, 9, (1, 4), generator=g)
    z, z_hat, sims = torch.randn(1, 4, 3), torch.randn(1, 4, 3), torch.rand(1, 4, 6)
    total, terms = prism_loss(logits, labels, z, z_hat, sims, 0.5, 0.2, 0.3)
    assert float(total) == pytest.approx(float(terms["ce"] + 0.5 * terms["rec"] + 0.2 * terms["r1"]
                                               + 0.3 * terms["r2"]), rel=1e-6)
    padded = labels.clone()
    padded[0, 3] = IGNORE_INDEX
    z2 = z.clone()
    z2[0, 3] = 1e3  # a padded token's state must not move any term but CE's own masking
    _, masked = prism_loss(logits, padded, z2, z_hat, sims, 0.5, 0.2, 0.3)
    assert float(masked["rec"]) == pytest.approx(float(rec_loss(z[:, :3], z_hat[:, :3])), rel=1e-6)


def test_r1_gradient_equals_the_plain_max_over_tokens():
    """r1_loss takes the maximum over tokens with a cheaper operation; value and gradient equal torch's
    max(dim=0) (with and without a mask), and tied maxima share the gradient."""
    torch.manual_seed(0)
    sims = torch.randn(3, 7, 5, requires_grad=True)
    mask = torch.rand(3, 7) > 0.3
    for m in (None, mask):
        sims.grad = None
        r1_loss(sims, m).backward()
        ours = sims.grad.clone()
        sims.grad = None
        flat = sims.reshape(-1, 5) if m is None else sims.reshape(-1, 5)[m.reshape(-1)]
        (1.0 - flat.max(dim=0).values).mean().backward()
        torch.testing.assert_close(ours, sims.grad)
    tied = torch.zeros(4, 2, requires_grad=True)  # every token ties for both prototypes
    r1_loss(tied).backward()
    torch.testing.assert_close(tied.grad, torch.full((4, 2), -1.0 / 8))
