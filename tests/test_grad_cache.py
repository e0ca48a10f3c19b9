"""The projected gradient cache (prism/grad_cache.py) against autograd on the weights and an explicit inverse."""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids, tiny_prism

from prism.grad_cache import (
    GradientCache,
    TokenGradientIndex,
    shifted_loss,
    summed_gradients,
    tracked_linears,
    trained_start_layer,
)
from prism.losses import IGNORE_INDEX

START = 1  # the tiny backbone has 3 layers: layers 1 and 2 are the "trainable" top


def _batch(seed: int = 0, batch: int = 3, length: int = 10):
    model = tiny_prism(seed=seed)
    ids = random_ids(batch, length, seed=seed)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, 7:] = 0  # one padded sequence
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    states = model.states_before_layer(ids, START, attention_mask=mask)
    return model, ids, mask, labels, states


def _weight_gradient(model, ids, mask, labels, states, b: int) -> list[torch.Tensor]:
    """Sequence b's loss gradient for every tracked weight, by autograd on the weights themselves."""
    mods = [m for _, m in tracked_linears(model, START)]
    for m in mods:
        m.weight.requires_grad_(True)
        m.weight.grad = None
    z, _ = model.final_states(ids[b: b + 1], attention_mask=mask[b: b + 1], start_layer=START,
                              start_states=states[b: b + 1])
    logits = model.lm_head(z)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[b, 1:], ignore_index=IGNORE_INDEX,
                                             reduction="sum")
    grads = torch.autograd.grad(loss, [m.weight for m in mods])
    for m in mods:
        m.weight.requires_grad_(False)
    return list(grads)


def _layer_inputs_and_output_gradients(model, mods, ids, mask, labels, states) -> tuple[dict, dict]:
    """Every module's input and its output's loss gradient (B, T, .), unprojected, from hooks of the test's own."""
    seen_in, seen_out, handles = {}, {}, []

    def grab(i):
        def forward(module, args, out):
            seen_in[i] = args[0].detach()
            out.register_hook(lambda g: seen_out.__setitem__(i, g.detach()))
        return forward

    for i, m in enumerate(mods):
        handles.append(m.register_forward_hook(grab(i)))
    x = states.clone().requires_grad_(True)
    z, _ = model.final_states(ids, attention_mask=mask, start_layer=START, start_states=x)
    logits = model.lm_head(z)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                      ignore_index=IGNORE_INDEX, reduction="sum").backward()
    for h in handles:
        h.remove()
    return seen_in, seen_out


def test_projected_gradients_equal_the_projection_of_autograds_weight_gradient():
    model, ids, mask, labels, states = _batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cache = GradientCache(model, START, rank=5, seed=3)
    got = cache.gradients(ids, states, mask, labels)  # the whole batch at once, one padded
    assert got.shape == (3, cache.dim) and cache.dim == 25 * len(cache.modules)
    for b in range(3):
        full = _weight_gradient(model, ids, mask, labels, states, b)
        want = torch.cat([(cache.p_out[i] @ g @ cache.p_in[i].T).reshape(-1) for i, g in enumerate(full)])
        torch.testing.assert_close(got[b], want, rtol=1e-4, atol=1e-5)
    # the weights are unchanged and get no .grad from the cache
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(m.weight.grad is None for _, m in tracked_linears(model, START))
    # llama's 7 linear layers per decoder layer, 2 layers
    assert len(cache.modules) == 14


