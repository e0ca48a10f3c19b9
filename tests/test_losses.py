"""Loss functions against plain loops, and their gradients against finite differences."""

from __future__ import annotations

import math

import pytest
import torch

from prism import losses
from prism.losses import (
    IGNORE_INDEX,
    ce_loss,
    head_gram,
    head_rec_loss,
    path_kl_loss,
    path_terms,
    prism_loss,
    r1_loss,
    r2_loss,
    rec_loss,
)


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
    # its gradient: (softmax - one-hot) / n at each counted position, zero at the last and at ignored targets
    logits.requires_grad_(True)
    ce_loss(logits, labels).backward()
    expected = torch.zeros_like(logits)
    for b in range(2):
        for t in range(4):
            y = int(labels[b, t + 1])
            if y != IGNORE_INDEX:
                expected[b, t] = logits[b, t].detach().softmax(-1)
                expected[b, t, y] -= 1
    assert torch.allclose(logits.grad, expected / len(terms), atol=1e-6)


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


def test_path_terms_match_direct_computations():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(11, 5, generator=g)  # (V, d) an LM head
    z, z_hat = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
    logits, path = z @ w.T, z_hat @ w.T
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    tokens = [(b, t) for b in range(2) for t in range(3) if mask[b, t]]
    kl, head = [], []
    w_c = w - w.mean(0)
    for b, t in tokens:
        p, q = logits[b, t].softmax(-1), path[b, t].softmax(-1)
        kl.append(float((p * (p.log() - q.log())).sum()))
        # the residual through the centred head, from the (V,) logit vectors themselves
        head.append(float((w_c @ (z[b, t] - z_hat[b, t])).pow(2).sum() / (w_c @ z[b, t]).pow(2).sum()))
    assert float(path_kl_loss(logits, path, mask)) == pytest.approx(sum(kl) / len(kl), rel=1e-5)
    assert float(head_rec_loss(z, z_hat, head_gram(w), mask)) == pytest.approx(sum(head) / len(head), rel=1e-5)
    # a shift of every logit by one amount is no residual through the head: rows that differ by a constant vector
    shifted = w + torch.randn(5, generator=g)
    assert torch.allclose(head_gram(shifted), head_gram(w), atol=1e-4)


