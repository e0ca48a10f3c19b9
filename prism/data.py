"""Training text: read documents from text/jsonl/Parquet files, split by document, tokenize and pack into blocks.

A corpus path is a file, a folder (every .txt/.jsonl/.parquet file under it, in sorted order) or a glob.
- .txt: the whole file is one document, its id the file name.
- .jsonl: one JSON object per line with a "text" field and optionally "id" (else file name + line number).
- .parquet: a "text" column and optionally "id" (FineWeb's schema has both).
The validation split is chosen per document from a hash of its id, so it does not depend on file order or on
how many processes read the corpus.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

SUFFIXES = (".txt", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


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


def read_documents(spec: str | Path) -> Iterator[Document]:
    """Every non-empty document of the corpus, in a deterministic order."""
    for path in corpus_files(spec):
        if path.suffix == ".txt":
            text = path.read_text(encoding="utf-8")
            if text.strip():
                yield Document(path.name, text)
        elif path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                        text = row["text"]
                    except (json.JSONDecodeError, KeyError, TypeError) as err:
                        raise ValueError(f"{path}:{n + 1}: expected a JSON object with a 'text' field ({err})") from err
                    if text and text.strip():
                        yield Document(str(row.get("id", f"{path.name}:{n}")), text)
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if "text" not in table.column_names:
                raise ValueError(f"{path} has no 'text' column (columns: {table.column_names})")
            ids = table.column("id").to_pylist() if "id" in table.column_names else None
            for n, text in enumerate(table.column("text").to_pylist()):
                if text and text.strip():
                    yield Document(str(ids[n]) if ids else f"{path.name}:{n}", text)


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
    spec: str | Path, tokenizer, val_fraction: float, max_tokens: int | None = None
) -> dict[str, np.ndarray]:
    """Token streams {'train': (N,), 'val': (M,)} int32; each document is followed by the EOS token.

    max_tokens caps the training stream (the validation stream is capped at max_tokens * val_fraction too,
    so a small run does not spend its time on validation text).
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to separate documents")
    caps = {"train": max_tokens, "val": None if max_tokens is None else max(1, int(max_tokens * val_fraction))}
    streams: dict[str, list[int]] = {"train": [], "val": []}
    bar = tqdm(desc="tokenizing", unit="doc", leave=False)
    for doc in read_documents(spec):
        split = "val" if is_validation(doc.doc_id, val_fraction) else "train"
        cap = caps[split]
        if cap is not None and len(streams[split]) >= cap:
            if all(caps[s] is not None and len(streams[s]) >= caps[s] for s in streams):
                break
            continue
        streams[split].extend(tokenizer(doc.text, add_special_tokens=False)["input_ids"] + [eos])
        bar.update()
    bar.close()
    return {s: np.asarray(v[: caps[s]] if caps[s] else v, dtype=np.int32) for s, v in streams.items()}


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping blocks (N, seq_len) of a token stream; the tail shorter than a block is dropped."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].reshape(n, seq_len)
