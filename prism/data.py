"""Corpus text: one Document type and one reader of local files (training and every precompute job read
documents through it), the by-document split, tokenizing and packing into blocks.

    for doc in read_documents("data/"):          # Document(doc_id, text, source, url, title, meta), streamed
        ...
    streams = tokenize_split("data/", tokenizer, val_fraction=0.05, max_tokens=300_000)   # {'train', 'val'}
    blocks = pack(streams["train"], seq_len=256)                                             # (N, 256)
    streams, mix = tokenize_split("data/", tokenizer, 0.05, max_source_share=0.4, seed=0, return_mix=True)

A corpus path is a file, a folder (every .txt/.jsonl/.parquet file under it, in sorted order) or a glob.
- .txt: the whole file is one document, its id the file name.
- .jsonl: one JSON object per line with a "text" field and optionally "id" (else file name + line number).
- .parquet: a "text" column and optionally "id" (FineWeb's schema has both), read in batches (a FineWeb shard is
  gigabytes: never the whole table at once).
A row's url and title become the Document's, an explicit "source" wins (else 'fineweb' when the row has FineWeb's
dump and url columns, else 'local'), and every other column goes into meta, so FineWeb's schema (text, id, dump,
url, date, language, ...) survives as is. precompute/corpus adds the offline default corpus and hub datasets,
whose rows become Documents through the same document_from_row.

The validation split is chosen per document from a hash of its id, so it does not depend on file order or on
how many processes read the corpus.

max_source_share caps any one source's share of the training tokens (the default corpus is mostly one source):
whole training documents are dropped, chosen by a seeded hash of their ids, until every source is within about one
document of the cap (cap_source_share). The validation split is not capped.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

SUFFIXES = (".txt", ".jsonl", ".parquet")
# FineWeb's columns beyond text/id; both present means the rows come from FineWeb (or a derivative of it).
FINEWEB_COLUMNS = frozenset({"dump", "url"})
# Row fields that are Document fields; every other column goes into Document.meta.
DOCUMENT_FIELDS = ("text", "id", "url", "title", "source", "meta")
PARQUET_BATCH = 1024  # rows per Parquet read


@dataclass(frozen=True)
class Document:
    """One corpus document. doc_id is stable across runs and machines; meta holds source-specific columns."""

    doc_id: str
    text: str
    source: str = "local"  # wiki | news | kjv | fineweb | local | hub | ...
    url: str | None = None
    title: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        """Hex sha256 of the text (utf-8): what a pointer-only database stores instead of the text."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def corpus_files(spec: str | Path) -> list[Path]:
    """The files a corpus path names, sorted; a clear error when there are none."""
    path = Path(spec)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    else:
        files = sorted(Path(p) for p in glob.glob(str(spec), recursive=True) if Path(p).suffix in SUFFIXES)
    unsupported = [f for f in files if f.suffix not in SUFFIXES]
    if unsupported:
        raise ValueError(f"unsupported corpus file {unsupported[0]}: use {', '.join(SUFFIXES)}")
    if not files:
        raise FileNotFoundError(f"no corpus files found at {spec!s} (expected {', '.join(SUFFIXES)} files)")
    return files


def document_from_row(row: dict[str, Any], fallback_id: str, default_source: str = "local") -> Document | None:
    """A Document from one row (a jsonl object, a Parquet or hub row), None for an empty text. An explicit 'source'
    field wins, then FineWeb's columns; our own exports write meta as one object, which is merged back."""
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
    meta = {k: v for k, v in row.items() if k not in DOCUMENT_FIELDS}
    if isinstance(row.get("meta"), dict):
        meta.update(row["meta"])
    url, title = row.get("url"), row.get("title")
    return Document(doc_id=fallback_id if doc_id is None else str(doc_id), text=text, source=source,
                    url=None if url is None else str(url), title=None if title is None else str(title), meta=meta)


