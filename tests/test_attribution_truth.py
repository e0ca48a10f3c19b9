"""The planted-fact attribution benchmark (issue 41): facts, planting, ground truth, the rank metrics, and one
whole small run (tiny backbone, every stage and method) end to end."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from helpers import synthetic_documents as _lowercase_documents
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bench.attribution_truth import main as truth_main
from bench.attribution_truth import rank_metrics
from bench.planted_facts import RELATIONS, make_facts, plant, single_token


def _answers_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE that has every answer word as one token (trained on the synthetic documents and on the
    answer words themselves), so the tiny model can be asked the facts' one-token questions."""
    answers = [" " + w for _, words in RELATIONS.values() for w in words]
    texts = [d["text"] for d in synthetic_documents()] + [" ".join(answers * 3)] * 4
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=900, min_frequency=2, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")


def synthetic_documents(n_docs: int = 60, seed: int = 0) -> list[dict]:
    """The helpers' made-up documents with capitalised sentences (facts go in before a capital, as in real text)."""
    docs = _lowercase_documents(n_docs, seed)
    for d in docs:
        d["text"] = ". ".join(s.strip().capitalize() for s in d["text"].split(". "))
    return docs


@pytest.fixture(scope="module")
def tokenizer():
    return _answers_tokenizer()


def test_facts_have_unique_unseen_subjects_and_one_token_answers(tokenizer):
    docs = synthetic_documents(40)
    words = {w.lower() for d in docs for w in d["text"].split()}
    facts = make_facts(tokenizer, n=60, seed=3, reserved=words)
    assert len(facts) == 60
    assert len({f.subject for f in facts}) == 60
    assert not {f.subject.lower() for f in facts} & words
    assert {f.relation for f in facts} == set(RELATIONS)
    for f in facts:
        assert tokenizer.encode(" " + f.answer, add_special_tokens=False) == [f.answer_token]
        assert f.statement.startswith(f"{f.prompt} {f.answer}") and f.statement.endswith(".")
        assert f.subject in f.prompt
    again = make_facts(tokenizer, n=60, seed=3, reserved=words)
    assert [f.to_dict() for f in again] == [f.to_dict() for f in facts]


def test_plant_inserts_each_statement_at_its_recorded_offsets_and_nothing_else(tokenizer):
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(synthetic_documents(50))]
    facts = make_facts(tokenizer, n=30, seed=1)
    planted = plant(docs, facts, seed=2, eligible=lambda i: i != "d0")
    assert [d["id"] for d in planted] == [d["id"] for d in docs]
    assert planted[0]["text"] == docs[0]["text"]  # not eligible: untouched
    by_id = {d["id"]: d["text"] for d in planted}
    copies = 0
    for f in facts:
        assert 1 <= len(f.documents) <= 3 and len(set(f.documents)) == len(f.documents)
        for doc, offset in zip(f.documents, f.offsets):
            assert by_id[doc][offset: offset + len(f.statement)] == f.statement
            assert by_id[doc].count(f.subject) == 1
            copies += 1
    # removing every statement gives the original documents back
    for d, original in zip(planted, docs):
        text = d["text"]
        for f in facts:
            text = text.replace(f.statement + " ", "")
        assert text == original["text"]
    assert sum(d["text"] != o["text"] for d, o in zip(planted, docs)) <= copies
    assert all(docs[i]["text"] == synthetic_documents(50)[i]["text"] for i in range(50))  # input unchanged


def test_plant_refuses_too_few_documents(tokenizer):
    facts = make_facts(tokenizer, n=40, seed=0)
    with pytest.raises(ValueError, match="documents"):
        plant([{"id": "a", "text": "One. Two. Three."}], facts)
    with pytest.raises(ValueError, match="copies"):
        plant([{"id": "a", "text": "One. Two."}], facts[:1], copies=(2, 1))


def test_single_token_is_none_for_split_words(tokenizer):
    assert single_token(tokenizer, "purple") is not None
    assert single_token(tokenizer, "Quorvessaxyzzy") is None


