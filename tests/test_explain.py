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


# ----------------------------------------------------------------------------------------------------------------
# One position explained: explain_token, contrast, logit_attrs, explain_change, each against numbers recomputed
# from the model's own parameters in float64 (W, the bank P, the state z, the activations the head reports).


def _state_and_bank(model, ids, position):
    """z at a position, and the head's own selection there: (z (d,), {prototype id: activation})."""
    out = model(ids)
    z = out.z[0, position]
    return z, dict(zip(out.prototype_ids[0, position].tolist(), out.activations[0, position].tolist()))


@torch.no_grad()
def test_explain_token_decomposes_the_top_tokens_exactly_and_in_logit_order():
    from prism.explain import explain_token

    model = tiny_prism(n_prototypes=16, top_k=4)
    z, active = _state_and_bank(model, random_ids(batch=1, length=9), 6)
    w, p = model.lm_head.weight.double(), model.prototypes.weight.double()
    logits = w @ z.double()  # the tiny head has no bias
    lowest = int(logits.argmin())  # a chosen token far from the top: it must still be explained, and listed
    ex = explain_token(model, z, lowest, n_alternatives=4, decode=lambda t: f"<{t}>")
    expected_top = logits.topk(4).indices.tolist()
    assert [d.token_id for d in ex.alternatives] == expected_top + [lowest]
    for d in ex.alternatives:
        assert d.logit == pytest.approx(float(logits[d.token_id]), abs=1e-4)
        assert d.residual + sum(d.contributions) == pytest.approx(d.logit, abs=1e-4)
        for pid, a, c in zip(d.prototype_ids, d.activations, d.contributions):
            assert a == pytest.approx(active[pid], abs=1e-5)
            assert c == pytest.approx(a * float(w[d.token_id] @ p[pid]), abs=1e-5)
    assert ex.chosen.token_id == lowest and ex.runner_up.token_id == expected_top[0]
    assert ex.carried.runner_up == f"<{expected_top[0]}>" and ex.carried.gap < 0  # chosen below the runner-up
    assert ex.carried.prototypes == pytest.approx(carried_share(ex.chosen, ex.runner_up))


@torch.no_grad()
def test_contrast_splits_the_margin_of_any_two_tokens_into_residual_and_prototype_parts():
    from prism.explain import contrast, explain_token

    model = tiny_prism(n_prototypes=16, top_k=4)
    z, active = _state_and_bank(model, random_ids(batch=1, length=9, seed=3), 4)
    w, p = model.lm_head.weight.double(), model.prototypes.weight.double()
    ex = explain_token(model, z, int((w @ z.double()).argmax()), n_alternatives=5)
    a, b = ex.alternatives[0], ex.alternatives[3]
    c = contrast(a, b)
    assert c.margin == pytest.approx(a.logit - b.logit, abs=1e-5)
    assert c.residual + c.prototypes == pytest.approx(c.margin, abs=1e-4)
    expected = {pid: act * float((w[a.token_id] - w[b.token_id]) @ p[pid]) for pid, act in active.items() if act > 0}
    assert dict(zip(c.prototype_ids, c.contributions)) == pytest.approx(expected, abs=1e-5)
    assert [abs(x) for x in c.contributions] == sorted((abs(x) for x in c.contributions), reverse=True)
    assert c.share == pytest.approx(carried_share(a, b))
    favour_a, favour_b = c.favouring("a"), c.favouring("b")
    assert all(x > 0 for _, x in favour_a) and all(x < 0 for _, x in favour_b)
    assert len(favour_a) + len(favour_b) == sum(x != 0 for x in c.contributions)
    flipped = contrast(b, a)
    assert flipped.margin == pytest.approx(-c.margin) and flipped.prototypes == pytest.approx(-c.prototypes)
    with pytest.raises(ValueError, match="same position"):
        contrast(a, explain_token(model, _state_and_bank(model, random_ids(batch=1, length=9), 2)[0], 0).chosen)


