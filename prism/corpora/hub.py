"""Hub datasets streamed with `datasets`: FineWeb ('HuggingFaceFW/fineweb', config 'sample-10BT', ...) or any dataset
with a 'text' column, row by row (never downloaded whole). Rows become Documents exactly as local files' rows do
(prism.data.document_from_row).

    for doc in iter_hf_dataset("HuggingFaceFW/fineweb", name="sample-10BT"): ...
    for doc in iter_hf_dataset("parquet", data_files=["shard-0.parquet"]): ...   # the same route on local files
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prism.data import Document, check_text_column, document_from_row


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
        check_text_column(columns, f"dataset {origin!r}")
    default_source = "local" if data_files is not None else "hub"
    for n, row in enumerate(dataset):
        if n == 0 and columns is None:
            check_text_column(row, f"dataset {origin!r}")
        doc = document_from_row(row, f"{origin}/{split}:{n}", default_source)
        if doc is not None:
            yield doc
