"""Training: modes, exact resumption, argument checks, prototype initialisation and re-seeding, DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_backbone_dir, write_corpus
from safetensors.torch import load_file

from prism import PrismConfig, PrismForCausalLM
from prism.backbones import load_backbone, load_tokenizer
from prism.train import (
    TrainArgs,
    balance_weights,
    batch_indices,
    build_parser,
    init_prototypes,
    main,
    reseed_dead,
    train,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    return {"backbone": str(tiny_backbone_dir(root / "llama", "llama")),
            "gpt2": str(tiny_backbone_dir(root / "gpt2", "gpt2")),
            "corpus": str(write_corpus(root / "corpus")), "cache": str(root / "cache")}


def _argv(setup, out, **over):
    base = dict(backbone=setup["backbone"], corpus=setup["corpus"], out=str(out), cache_dir=setup["cache"],
                mode="top", n_layers=1, n_prototypes=24, top_k=4, steps=12, seq_len=32, batch_size=4,
                init_tokens=200, dead_every=4, warmup=3, checkpoint_every=5, log_every=2)
    base.update(over)
    argv = []
    for k, v in base.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is not False and v is not None:
            argv += [flag, str(v)]
    return argv


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("mode", ["top", "prototypes", "end-to-end"])
def test_modes_train_the_right_parameters(setup, tmp_path, mode):
    final = main(_argv(setup, tmp_path / mode, mode=mode, steps=30, dead_every=0))
    trained = _weights(final)
    if mode == "top":
        assert any(k.startswith("backbone.model.layers.2.") for k in trained)
        assert not any(k.startswith("backbone.model.layers.1.") for k in trained)
        assert "backbone.model.norm.weight" in trained and "backbone.model.embed_tokens.weight" not in trained
    elif mode == "prototypes":
        assert set(trained) == {"prototypes.weight"}
    else:
        assert "backbone.model.layers.0.mlp.up_proj.weight" in trained  # the full model is saved
    log = [json.loads(line) for line in (tmp_path / mode / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 30 and {"ce", "rec", "r1", "r2", "fve", "mean_active"} <= set(log[-1])
    assert log[-1]["rec"] < log[0]["rec"], "the prototypes should learn to reconstruct the states"
    model = PrismForCausalLM.from_pretrained(final)
    assert model.config.n_prototypes == 24 and (final / "tokenizer.json").exists()
    # generate stops at the tokenizer's end of text: generation_config.json is written from the tokenizer
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == \
        load_tokenizer(str(final)).eos_token_id == model.generation_config.eos_token_id


def test_gpt2_backbone_trains_in_top_mode(setup, tmp_path):
    final = main(_argv(setup, tmp_path / "g", backbone=setup["gpt2"], cache_dir=str(tmp_path / "c")))
    assert any(k.startswith("backbone.transformer.h.2.") for k in _weights(final))
    assert "backbone.transformer.ln_f.weight" in _weights(final)


def test_resumed_run_equals_uninterrupted_run(setup, tmp_path):
    whole = main(_argv(setup, tmp_path / "whole"))
    # the first part leaves glibc's default allocator (--release-freed-memory), the second keeps freed memory: the
    # flag may change between a run and its resumption and does not change the result
    first = main(_argv(setup, tmp_path / "parts", exit_after=7, release_freed_memory=True))
    assert first.name == "checkpoint" and not (tmp_path / "parts" / "final").exists()
    assert json.loads((first / "state.json").read_text())["step"] == 7
    resumed = main(_argv(setup, tmp_path / "parts", exit_after=7))
    a, b = _weights(whole), _weights(resumed)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    log_a = (tmp_path / "whole" / "train_log.jsonl").read_text().splitlines()
    log_b = (tmp_path / "parts" / "train_log.jsonl").read_text().splitlines()
    strip = [{k: v for k, v in json.loads(r).items() if k != "tokens_per_s"} for r in log_a]
    assert strip == [{k: v for k, v in json.loads(r).items() if k != "tokens_per_s"} for r in log_b]


def test_rerun_with_other_arguments_is_refused(setup, tmp_path):
    main(_argv(setup, tmp_path / "r", steps=2))
    with pytest.raises(ValueError, match="different arguments.*lr"):
        train(TrainArgs(**_args_dict(setup, tmp_path / "r", steps=2, lr=1e-2)))
    main(_argv(setup, tmp_path / "r", steps=2, lr=1e-2, overwrite=True))
    assert json.loads((tmp_path / "r" / "train_args.json").read_text())["lr"] == 1e-2


def _args_dict(setup, out, **over):
    return vars(build_parser().parse_args(_argv(setup, out, **over)))


def test_dense_baseline_trains_the_same_layers_without_prototypes(setup, tmp_path):
    dense = main(_argv(setup, tmp_path / "d", dense_baseline=True))
    prism = main(_argv(setup, tmp_path / "p"))
    assert set(_weights(prism)) - set(_weights(dense)) == {"prototypes.weight"}
    log = [json.loads(line) for line in (tmp_path / "d" / "train_log.jsonl").read_text().splitlines()]
    assert set(log[0]) >= {"ce"} and "rec" not in log[0]


def test_a_lower_cache_layer_gives_the_same_run_and_is_shared(setup, tmp_path):
    """Caching the states entering layer 0 and running the frozen layers per step equals caching the states
    entering the first trained layer; runs that train different layers share the lower cache."""
    cache = str(tmp_path / "c")
    direct = main(_argv(setup, tmp_path / "direct", cache_dir=cache, steps=6))
    low = main(_argv(setup, tmp_path / "low", cache_dir=cache, steps=6, cache_layer=0))
    for name, tensor in _weights(direct).items():
        torch.testing.assert_close(_weights(low)[name], tensor, rtol=1e-4, atol=1e-5)
    main(_argv(setup, tmp_path / "two", cache_dir=cache, steps=2, n_layers=2, cache_layer=0))
    assert len(list(Path(cache).glob("states-*"))) == 2  # layer 2 (the direct run) and layer 0 (both others)


def test_bad_arguments_get_clear_errors(setup, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(_argv(setup, tmp_path / "x", top_k=50))
    assert "cannot exceed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_argv(setup, tmp_path / "x", mode="sideways"))
    with pytest.raises(ValueError, match="n-layers"):
        main(_argv(setup, tmp_path / "y", n_layers=9))
    with pytest.raises(ValueError, match="cache-layer"):
        main(_argv(setup, tmp_path / "w", cache_layer=3))  # above the first trained layer (2)
    with pytest.raises(SystemExit):
        main(_argv(setup, tmp_path / "v", mode="prototypes", cache_layer=0))
    with pytest.raises(FileNotFoundError, match="no corpus files"):
        main(_argv(setup, tmp_path / "z", corpus=str(tmp_path / "missing.jsonl")))


def test_init_places_prototypes_on_real_states_at_the_best_scale():
    from helpers import tiny_prism

    model = tiny_prism("llama", n_prototypes=16, top_k=4)
    z = torch.randn(200, 32, dtype=torch.float32)
    init_prototypes(model, z, seed=0)
    P = model.prototypes.weight.detach()
    cos = torch.nn.functional.normalize(P, dim=-1) @ torch.nn.functional.normalize(z, dim=-1).T
    assert torch.allclose(cos.max(-1).values, torch.ones(16), atol=1e-5)  # each is some token state's direction
    assert len(set(cos.argmax(-1).tolist())) == 16  # distinct states

    def rec(scale):
        ids, acts = model.prototypes.activate(model.prototypes.similarities(z), 4)
        return float((z - scale * model.prototypes.reconstruct(ids, acts)).pow(2).sum())
    assert rec(1.0) <= min(rec(0.9), rec(1.1))  # the chosen global scale is the least-squares one


def test_weighted_init_draws_only_weighted_distinct_states_and_refuses_bad_weights():
    from helpers import tiny_prism

    model = tiny_prism("llama", n_prototypes=16, top_k=4)
    z = torch.randn(60, 32)
    z = torch.cat([z, z[:10]])  # 10 states repeated at the end: a repeat keeps its first occurrence's weight
    weights = torch.zeros(70, dtype=torch.float64)
    weights[20:40] = 1.0  # 20 eligible states for 16 prototypes
    weights[60:] = 5.0  # the repeats' weights are ignored (their first occurrences weigh 0)
    init_prototypes(model, z, seed=3, weights=weights)
    P = torch.nn.functional.normalize(model.prototypes.weight.detach(), dim=-1)
    cos = P @ torch.nn.functional.normalize(z[:60], dim=-1).T  # (16, 60)
    assert torch.allclose(cos.max(-1).values, torch.ones(16), atol=1e-5)
    picked = cos.argmax(-1).tolist()
    assert len(set(picked)) == 16 and all(20 <= i < 40 for i in picked)  # distinct, and only from weight > 0

    before = model.prototypes.weight.detach().clone()
    weights[20:40] = 0.0
    weights[20:30] = 1.0  # only 10 eligible
    with pytest.raises(ValueError, match="weight > 0"):
        init_prototypes(model, z, seed=3, weights=weights)
    with pytest.raises(ValueError, match="finite and >= 0"):
        init_prototypes(model, z, seed=3, weights=-torch.ones(70))
    with pytest.raises(ValueError, match="finite and >= 0"):
        init_prototypes(model, z, seed=3, weights=torch.ones(69))
    assert torch.equal(model.prototypes.weight.detach(), before)  # a refused init changes nothing


def test_weighted_init_follows_the_weights():
    """Drawn many times, a state twice as heavy is chosen about as often as the draw without replacement says
    (checked against numpy's own weighted draw without replacement, an independent sampler)."""
    from helpers import tiny_prism

    model = tiny_prism("llama", n_prototypes=16, top_k=4)
    z = torch.randn(40, 32)
    weights = torch.ones(40, dtype=torch.float64)
    weights[:8] = 6.0
    unit = torch.nn.functional.normalize(z, dim=-1)
    ours, theirs = np.zeros(40), np.zeros(40)
    for seed in range(300):
        init_prototypes(model, z, seed=seed, weights=weights)
        P = torch.nn.functional.normalize(model.prototypes.weight.detach(), dim=-1)
        ours[(P @ unit.T).argmax(-1).numpy()] += 1
        p = (weights / weights.sum()).numpy()
        theirs[np.random.default_rng(seed).choice(40, 16, replace=False, p=p)] += 1
    assert abs(ours[:8].mean() - theirs[:8].mean()) < 0.05 * 300  # heavy states: nearly always picked
    assert abs(ours[8:].mean() - theirs[8:].mean()) < 0.05 * 300
    assert ours[:8].mean() > 2 * ours[8:].mean()


def test_balance_weights_are_inverse_count_powers():
    from collections import Counter

    tokens = np.array([5, 5, 5, 5, 2, 2, 9, 5, 7])
    counts = np.bincount(tokens)
    w = balance_weights(tokens[[0, 4, 6]], counts, 0.5).numpy()
    c = Counter(tokens.tolist())
    assert np.allclose(w, [c[5] ** -0.5, c[2] ** -0.5, c[9] ** -0.5])
    assert np.allclose(balance_weights(tokens, counts, 0.0).numpy(), 1.0)  # exponent 0: uniform


def test_init_balance_trains_and_starts_on_rarer_tokens(setup, tmp_path, monkeypatch):
    """--init-balance: the run records it, trains, and its bank starts on rarer tokens than the uniform draw's."""
    import prism.train as train_module

    original = train_module.init_prototypes

    def spy(seen):
        def init(model, z, seed, weights=None):
            original(model, z, seed, weights)
            seen.update(weights=weights, bank=model.prototypes.weight.detach().clone(), z=z)
        return init

    starts = {}
    for a in (0.0, 2.0):
        starts[a] = {}
        monkeypatch.setattr(train_module, "init_prototypes", spy(starts[a]))
        out = tmp_path / f"a{a}"
        main(_argv(setup, out, init_balance=a, steps=2, n_prototypes=16, top_k=2, init_tokens=200))
        assert json.loads((out / "train_args.json").read_text())["init_balance"] == a
        assert (starts[a]["weights"] is None) == (a == 0.0)
    # the drawn states' mean weight under the a=2 weights: higher for the balanced draw (rarer tokens)
    w = starts[2.0]["weights"]
    unit = torch.nn.functional.normalize(starts[2.0]["z"], dim=-1)

    def mean_weight(bank):
        return float(w[(torch.nn.functional.normalize(bank, dim=-1) @ unit.T).argmax(-1)].mean())
    assert mean_weight(starts[2.0]["bank"]) > mean_weight(starts[0.0]["bank"])
    with pytest.raises(SystemExit):
        main(_argv(setup, tmp_path / "bad", init_balance=-1.0))


def test_reseeding_moves_dead_prototypes_to_worst_reconstructed_tokens():
    from helpers import tiny_prism

    model = tiny_prism("llama", n_prototypes=8, top_k=2)
    opt = torch.optim.AdamW([model.prototypes.weight])
    model.prototypes.weight.grad = torch.ones_like(model.prototypes.weight)
    opt.step()
    z, z_hat = torch.randn(10, 32), torch.randn(10, 32)
    err = (z - z_hat).pow(2).sum(-1) / z.pow(2).sum(-1)
    dead = torch.zeros(8, dtype=torch.bool)
    dead[[1, 5]] = True
    before = model.prototypes.weight.detach().clone()
    assert reseed_dead(model, opt, dead, z, z_hat) == 2
    after = model.prototypes.weight.detach()
    worst = err.topk(2).indices
    for slot, token in zip([1, 5], worst.tolist()):
        assert torch.nn.functional.cosine_similarity(after[slot], z[token], dim=0) > 0.9999
        assert float(opt.state[model.prototypes.weight]["exp_avg"][slot].abs().sum()) == 0
    assert torch.equal(after[~dead], before[~dead])


def test_batch_order_is_a_pure_function_of_the_step():
    seen = np.concatenate([batch_indices(40, s, 4, 0, 1, seed=3) for s in range(10)])
    assert sorted(seen.tolist()) == list(range(40))  # one epoch covers every block once
    split = [batch_indices(40, 2, 2, r, 2, seed=3) for r in range(2)]
    assert sorted(np.concatenate(split).tolist()) == sorted(batch_indices(40, 2, 4, 0, 1, seed=3).tolist())


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_on_the_same_global_batch(setup, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # L_R1 takes a max over the batch, which DDP computes per rank (a documented difference), so it is off here;
    # every other term is a per-token mean and must agree.
    common = dict(steps=6, dead_every=0, checkpoint_every=3, cache_dir=str(tmp_path / "cache"), lambda_r1=0.0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "prism.train", *_argv(setup, tmp_path / "ddp", batch_size=2, **common)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = main(_argv(setup, tmp_path / "one", batch_size=4, **common))
    a, b = _weights(tmp_path / "ddp" / "final"), _weights(single)
    untrained = PrismForCausalLM.from_backbone(load_backbone(setup["backbone"]),
                                               PrismConfig(n_prototypes=24, top_k=4)).state_dict()
    for k in a:
        if k == "prototypes.weight":  # initialised from data, the same way in both runs
            torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-3)
            continue
        # Adam turns float summation-order noise in near-zero gradients into visible steps, so compare the
        # updates as a whole: the two runs must move the weights the same way.
        update = (b[k] - untrained[k]).norm()
        assert update > 0, f"{k} should have trained"
        assert (a[k] - b[k]).norm() < 0.01 * update, k


def _dead_fraction(final: Path, run: Path) -> float:
    """Fraction of the bank active at no token of the run's training blocks."""
    from prism.data import pack
    from prism.eval import evaluate_prism

    train = np.load(next((run / "cache").glob("tokens-*")) / "train.npy")
    return evaluate_prism(PrismForCausalLM.from_pretrained(final), pack(train, 32), 8)["dead_fraction"]


def test_reseeding_leaves_fewer_dead_prototypes_than_none(setup, tmp_path, monkeypatch):
    """A bank bigger than the tiny model needs (K = 96, k = 1), half of it planted badly (those rows point away
    from the states they were initialised on): after the same steps, without re-seeding about a fifth of the bank
    is active at no training token; --dead-every moves the unused rows onto states of the batch, where they stay
    in use. (A re-seeded row's direction is its state's: test_reseeding_moves_dead_prototypes_to_...)"""
    import prism.train as train_module

    def planted(model, z, seed, weights=None):
        init_prototypes(model, z, seed, weights)
        with torch.no_grad():
            model.prototypes.weight[48:] *= -1

    monkeypatch.setattr(train_module, "init_prototypes", planted)
    common = dict(mode="prototypes", n_prototypes=96, steps=20, log_every=3, init_tokens=400, top_k=1)
    runs = {}
    for every in (0, 5):
        out = tmp_path / f"every{every}"
        final = main(_argv(setup, out, dead_every=every, cache_dir=str(out / "cache"), **common))
        runs[every] = (_dead_fraction(final, out), [json.loads(r) for r in (out / "train_log.jsonl").open()])
    assert runs[0][0] > 0.1 and runs[5][0] < runs[0][0] / 4, runs
    checks = [r for r in runs[5][1] if "reseeded" in r]
    assert [r["step"] for r in checks] == [5, 10, 15, 20]  # logged at every check, between --log-every steps too
    assert checks[0]["dead"] >= 24 and checks[0]["reseeded"] == checks[0]["dead"]  # a batch has enough states
    assert all(r["reseeded"] <= r["dead"] for r in checks)
    assert not any("reseeded" in r for r in runs[0][1])


def test_resumed_run_with_reseeding_equals_uninterrupted_run(setup, tmp_path):
    """Usage counts since the last check are part of the checkpoint: a run stopped between two checks and resumed
    re-seeds the same prototypes at the same steps as one that never stopped."""
    common = dict(n_prototypes=64, top_k=2, dead_every=3, checkpoint_every=4, log_every=5)
    whole = main(_argv(setup, tmp_path / "whole", **common))
    main(_argv(setup, tmp_path / "parts", exit_after=5, **common))  # stops at step 5, between the checks at 3 and 6
    resumed = main(_argv(setup, tmp_path / "parts", **common))
    for k, tensor in _weights(whole).items():
        assert torch.equal(tensor, _weights(resumed)[k]), k
    rows = {}
    for name in ("whole", "parts"):
        rows[name] = [{k: v for k, v in json.loads(r).items() if k != "tokens_per_s"}
                      for r in (tmp_path / name / "train_log.jsonl").open()]
    assert rows["whole"] == rows["parts"]
    assert sum(r.get("reseeded", 0) for r in rows["whole"]) > 0  # re-seeding did happen


def _sourced_corpus(folder: Path) -> Path:
    from helpers import synthetic_documents

    docs = synthetic_documents(90)
    for i, doc in enumerate(docs):  # 'kjv' gets about 80% of the documents
        doc["source"] = "kjv" if i % 5 else ("wiki" if i % 2 else "news")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "c.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return folder / "c.jsonl"


def test_max_source_share_is_applied_and_recorded_with_the_run(setup, tmp_path):
    corpus = str(_sourced_corpus(tmp_path / "corpus"))
    final = main(_argv(setup, tmp_path / "cap", corpus=corpus, steps=2, max_source_share=0.4))
    mix = json.loads((tmp_path / "cap" / "corpus_mix.json").read_text())
    assert mix["max_source_share"] == 0.4 and mix["before"]["kjv"] > 0.7 * sum(mix["before"].values())
    assert mix["after"]["kjv"] < 0.5 * sum(mix["after"].values())
    assert PrismForCausalLM.from_pretrained(final).config.metadata["corpus_mix"] == mix
    main(_argv(setup, tmp_path / "plain", corpus=corpus, steps=2))  # no cap: no mix recorded, all of kjv read
    assert not (tmp_path / "plain" / "corpus_mix.json").exists()


def test_a_run_saved_before_a_new_argument_existed_resumes(setup, tmp_path):
    """An argument added later (here --max-source-share) counts as its default for runs saved without it."""
    main(_argv(setup, tmp_path / "old", steps=4, exit_after=2))
    saved = tmp_path / "old" / "train_args.json"
    args = json.loads(saved.read_text())
    del args["max_source_share"]
    saved.write_text(json.dumps(args))
    main(_argv(setup, tmp_path / "old", steps=4))
    assert (tmp_path / "old" / "final").exists()


# ----------------------------------------------------------------------------------------------------------------
# --autocast bfloat16: mixed precision, checked against the float32 step


def _module(setup, autocast: str):
    from prism.train import TrainModule

    args = TrainArgs(**{**_args_dict(setup, "unused"), "autocast": autocast})
    torch.manual_seed(0)
    model = PrismForCausalLM.from_backbone(load_backbone(setup["backbone"]),
                                           PrismConfig(n_prototypes=24, top_k=4, lambda_r1=0.5, lambda_r2=0.5))
    for p in model.parameters():
        p.requires_grad_(True)
    return TrainModule(model.eval(), args)


def test_autocast_step_matches_the_float32_step(setup):
    """The same model and batch: the loss terms within bfloat16's precision of the float32 ones, the gradients
    pointing the same way, and the LM head's product really ran in bfloat16."""
    ids = torch.randint(0, 64, (3, 16))
    states = None
    results = {}
    for autocast in ("none", "bfloat16"):
        module = _module(setup, autocast)
        seen = []
        hook = module.model.lm_head.register_forward_hook(lambda m, a, out, seen=seen: seen.append(out.dtype))
        module.start_layer = 0  # run every layer from the embeddings' output: the whole stack under autocast
        states = module.model.states_before_layer(ids, 0) if states is None else states
        loss, losses, out = module(ids, states)
        loss.backward()
        hook.remove()
        grads = torch.cat([p.grad.flatten() for p in module.model.parameters() if p.grad is not None])
        results[autocast] = (loss.item(), {k: v.item() for k, v in losses.items()}, grads, seen)
    (loss32, terms32, g32, seen32), (loss16, terms16, g16, seen16) = results["none"], results["bfloat16"]
    assert seen32 == [torch.float32] and seen16 == [torch.bfloat16]
    assert loss16 == pytest.approx(loss32, rel=0.02)
    for name in ("ce", "rec", "r1", "r2"):
        assert terms16[name] == pytest.approx(terms32[name], rel=0.05, abs=1e-3), name
    assert g16.dtype == torch.float32 and g16.shape == g32.shape
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.98


@pytest.mark.parametrize("density", [1.0, 0.01])
def test_similarities_backward_under_autocast_matches_autograd(density):
    """_Similarities' own backward, given the bfloat16 gradient autocast produces (dense, and sparse enough for
    the sparse CPU path), against float32 autograd of the plain product."""
    from prism.model import _Similarities

    gen = torch.Generator().manual_seed(1)
    zn = torch.nn.functional.normalize(torch.randn(200, 16, generator=gen), dim=-1).requires_grad_(True)
    pn = torch.nn.functional.normalize(torch.randn(30, 16, generator=gen), dim=-1).requires_grad_(True)
    weight = torch.randn(200, 30, generator=gen) * (torch.rand(200, 30, generator=gen) < density)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sims = _Similarities.apply(zn, pn)
    assert sims.dtype == torch.bfloat16
    (sims.float() * weight).sum().backward()
    a, b = zn.detach().clone().requires_grad_(True), pn.detach().clone().requires_grad_(True)
    ((a @ b.T) * weight.bfloat16().float()).sum().backward()
    assert zn.grad.dtype == pn.grad.dtype == torch.float32
    torch.testing.assert_close(zn.grad, a.grad, rtol=0.02, atol=0.02)
    torch.testing.assert_close(pn.grad, b.grad, rtol=0.02, atol=0.02)


def test_autocast_run_resumes_exactly_and_keeps_its_own_cache(setup, tmp_path):
    cache = str(tmp_path / "c")
    whole = main(_argv(setup, tmp_path / "whole", cache_dir=cache, autocast="bfloat16"))
    main(_argv(setup, tmp_path / "parts", cache_dir=cache, autocast="bfloat16", exit_after=7))
    resumed = main(_argv(setup, tmp_path / "parts", cache_dir=cache, autocast="bfloat16"))
    for name, tensor in _weights(whole).items():
        assert tensor.dtype == torch.float32 and torch.equal(_weights(resumed)[name], tensor), name
    assert len(list(Path(cache).glob("states-*"))) == 1
    main(_argv(setup, tmp_path / "fp32", cache_dir=cache))  # a float32 run does not reuse those states
    assert len(list(Path(cache).glob("states-*"))) == 2
    # and the mixed-precision run follows the float32 one: CE (the frozen head's, mostly) to 0.1%, the
    # reconstruction loosely (the bank starts from states that went through bfloat16 layers, and in this tiny
    # model's 32 dimensions nearly tied similarities pick different top-k sets)
    logs = {name: [json.loads(line) for line in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
            for name in ("whole", "fp32")}
    assert [r["step"] for r in logs["whole"]] == [r["step"] for r in logs["fp32"]]
    for mixed, full in zip(logs["whole"], logs["fp32"]):
        assert mixed["ce"] == pytest.approx(full["ce"], rel=1e-3), mixed["step"]
        assert mixed["rec"] == pytest.approx(full["rec"], rel=0.08), mixed["step"]
    with pytest.raises(ValueError, match="different arguments.*autocast"):
        main(_argv(setup, tmp_path / "whole", cache_dir=cache))
    with pytest.raises(SystemExit):
        main(_argv(setup, tmp_path / "bad", autocast="float16"))


def test_autocast_auto_resolves_by_the_device_and_bfloat16_without_native_support_is_warned(monkeypatch, caplog):
    from prism import train as train_module

    for native, fast, expected in ((True, True, "bfloat16"), (True, False, "none"), (False, False, "none")):
        monkeypatch.setattr(train_module, "native_bfloat16", lambda device="cpu", n=native: n)
        monkeypatch.setattr(train_module, "fast_bfloat16", lambda device="cpu", f=fast: f)
        assert TrainArgs(corpus="c", out="o", autocast="auto").autocast == expected
    with caplog.at_level("WARNING", logger="prism.train"):
        assert TrainArgs(corpus="c", out="o", autocast="bfloat16").autocast == "bfloat16"  # kept, but said
    assert "no native bfloat16" in caplog.text
    caplog.clear()
    monkeypatch.setattr(train_module, "native_bfloat16", lambda device="cpu": True)
    with caplog.at_level("WARNING", logger="prism.train"):  # native but measured slower than float32: said too
        assert TrainArgs(corpus="c", out="o", autocast="bfloat16").autocast == "bfloat16"
    assert "slower than in float32" in caplog.text
    caplog.clear()
    monkeypatch.setattr(train_module, "fast_bfloat16", lambda device="cpu": True)
    with caplog.at_level("WARNING", logger="prism.train"):
        TrainArgs(corpus="c", out="o", autocast="bfloat16")
    assert not caplog.text
    with pytest.raises(ValueError, match="or auto"):
        TrainArgs(corpus="c", out="o", autocast="float16")


def test_autocast_auto_follows_this_cpus_measured_bfloat16_speed():
    """Native bfloat16 is not always faster (an Intel Xeon with AVX-512 BF16 and no AMX ran it at half the speed of
    float32): 'auto' picks bfloat16 exactly when the measured speed-up of this machine's products clears the bar."""
    from prism import train as train_module

    speedup = train_module.bfloat16_speedup()
    assert speedup > 0 and train_module.bfloat16_speedup() == speedup  # measured once per process
    fast = train_module.native_bfloat16() and speedup >= train_module.MIN_BFLOAT16_SPEEDUP
    assert train_module.fast_bfloat16() == fast
    assert train_module.resolve_autocast("auto") == ("bfloat16" if fast else "none")


def test_path_terms_are_trained_logged_and_recorded(setup, tmp_path):
    """--lambda-path-ce/-kl/--lambda-head-rec reach the config and the log, and the first step's loss is the
    model's own objective with them (recomputed from the saved start)."""
    out = tmp_path / "path"
    final = main(_argv(setup, out, steps=3, lambda_path_ce=0.5, lambda_path_kl=1.0, lambda_head_rec=2.0,
                       log_every=1, dead_every=0))
    config = json.loads((final / "config.json").read_text())
    assert (config["lambda_path_ce"], config["lambda_path_kl"], config["lambda_head_rec"]) == (0.5, 1.0, 2.0)
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    for row in rows:
        assert {"path_ce", "path_kl", "head_rec", "path_agreement"} <= set(row)
        assert row["loss"] == pytest.approx(row["ce"] + row["rec"] + 0.1 * row["r1"] + 0.1 * row["r2"]
                                            + 0.5 * row["path_ce"] + row["path_kl"] + 2 * row["head_rec"],
                                            rel=1e-5)
    model = PrismForCausalLM.from_pretrained(final)
    ids = torch.randint(0, model.vocab_size, (2, 16))
    out_ = model(ids, labels=ids)  # the model's own forward computes the same terms from its config
    assert {"path_ce", "path_kl", "head_rec"} <= set(out_.losses)
    with pytest.raises(SystemExit):
        main(_argv(setup, tmp_path / "bad", lambda_path_kl=-1.0))


def test_a_path_term_makes_the_prototype_path_agree_more_with_the_model():
    """The same bank trained from the same start with and without lambda_path_kl, through the model's own loss
    (PrismForCausalLM.forward with labels): with it, the path W z_hat + b is nearer the model's distribution and
    picks the model's token more often (measured independently with prism.explain)."""
    from helpers import random_ids, tiny_prism

    from prism.explain import path_statistics

    ids = random_ids(batch=4, length=24, seed=7)
    measured = {}
    for weight in (0.0, 3.0):
        model = tiny_prism(n_prototypes=16, top_k=2, seed=0)
        with torch.no_grad():
            model.lm_head.weight.mul_(8)  # a confident head, so that the top token is a real choice
        model.config.lambda_path_kl = weight
        model.requires_grad_(False)
        model.prototypes.requires_grad_(True)
        optimizer = torch.optim.Adam(model.prototypes.parameters(), lr=0.05)
        for _ in range(60):
            loss = model(ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            out = model(ids)
            stats = path_statistics(out.z, out.z_hat, model.lm_head.weight)
        measured[weight] = (float(stats.agree.double().mean()), float(stats.kl.mean()))
    assert measured[3.0][1] < 0.8 * measured[0.0][1], measured
    assert measured[3.0][0] > measured[0.0][0] + 0.05, measured


def test_a_named_corpus_trains_from_one_export_that_eval_reads_too(setup, tmp_path):
    """--corpus default: exported once to CACHE/corpus-default.jsonl (the same documents as iter_documents), the
    tokens a run reads are those of that file, and prism.eval finds the same file from the run's arguments."""
    from prism.corpora import iter_documents, local_corpus
    from prism.eval import main as eval_main

    cache = tmp_path / "cache"
    final = main(_argv(setup, tmp_path / "named", corpus="default", cache_dir=str(cache), steps=2,
                       max_tokens=3000))
    export = cache / "corpus-default.jsonl"
    rows = [json.loads(line) for line in export.read_text(encoding="utf-8").splitlines()]
    expected = list(iter_documents("default"))
    assert [r["id"] for r in rows] == [d.doc_id for d in expected] and rows[3]["text"] == expected[3].text
    stamp = export.stat().st_mtime_ns
    assert local_corpus("default", cache) == str(export) and export.stat().st_mtime_ns == stamp  # not rewritten
    assert local_corpus(setup["corpus"], cache) == setup["corpus"]  # a path is itself
    assert PrismForCausalLM.from_pretrained(final).config.metadata["corpus"] == "default"  # the name is recorded
    via_path = main(_argv(setup, tmp_path / "path", corpus=str(export), cache_dir=str(cache), steps=2,
                          max_tokens=3000))
    for name, value in _weights(final).items():  # the same tokens, the same steps: the same weights
        torch.testing.assert_close(value, _weights(via_path)[name], msg=name)
    result = eval_main(["--checkpoint", str(final), "--max-val-tokens", "256", "--no-probe"])
    assert result["split"]["corpus"] == str(export)
