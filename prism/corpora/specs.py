"""Corpus specs: what a spec string names, and every document it names in a deterministic order.

    parse_spec("default")                            # CorpusSpec('default', 'default')
    parse_spec("HuggingFaceFW/fineweb:sample-10BT")  # CorpusSpec('hub', 'HuggingFaceFW/fineweb', 'sample-10BT')
    for doc in iter_documents("data/fineweb/", limit=100): ...

A spec is 'default', 'default-v2' or 'default-v3' (the offline corpora, default.py), a local .txt/.jsonl/.parquet
file, folder or glob (read by prism/data.py, the reader training uses, so evidence points at the documents a model
trained on) or a hub dataset id with an optional config (hub.py). A local path of the same name wins over a hub id.
"""

from __future__ import annotations

import glob
import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prism.corpora.default import CORPORA, default_documents
from prism.corpora.hub import iter_hf_dataset
from prism.data import SUFFIXES, Document, read_documents


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
    if spec in CORPORA:
        return CorpusSpec("default", spec)
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
        docs: Iterable[Document] = default_documents(parsed.path)
    elif parsed.kind == "local":
        docs = read_documents(parsed.path)
    else:
        docs = iter_hf_dataset(parsed.path, name=parsed.name)
    yield from itertools.islice(docs, limit)  # stops before reading document limit + 1 (a stream may be remote)