def check_text_column(columns: Iterable[str], where: str) -> None:
    columns = list(columns)
    if "text" not in columns:
        raise ValueError(f"{where} has no 'text' column (columns: {columns})")


def read_documents(spec: str | Path) -> Iterator[Document]:
    """Every non-empty document of a local corpus path, in a deterministic order, streamed."""
    for path in corpus_files(spec):
        if path.suffix == ".txt":
            yield from _read_txt(path)
        elif path.suffix == ".jsonl":
            yield from _read_jsonl(path)
        else:
            yield from _read_parquet(path)


def _read_txt(path: Path) -> Iterator[Document]:
    text = path.read_text(encoding="utf-8")
    if text.strip():
        yield Document(path.name, text, "local", meta={"file": path.name})


def _read_jsonl(path: Path) -> Iterator[Document]:
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
            doc = document_from_row(row, f"{path.name}:{n}")
            if doc is not None:
                yield doc


def _read_parquet(path: Path) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError for a file that is not Parquet
        raise ValueError(f"{path} is not a readable Parquet file: {err}") from err
    check_text_column(parquet.schema_arrow.names, str(path))
    n = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH):
        for row in batch.to_pylist():
            doc = document_from_row(row, f"{path.name}:{n}")
            n += 1
            if doc is not None:
                yield doc


