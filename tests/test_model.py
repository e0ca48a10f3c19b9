"""The model's math against independent computations, on tiny random Llama and GPT-2 backbones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import BACKBONES, random_ids, tiny_backbone_dir, tiny_prism

from prism import Interventions, PrismConfig, PrismForCausalLM
from prism.backbones import load_backbone

KINDS = ["llama", "gpt2"]


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _reference_head(model: PrismForCausalLM, z: torch.Tensor):
    """Activations and logit pieces recomputed in float64 numpy from the weights alone."""
    P = _np(model.prototypes.weight)  # (K, d)
    W = _np(model.lm_head.weight)  # (V, d)
    zz = _np(z)  # (B, T, d)
    cos = (zz / np.linalg.norm(zz, axis=-1, keepdims=True)) @ (P / np.linalg.norm(P, axis=-1, keepdims=True)).T
    return P, W, cos


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_backbone_and_activations_match_reference(kind):
    model = tiny_prism(kind)
    ids = random_ids()
    out = model(ids)
    torch.testing.assert_close(out.logits, model.backbone(ids).logits, rtol=1e-5, atol=1e-5)
    P, W, cos = _reference_head(model, out.z)
    k = model.config.top_k
    ref_ids = np.argsort(-cos, axis=-1)[..., :k]
    ref_acts = np.maximum(np.take_along_axis(cos, ref_ids, -1), 0)
    assert out.prototype_ids.shape == (*ids.shape, k) and out.prototype_ids.dtype == torch.long
    np.testing.assert_array_equal(out.prototype_ids.numpy(), ref_ids)
    np.testing.assert_allclose(_np(out.activations), ref_acts, rtol=1e-5, atol=1e-6)
    assert (out.activations >= 0).all()
    z_hat = np.einsum("btk,btkd->btd", ref_acts, P[ref_ids])
    np.testing.assert_allclose(_np(out.residual), _np(out.z) - z_hat, rtol=1e-4, atol=1e-5)


def test_k_equals_K_reconstructs_with_every_positive_prototype():
    model = tiny_prism("llama", n_prototypes=8, top_k=8)
    out = model(random_ids())
    P, _, cos = _reference_head(model, out.z)
    z_hat = np.maximum(cos, 0) @ P  # dense: every prototype, ReLU(cos)
    np.testing.assert_allclose(_np(out.z_hat), z_hat, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_decomposition_sums_to_the_real_logit(kind):
    model = tiny_prism(kind)
    ids = random_ids(batch=1, length=10, seed=3)
    real = model.backbone(ids).logits[0].detach()  # (T, V), computed without PRISM
    for position in (0, 4, -1):
        d = model.decompose(ids, position=position)
        assert d.token_id == int(real[position].argmax())
        assert d.logit == pytest.approx(float(real[position, d.token_id]), rel=1e-5, abs=1e-6)
        total = d.residual + sum(d.contributions)
        assert total == pytest.approx(d.logit, rel=1e-4, abs=1e-5)
        for token in (0, 17, 96):
            e = model.decompose(ids, position=position, token_id=token)
            assert e.residual + sum(e.contributions) == pytest.approx(float(real[position, token]), rel=1e-4,
                                                                      abs=1e-5)


def test_contributions_are_activation_times_logit_signature():
    model = tiny_prism("llama")
    ids = random_ids(batch=1)
    out = model(ids)
    d = model.decompose(ids, position=5, token_id=11)
    W, P = _np(model.lm_head.weight), _np(model.prototypes.weight)
    acts = dict(zip(out.prototype_ids[0, 5].tolist(), _np(out.activations[0, 5]), strict=True))
    for i, c in zip(d.prototype_ids, d.contributions, strict=True):
        assert c == pytest.approx(acts[i] * (W[11] @ P[i]), rel=1e-5, abs=1e-6)
    assert d.residual == pytest.approx(W[11] @ _np(out.residual[0, 5]), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_suppression_equals_subtracting_slices(kind):
    model = tiny_prism(kind)
    ids = random_ids()
    out = model(ids)
    suppress = set(out.prototype_ids[0, 3].tolist()[:2]) | {int(out.prototype_ids[1, 7, 0])}
    supp = model(ids, interventions=Interventions(suppress=suppress))
    P, W = _np(model.prototypes.weight), _np(model.lm_head.weight)
    expected = _np(out.logits).copy()
    pid, act = out.prototype_ids.numpy(), _np(out.activations)
    for b, t, j in np.ndindex(*pid.shape):
        if pid[b, t, j] in suppress:
            expected[b, t] -= act[b, t, j] * (W @ P[pid[b, t, j]])
    np.testing.assert_allclose(_np(supp.logits), expected, rtol=1e-4, atol=1e-4)
    assert not np.allclose(_np(supp.logits), _np(out.logits))


def test_scale_and_inject_change_logits_by_their_slices():
    model = tiny_prism("llama")
    ids = random_ids(batch=1)
    out = model(ids)
    P, W = _np(model.prototypes.weight), _np(model.lm_head.weight)
    pid, act = out.prototype_ids.numpy(), _np(out.activations)
    target = int(pid[0, 2, 0])
    scaled = model(ids, interventions=Interventions(scale={target: 3.0}))
    expected = _np(out.logits).copy()
    for b, t, j in np.ndindex(*pid.shape):
        if pid[b, t, j] == target:
            expected[b, t] += 2.0 * act[b, t, j] * (W @ P[target])
    np.testing.assert_allclose(_np(scaled.logits), expected, rtol=1e-4, atol=1e-4)

    injected = model(ids, interventions=Interventions(inject={target: 0.5}))
    expected = _np(out.logits).copy()
    for b, t in np.ndindex(*pid.shape[:2]):
        current = sum(act[b, t, j] for j in range(pid.shape[2]) if pid[b, t, j] == target)
        expected[b, t] += (0.5 - current) * (W @ P[target])
    np.testing.assert_allclose(_np(injected.logits), expected, rtol=1e-4, atol=1e-4)
    d = model.decompose(ids, position=4, interventions=Interventions(inject={target: 0.5}))
    assert target in d.prototype_ids
    assert d.activations[d.prototype_ids.index(target)] == pytest.approx(0.5)
    assert d.residual + sum(d.contributions) == pytest.approx(d.logit, rel=1e-4, abs=1e-5)


def test_decomposition_under_suppression_drops_the_prototype_and_still_sums():
    model = tiny_prism("gpt2")
    ids = random_ids(batch=1)
    plain = model.decompose(ids, position=-1)
    gone = plain.prototype_ids[0]
    d = model.decompose(ids, position=-1, token_id=plain.token_id, interventions=Interventions(suppress={gone}))
    assert gone not in d.prototype_ids
    assert d.logit == pytest.approx(plain.logit - plain.contributions[0], rel=1e-4, abs=1e-5)
    assert d.residual + sum(d.contributions) == pytest.approx(d.logit, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_the_backbone(kind):
    model = tiny_prism(kind)
    ids = random_ids(batch=1, length=6, seed=5)
    ours = model.generate(ids, max_new_tokens=12)
    theirs = model.backbone.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("mode", ["zero", "reroute"])
@pytest.mark.parametrize("kind", KINDS)
def test_cached_generation_with_interventions_equals_recomputing_without_cache(kind, mode):
    model = tiny_prism(kind)
    ids = random_ids(batch=1, length=6, seed=7)
    iv = Interventions(suppress={0, 1, 2}, scale={3: 2.5}, inject={4: 0.8}, suppress_mode=mode)
    generated = model.generate(ids, max_new_tokens=10, interventions=iv)
    seq = ids
    with torch.no_grad():
        for _ in range(10):  # no KV cache: the whole sequence each step
            nxt = model(seq, interventions=iv).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    torch.testing.assert_close(generated, seq)


def test_interventions_leave_no_state_behind():
    model = tiny_prism("llama")
    ids = random_ids(batch=1, length=6, seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    original = model.generate(ids, max_new_tokens=10)
    strong = Interventions(inject={5: 50.0})
    changed = model.generate(ids, max_new_tokens=10, interventions=strong)
    assert not torch.equal(original, changed), "a strong injection should change the continuation"
    torch.testing.assert_close(model.generate(ids, max_new_tokens=10), original)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_sampling_is_seeded_per_call():
    model = tiny_prism("llama")
    ids = random_ids(batch=1, length=4)
    kwargs = dict(max_new_tokens=15, do_sample=True, temperature=1.5, top_p=0.9)
    a = model.generate(ids, seed=1, **kwargs)
    torch.manual_seed(123)  # the global RNG must not matter
    assert torch.equal(a, model.generate(ids, seed=1, **kwargs))
    assert not torch.equal(a, model.generate(ids, seed=2, **kwargs))


def test_left_padded_batch_generates_like_single_sequences():
    model = tiny_prism("llama")
    short, long = random_ids(1, 4, seed=8), random_ids(1, 7, seed=9)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    out = model.generate(batch, max_new_tokens=6, attention_mask=mask)
    torch.testing.assert_close(out[0, 3:], model.generate(short, max_new_tokens=6)[0])
    torch.testing.assert_close(out[1], model.generate(long, max_new_tokens=6)[0])


def test_stream_yields_prototypes_of_each_generated_token():
    model = tiny_prism("gpt2")
    ids = random_ids(batch=1, length=5)
    steps = list(model.stream(ids, max_new_tokens=4))
    seq = model.generate(ids, max_new_tokens=4)
    assert [int(s.token_ids[0]) for s in steps] == seq[0, 5:].tolist()
    out = model(seq[:, :-1])
    for s in steps:  # the state at the position that produced the token, recomputed without cache
        pos = 4 + s.step
        np.testing.assert_array_equal(s.prototype_ids[0].numpy(), out.prototype_ids[0, pos].numpy())


@pytest.mark.parametrize("kind", KINDS)
def test_stream_keeps_the_states_entering_a_layer_as_a_full_pass_computes_them(kind):
    """stream(keep_states_before=L): the steps' layer_states, one after the other, are states_before_layer's for
    the prompt and every generated token but the last, with or without interventions (they act above every
    decoder layer); without the argument nothing is kept, and a layer outside the model is refused."""
    model = tiny_prism(kind)
    ids = random_ids(batch=1, length=5)
    for interventions in (None, Interventions(suppress=[0, 1, 2])):
        steps = list(model.stream(ids, max_new_tokens=4, interventions=interventions, keep_states_before=1))
        assert steps[0].layer_states.shape == (1, 5, model.d_model)
        assert all(s.layer_states.shape == (1, 1, model.d_model) for s in steps[1:])
        text = torch.cat([ids, torch.stack([s.token_ids for s in steps[:-1]], 1)], 1)  # prompt + tokens[:-1]
        torch.testing.assert_close(torch.cat([s.layer_states for s in steps], 1), model.states_before_layer(text, 1),
                                   rtol=1e-5, atol=1e-5)
    assert all(s.layer_states is None for s in model.stream(ids, max_new_tokens=2))
    with pytest.raises(ValueError, match="keep_states_before"):
        next(model.stream(ids, max_new_tokens=2, keep_states_before=model.n_layers))


def test_eos_stops_generation():
    model = tiny_prism("llama")
    ids = random_ids(batch=1, length=5)
    free = model.generate(ids, max_new_tokens=8)
    eos = int(free[0, 7])  # the third generated token
    stopped = model.generate(ids, max_new_tokens=8, eos_token_id=eos)
    assert stopped.shape[1] <= 8 and int(stopped[0, -1]) == eos


@pytest.mark.parametrize("kind", KINDS)
def test_top_layer_view_from_cached_states_equals_full_forward(kind):
    model = tiny_prism(kind)
    ids = random_ids()
    full = model(ids).z
    for layer in range(model.n_layers):
        states = model.states_before_layer(ids, layer)
        z, _ = model.final_states(ids, start_layer=layer, start_states=states)
        torch.testing.assert_close(z, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(ids).z, full)  # the real backbone is untouched by the views


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_roundtrip(kind, tmp_path):
    model = tiny_prism(kind)
    ids = random_ids()
    model.save_pretrained(tmp_path / "m")
    loaded = PrismForCausalLM.from_pretrained(tmp_path / "m").eval()
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    torch.testing.assert_close(loaded.prototypes.weight, model.prototypes.weight)
    assert loaded.config.prism_dict() == model.config.prism_dict()
    assert type(loaded.backbone) is type(model.backbone)
    assert loaded.backbone.config.num_hidden_layers == model.backbone.config.num_hidden_layers


def test_trainable_only_checkpoint_checks_its_backbone(tmp_path):
    folder = tiny_backbone_dir(tmp_path / "bb", "llama")
    model = PrismForCausalLM.from_backbone(load_backbone(str(folder)),
                                           PrismConfig(n_prototypes=8, top_k=2, backbone=str(folder)))
    model.requires_grad_(False)
    model.prototypes.requires_grad_(True)
    with torch.no_grad():
        model.prototypes.weight.normal_()
    model.save_pretrained(tmp_path / "ckpt", trainable_only=True)
    loaded = PrismForCausalLM.from_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, model.vocab_size, (1, 9))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    torch.testing.assert_close(loaded.prototypes.weight, model.prototypes.weight)
    other = BACKBONES["llama"](seed=4)
    other.resize_token_embeddings(model.vocab_size)
    with pytest.raises(ValueError, match="fingerprint"):
        PrismForCausalLM.from_pretrained(tmp_path / "ckpt", backbone=other)


def test_corrupt_or_missing_checkpoint_gives_clear_errors(tmp_path):
    model = tiny_prism("llama")
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="not a PRISM checkpoint"):
        PrismForCausalLM.from_pretrained(tmp_path / "nothing")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt"):
        PrismForCausalLM.from_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid PRISM config"):
        PrismForCausalLM.from_pretrained(tmp_path / "m")


def test_bad_config_and_inputs_are_refused():
    with pytest.raises(ValueError, match="cannot exceed"):
        PrismConfig(n_prototypes=4, top_k=8)
    with pytest.raises(ValueError, match="non-negative"):
        PrismConfig(lambda_rec=-1.0)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        PrismForCausalLM.from_backbone(torch.nn.Linear(2, 2), PrismConfig(n_prototypes=4, top_k=2))
    model = tiny_prism("llama")
    ids = random_ids()
    for bad in (ids[None], ids.float(), ids + 1000, ids[:, :0]):
        with pytest.raises(ValueError):
            model(bad)
    with pytest.raises(ValueError, match="labels shape"):
        model(ids, labels=ids[:, :3])
    with pytest.raises(ValueError, match="outside"):
        model.decompose(ids[:1], position=50)
    with pytest.raises(ValueError, match="vocabulary"):
        model.decompose(ids[:1], token_id=10_000)


def test_bad_interventions_are_refused_and_change_nothing():
    model = tiny_prism("llama")
    ids = random_ids(batch=1)
    before = model(ids).logits
    with pytest.raises(ValueError, match="unknown prototype"):
        model(ids, interventions=Interventions(suppress={99}))
    with pytest.raises(ValueError, match=">= 0"):
        Interventions(scale={1: -2.0})
    with pytest.raises(ValueError, match="more than one"):
        Interventions(suppress={1}, inject={1: 1.0})
    with pytest.raises(ValueError, match="unknown prototype"):
        model.generate(ids, interventions=Interventions(inject={-1: 1.0}))
    torch.testing.assert_close(model(ids).logits, before)


def test_loss_terms_are_returned_with_labels():
    model = tiny_prism("gpt2")
    ids = random_ids()
    out = model(ids, labels=ids)
    assert set(out.losses) == {"ce", "rec", "r1", "r2"}
    cfg = model.config
    expected = out.losses["ce"] + cfg.lambda_rec * out.losses["rec"] + cfg.lambda_r1 * out.losses["r1"] \
        + cfg.lambda_r2 * out.losses["r2"]
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    assert model.prototypes.weight.grad is not None and model.prototypes.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", sorted(BACKBONES))
def test_the_training_loss_and_its_gradients_equal_the_differentiable_similarities_path(kind):
    """model(ids, labels) routes without a gradient through the (tokens, K) similarities (_Routing, coverage_losses);
    the same loss through the path that keeps it (taken when interventions are given: a scale of 1 changes nothing)
    gives the same loss, terms and gradients for every trained parameter, padding left out of both."""
    model = tiny_prism(kind, n_prototypes=16, top_k=4)
    ids = random_ids(2, 12, seed=3)
    attention = torch.ones_like(ids)
    attention[1, 8:] = 0  # right padding: left out of every term
    results = []
    for interventions in (None, Interventions(scale={0: 1.0})):
        model.zero_grad()
        out = model(ids, attention_mask=attention, labels=ids, interventions=interventions)
        assert (out.top_similarity is None) == (interventions is not None)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), {k: float(v) for k, v in out.losses.items()}, grads))
    (loss, terms, grads), (ref_loss, ref_terms, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss)
    assert terms == pytest.approx(ref_terms, rel=1e-5)
    assert grads.keys() == ref_grads.keys() and "prototypes.weight" in grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_cheap_head_matches_the_plain_computation_in_value_and_gradient(monkeypatch):
    """Reconstruction (embedding_bag) and the similarities' sparse backward against the plain formulas under
    autograd: a dense (tokens, K) activation matrix times the bank, and cos(z, p) as a dense product. Both the
    sparse backward (a training-like loss: top-k, R1, R2) and its dense fallback are checked."""
    import prism.model as model_module
    from prism.losses import r1_loss, r2_loss

    model = tiny_prism("llama", n_prototypes=16, top_k=4)
    bank = model.prototypes
    for density in (1.0, 0.0):  # always the sparse path, then always the dense fallback
        monkeypatch.setattr(model_module, "SPARSE_GRAD_MAX_DENSITY", density)
        z = torch.randn(2, 40, 32, requires_grad=True)
        results = []
        for plain in (False, True):
            model.zero_grad()
            z.grad = None
            if plain:
                sims = F.normalize(z, dim=-1) @ F.normalize(bank.weight, dim=-1).T  # (B, T, K)
                values, ids = sims.topk(4, dim=-1)
                acts = values.relu()
                dense = torch.zeros(*ids.shape[:-1], 16).scatter_add(-1, ids, acts)
                z_hat = dense @ bank.weight
            else:
                sims = bank.similarities(z)
                ids, acts = bank.activate(sims, 4)
                z_hat = bank.reconstruct(ids, acts)
            loss = (z - z_hat).pow(2).sum() + r1_loss(sims) + r2_loss(sims)
            loss.backward()
            results.append((z_hat.detach(), sims.detach(), z.grad.clone(), bank.weight.grad.clone()))
        for ours, plain in zip(*results):
            torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)


def test_the_reconstruction_stays_float32_under_autocast():
    """Under bfloat16 autocast the activations are bfloat16 (the similarity product is) and z_hat is their weighted
    sum of the float32 prototypes, in float32 (not rounded to bfloat16 and widened again for L_REC)."""
    model = tiny_prism("llama", n_prototypes=16, top_k=4)
    bank = model.prototypes.weight
    z = torch.randn(2, 7, bank.shape[1], generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.head(z)
    assert out.activations.dtype == torch.bfloat16 and out.z_hat.dtype == torch.float32
    want = (out.activations.float()[..., None] * bank.detach()[out.prototype_ids]).sum(-2)  # (2, 7, d)
    torch.testing.assert_close(out.z_hat, want)
