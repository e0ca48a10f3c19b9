"""Suppression by re-routing (Interventions(suppress_mode="reroute")) against an independent float64 recomputation:
similarities with the set masked, top-k, reconstruction from the position's own residual, logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import random_ids, tiny_prism

from prism import Interventions
from prism.controllers import PrototypeController

KINDS = ["llama", "gpt2"]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def brute_force_reroute(model, z: torch.Tensor, suppress: set[int], scale: dict[int, float] | None = None):
    """Logits (B, T, V) and the re-routed (ids, acts) recomputed from the weights alone in float64 numpy."""
    P, W = _np(model.prototypes.weight), _np(model.lm_head.weight)  # (K, d), (V, d)
    b = _np(model.lm_head.bias) if model.lm_head.bias is not None else 0.0
    zz = _np(z)  # (B, T, d)
    k = model.config.top_k
    cos = (zz / np.linalg.norm(zz, axis=-1, keepdims=True)) @ (P / np.linalg.norm(P, axis=-1, keepdims=True)).T
    own = np.argsort(-cos, axis=-1)[..., :k]
    own_acts = np.maximum(np.take_along_axis(cos, own, -1), 0)
    residual = zz - np.einsum("btk,btkd->btd", own_acts, P[own])
    allowed = [i for i in range(P.shape[0]) if i not in suppress]
    masked = cos[..., allowed]
    pick = np.argsort(-masked, axis=-1)[..., :k]
    ids = np.asarray(allowed)[pick]  # (B, T, k)
    acts = np.maximum(np.take_along_axis(masked, pick, -1), 0)
    for i, f in (scale or {}).items():
        acts = np.where(ids == i, acts * f, acts)
    z_new = residual + np.einsum("btk,btkd->btd", acts, P[ids])
    return z_new @ W.T + b, ids, acts


def _suppressed_set(out, n: int = 3) -> set[int]:
    """The n prototypes most often active in out: suppressing them changes many positions."""
    counts = np.bincount(out.prototype_ids.flatten().numpy())
    return {int(i) for i in np.argsort(-counts)[:n]}


@pytest.mark.parametrize("kind", KINDS)
def test_reroute_equals_brute_force_recomputation(kind):
    model = tiny_prism(kind)
    ids = random_ids()
    plain = model(ids)
    suppress = _suppressed_set(plain)
    out = model(ids, interventions=Interventions(suppress=suppress, suppress_mode="reroute"))
    expected, ref_ids, ref_acts = brute_force_reroute(model, plain.z, suppress)
    np.testing.assert_allclose(_np(out.logits), expected, rtol=1e-4, atol=1e-4)
    used = out.used_prototype_ids.numpy()
    assert not np.isin(used, list(suppress)).any()
    np.testing.assert_array_equal(np.sort(used, -1), np.sort(ref_ids, -1))
    np.testing.assert_allclose(np.sort(_np(out.used_activations), -1), np.sort(ref_acts, -1), atol=1e-5)
    # It is a different intervention from zeroing: the replacements add their slices back.
    zeroed = model(ids, interventions=Interventions(suppress=suppress))
    assert not np.allclose(_np(zeroed.logits), _np(out.logits), atol=1e-3)


def test_reroute_composes_with_scale_on_the_rerouted_selection():
    model = tiny_prism("llama")
    ids = random_ids(batch=1)
    plain = model(ids)
    suppress = _suppressed_set(plain, 2)
    iv = Interventions(suppress=suppress, suppress_mode="reroute")
    replacement = int(model(ids, interventions=iv).used_prototype_ids[0, 0, -1])  # one that re-routing brought in
    scale = {replacement: 2.5}
    out = model(ids, interventions=Interventions(suppress=suppress, scale=scale, suppress_mode="reroute"))
    expected, _, _ = brute_force_reroute(model, plain.z, suppress, scale)
    np.testing.assert_allclose(_np(out.logits), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_reroute_of_an_empty_set_equals_no_intervention(kind):
    model = tiny_prism(kind)
    ids = random_ids()
    plain = model(ids)
    torch.testing.assert_close(model(ids, interventions=Interventions(suppress_mode="reroute")).logits, plain.logits)
    # and with a scale alone, reroute and zero are the same intervention
    scale = {int(plain.prototype_ids[0, 2, 0]): 1.7}
    torch.testing.assert_close(model(ids, interventions=Interventions(scale=scale, suppress_mode="reroute")).logits,
                               model(ids, interventions=Interventions(scale=scale)).logits)


@pytest.mark.parametrize("mode", ["zero", "reroute"])
@pytest.mark.parametrize("kind", KINDS)
def test_decomposition_sums_to_the_logit_used_and_names_the_replacements(kind, mode):
    model = tiny_prism(kind)
    ids = random_ids(batch=1)
    with torch.no_grad():
        plain = model(ids)
    own = plain.prototype_ids[0, -1].tolist()
    suppress = set(own[:2])
    iv = Interventions(suppress=suppress, suppress_mode=mode)
    with torch.no_grad():
        out = model(ids, interventions=iv)
    for token in (None, int(plain.logits[0, -1].argmax()), 7):
        d = model.decompose(ids, position=-1, token_id=token, interventions=iv)
        assert d.residual + sum(d.contributions) == pytest.approx(d.logit, rel=1e-4, abs=1e-5)
        assert d.logit == pytest.approx(float(out.logits[0, -1, d.token_id]), rel=1e-5, abs=1e-5)
        assert not suppress & set(d.prototype_ids)
        assert set(d.removed_ids) == suppress & {i for i, a in zip(own, plain.activations[0, -1].tolist()) if a > 0}
        # The residual slice is the position's own residual in both modes.
        W = model.lm_head.weight.detach()
        own_residual = float(W[d.token_id] @ plain.residual[0, -1]) + float(
            model.lm_head.bias.detach()[d.token_id] if model.lm_head.bias is not None else 0.0)
        assert d.residual == pytest.approx(own_residual, rel=1e-4, abs=1e-5)
        if mode == "zero":
            assert d.rerouted_ids == [] and set(d.prototype_ids) <= set(own)
        else:
            assert d.rerouted_ids and set(d.rerouted_ids) == set(d.prototype_ids) - set(own)
            assert len(d.prototype_ids) <= model.config.top_k


@pytest.mark.parametrize("kind", KINDS)
def test_stream_reports_the_rerouted_prototypes_it_used(kind):
    # (cached generation equals recomputing without a cache in both modes: tests/test_model.py)
    model = tiny_prism(kind)
    ids = random_ids(batch=1, length=6, seed=7)
    plain = model(ids)
    iv = Interventions(suppress=_suppressed_set(plain, 3), suppress_mode="reroute")
    steps = list(model.stream(ids, max_new_tokens=3, interventions=iv))
    seq = model.generate(ids, max_new_tokens=3, interventions=iv)
    for n, step in enumerate(steps):  # each step's used prototypes are those of a full forward at that position
        full = model(seq[:, : ids.shape[1] + n], interventions=iv)
        torch.testing.assert_close(step.used_prototype_ids, full.used_prototype_ids[:, -1])
        torch.testing.assert_close(step.used_activations, full.used_activations[:, -1], rtol=1e-4, atol=1e-5)
        assert not np.isin(step.used_prototype_ids.numpy(), list(iv.suppress)).any()


def test_reroute_leaves_no_state_between_calls():
    model = tiny_prism("llama")
    ids = random_ids(batch=1, length=6, seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    original = model.generate(ids, max_new_tokens=10)
    plain = model(ids)
    iv = Interventions(suppress=_suppressed_set(plain, 6), suppress_mode="reroute")
    model.generate(ids, max_new_tokens=10, interventions=iv)
    changed = model(ids, interventions=iv)
    assert not torch.allclose(changed.logits, plain.logits), "re-routing the busiest prototypes changes the logits"
    torch.testing.assert_close(model.generate(ids, max_new_tokens=10), original)
    torch.testing.assert_close(model(ids).logits, plain.logits)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_reroute_with_a_controller_reweights_the_rerouted_selection():
    model = tiny_prism("gpt2")
    ids = random_ids(batch=1)
    plain = model(ids)
    suppress = _suppressed_set(plain, 2)
    gains = torch.linspace(0.5, 2.0, model.config.n_prototypes)
    controller = PrototypeController(gains.log())
    out = model(ids, interventions=Interventions(suppress=suppress, controller=controller, suppress_mode="reroute"))
    rerouted = model(ids, interventions=Interventions(suppress=suppress, suppress_mode="reroute"))
    expected = controller.reweight(rerouted.used_prototype_ids, rerouted.used_activations)
    torch.testing.assert_close(out.used_activations, expected)
    torch.testing.assert_close(out.used_prototype_ids, rerouted.used_prototype_ids)
    d = model.decompose(ids, position=3, interventions=Interventions(suppress=suppress, controller=controller,
                                                                      suppress_mode="reroute"))
    assert d.residual + sum(d.contributions) == pytest.approx(d.logit, rel=1e-4, abs=1e-5)


def test_suppressing_almost_the_whole_bank_leaves_fewer_active_prototypes():
    model = tiny_prism("llama", n_prototypes=16, top_k=4)
    ids = random_ids(batch=1)
    suppress = set(range(14))  # only 2 prototypes left for 4 slots
    out = model(ids, interventions=Interventions(suppress=suppress, suppress_mode="reroute"))
    assert torch.isfinite(out.logits).all()
    live = out.used_activations > 0
    assert not np.isin(out.used_prototype_ids[live].numpy(), list(suppress)).any()
    d = model.decompose(ids, position=-1, interventions=Interventions(suppress=suppress, suppress_mode="reroute"))
    assert set(d.prototype_ids) <= {14, 15}
    assert d.residual + sum(d.contributions) == pytest.approx(d.logit, rel=1e-4, abs=1e-5)


def test_unknown_suppress_mode_is_refused():
    with pytest.raises(ValueError, match="suppress_mode must be one of 'zero', 'reroute'"):
        Interventions(suppress={1}, suppress_mode="drop")
    model = tiny_prism("llama")
    with pytest.raises(ValueError, match="unknown prototype"):
        model(random_ids(batch=1), interventions=Interventions(suppress={99}, suppress_mode="reroute"))