def test_rank_metrics_match_a_direct_count():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(5, 40))
        scores = rng.integers(0, 6, size=n).astype(np.float32)  # many ties
        truth = sorted(rng.choice(n, size=int(rng.integers(1, 4)), replace=False).tolist())
        got = rank_metrics(scores, truth, top=3)
        order = sorted(range(n), key=lambda i: (-scores[i], i))  # ties: lower index first
        rank = {i: order.index(i) + 1 for i in range(n)}
        assert got["recall@1"] == pytest.approx(sum(rank[i] == 1 for i in truth) / len(truth))
        assert got["recall@3"] == pytest.approx(sum(rank[i] <= 3 for i in truth) / len(truth))
        assert got["mrr"] == pytest.approx(1 / min(rank[i] for i in truth))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, tokenizer):
    """The whole benchmark on a tiny Llama backbone and a synthetic corpus: corpus, the two PRISM runs, learned,
    every method (EK-FAC included) and the report."""
    root = tmp_path_factory.mktemp("truth")
    backbone = root / "bb"
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(backbone)
    tokenizer.save_pretrained(backbone)
    rng = random.Random(0)
    docs = synthetic_documents(80, seed=5)
    for d in docs:  # longer documents, several windows each
        d["text"] = " ".join([d["text"]] * rng.randint(1, 3))
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    work = root / "work"
    argv = ["--work", str(work), "--corpus", str(corpus), "--backbone", str(backbone), "--tokens", "6000",
            "--facts", "12", "--epochs", "1", "--n-prototypes", "32", "--top-k", "4", "--seq-len", "64",
            "--batch-size", "4", "--max-doc-chars", "2000", "--max-source-share", "1", "--rank", "16",
            "--ekfac-query-batch", "12", "--grad-whiten", "8",  # whitened projections: the longer path
            "--runs", "prism-planted,prism-base"]  # the dense runs: the same code
    result = truth_main(argv)
    return work, argv, result


@pytest.mark.slow
def test_small_run_measures_every_method_against_the_planted_truth(small_run):
    work, _, result = small_run
    report = result["report"]
    facts = [json.loads(line) for line in (work / "facts.jsonl").read_text().splitlines()]
    assert report["facts"] == len(facts) == 12
    assert set(report["methods"]) == {"cached", "cached_rerank", "cached_same_token", "cached_same_token_block",
                                      "reference", "ekfac", "bm25", "embedding", "grad_cache", "grad_cache_raw",
                                      "grad_cache_same_token", "cached_gradient"}
    # the app's store reads the positions that predicted the answer: every planted copy holds one
    assert report["methods"]["cached_gradient"]["copies_scored_zero"] == 0
    # the truth: every true sequence's text holds the statement (checked on the stored text, independently)
    from bench.attribution_truth import ground_truth, sequence_texts

    rows, truth = ground_truth(work)
    texts = sequence_texts(rows)
    for fact, true in zip(facts, truth):
        assert all(fact["statement"] in texts[i] for i in true)
        assert not any(fact["statement"] in texts[i] for i in set(range(len(rows))) - set(true))
    assert report["facts_with_intact_copy"] == sum(bool(t) for t in truth) > 0
    # the invented subject is in the BM25 query and only in the planted sequences: BM25 must find them
    assert report["methods"]["bm25"]["all_recall@10"] == pytest.approx(1.0)
    for method, row in report["methods"].items():
        assert 0 <= row["all_mrr"] <= 1 and row["query_ms"] > 0, method
        scores = np.load(work / "scores" / f"{method}.npy")
        assert scores.shape == (12, len(rows))
        # the copies a method cannot rank at all, counted here from the saved scores; reading deeper never loses
        assert row["copies"] == sum(len(t) for t in truth)
        assert row["copies_scored_zero"] == sum(int((scores[i][t] == 0).sum()) for i, t in enumerate(truth))
        assert row["all_recall@10"] <= row["all_recall@100"] <= 1, method
    learned = json.loads((work / "learned.json").read_text())
    assert set(learned["summary"]) == {"prism", "prism-planted", "prism-base"}
    # one fact's log-probability and pool rank, recomputed here from the saved model
    import torch

    from bench.planted_facts import RELATIONS
    from prism import PrismForCausalLM

    tok = _answers_tokenizer()
    model = PrismForCausalLM.from_pretrained(work / "prism-planted" / "final").eval()
    fact, row = facts[0], learned["per_fact"][0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tok(fact["prompt"], add_special_tokens=False)["input_ids"]]))
                                 .logits[0, -1], -1)
    assert row["logp_prism-planted"] == pytest.approx(float(logp[fact["answer_token"]]), abs=1e-3)
    pool = [tok.encode(" " + w, add_special_tokens=False)[0] for w in RELATIONS[fact["relation"]][1]]
    assert row["pool_rank_prism-planted"] == 1 + sum(float(logp[t]) > float(logp[fact["answer_token"]])
                                                     for t in pool if t != fact["answer_token"])
    assert row["gain_prism"] == pytest.approx(row["logp_prism-planted"] - row["logp_prism-base"], abs=2e-4)
    assert (work / "report.md").read_text().count("|") > 20


@pytest.mark.slow
def test_a_second_run_reuses_every_stage(small_run):
    work, argv, result = small_run
    before = {p.name: p.stat().st_mtime_ns for p in work.glob("*.json")}
    again = truth_main(argv)
    assert again["report"]["methods"] == result["report"]["methods"]
    after = {p.name: p.stat().st_mtime_ns for p in work.glob("*.json")}
    assert {k: after[k] for k in before if k != "report.json"} == {k: v for k, v in before.items()
                                                                    if k != "report.json"}