def test_query_gradient_is_the_gradient_of_that_tokens_loss_alone():
    model, ids, _, _, states = _batch(seed=1, batch=1, length=8)
    cache = GradientCache(model, START, rank=4)
    got = cache.query_gradient(ids, states, position=4, token=int(ids[0, 6]))
    labels = torch.full((1, 6), IGNORE_INDEX)
    labels[0, 5] = ids[0, 6]
    q_ids = torch.cat([ids[:, :5], ids[:, 6:7]], 1)
    q_states = model.states_before_layer(q_ids, START)
    full = _weight_gradient(model, q_ids, torch.ones_like(q_ids), labels, q_states, 0)
    want = torch.cat([(cache.p_out[i] @ g @ cache.p_in[i].T).reshape(-1) for i, g in enumerate(full)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="position"):
        cache.query_gradient(ids, states, position=8, token=1)


def test_ekfac_preconditioner_equals_an_explicit_damped_inverse_in_the_kronecker_eigenbasis():
    model, ids, mask, labels, states = _batch(seed=2, batch=4, length=9)
    cache = GradientCache(model, START, rank=3, seed=1)
    stats: dict = {}
    grads = torch.cat([cache.gradients(ids[i: i + 2], states[i: i + 2], mask[i: i + 2], labels[i: i + 2], stats)
                       for i in (0, 2)])
    cache.fit(grads, stats, precondition="ekfac", damping_factor=0.1)
    query = torch.randn(cache.dim, generator=torch.Generator().manual_seed(0))
    want = torch.zeros(len(grads), dtype=torch.float64)
    xs, ds = cache._run(ids, states, mask, labels)  # the per-position statistics again, by hand
    for i in range(len(cache.modules)):
        sl = slice(i * cache.block, (i + 1) * cache.block)
        x, d = xs[i].reshape(-1, 3).double(), ds[i].reshape(-1, 3).double()
        n = float(mask.sum())
        a, s = x.T @ (x * mask.reshape(-1, 1)) / n, d.T @ d / n
        _, q_a = torch.linalg.eigh(a)
        _, q_s = torch.linalg.eigh(s)
        basis = torch.kron(q_s, q_a)  # row-major vec(Q_S^T G Q_A) = basis^T vec(G)
        g = grads[:, sl].double()
        fisher = g.T @ g / len(g)
        eigen = torch.diagonal(basis.T @ fisher @ basis)
        lam = 0.1 * eigen.mean()
        h = basis @ torch.diag(eigen) @ basis.T + lam * torch.eye(cache.block, dtype=torch.float64)
        want += torch.linalg.solve(h, g.T).T @ query[sl].double()
    torch.testing.assert_close(cache.scores(query).double(), want, rtol=2e-3, atol=1e-6)


def test_identity_scores_are_plain_dot_products_and_bad_input_is_refused():
    model, ids, mask, labels, states = _batch(seed=3)
    cache = GradientCache(model, START, rank=2)
    grads = cache.gradients(ids, states, mask, labels)
    with pytest.raises(RuntimeError, match="fit"):
        cache.scores(grads[0])
    with pytest.raises(ValueError, match="statistics"):
        cache.fit(grads, None, precondition="ekfac")
    with pytest.raises(ValueError, match="precondition"):
        cache.fit(grads, None, precondition="newton")
    with pytest.raises(ValueError, match=r"\(N, "):
        cache.fit(grads[:, :5], None, precondition="identity")
    cache.fit(grads, None, precondition="identity")
    torch.testing.assert_close(cache.scores(grads[0]), grads @ grads[0])
    with pytest.raises(ValueError, match="rank"):
        GradientCache(model, START, rank=0)
    with pytest.raises(ValueError, match="start_layer"):
        GradientCache(model, 7)


def test_whitened_projections_project_kfac_whitened_weight_gradients():
    """After whiten(), the cache's gradient is P_out (S + s)^-1/2 G (A + a)^-1/2 P_in^T, with A and S the inputs' and
    output gradients' second moments over every real position, computed here from hooks of our own."""
    model, ids, mask, labels, states = _batch(seed=4)
    cache = GradientCache(model, START, rank=4, seed=2)
    p_in, p_out = [p.clone() for p in cache.p_in], [p.clone() for p in cache.p_out]
    cov: dict = {}
    cache.covariances(ids[:2], states[:2], mask[:2], labels[:2], cov)
    cache.covariances(ids[2:], states[2:], mask[2:], labels[2:], cov)
    cache.whiten(cov, damping_factor=0.5)
    got = cache.gradients(ids, states, mask, labels)
    # the factors by hand: inputs and output gradients of every tracked module, padded positions left out
    mods = [m for _, m in tracked_linears(model, START)]
    seen_in, seen_out = _layer_inputs_and_output_gradients(model, mods, ids, mask, labels, states)
    real = mask.reshape(-1).bool()

    def inv_sqrt(m: torch.Tensor) -> torch.Tensor:
        values, vectors = torch.linalg.eigh(m.double())
        values = values.clamp_min(0)
        return (vectors @ torch.diag((values + 0.5 * values.mean()) ** -0.5) @ vectors.T).float()

    for b in range(3):
        full = _weight_gradient(model, ids, mask, labels, states, b)
        want = []
        for i, g in enumerate(full):
            xi = seen_in[i].reshape(-1, seen_in[i].shape[-1])[real]
            di = seen_out[i].reshape(-1, seen_out[i].shape[-1])[real]
            a, s = xi.T @ xi / real.sum(), di.T @ di / real.sum()
            want.append((p_out[i] @ inv_sqrt(s) @ g @ inv_sqrt(a) @ p_in[i].T).reshape(-1))
        torch.testing.assert_close(got[b], torch.cat(want), rtol=2e-3, atol=1e-5)


def test_token_index_scores_the_positions_that_predicted_the_token_and_they_add_up_to_the_whole_gradient():
    model, ids, mask, labels, states = _batch(seed=5, batch=4, length=12)
    ids[:, 3] = 7  # token 7 predicted at position 2 of every sequence (and wherever the draw put it)
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    states = model.states_before_layer(ids, START, attention_mask=mask)
    cache = GradientCache(model, START, rank=3, seed=4)
    grads, parts = [], []
    for lo in (0, 2):  # two batches: sequence numbers offset as a caller does
        g, f = cache.gradients_and_positions(ids[lo: lo + 2], states[lo: lo + 2], mask[lo: lo + 2],
                                             labels[lo: lo + 2])
        f.sequence = f.sequence + lo
        grads.append(g)
        parts.append(f)
    grads = torch.cat(grads)
    torch.testing.assert_close(grads, cache.gradients(ids, states, mask, labels))
    index = TokenGradientIndex(parts, n_sequences=4)
    query = torch.randn(cache.dim, generator=torch.Generator().manual_seed(1))
    # by hand, from hooks of our own: per sequence, the projected sum of d_t x_t^T over positions t predicting 7
    mods = [m for _, m in tracked_linears(model, START)]
    seen_in, seen_out = _layer_inputs_and_output_gradients(model, mods, ids, mask, labels, states)
    predicts = torch.zeros_like(ids, dtype=torch.bool)
    predicts[:, :-1] = (labels[:, 1:] == 7)
    want = torch.zeros(4)
    total = torch.zeros(4)
    for b in range(4):
        for i in range(len(mods)):
            block = query[i * cache.block: (i + 1) * cache.block].reshape(3, 3)
            t = predicts[b].nonzero(as_tuple=True)[0]
            g = seen_out[i][b, t].T @ seen_in[i][b, t]  # (d_out, d_in) over the chosen positions only
            want[b] += (block * (cache.p_out[i] @ g @ cache.p_in[i].T)).sum()
    torch.testing.assert_close(index.scores(query, 7), want, rtol=2e-2, atol=2e-3)  # float16 storage
    assert predicts.sum() >= 4
    # every token's scores together give the whole gradient's product
    for token in set(labels[:, 1:][labels[:, 1:] != IGNORE_INDEX].tolist()):
        total += index.scores(query, token)
    torch.testing.assert_close(total, grads @ query, rtol=2e-2, atol=2e-3)
    absent = next(t for t in range(97) if not (labels[:, 1:] == t).any())  # a token no position predicts
    assert torch.equal(index.scores(query, absent), torch.zeros(4))
    with pytest.raises(ValueError, match="query must hold"):
        index.scores(query[:5], 7)
    with pytest.raises(ValueError, match="n_sequences"):
        TokenGradientIndex(parts, n_sequences=3)


def test_position_factors_from_the_output_gradient_equal_the_losss_and_the_state_round_trips():
    """position_factors (backward from a given gradient at the final states, the attribution job's way) against
    gradients_and_positions (backward from the loss through lm_head); summed_gradients of those factors against
    gradients(); a fitted preconditioner saved with state() and loaded into a fresh cache applies the same; a
    sorted index built from arrays equals the one built from parts; bad input refused."""
    model, ids, mask, labels, states = _batch(seed=6, batch=3, length=11)
    cache = GradientCache(model, START, rank=3, seed=2)
    stats: dict = {}
    grads, f = cache.gradients_and_positions(ids, states, mask, labels, stats)
    with torch.enable_grad():  # the loss's gradient at the final states, by autograd
        z, _ = model.final_states(ids, attention_mask=mask, start_layer=START, start_states=states)
        z = z.detach().requires_grad_(True)
        shifted_loss(model.lm_head(z), labels).backward()
    x, d = cache.position_factors(ids, states, mask, z.grad, f.sequence, f.position)
    torch.testing.assert_close(x, f.x)
    torch.testing.assert_close(d, f.d, rtol=1e-4, atol=1e-6 * float(f.d.abs().max()))
    mine: dict = {}
    torch.testing.assert_close(summed_gradients(f.sequence, f.x, f.d, 3, mine), grads, rtol=1e-4, atol=1e-6)
    for key in ("a", "s"):  # the positions with a target (the last one's output gradient is zero: S the same)
        assert len(mine[key]) == len(cache.modules)
    torch.testing.assert_close(mine["s"][0], stats["s"][0], rtol=1e-4, atol=1e-8)
    cache.fit(grads, stats)
    fresh = GradientCache(model, START, rank=3, seed=99)  # other projections until the state is loaded
    fresh.load_state(cache.state())
    query = torch.randn(cache.dim, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(fresh.apply(query[None]), cache.apply(query[None]))
    torch.testing.assert_close(fresh.query_gradient(ids[:1], states[:1], 5, 11),
                               cache.query_gradient(ids[:1], states[:1], 5, 11))
    with pytest.raises(ValueError, match="rank 4"):
        GradientCache(model, START, rank=4).load_state(cache.state())
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state({k: v for k, v in cache.state().items() if k != "q_a.0"})
    with pytest.raises(RuntimeError, match="fit"):
        GradientCache(model, START, rank=3).state()
    built = TokenGradientIndex([f], n_sequences=3)
    sorted_ = TokenGradientIndex.from_sorted(built.token, built.sequence, built.x, built.d, 3, built.position)
    for token in set(f.token.tolist()):
        torch.testing.assert_close(sorted_.scores(query, token), built.scores(query, token))
    with pytest.raises(ValueError, match="sorted"):
        TokenGradientIndex.from_sorted(built.token.flip(0), built.sequence, built.x, built.d, 3)
    with pytest.raises(ValueError, match="x and d"):
        TokenGradientIndex.from_sorted(built.token, built.sequence, built.x, built.d[:-1], 3)
    assert trained_start_layer(model) == model.n_layers - 2  # no training record: the top two layers
    model.config.metadata = {"mode": "top", "n_layers": 1}
    assert trained_start_layer(model) == model.n_layers - 1
