"""prism.eval against metrics recomputed directly from the models on the same held-out blocks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_backbone_dir, write_corpus

from prism import PrismForCausalLM
from prism.backbones import load_backbone, load_tokenizer
from prism.data import pack, tokenize_split
from prism.eval import main as eval_main
from prism.train import main as train_main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    backbone = str(tiny_backbone_dir(root / "bb"))
    corpus = str(write_corpus(root / "c", n_docs=90))
    common = ["--backbone", backbone, "--corpus", corpus, "--cache-dir", str(root / "cache"), "--mode", "top",
              "--n-layers", "1", "--n-prototypes", "24", "--top-k", "4", "--steps", "15", "--seq-len", "32",
              "--batch-size", "4", "--init-tokens", "200", "--val-fraction", "0.2", "--dead-every", "5"]
    prism = train_main([*common, "--out", str(root / "prism")])
    dense = train_main([*common, "--out", str(root / "dense"), "--dense-baseline"])
    return {"root": root, "backbone": backbone, "corpus": corpus, "prism": prism, "dense": dense}


def _val_blocks(runs) -> torch.Tensor:
    tok = load_tokenizer(runs["backbone"])
    stream = tokenize_split(runs["corpus"], tok, val_fraction=0.2)["val"]
    return torch.from_numpy(pack(stream, 32).astype(np.int64))


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


@torch.no_grad()
def test_eval_reports_what_a_direct_computation_gives(runs, capsys):
    out_file = runs["root"] / "eval.json"
    results = eval_main(["--checkpoint", str(runs["prism"]), "--dense", str(runs["dense"]), "--out", str(out_file),
                         "--batch-size", "3"])
    assert json.loads(out_file.read_text()) == json.loads(json.dumps(results))
    printed = capsys.readouterr().out
    assert "prism" in printed and "dense" in printed and "backbone" in printed
    # without --out nothing is written anywhere, least of all into the checkpoint folder
    before = {p: p.stat().st_mtime_ns for p in runs["prism"].rglob("*")}
    again = eval_main(["--checkpoint", str(runs["prism"]), "--no-backbone", "--batch-size", "3"])
    assert again["prism"] == results["prism"]
    assert {p: p.stat().st_mtime_ns for p in runs["prism"].rglob("*")} == before

    ids = _val_blocks(runs)
    assert results["split"]["blocks"] == len(ids) > 0
    prism = PrismForCausalLM.from_pretrained(runs["prism"])
    dense = PrismForCausalLM.from_pretrained(runs["dense"])
    backbone = load_backbone(runs["backbone"])
    out = prism(ids)
    assert results["prism"]["ce"] == pytest.approx(_ce(out.logits, ids), rel=1e-4)
    assert results["prism"]["perplexity"] == pytest.approx(math.exp(results["prism"]["ce"]), rel=1e-9)
    assert results["dense"]["ce"] == pytest.approx(_ce(dense(ids).logits, ids), rel=1e-4)
    assert results["backbone"]["ce"] == pytest.approx(_ce(backbone(ids).logits, ids), rel=1e-4)
    assert results["prism_vs_dense_ce"] == pytest.approx(results["prism"]["ce"] / results["dense"]["ce"] - 1)

    z = out.z.reshape(-1, out.z.shape[-1]).double().numpy()
    P = prism.prototypes.weight.double().numpy()
    cos = (z / np.linalg.norm(z, axis=1, keepdims=True)) @ (P / np.linalg.norm(P, axis=1, keepdims=True)).T
    r = out.residual.reshape(-1, z.shape[1]).double().numpy()
    acts = out.activations.reshape(-1, 4).numpy()
    ids_k = out.prototype_ids.reshape(-1, 4).numpy()
    used = set(ids_k[acts > 0].tolist())
    expected = {
        "r1_bar": cos.max(0).mean(),
        "r2": cos.max(1).mean(),
        "fve": 1 - (r ** 2).sum() / ((z - z.mean(0)) ** 2).sum(),
        "mean_active": (acts > 0).sum(1).mean(),
        "dead_fraction": 1 - len(used) / 24,
    }
    for name, value in expected.items():
        assert results["prism"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert 0 < results["prism"]["fve"] < 1


def test_eval_without_a_split_source_is_a_clear_error(runs, tmp_path, capsys):
    PrismForCausalLM.from_pretrained(runs["prism"]).save_pretrained(tmp_path / "alone")
    with pytest.raises(SystemExit):
        eval_main(["--checkpoint", str(tmp_path / "alone")])
    assert "--corpus is needed" in capsys.readouterr().err


def test_a_dense_baseline_is_scored_alone_as_in_the_comparison(runs):
    both = eval_main(["--checkpoint", str(runs["prism"]), "--dense", str(runs["dense"]), "--no-backbone"])
    alone = eval_main(["--checkpoint", str(runs["dense"]), "--no-backbone"])
    assert "prism" not in alone and alone["split"] == both["split"]
    assert alone["dense"]["ce"] == pytest.approx(both["dense"]["ce"], rel=1e-6)
    with pytest.raises(SystemExit):  # a dense checkpoint compared with a dense baseline is a usage error
        eval_main(["--checkpoint", str(runs["dense"]), "--dense", str(runs["dense"]), "--no-backbone"])


def test_more_validation_tokens_than_the_training_cap_reads_the_same_stream_further(runs, tmp_path):
    # a run capped at max_tokens keeps max_tokens x val_fraction held-out tokens; asking the evaluation for more
    # must read further along the same held-out stream, not stop at the cap or read other text
    common = ["--corpus", runs["corpus"], "--val-fraction", "0.2", "--seq-len", "32", "--no-backbone",
              "--checkpoint", str(runs["prism"])]
    capped = eval_main([*common, "--max-tokens", "800"])
    wider = eval_main([*common, "--max-tokens", "800", "--max-val-tokens", "480"])
    assert capped["split"]["blocks"] == 800 * 0.2 // 32 == 5
    assert wider["split"]["blocks"] == 480 // 32 == 15
    tok = load_tokenizer(runs["backbone"])
    stream = tokenize_split(runs["corpus"], tok, val_fraction=0.2)["val"]
    full = torch.from_numpy(pack(stream, 32).astype(np.int64))
    prism = PrismForCausalLM.from_pretrained(runs["prism"])
    assert wider["prism"]["ce"] == pytest.approx(_ce(prism(full[:15]).logits, full[:15]), rel=1e-4)
    assert capped["prism"]["ce"] == pytest.approx(_ce(prism(full[:5]).logits, full[:5]), rel=1e-4)


@torch.no_grad()
def test_eval_reports_what_the_prototypes_carry_overall_per_source_and_on_the_probe(runs, tmp_path):
    from prism.eval import next_token_labels, probe_sequences
    from prism.explain import path_statistics, summarize_path
    from prism.probe import PROBE

    results = eval_main(["--checkpoint", str(runs["prism"]), "--no-backbone", "--per-source-tokens", "160"])
    prism = PrismForCausalLM.from_pretrained(runs["prism"])
    head = prism.lm_head

    def direct(ids):
        out = prism(ids)
        return summarize_path(path_statistics(out.z, out.z_hat, head.weight, head.bias, next_token_labels(ids)))

    ids = _val_blocks(runs)
    path = results["prism"]["path"]
    for name, value in direct(ids).items():
        assert path[name] == pytest.approx(value, rel=1e-5, abs=1e-9), name
    assert path["full_ce"] == pytest.approx(results["prism"]["ce"], rel=1e-5)  # the same positions and labels
    # per source: the synthetic corpus is one source, whose first 160 held-out tokens are the same 5 blocks
    assert list(results["prism"]["sources"]) == ["local"]
    local = results["prism"]["sources"]["local"]
    assert local["tokens"] == 160
    for name, value in direct(ids[:5]).items():
        assert local[name] == pytest.approx(value, rel=1e-5, abs=1e-9), name
    # the probe: every passage its own sequence after EOS, all kinds, none of them in this corpus
    probe = results["prism"]["probe"]
    assert probe["passages"] == len(PROBE) >= 32 and probe["in_corpus"] == 0
    assert set(probe) >= {"everyday", "technical", "news", "code"}
    tok = load_tokenizer(runs["backbone"])
    seqs = probe_sequences(tok, prism.max_length)
    assert all(s[0] == tok.eos_token_id for _, s in seqs)
    stats = None
    for _, s in seqs:
        one = torch.from_numpy(s.astype(np.int64))[None]
        out = prism(one)
        part = path_statistics(out.z, out.z_hat, head.weight, head.bias, next_token_labels(one))
        stats = part if stats is None else stats.cat(part)
    expected = summarize_path(stats)
    for name in ("agreement", "path_ce", "margin_share_median", "kl"):
        assert probe[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-9), name
    from prism.eval import format_table

    table = format_table(results)  # one row per source and per probe kind, none overwriting another
    assert "\n  local " in table and all(f"\n  probe {k} " in table for k in ("everyday", "technical", "news", "code"))
    skipped = eval_main(["--checkpoint", str(runs["prism"]), "--no-backbone", "--per-source-tokens", "0",
                         "--no-probe"])
    assert "sources" not in skipped["prism"] and "probe" not in skipped["prism"]
    assert skipped["prism"]["path"] == path


def test_a_probe_passage_in_the_corpus_is_counted(tmp_path):
    from prism.eval import probe_in_corpus
    from prism.probe import PROBE

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "intro " + PROBE[3]["text"] + " outro"}) + "\n"
                      + json.dumps({"id": "b", "text": "nothing of the probe"}) + "\n")
    assert probe_in_corpus(str(corpus)) == 1
