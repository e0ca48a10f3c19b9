"""prism.explain against independent computations: the path measures recomputed in float64 numpy from the model's
own head, the margin share from two decompositions, and the limits (z_hat = z carries everything)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import random_ids, tiny_prism

from prism.explain import carried_share, path_statistics, summarize_path
from prism.losses import IGNORE_INDEX


def _numpy_measures(z, z_hat, w, b, labels):
    full = z @ w.T + b  # (N, V)
    path = z_hat @ w.T + b
    out = {"agree": [], "share": [], "kl": [], "full_nll": [], "path_nll": []}
    for n in range(len(z)):
        order = np.argsort(-full[n], kind="stable")
        a, second = order[0], order[1]
        out["agree"].append(path[n].argmax() == a)
        out["share"].append(float((w[a] - w[second]) @ z_hat[n] / (full[n, a] - full[n, second])))
        pf = np.exp(full[n] - full[n].max())
        pf /= pf.sum()
        pp = np.exp(path[n] - path[n].max())
        pp /= pp.sum()
        out["kl"].append(float((pf * (np.log(pf) - np.log(pp))).sum()))
        out["full_nll"].append(-math.log(pf[labels[n]]) if labels[n] != IGNORE_INDEX else math.nan)
        out["path_nll"].append(-math.log(pp[labels[n]]) if labels[n] != IGNORE_INDEX else math.nan)
    return {k: np.asarray(v) for k, v in out.items()}


@torch.no_grad()
def test_path_statistics_match_a_float64_recomputation_from_the_head():
    model = tiny_prism()
    ids = random_ids(batch=2, length=10)
    out = model(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    bias = torch.randn(model.vocab_size)  # the tiny head has none: a bias must count in the margin, not the share
    stats = path_statistics(out.z, out.z_hat, model.lm_head.weight, bias, labels, chunk=7)  # chunks cross rows
    z = out.z.reshape(-1, out.z.shape[-1]).double().numpy()
    z_hat = out.z_hat.reshape(-1, out.z.shape[-1]).double().numpy()
    expected = _numpy_measures(z, z_hat, model.lm_head.weight.double().numpy(), bias.double().numpy(),
                               labels.reshape(-1).numpy())
    assert stats.agree.numpy().tolist() == expected["agree"].tolist()
    for name in ("share", "kl", "full_nll", "path_nll"):
        np.testing.assert_allclose(getattr(stats, name).numpy(), expected[name], rtol=2e-4, atol=2e-5,
                                   equal_nan=True, err_msg=name)
    summary = summarize_path(stats)
    labelled = ~np.isnan(expected["full_nll"])
    assert summary["positions"] == 20
    assert summary["agreement"] == pytest.approx(expected["agree"].mean())
    assert summary["path_ce"] == pytest.approx(expected["path_nll"][labelled].mean(), rel=1e-4)
    assert summary["full_ce"] == pytest.approx(expected["full_nll"][labelled].mean(), rel=1e-4)
    assert summary["kl"] == pytest.approx(expected["kl"].mean(), rel=1e-3, abs=1e-6)
    assert summary["margin_share_median"] == pytest.approx(np.median(expected["share"]), rel=1e-3)
    assert summary["carried_fraction"] == pytest.approx((expected["share"] >= 0.5).mean())
    # with the model's own head (no bias), the full CE is the model's own loss on the same labels
    own = summarize_path(path_statistics(out.z, out.z_hat, model.lm_head.weight, model.lm_head.bias, labels))
    assert own["full_ce"] == pytest.approx(float(model(ids, labels=ids).losses["ce"]), rel=1e-4)


@torch.no_grad()
def test_the_margin_share_is_what_two_decompositions_say():
    model = tiny_prism()
    ids = random_ids(batch=1, length=9, seed=3)
    out = model(ids)
    stats = path_statistics(out.z, out.z_hat, model.lm_head.weight)
    for position in range(ids.shape[1]):
        top2 = out.logits[0, position].topk(2).indices.tolist()
        dec_a, dec_b = model.decompose_output(out, position, top2)
        share = carried_share(dec_a, dec_b)
        assert share == pytest.approx(float(stats.share[position]), rel=1e-4, abs=1e-5)
        # the residual's share is the rest: (residual_a - residual_b) / margin
        assert 1 - share == pytest.approx((dec_a.residual - dec_b.residual) / (dec_a.logit - dec_b.logit),
                                          rel=1e-4, abs=1e-5)
    with pytest.raises(ValueError, match="positions"):
        carried_share(*model.decompose_output(out, 0, top2[:1]), *model.decompose_output(out, 1, top2[:1]))


def test_a_reconstruction_without_residual_carries_everything_and_a_zero_one_nothing():
    torch.manual_seed(0)
    w, z = torch.randn(50, 8), torch.randn(30, 8)
    labels = torch.randint(0, 50, (30,))
    whole = summarize_path(path_statistics(z, z.clone(), w, labels=labels))
    assert whole["agreement"] == 1 and whole["margin_share_median"] == pytest.approx(1)
    assert whole["carried_fraction"] == 1 and whole["kl"] == pytest.approx(0, abs=1e-6)
    assert whole["path_ce"] == pytest.approx(whole["full_ce"])
    none = summarize_path(path_statistics(z, torch.zeros_like(z), w, labels=labels))
    assert none["margin_share_median"] == 0 and none["carried_fraction"] == 0
    assert none["path_ce"] == pytest.approx(math.log(50), rel=1e-5)  # a zero path is uniform over the vocabulary


def test_bad_shapes_are_refused():
    w = torch.randn(5, 4)
    with pytest.raises(ValueError, match="same shape"):
        path_statistics(torch.randn(3, 4), torch.randn(2, 4), w)
    with pytest.raises(ValueError, match="labels"):
        path_statistics(torch.randn(3, 4), torch.randn(3, 4), w, labels=torch.zeros(2, dtype=torch.long))
