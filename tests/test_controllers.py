"""Prototype controllers (prism/controllers.py, prism/controller_fit.py) and the controller experiment
(bench/controllers.py, bench/dense_controller.py, bench/controller_tasks.py) on tiny models:
the controlled logits against activations replaced by hand, the exact decomposition, cached generation, the fit
objective and its gradient against independent implementations, a fit that must find the prototype a synthetic
task depends on, save/load, the task builders' determinism and document split, and the command lines."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from helpers import VOCAB, random_ids, tiny_prism

from bench.controller_tasks import (
    SPLIT_PATTERN,
    assign_splits,
    build_tasks,
    find_gaps,
    sections,
    split_sentences,
)
from bench.controller_tasks import main as tasks_main
from bench.controllers import correct_items
from bench.controllers import main as controllers_main
from bench.dense_controller import DENSE, DenseController, GatheredRowsDot, load_any, make_frame
from prism import Interventions
from prism.controller_fit import (
    PROTOTYPE,
    FitArgs,
    MCItem,
    TokenizedItem,
    candidate_features,
    encode_items,
    exact_logprobs,
    fit_controller,
    fit_objective,
    option_scores,
    read_items,
    write_items,
)
from prism.controllers import PrototypeController, bank_fingerprint, load_controller, save_controller
from prism.corpora import Document
from prism.data import is_validation

KINDS = ["llama", "gpt2"]
KINDS_BY_NAME = {"prototype": PROTOTYPE, "dense": DENSE}  # the two kinds of controller the fit is written for


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread, so a busy machine's other jobs do not make every op wait for a second one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def random_controller(n_prototypes: int, seed: int = 0, moved: int | None = None) -> PrototypeController:
    g = torch.Generator().manual_seed(seed)
    log_factors = torch.randn(n_prototypes, generator=g)
    if moved is not None:
        log_factors[moved:] = 0
    return PrototypeController(log_factors, {"task": "t", "seed": seed})


# ----------------------------------------------------------------------------------------------------------------
# The controller inside the model.


@pytest.mark.parametrize("kind", KINDS)
def test_controlled_logits_equal_activations_replaced_by_hand(kind):
    model = tiny_prism(kind)
    ids = random_ids()
    controller = random_controller(model.config.n_prototypes)
    plain = model(ids)
    out = model(ids, interventions=Interventions(controller=controller))
    P, W = _np(model.prototypes.weight), _np(model.lm_head.weight)
    bias = 0 if model.lm_head.bias is None else _np(model.lm_head.bias)
    factors = np.exp(_np(controller.log_factors))
    pid, act = plain.prototype_ids.numpy(), _np(plain.activations)
    z = _np(plain.z).copy()
    for b, t in np.ndindex(*pid.shape[:2]):  # z' = r + sum_j f_j a_j p_j
        z[b, t] = _np(plain.residual)[b, t] + sum(factors[pid[b, t, j]] * act[b, t, j] * P[pid[b, t, j]]
                                                  for j in range(pid.shape[2]))
    np.testing.assert_allclose(_np(out.logits), z @ W.T + bias, rtol=1e-4, atol=1e-4)
    assert not np.allclose(_np(out.logits), _np(plain.logits))
    new_ids, new_acts = model.effective_activations(plain.prototype_ids, plain.activations,
                                                    Interventions(controller=controller))
    torch.testing.assert_close(new_ids, plain.prototype_ids)
    assert (new_acts >= 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_decomposition_with_a_controller_sums_to_the_logit(kind):
    model = tiny_prism(kind)
    ids = random_ids(batch=1, length=9, seed=4)
    controller = random_controller(model.config.n_prototypes, seed=1)
    iv = Interventions(controller=controller)
    with torch.no_grad():
        logits = model(ids, interventions=iv).logits[0]
    plain = model.decompose(ids, position=5, token_id=7)
    for token in (None, 7, 50):
        d = model.decompose(ids, position=5, token_id=token, interventions=iv)
        assert d.logit == pytest.approx(float(logits[5, d.token_id]), rel=1e-5, abs=1e-6)
        assert d.residual + sum(d.contributions) == pytest.approx(d.logit, rel=1e-4, abs=1e-5)
    d = model.decompose(ids, position=5, token_id=7, interventions=iv)
    before = dict(zip(plain.prototype_ids, plain.activations))
    for pid, act in zip(d.prototype_ids, d.activations):  # each activation multiplied by its factor, no other
        assert act == pytest.approx(before[pid] * float(controller.factors[pid]), rel=1e-5)
    assert d.residual == pytest.approx(plain.residual, rel=1e-5, abs=1e-6)  # the residual does not move


def test_controller_composes_with_suppress_and_scale():
    model = tiny_prism("llama")
    ids = random_ids(batch=1)
    controller = random_controller(model.config.n_prototypes, seed=2)
    with torch.no_grad():
        out = model(ids)
    target, gone = int(out.prototype_ids[0, 3, 0]), int(out.prototype_ids[0, 3, 1])
    iv = Interventions(controller=controller, scale={target: 2.0}, suppress={gone})
    new_ids, new_acts = model.effective_activations(out.prototype_ids[0, 3], out.activations[0, 3], iv)
    f = controller.factors
    for i, a_old, a_new in zip(out.prototype_ids[0, 3].tolist(), out.activations[0, 3], new_acts):
        expected = 0.0 if i == gone else float(a_old * f[i] * (2.0 if i == target else 1.0))
        assert float(a_new) == pytest.approx(expected, rel=1e-5, abs=1e-7)
    d = model.decompose(ids, position=3, interventions=iv)
    assert gone not in d.prototype_ids
    assert d.residual + sum(d.contributions) == pytest.approx(d.logit, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_generation_with_a_controller_equals_recomputing(kind):
    model = tiny_prism(kind)
    ids = random_ids(batch=1, length=6, seed=7)
    # strong factors so the continuation changes
    iv = Interventions(controller=PrototypeController(torch.full((model.config.n_prototypes,), 2.0)))
    generated = model.generate(ids, max_new_tokens=8, interventions=iv)
    seq = ids
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq, interventions=iv).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    torch.testing.assert_close(generated, seq)
    steps = list(model.stream(ids, max_new_tokens=3, interventions=iv))
    assert [int(s.token_ids[0]) for s in steps] == generated[0, 6:9].tolist()


def test_factor_one_is_the_plain_model_and_restricted_moves_only_its_prototypes():
    model = tiny_prism("gpt2")
    ids = random_ids()
    plain = model(ids)
    identity = PrototypeController(torch.zeros(model.config.n_prototypes))
    torch.testing.assert_close(model(ids, interventions=Interventions(controller=identity)).logits, plain.logits)
    controller = random_controller(model.config.n_prototypes, seed=3)
    keep = {1, 4, 9}
    part = controller.restricted(keep)
    assert set(part.moved()) == keep
    torch.testing.assert_close(part.log_factors[list(keep)], controller.log_factors[list(keep)])


def test_bad_controllers_are_refused():
    model = tiny_prism("llama")
    ids = random_ids(batch=1)
    with pytest.raises(ValueError, match="fitted for a model with 8 prototypes"):
        model(ids, interventions=Interventions(controller=random_controller(8)))
    with pytest.raises(ValueError, match="finite"):
        PrototypeController(torch.tensor([0.0, float("nan")]))
    with pytest.raises(TypeError, match="ActivationController"):
        Interventions(controller=object())

    class Negative:
        n_prototypes = model.config.n_prototypes

        def reweight(self, ids, acts):
            return -acts

        def restricted(self, ids):
            return self

    with pytest.raises(ValueError, match=">= 0"):
        model(ids, interventions=Interventions(controller=Negative()))


# ----------------------------------------------------------------------------------------------------------------
# Files.


@pytest.mark.parametrize("which", ["prototype", "dense"])
def test_save_and_load_roundtrip(which, tmp_path):
    model = tiny_prism("llama")
    g = random_controller(model.config.n_prototypes, seed=5, moved=6).log_factors
    meta = {"task": "cloze", "seed": 5, "bank_fingerprint": bank_fingerprint(model)}
    controller = (PrototypeController(g, meta) if which == "prototype"
                  else DenseController(make_frame(model.config.n_prototypes, model.d_model, 5), g, meta))
    path = save_controller(controller, tmp_path / "c.safetensors")
    loaded = load_any(path, model)
    assert type(loaded) is type(controller) and loaded.meta == meta
    if which == "dense":  # the library reads prototype controllers only, and says what the file is
        with pytest.raises(ValueError, match="dense baseline"):
            load_controller(path, model)
    torch.testing.assert_close(loaded.log_factors, controller.log_factors)
    z = torch.randn(5, model.d_model)
    if which == "prototype":
        ids = random_ids()
        torch.testing.assert_close(model(ids, interventions=Interventions(controller=loaded)).logits,
                                   model(ids, interventions=Interventions(controller=controller)).logits)
    else:
        torch.testing.assert_close(loaded.edit(z), controller.edit(z))


def test_loading_refuses_other_models_and_other_files(tmp_path):
    model = tiny_prism("llama")
    meta = {"bank_fingerprint": bank_fingerprint(model)}
    path = save_controller(PrototypeController(torch.zeros(16), meta), tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="another checkpoint"):
        load_controller(path, tiny_prism("llama", seed=3))
    with pytest.raises(ValueError, match="16 prototypes"):
        load_controller(path, tiny_prism("llama", n_prototypes=8))
    with pytest.raises(FileNotFoundError):
        load_controller(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors at all")
    with pytest.raises(ValueError, match="not a PRISM controller"):
        load_controller(bad)


def test_dense_baseline_frame_and_parameter_count():
    for n, d in ((64, 32), (16, 32)):
        frame = make_frame(n, d, seed=1)
        assert frame.shape == (n, d)
        torch.testing.assert_close(frame, make_frame(n, d, seed=1))
        gram = frame.T @ frame if n >= d else frame @ frame.T
        torch.testing.assert_close(gram, torch.eye(min(n, d)), atol=1e-5, rtol=0)
    frame = make_frame(64, 32, seed=2)
    z = torch.randn(3, 32)
    torch.testing.assert_close(DenseController(frame, torch.zeros(64)).edit(z), z)
    g = torch.randn(64)
    expected = frame.T @ torch.diag(g.exp()) @ frame @ z.T  # F^T diag(exp g) F z, written out
    torch.testing.assert_close(DenseController(frame, g).edit(z), expected.T, atol=1e-4, rtol=1e-4)
    assert DenseController(frame, g).n_parameters == PrototypeController(g).n_parameters == 64


# ----------------------------------------------------------------------------------------------------------------
# Encoding and scoring.


def tokenized_items(n: int, n_options: int = 3, seed: int = 0) -> list[TokenizedItem]:
    rng = random.Random(seed)
    return [TokenizedItem(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))),
                          tuple(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 4)))
                                for _ in range(n_options)), rng.randrange(n_options)) for _ in range(n)]


@pytest.mark.parametrize("kind", KINDS)
def test_encoding_with_a_shared_context_equals_full_forwards(kind):
    model = tiny_prism(kind)
    items = tokenized_items(5)
    enc = encode_items(model, items, ["fit"] * 5, batch_size=3)  # contexts of 2-6 tokens: left padding
    single = encode_items(model, items, ["fit"] * 5, batch_size=1)
    torch.testing.assert_close(enc.z, single.z, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(enc.targets, single.targets)
    controller = random_controller(model.config.n_prototypes, seed=6)
    for iv in (None, Interventions(controller=controller)):
        scores_sum = option_scores(exact_logprobs(model, enc, iv), enc, "sum")
        scores_mean = option_scores(exact_logprobs(model, enc, iv), enc, "mean")
        for n, item in enumerate(items):
            for o, opt in enumerate(item.option_ids):
                seq = torch.tensor([item.context_ids + opt])
                with torch.no_grad():
                    logp = model(seq, interventions=iv).logits[0].log_softmax(-1)  # the forward path
                c = len(item.context_ids)
                expected = sum(float(logp[c - 1 + j, t]) for j, t in enumerate(opt))
                assert float(scores_sum[n, o]) == pytest.approx(expected, rel=1e-4, abs=1e-4)
                assert float(scores_mean[n, o]) == pytest.approx(expected / len(opt), rel=1e-4, abs=1e-4)
    sub = enc.select([2, 0])
    torch.testing.assert_close(option_scores(exact_logprobs(model, sub), sub),
                               option_scores(exact_logprobs(model, enc), enc)[[2, 0]])


@pytest.mark.parametrize("which", ["prototype", "dense"])
def test_fit_logprobs_are_exact_when_the_candidates_cover_the_vocabulary(which):
    model = tiny_prism("llama")
    enc = encode_items(model, tokenized_items(6), ["fit"] * 6)
    feats = candidate_features(model, enc, n_candidates=VOCAB)  # every token is a candidate, no tail
    assert torch.isinf(feats.lse_tail).all()
    g = random_controller(model.config.n_prototypes, seed=8).log_factors
    frame = make_frame(model.config.n_prototypes, model.d_model, 0) if which == "dense" else None
    args = FitArgs(reduce="sum", temperature=1.0)
    items = torch.arange(enc.n_items)
    _, scores = fit_objective(KINDS_BY_NAME[which], g, feats, items, model, frame, args)
    if which == "prototype":
        exact = exact_logprobs(model, enc, Interventions(controller=PrototypeController(g)))
    else:
        exact = exact_logprobs(model, enc, z_edit=DenseController(frame, g).edit)
    torch.testing.assert_close(scores, option_scores(exact, enc, "sum"), rtol=1e-4, atol=1e-4)


def reference_objective(model, feats, g, which, frame, args) -> torch.Tensor:
    """The fit objective written independently in float64 from full logits: candidates' logits are picked out of
    the full edited logits, the tail is lse_tail + m_tail . dz with m_tail recomputed from the plain logits."""
    W = model.lm_head.weight.double()
    P = model.prototypes.weight.double()
    z = feats.enc.z.double()
    g = g.double()
    if which == "prototype":
        ids, acts = feats.prototype_ids, feats.activations.double()
        dz = torch.einsum("nk,nkd->nd", acts * (g.exp()[ids] - 1), P[ids])
    else:
        F = frame.double()
        dz = ((z @ F.T) * (g.exp() - 1)) @ F
    plain = z @ W.T  # (N, V)
    logits = (z + dz) @ W.T
    cand = feats.candidates
    in_tail = torch.ones_like(plain, dtype=torch.bool).scatter(1, cand, False)
    q = torch.where(in_tail, plain, torch.tensor(float("-inf"), dtype=plain.dtype)).softmax(-1)
    tail = torch.where(in_tail, plain, torch.tensor(float("-inf"), dtype=plain.dtype)).logsumexp(-1) + \
        ((q @ W) * dz).sum(-1)
    picked = logits.gather(1, cand)
    logp = picked[:, 0] - torch.logaddexp(picked.logsumexp(-1), tail)
    enc = feats.enc
    sums = torch.zeros(enc.option_length.shape[0], dtype=torch.float64).index_add(0, enc.position_option, logp)
    scores = (sums / enc.option_length.double()).view(enc.n_items, enc.n_options)
    return torch.nn.functional.cross_entropy(scores / args.temperature, enc.answers)


@pytest.mark.parametrize("which", ["prototype", "dense"])
def test_fit_objective_and_gradient_match_a_reference(which):
    model = tiny_prism("gpt2")
    model.requires_grad_(False)
    enc = encode_items(model, tokenized_items(8, n_options=4, seed=2), ["fit"] * 8)
    feats = candidate_features(model, enc, n_candidates=10)  # a real tail
    frame = make_frame(model.config.n_prototypes, model.d_model, 3) if which == "dense" else None
    args = FitArgs(temperature=0.5)
    start = 0.3 * random_controller(model.config.n_prototypes, seed=9).log_factors
    g = start.clone().requires_grad_(True)
    loss, _ = fit_objective(KINDS_BY_NAME[which], g, feats, torch.arange(enc.n_items), model, frame, args)
    loss.backward()
    g_ref = start.double().clone().requires_grad_(True)
    ref = reference_objective(model, feats, g_ref, which, frame, args)
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-4)
    torch.testing.assert_close(g.grad.double(), g_ref.grad, rtol=1e-3, atol=1e-5)
    assert g.grad.abs().sum() > 0


def test_gathered_rows_dot_gradient():
    weight = torch.randn(11, 5, dtype=torch.float64)
    idx = torch.randint(0, 11, (7, 3))
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v: GatheredRowsDot.apply(v, weight, idx), (x,))
    torch.testing.assert_close(GatheredRowsDot.apply(x, weight, idx), torch.einsum("nmd,nd->nm", weight[idx], x))


# ----------------------------------------------------------------------------------------------------------------
# Fitting finds what a task needs.


def decidable_task(model, n_contexts: int = 900, seed: int = 0):
    """Single-token options; the right one is the option that prototype j's logit signature W p_j ranks highest,
    with j active at the scored position. Raising j's factor decides the task; the plain model does not."""
    gen = torch.Generator().manual_seed(seed)
    contexts = torch.randint(0, VOCAB, (n_contexts, 5), generator=gen)
    with torch.no_grad():
        out = model(contexts)
    last = out.prototype_ids[:, -1]  # (n, k)
    j = int(torch.bincount(last.flatten(), minlength=model.config.n_prototypes).argmax())
    signature = model.lm_head.weight.detach() @ model.prototypes.weight.detach()[j]  # (V,)
    items = []
    for n in torch.nonzero((last == j).any(-1)).flatten().tolist():
        options = torch.randperm(VOCAB, generator=gen)[:4]
        answer = int(signature[options].argmax())
        items.append(TokenizedItem(tuple(contexts[n].tolist()), tuple((int(o),) for o in options), answer))
    splits = ["fit", "val", "test", "test"] * (len(items) // 4 + 1)
    return items, splits[: len(items)], j


def test_fit_finds_the_prototype_a_task_depends_on():
    model = tiny_prism("llama")
    with torch.no_grad():
        model.prototypes.weight.mul_(3.0)  # a bank strong enough that factors <= 10 can decide the task
    model.requires_grad_(False)
    items, splits, j = decidable_task(model)
    enc = encode_items(model, items, splits)
    fit, val, test = (enc.subset(s) for s in ("fit", "val", "test"))
    assert min(fit.n_items, val.n_items, test.n_items) >= 50
    feats = {s: candidate_features(model, e, n_candidates=32) for s, e in (("fit", fit), ("val", val))}
    args = FitArgs(epochs=12, lr=0.1, l1=(0.1,), temperature=0.05, reduce="sum")
    before = float(correct_items(model, test, None, "sum").double().mean())
    after = {}
    for which in ("prototype", "dense"):
        result = fit_controller(KINDS_BY_NAME[which], model, feats["fit"], feats["val"], args, seed=0, l1=0.1)
        assert result.val_accuracy >= result.val_accuracy_before  # the identity (epoch 0) is a candidate
        after[which] = float(correct_items(model, test, result.controller, "sum").double().mean())
        if which == "prototype":
            assert result.epoch > 0
            raised = [r["prototype_id"] for r in result.controller.top(3)["raised"]]
            assert j in raised and float(result.controller.factors[j]) > 2, (j, raised)
    assert after["prototype"] > before + 0.25, (before, after)
    # the baseline has as many parameters (K = 16 < d = 32: a 16-direction frame) and cannot reach p_j's edit
    assert after["prototype"] > after["dense"] + 0.1, (before, after)


# ----------------------------------------------------------------------------------------------------------------
# Tasks from documents.


NAMES = ["Tarvo", "Melisande", "Orrin", "Quillon", "Bexley", "Ysolde", "Kadmon", "Fenwick", "Liora", "Pashur"]
WORDS = ("the cat dog bird sat ran flew over under near a red blue green small big house tree river and then it "
         "was seven days").split()


def synthetic_sources(n: int = 90, seed: int = 0) -> list[Document]:
    """Made-up documents of three sources (no third-party text), with sentences, numbers and names."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        source = ("wiki", "news", "kjv")[i % 3]
        sentences = []
        for _ in range(rng.randint(8, 16)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 10))]
            words.insert(rng.randint(1, len(words)), rng.choice(NAMES) if rng.random() < 0.5
                         else str(rng.randint(1, 2000)))
            sentences.append(" ".join(words).capitalize() + ".")
        docs.append(Document(f"{source}/{i}", ("\n" if source == "kjv" else " ").join(sentences), source))
    return docs


def test_sentences_sections_and_gaps():
    assert split_sentences('He met Dr. Smith in St. Louis. It rained. "Yes!" she said. J. R. Tolkien wrote 3 books.') \
        == ["He met Dr. Smith in St. Louis.", "It rained.", '"Yes!" she said.', "J. R. Tolkien wrote 3 books."]
    assert split_sentences("In 1600 B.C.E., the letter changed. Then e.g. this stays.") == [
        "In 1600 B.C.E., the letter changed.", "Then e.g. this stays."]
    doc = Document("wiki/1", "Intro sentence one. Intro two here.\n\nHistory\n\nFirst of history. Second one.", "wiki")
    assert [[u.text for u in s] for s in sections(doc)] == [["Intro sentence one.", "Intro two here."],
                                                            ["First of history.", "Second one."]]
    kjv = Document("kjv/x/1", "In the beginning.\nAnd the earth.", "kjv")
    assert [(u.text, u.sep) for u in sections(kjv)[0]] == [("In the beginning.", "\n"), ("And the earth.", "\n")]
    gaps = find_gaps("Tarvo saw 1,200 birds and seven cats near Ysolde in 1975.", {"saw"})
    assert [(g.filler, g.kind, g.shape) for g in gaps] == [("1,200", "number", "9,999"), ("seven", "number", "word"),
                                                           ("Ysolde", "name", "name"), ("1975", "number", "9999")]


def test_task_builders_are_deterministic_and_split_by_document():
    docs = synthetic_sources()
    built = build_tasks(docs, val_fraction=0.6, max_per_doc=6)
    assert build_tasks(docs, val_fraction=0.6, max_per_doc=6) == built
    for task, items in build_tasks(list(reversed(docs)), val_fraction=0.6, max_per_doc=6).items():
        assert sorted(items, key=lambda it: it.item_id) == sorted(built[task], key=lambda it: it.item_id)
    by_id = {d.doc_id: d for d in docs}
    held_out = [d for d in docs if is_validation(d.doc_id, 0.6)]
    assert 0 < len(held_out) < len(docs)
    splits = assign_splits(held_out)
    for task, items in built.items():
        assert len(items) > 50, task
        for it in items:
            assert it.doc_id in splits and it.split == splits[it.doc_id]  # held out, one split per document
            assert len(it.options) == 4 and len(set(it.options)) == 4
            for other in it.meta["option_docs"]:  # distractors: same source and split, another document
                assert other != it.doc_id and splits[other] == it.split and by_id[other].source == it.source
            text, right = by_id[it.doc_id].text, it.options[it.answer]
            assert (it.context + right) in text
            for n, option in enumerate(it.options):
                if n != it.answer:
                    assert (it.context + option) not in text
        docs_in = {s: {it.doc_id for it in items if it.split == s} for s in ("fit", "val", "test")}
        assert all(docs_in.values())
        assert not (docs_in["test"] & (docs_in["fit"] | docs_in["val"])) and not (docs_in["fit"] & docs_in["val"])
        fitting_text = docs_in["fit"] | docs_in["val"] | {o for it in items if it.split != "test"
                                                           for o in it.meta["option_docs"]}
        assert not fitting_text & docs_in["test"]  # no test document's text in fitting or validation


def test_splits_follow_the_pattern_per_source():
    docs = synthetic_sources(60)
    splits = assign_splits(docs)
    for source in ("wiki", "news", "kjv"):
        mine = [splits[d.doc_id] for d in docs if d.source == source]
        assert sorted(mine) == sorted(SPLIT_PATTERN * 2)
    assert splits == assign_splits(list(reversed(docs)))


def test_default_corpus_gives_500_items_per_task():
    """The real default corpus at the training run's val_fraction 0.05 (no model needed to count)."""
    from prism.corpora import iter_documents

    built = build_tasks(iter_documents("default"), val_fraction=0.05)
    for task, items in built.items():
        counts = {s: sum(it.split == s for it in items) for s in ("fit", "val", "test")}
        assert len(items) >= 500 and min(counts.values()) >= 100, (task, counts)


# ----------------------------------------------------------------------------------------------------------------
# Command lines, end to end on a tiny model.


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from test_app_support import build_tiny_model

    root = tmp_path_factory.mktemp("controllers")
    model = build_tiny_model(root)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text, "source": d.source}) + "\n"
                              for d in synthetic_sources(60)))
    (model.parent / "train_args.json").write_text(json.dumps({"corpus": str(corpus), "val_fraction": 0.5}))
    return root, model