def test_path_kl_leaves_the_full_logits_alone_and_its_gradient_matches_finite_differences():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    path = torch.randn(2, 3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    path_kl_loss(logits, path).backward()
    assert logits.grad is None and path.grad is not None  # the model's distribution is a fixed target
    assert torch.autograd.gradcheck(lambda q: path_kl_loss(logits.detach(), q), (path.detach().requires_grad_(),))
    z = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    z_hat = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    gram = head_gram(torch.randn(9, 4, dtype=torch.float64, generator=g)).double()
    assert torch.autograd.gradcheck(lambda a, b: head_rec_loss(a, b, gram), (z, z_hat))


def test_prism_loss_adds_the_path_terms_only_when_weighted_and_asks_for_their_inputs():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(9, 3, generator=g)
    z, z_hat, sims = torch.randn(1, 4, 3, generator=g), torch.randn(1, 4, 3, generator=g), torch.rand(1, 4, 6)
    logits, path, labels = z @ w.T, z_hat @ w.T, torch.randint(0, 9, (1, 4), generator=g)
    base, base_terms = prism_loss(logits, labels, z, z_hat, sims, 0.5, 0.2, 0.3)
    assert set(base_terms) == {"ce", "rec", "r1", "r2"}
    total, terms = prism_loss(logits, labels, z, z_hat, sims, 0.5, 0.2, 0.3, path_logits=path, lambda_path_ce=0.7,
                              lambda_path_kl=1.5, gram=head_gram(w), lambda_head_rec=2.0)
    assert float(terms["path_ce"]) == pytest.approx(float(ce_loss(path, labels)), rel=1e-6)
    assert float(total) == pytest.approx(float(base + 0.7 * terms["path_ce"] + 1.5 * terms["path_kl"]
                                               + 2.0 * terms["head_rec"]), rel=1e-6)
    with pytest.raises(ValueError, match="path_logits"):
        prism_loss(logits, labels, z, z_hat, sims, 0.5, 0.2, 0.3, lambda_path_kl=1.0)
    with pytest.raises(ValueError, match="gram"):
        prism_loss(logits, labels, z, z_hat, sims, 0.5, 0.2, 0.3, lambda_head_rec=1.0)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_path_terms_chunk_by_chunk_equal_the_whole_path_logits_values_and_gradients(chunk):
    g = torch.Generator().manual_seed(11)
    z_hat = torch.randn(2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(13, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(13, dtype=torch.float64, generator=g, requires_grad=True)
    logits = torch.randn(2, 5, 13, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 13, (2, 5), generator=g)
    labels[0, 2] = labels[1, 4] = IGNORE_INDEX  # a padded input and a padded last target
    for ce, kl in ((True, False), (False, True), (True, True)):
        for x in (z_hat, weight, bias):
            x.grad = None
        path_ce, path_kl, share = path_terms(z_hat, weight, bias, logits, labels, ce=ce, kl=kl, chunk=chunk)
        (0.7 * path_ce + 1.9 * path_kl).backward()
        fused = [x.grad.clone() for x in (z_hat, weight, bias)]
        for x in (z_hat, weight, bias):
            x.grad = None
        path = torch.nn.functional.linear(z_hat, weight, bias)  # (2, 5, 13) whole: the reference
        ref_ce, ref_kl = ce_loss(path, labels), path_kl_loss(logits, path, labels != IGNORE_INDEX)
        (0.7 * ref_ce * ce + 1.9 * ref_kl * kl).backward()
        if ce:
            assert float(path_ce.detach()) == pytest.approx(float(ref_ce.detach()), rel=1e-6)
        if kl:
            assert float(path_kl.detach()) == pytest.approx(float(ref_kl.detach()), rel=1e-6)
        for mine, ref in zip(fused, (z_hat.grad, weight.grad, bias.grad)):
            assert torch.allclose(mine, ref, atol=1e-6)
        assert float(share) == pytest.approx(float((path.argmax(-1) == logits.argmax(-1)).double().mean()))


def test_path_terms_form_no_gradient_where_none_is_asked_and_products_follow_matmul_dtype():
    g = torch.Generator().manual_seed(12)
    z_hat = torch.randn(3, 8, generator=g, requires_grad=True)
    weight, logits = torch.randn(50, 8, generator=g), torch.randn(1, 3, 50, generator=g)
    labels = torch.randint(0, 50, (1, 3), generator=g)
    path_ce, path_kl, _ = path_terms(z_hat, weight, None, logits, labels)
    path_kl.backward()
    assert weight.grad is None and z_hat.grad is not None
    low, _, _ = path_terms(z_hat, weight, None, logits, labels, kl=False, matmul_dtype=torch.bfloat16)
    bf16 = ce_loss(torch.nn.functional.linear(z_hat.bfloat16(), weight.bfloat16()).float().unsqueeze(0), labels)
    # the products in bfloat16, the softmax in float32
    assert float(low.detach()) == pytest.approx(float(bf16.detach()), rel=1e-5)
    assert float(low.detach()) != float(path_ce.detach())
    with pytest.raises(ValueError, match="chunk"):
        path_terms(z_hat, weight, None, logits, labels, chunk=0)


def test_prism_loss_with_the_head_equals_prism_loss_with_whole_path_logits():
    g = torch.Generator().manual_seed(13)
    w, b = torch.randn(9, 3, generator=g), torch.randn(9, generator=g)
    z, sims = torch.randn(1, 4, 3, generator=g), torch.rand(1, 4, 6)
    z_hat = torch.randn(1, 4, 3, generator=g, requires_grad=True)
    logits, labels = z @ w.T, torch.randint(0, 9, (1, 4), generator=g)
    args = (logits, labels, z, z_hat, sims, 0.5, 0.2, 0.3)
    total, terms = prism_loss(*args, path_head=(w, b), lambda_path_ce=0.7, lambda_path_kl=1.5)
    total.backward()
    grad, z_hat.grad = z_hat.grad.clone(), None
    ref, ref_terms = prism_loss(*args, path_logits=z_hat @ w.T + b, lambda_path_ce=0.7, lambda_path_kl=1.5)
    ref.backward()
    assert float(total.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    assert {k: pytest.approx(float(v), rel=1e-6) for k, v in ref_terms.items()} == \
        {k: float(v.detach()) for k, v in terms.items() if k != "path_agreement"}
    assert torch.allclose(grad, z_hat.grad, atol=1e-6)


def test_routing_and_coverage_losses_equal_autograd_of_the_plain_formulas():
    """Training's head (prism.model's _Routing: similarities and top-k with a backward written out, and
    coverage_losses for R1 and R2 from sims without gradient) against autograd of the plain formulas: cos as a
    dense product of F.normalize'd vectors, torch's topk and max. Values and gradients, with and without a mask
    (padding left out), and finite differences in float64."""
    import torch.nn.functional as F

    from prism.losses import coverage_losses
    from prism.model import _Routing

    gen = torch.Generator().manual_seed(7)
    z = torch.randn(2, 15, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(9, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(2, 15, 3, dtype=torch.float64, generator=gen)  # a loss on the activations

    def ours(z, w, mask):
        sims, values, ids = _Routing.apply(z.reshape(-1, 6), w, 3)
        assert not sims.requires_grad and not ids.requires_grad
        values = values.reshape(2, 15, 3)
        r1, r2 = coverage_losses(sims.reshape(2, 15, 9), values[..., 0], z, w, mask)
        return r1 + 2 * r2 + (F.relu(values) * weight).sum(), ids.reshape(2, 15, 3)

    def plain(z, w, mask):
        sims = F.normalize(z, dim=-1) @ F.normalize(w, dim=-1).T  # (2, 15, 9)
        values, ids = sims.topk(3, dim=-1)
        flat = sims.reshape(-1, 9) if mask is None else sims.reshape(-1, 9)[mask.reshape(-1)]
        r1 = (1 - flat.max(dim=0).values).mean()
        top = sims.max(dim=-1).values
        r2 = (1 - top).mean() if mask is None else ((1 - top) * mask).sum() / mask.sum()
        return r1 + 2 * r2 + (F.relu(values) * weight).sum(), ids

    mask = torch.rand(2, 15, generator=gen) > 0.3
    for m in (None, mask):
        (a, ids_a), (b, ids_b) = ours(z, w, m), plain(z, w, m)
        assert torch.equal(ids_a, ids_b)
        torch.testing.assert_close(a, b)
        for ga, gb in zip(torch.autograd.grad(a, (z, w)), torch.autograd.grad(b, (z, w))):
            torch.testing.assert_close(ga, gb)
        assert torch.autograd.gradcheck(lambda z, w, m=m: ours(z, w, m)[0], (z, w))


def test_routing_under_autocast_matches_float32():
    """Under bfloat16 autocast the similarity product is bfloat16 (as the old path's) and the gradients come back
    in float32, close to the float32 ones."""
    import torch.nn.functional as F

    from prism.model import _Routing

    gen = torch.Generator().manual_seed(3)
    z = torch.randn(300, 32, generator=gen, requires_grad=True)
    w = torch.randn(40, 32, generator=gen, requires_grad=True)
    grads = []
    for bf16 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            sims, values, _ = _Routing.apply(z, w, 4)
        assert sims.dtype == (torch.bfloat16 if bf16 else torch.float32)
        (F.relu(values.float()) ** 2).sum().backward()
        assert z.grad.dtype == w.grad.dtype == torch.float32
        grads.append((z.grad.clone(), w.grad.clone()))
        z.grad = w.grad = None
    for fp32, bf16 in zip(*grads):
        assert F.cosine_similarity(fp32.flatten(), bf16.flatten(), dim=0) > 0.98


def test_rec_loss_and_its_written_out_gradient_equal_autograd_of_the_formula():
    """L_REC's backward is written out (_RecRatio): values and both gradients against autograd of the plain formula
    in float32, a zero state (the clamp) and padding included."""
    g = torch.Generator().manual_seed(5)
    z, z_hat = torch.randn(4, 16, 32, generator=g), torch.randn(4, 16, 32, generator=g)
    z[1, 3] = 0.0  # below the clamp: no gradient through |z|^2 there
    mask = torch.ones(4, 16, dtype=torch.bool)
    mask[3, 10:] = False
    weights = torch.rand(4, 16, generator=g)  # a gradient that differs per token
    grads = []
    for plain in (False, True):
        a, b = z.clone().requires_grad_(True), z_hat.clone().requires_grad_(True)
        if plain:
            ratio = (a - b).pow(2).sum(-1) / a.pow(2).sum(-1).clamp_min(1e-12)
            loss = (ratio * weights)[mask].mean()
        else:
            loss = (losses._RecRatio.apply(a, b) * weights)[mask].mean()
        loss.backward()
        grads.append((float(loss), a.grad, b.grad))
    (mine, gz, gzh), (ref, rz, rzh) = grads
    assert mine == pytest.approx(ref, rel=1e-6)
    assert torch.allclose(gz, rz, atol=1e-6) and torch.allclose(gzh, rzh, atol=1e-6)
    assert float(gz[1, 3].abs().max()) == float(rz[1, 3].abs().max())  # the clamped token: the same (r's term only)


def test_the_first_best_row_of_each_column_is_found_with_ties():
    """coverage_losses takes each prototype's first best token (_first_max_rows): against a loop over the columns,
    on a matrix full of ties, in float32 and bfloat16, and on more rows than an int16 holds."""
    g = torch.Generator().manual_seed(6)
    for n, k, dtype in ((50, 7, torch.float32), (64, 9, torch.bfloat16), (40000, 3, torch.float32)):
        flat = torch.randint(0, 4, (n, k), generator=g).to(dtype)  # values 0..3: every column has ties
        expected = [next(i for i in range(n) if flat[i, c] == flat[:, c].max()) for c in range(k)]
        assert losses._first_max_rows(flat).tolist() == expected