def is_validation(doc_id: str, val_fraction: float) -> bool:
    """Deterministic per-document split: the first 8 bytes of sha256(doc_id) as a fraction of 2^64."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2**64 < val_fraction


def corpus_fingerprint(spec: str | Path) -> str:
    """sha256 over the corpus files' names and bytes: the key of every cache built from it."""
    digest = hashlib.sha256()
    for path in corpus_files(spec):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def tokenize_split(
    spec: str | Path, tokenizer, val_fraction: float, max_tokens: int | None = None,
    max_source_share: float | None = None, seed: int = 0, return_mix: bool = False,
) -> dict[str, np.ndarray] | tuple[dict[str, np.ndarray], dict]:
    """Token streams {'train': (N,), 'val': (M,)} int32; each document is followed by the EOS token.

    max_tokens caps the training stream (the validation stream is capped at max_tokens * val_fraction too,
    so a small run does not spend its time on validation text).
    max_source_share (0 < share <= 1) caps each source's share of the training tokens by dropping whole training
    documents (cap_source_share, seeded by `seed`); the whole corpus is then tokenized before the cap and
    max_tokens are applied, so the documents kept are a seeded sample of every source, not the first files.
    return_mix also returns the training tokens per source before and after the cap:
    {"max_source_share", "seed", "before": {source: tokens}, "after": {source: tokens}}.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_source_share is not None and not 0 < max_source_share <= 1:
        raise ValueError(f"max_source_share must be in (0, 1], got {max_source_share}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to separate documents")
    capping = max_source_share is not None
    caps = {"train": max_tokens, "val": None if max_tokens is None else max(1, int(max_tokens * val_fraction))}
    streams: dict[str, list[int]] = {"train": [], "val": []}
    train_docs: list[tuple[str, str, list[int]]] = []  # (doc_id, source, tokens): kept whole when capping
    train_sources: list[tuple[str, int]] = []  # (source, tokens) of each document in the training stream
    bar = tqdm(desc="tokenizing", unit="doc", leave=False)
    for doc in read_documents(spec):
        split = "val" if is_validation(doc.doc_id, val_fraction) else "train"
        cap = None if capping and split == "train" else caps[split]
        if cap is not None and len(streams[split]) >= cap:
            if not capping and all(caps[s] is not None and len(streams[s]) >= caps[s] for s in streams):
                break
            continue
        tokens = tokenizer(doc.text, add_special_tokens=False)["input_ids"] + [eos]
        if split == "train" and capping:
            train_docs.append((doc.doc_id, doc.source, tokens))
        else:
            streams[split].extend(tokens)
            if split == "train":
                train_sources.append((doc.source, len(tokens)))
        bar.update()
    bar.close()
    before = _tokens_per_source(train_sources)
    if capping:
        before = _tokens_per_source([(src, len(t)) for _, src, t in train_docs])
        keep = cap_source_share([d[0] for d in train_docs], [d[1] for d in train_docs],
                                [len(d[2]) for d in train_docs], max_source_share, seed, max_tokens)
        for (_, src, tokens), kept in zip(train_docs, keep):
            if kept:
                streams["train"].extend(tokens)
                train_sources.append((src, len(tokens)))
    out = {s: np.asarray(v[: caps[s]] if caps[s] else v, dtype=np.int32) for s, v in streams.items()}
    if not return_mix:
        return out
    after, total = {}, 0  # what the final (possibly truncated) training stream holds
    for src, n in train_sources:
        n = min(n, len(out["train"]) - total)
        if n > 0:
            after[src] = after.get(src, 0) + n
            total += n
    return out, {"max_source_share": max_source_share, "seed": seed, "before": before, "after": after}


def _tokens_per_source(docs: Iterable[tuple[str, int]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for src, n in docs:
        counts[src] = counts.get(src, 0) + n
    return dict(sorted(counts.items()))


def cap_source_share(doc_ids: list[str], sources: list[str], n_tokens: list[int], max_share: float, seed: int = 0,
                     max_tokens: int | None = None) -> np.ndarray:
    """Which documents to keep (N,) bool so that no source holds more than max_share of the kept tokens.

    Each source s with T_s tokens gets a budget min(T_s, L), the level L solving L = max_share * sum_s min(T_s, L)
    (water-filling: the large sources are cut to one common level, the small ones are kept whole); with
    max_tokens, all budgets then shrink in proportion so they add up to it. A source over its budget keeps its
    documents in the order of sha256(seed, doc_id) up to its budget (the document that crosses it stays if that
    lands closer), so the choice is a deterministic function of the seed and the ids (not of file order), and every
    source ends within half a document of its budget.
    """
    totals = _tokens_per_source(zip(sources, n_tokens))
    if not totals:
        return np.zeros(0, dtype=bool)
    level = _share_level(sorted(totals.values(), reverse=True), max_share)
    if level is None:
        raise ValueError(f"no source can be kept under {max_share:.0%} of the tokens: the corpus has only "
                         f"{len(totals)} source(s) ({', '.join(totals)})")
    budgets = {s: min(t, level) for s, t in totals.items()}
    if max_tokens is not None and sum(budgets.values()) > max_tokens:
        scale = max_tokens / sum(budgets.values())
        budgets = {s: b * scale for s, b in budgets.items()}
    keep = np.zeros(len(doc_ids), dtype=bool)
    for src, budget in budgets.items():
        mine = [i for i, s in enumerate(sources) if s == src]
        if budget >= totals[src]:
            keep[mine] = True
            continue
        mine.sort(key=lambda i: hashlib.sha256(f"{seed}:{doc_ids[i]}".encode()).digest())
        used = 0
        for i in mine:
            if used + n_tokens[i] > budget:  # the document that crosses the budget stays if that lands closer
                keep[i] = used + n_tokens[i] - budget < budget - used
                break
            keep[i] = True
            used += n_tokens[i]
    return keep


def _share_level(totals: list[int], max_share: float) -> float | None:
    """The common level L that the largest sources are cut to (totals sorted descending), inf when no source is
    over max_share, None when no level works (fewer than 1 / max_share sources)."""
    total = sum(totals)
    if totals[0] <= max_share * total:
        return float("inf")
    for j in range(1, len(totals)):  # the j largest sources are cut to L = share * rest / (1 - share * j)
        if max_share * j >= 1:
            break
        rest = sum(totals[j:])
        level = max_share * rest / (1 - max_share * j)
        if totals[j] <= level <= totals[j - 1]:
            return level
    return None


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping blocks (N, seq_len) of a token stream; the tail shorter than a block is dropped."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].reshape(n, seq_len)