@torch.no_grad()
def test_logit_attrs_is_the_decomposition_as_a_tensor_under_interventions_too():
    from prism.explain import logit_attrs
    from prism.interventions import Interventions

    model = tiny_prism(n_prototypes=16, top_k=4)
    z, active = _state_and_bank(model, random_ids(batch=1, length=9, seed=5), 7)
    tokens = [0, 5, 17, 31]
    for iv in (None, Interventions(suppress={max(active, key=active.get)}),
               Interventions(suppress={max(active, key=active.get)}, suppress_mode="reroute"),
               Interventions(inject={next(i for i in range(16) if i not in active): 0.7})):
        slices, residual = logit_attrs(model, z, tokens, iv)
        logits = model.head(z[None, None], iv).logits[0, 0, tokens]
        torch.testing.assert_close(slices.sum(-1) + residual, logits, rtol=1e-4, atol=1e-4)
        assert slices.shape == (4, 16)
        if iv is not None and iv.suppress and iv.suppress_mode == "zero":
            assert bool((slices[:, sorted(iv.suppress)] == 0).all())  # the suppressed slice is gone, exactly
        if iv is not None and iv.inject:
            (pid, act), = iv.inject.items()
            expected = act * (model.lm_head.weight[tokens] @ model.prototypes.weight[pid])
            torch.testing.assert_close(slices[:, pid], expected, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_explain_change_effects_add_up_to_the_change_of_the_margin_and_the_flip_set_flips():
    from prism.explain import explain_change, explain_token
    from prism.interventions import Interventions, restrict

    model = tiny_prism(n_prototypes=16, top_k=4)
    model.prototypes.weight.mul_(10)  # long prototypes: their slices outweigh the residual, so suppression flips
    found = with_flip_set = 0
    for seed, position in ((s, q) for s in range(4) for q in range(1, 8)):  # where suppressing the two strongest
        z, active = _state_and_bank(model, random_ids(batch=1, length=8, seed=seed), position)  # flips the token
        strongest = sorted(active, key=active.get, reverse=True)[:2]
        for mode in ("zero", "reroute"):
            iv = Interventions(suppress=set(strongest), suppress_mode=mode)
            plain = model.head(z[None, None]).logits[0, 0].double()
            used = model.head(z[None, None], iv).logits[0, 0].double()
            reference, new = int(plain.argmax()), int(used.argmax())
            if new == reference:
                continue
            found += 1
            change = explain_change(model, z, iv, new, reference)
            expected = float((used[new] - used[reference]) - (plain[new] - plain[reference]))
            assert sum(e for _, e in change.effects) == pytest.approx(expected, abs=1e-4)
            assert [e for _, e in change.effects] == sorted((e for _, e in change.effects), reverse=True)
            assert (mode == "reroute") == bool(change.replacing)  # only re-routing brings prototypes in
            def flips(subset, z=z, iv=iv, reference=reference):
                return int(model.head(z[None, None], restrict(iv, set(subset))).logits.argmax()) != reference

            leading = [p for p, e in change.effects if p not in change.replacing]
            leading = leading[:next((i for i, p in enumerate(leading) if dict(change.effects)[p] <= 0), len(leading))]
            runs = [leading[:n] for n in range(1, len(leading) + 1)]  # every leading run of positive effects
            if change.flip_set:  # the shortest such run that flips the greedy choice
                with_flip_set += 1
                assert change.flip_set == next(r for r in runs if flips(r))
            else:
                assert not any(flips(r) for r in runs)
            # the same through explain_token, given the two texts: the first difference is at this index
            ex = explain_token(model, z, new, iv, against=([5, 6, reference], [5, 6, new], 2))
            assert ex.change.kind == "direct" and ex.change.effects == change.effects
            assert explain_token(model, z, new, iv, against=([5, 6, reference], [5, 6, new], 1)).change.kind == "same"
            assert explain_token(model, z, reference, iv, against=([5, 7, 9], [5, 6, reference], 2)).change.kind == \
                "indirect"  # after the first change, a token the plain model would write as well
            longer = explain_token(model, z, new, iv, against=([5, 6], [5, 6, new], 2)).change  # the original ended
            assert longer.kind == "direct" and longer.reference == reference  # the plain model's own choice
    assert found >= 4 and with_flip_set >= 2


@torch.no_grad()
def test_probabilities_and_who_pushes_a_token_against_the_model_itself():
    from prism.explain import explain_token, pushers

    model = tiny_prism(n_prototypes=16, top_k=4)
    z, _ = _state_and_bank(model, random_ids(batch=1, length=9, seed=7), 5)
    logits = (model.lm_head.weight.double() @ z.double())
    ex = explain_token(model, z, int(logits.argmax()), n_alternatives=4)
    probs = logits.softmax(-1)
    assert ex.probabilities == pytest.approx({d.token_id: float(probs[d.token_id]) for d in ex.alternatives},
                                             abs=1e-5)
    assert list(ex.probabilities.values()) == sorted(ex.probabilities.values(), reverse=True)
    token = int(logits.argmin())
    got = pushers(model, token, top=5)
    brute = sorted(((i, float(model.prototypes.weight[i].double() @ model.lm_head.weight[token].double()))
                    for i in range(16)), key=lambda x: -x[1])[:5]
    assert [i for i, _ in got] == [i for i, _ in brute]
    assert [v for _, v in got] == pytest.approx([v for _, v in brute], abs=1e-5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pushers(model, 10**6)
