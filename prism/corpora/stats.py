"""A corpus written out as jsonl (the format prism.train reads), and its size: documents, characters and tokens,
in total and per source.

    export_jsonl("default", "corpus.jsonl")                 # then: python -m prism.train --corpus corpus.jsonl
    corpus_stats("default", tokenizer)                      # {"documents", "characters", "tokens", "sources"}
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from prism.corpora.default import CORPORA
from prism.corpora.specs import iter_documents
from prism.data import Document

logger = logging.getLogger("precompute.corpus")


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


def format_stats(stats: dict[str, Any]) -> str:
    def num(v: int | None) -> str:
        return "-" if v is None else f"{v:,}"

    by = "tokens" if stats.get("tokens") else "characters"  # each source's share of the tokens, else of the text
    whole = max(1, stats.get(by) or 0)
    lines = [f"corpus: {stats['spec']}" + (f"  (tokenizer: {stats['tokenizer']})" if stats.get("tokenizer") else ""),
             f"{'source':<10}{'documents':>12}{'characters':>16}{'tokens':>14}{'share':>8}  kind"]
    for source, row in stats["sources"].items():
        share = f"{100 * (row.get(by) or 0) / whole:.1f}%"
        lines.append(f"{source:<10}{num(row['documents']):>12}{num(row['characters']):>16}{num(row['tokens']):>14}"
                     f"{share:>8}  {row.get('kind', '')}".rstrip())
    lines.append(f"{'total':<10}{num(stats['documents']):>12}{num(stats['characters']):>16}{num(stats['tokens']):>14}"
                 f"{'100%':>8}")
    left_out = {s: {k: v for k, v in r.items() if k.startswith("left_out") and v} for s, r in stats["sources"].items()}
    for source, counts in left_out.items():
        if counts:
            lines.append(f"{source}: left out " + ", ".join(f"{v:,} {k.removeprefix('left_out_').replace('_', ' ')}"
                                                            for k, v in counts.items()))
    licences = [(s, r["licence"]) for s, r in stats["sources"].items() if r.get("licence")]
    if licences:
        lines.append("licences:")
        lines.extend(f"  {s}: {licence}" for s, licence in licences)
    return "\n".join(lines)


def local_corpus(spec: str, folder: str | Path) -> str:
    """A local corpus path for `spec`, what prism.train and prism.eval read: a named offline corpus (CORPORA) is
    exported once to FOLDER/corpus-NAME.jsonl (the export writes a .partial file and renames it, so a killed one
    leaves nothing half-written; delete the file to export again after the corpus packages change); any other
    spec is returned as it is."""
    if str(spec).strip() not in CORPORA or Path(spec).exists():  # a local file of that name wins, as in parse_spec
        return str(spec)
    path = Path(folder) / f"corpus-{str(spec).strip()}.jsonl"
    if not path.exists():
        export_jsonl(str(spec).strip(), path)
    return str(path)