def test_cli_builds_fits_and_evaluates(tiny_run, capsys):
    root, model = tiny_run
    stats = tasks_main(["build", "--checkpoint", str(model), "--out", str(root / "tasks"), "--max-per-doc", "4"])
    assert set(stats) == {"next_sentence", "cloze"}
    items = read_items(root / "tasks" / "cloze.jsonl")
    assert write_items(items, root / "copy.jsonl") == len(items) and read_items(root / "copy.jsonl") == items
    argv = ["fit", "--checkpoint", str(model), "--tasks", str(root / "tasks"), "--out", str(root / "ctl"),
            "--epochs", "2", "--l1", "0.1", "--candidates", "16"]
    summary = controllers_main(argv)
    assert set(summary) == {"next_sentence", "cloze"}
    for task in summary:
        assert len(list((root / "ctl" / task).glob("*.safetensors"))) == 6  # 2 kinds x 3 seeds
    capsys.readouterr()
    results = controllers_main(["eval", "--out", str(root / "ctl"), "--top", "3"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(results))
    for row in results["tasks"].values():
        assert 0 <= row["before"] <= 1
        for kind in ("prototype", "dense"):
            assert len(row[kind]["per_seed"]) == 3 and row[kind]["std"] >= 0
            for r in row[kind]["per_seed_paired"]:
                assert r["gain_points"] == pytest.approx(100 * (r["accuracy"] - row["before"]))
        assert row["cost"]["parameters"] == 24 and "generate_tokens_per_s" in row["cost"]
    with pytest.raises(SystemExit):  # other arguments into the same folder are refused
        controllers_main([*argv[:-2], "--candidates", "8"])
    described = tasks_main(["describe", "--controllers", str(root / "ctl"), "--top", "2"])
    assert set(described) == {"next_sentence", "cloze"}


@pytest.mark.parametrize("main, argv", [(controllers_main, ["--help"]), (controllers_main, ["fit", "--help"]),
                                        (controllers_main, ["eval", "--help"]), (tasks_main, ["--help"]),
                                        (tasks_main, ["build", "--help"]), (tasks_main, ["describe", "--help"])])
def test_help(main, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0 and "usage" in capsys.readouterr().out


def test_items_are_validated():
    with pytest.raises(ValueError, match="split"):
        MCItem("x", "t", "d", "s", "train", "ctx", ("a", "b"), 0)
    with pytest.raises(ValueError, match="answer"):
        MCItem("x", "t", "d", "s", "fit", "ctx", ("a", "b"), 2)
